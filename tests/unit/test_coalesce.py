"""The coalescer: the keys asked for in one event-loop turn go in one fetch."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest

from llmbatch.dispatcher.domain.coalesce import Coalescer

pytestmark = pytest.mark.unit


class Source:
    """A fetch that records each call and answers ``<key>!`` for known keys."""

    def __init__(
        self, known: set[str] | None = None, error: Exception | None = None, pause_s: float = 0.0
    ) -> None:
        self.calls: list[list[str]] = []
        self.known = known
        self.error = error
        self.pause_s = pause_s

    async def fetch(self, keys: Sequence[str]) -> Mapping[str, str]:
        self.calls.append(list(keys))
        await asyncio.sleep(self.pause_s)
        if self.error is not None:
            raise self.error
        return {k: k + "!" for k in keys if self.known is None or k in self.known}


def test_one_fetch_answers_every_caller_of_a_turn_with_its_own_key() -> None:
    source = Source()
    coalescer = Coalescer(source.fetch, missing="?")

    async def main() -> list[str]:
        return await asyncio.gather(*(coalescer.get(k) for k in ["a", "b", "c", "b"]))

    assert asyncio.run(main()) == ["a!", "b!", "c!", "b!"]
    assert source.calls == [["a", "b", "c"]]  # one call; a key asked twice goes once


def test_callers_that_arrive_after_a_turn_get_a_fetch_of_their_own() -> None:
    source = Source()
    coalescer = Coalescer(source.fetch, missing="?")

    async def main() -> tuple[str, str]:
        first = await coalescer.get("a")
        return first, await coalescer.get("b")

    assert asyncio.run(main()) == ("a!", "b!")
    assert source.calls == [["a"], ["b"]]


def test_the_keys_of_a_turn_are_split_into_calls_of_at_most_max_keys() -> None:
    source = Source()
    coalescer = Coalescer(source.fetch, missing="?", max_keys=2)

    async def main() -> list[str]:
        return await asyncio.gather(*(coalescer.get(k) for k in "abcde"))

    assert asyncio.run(main()) == [k + "!" for k in "abcde"]
    assert source.calls == [["a", "b"], ["c", "d"], ["e"]]


def test_a_key_the_fetch_leaves_out_answers_missing() -> None:
    coalescer = Coalescer(Source(known={"a"}).fetch, missing="?")

    async def main() -> list[str]:
        return list(await asyncio.gather(coalescer.get("a"), coalescer.get("z")))

    assert asyncio.run(main()) == ["a!", "?"]


def test_every_caller_of_a_failed_fetch_gets_its_error() -> None:
    coalescer = Coalescer(Source(error=ConnectionError("away")).fetch, missing="?")

    async def main() -> list[str | BaseException]:
        return list(await asyncio.gather(coalescer.get("a"), coalescer.get("b"), return_exceptions=True))

    errors = asyncio.run(main())
    assert [type(e) for e in errors] == [ConnectionError, ConnectionError]
    assert all(str(e) == "away" for e in errors)


def test_a_cancelled_caller_leaves_the_others_their_answers() -> None:
    source = Source(pause_s=0.05)
    coalescer = Coalescer(source.fetch, missing="?")

    async def main() -> str:
        gone = asyncio.ensure_future(coalescer.get("a"))
        kept = asyncio.ensure_future(coalescer.get("a"))
        await asyncio.sleep(0.01)
        gone.cancel()
        return await kept

    assert asyncio.run(main()) == "a!"


def test_it_serves_one_loop_after_another() -> None:
    # the dispatcher runs one loop, but a client made once may be used from several (CLIs, tests)
    source = Source()
    coalescer = Coalescer(source.fetch, missing="?")
    for key in "ab":
        assert asyncio.run(asyncio.wait_for(coalescer.get(key), 5)) == key + "!"
    assert source.calls == [["a"], ["b"]]


def test_max_keys_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_keys"):
        Coalescer(Source().fetch, missing="?", max_keys=0)
