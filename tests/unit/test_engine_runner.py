"""The engine runner without Ray: order and per-request isolation, batches sharing one engine,
a dying engine, strict priorities with preemption, fair turns, and the fake backend."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from llmbatch.ray_job.engines.backend_fake import FakeBackend
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.engines.engine_runner import EngineRunner
from llmbatch.ray_job.errors import CallAbandonedError, EngineDeadError, RequestRejected
from llmbatch.ray_job.lines.records import Generation, GenRequest
from llmbatch.schemas.job import EngineConfig

pytestmark = pytest.mark.unit


def req(key: str, words: str = "hello there", custom_id: str = "", **sampling: Any) -> GenRequest:
    return GenRequest(
        key, [1] * len(words.split()), dict(sampling), prompt_text=words, custom_id=custom_id or key
    )


class RecordingBackend:
    """Finishes one request per step; refuses prompts containing 'bad'; records concurrency."""

    max_model_len = 100
    default_max_tokens: int | None = None

    def __init__(self, *, die_after: int | None = None) -> None:
        self.queue: list[GenRequest] = []
        self.max_running = 0
        self.steps = 0
        self.die_after = die_after

    def add(self, request: GenRequest) -> None:
        if "bad" in request.prompt_text:
            raise RequestRejected("refused", param="x")
        if "boom" in request.prompt_text:
            raise RuntimeError("kaput")
        self.queue.append(request)
        self.max_running = max(self.max_running, len(self.queue))

    def abort(self, keys: list[str]) -> None:
        self.queue = [r for r in self.queue if r.key not in keys]

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[Generation]:
        self.steps += 1
        if self.die_after is not None and self.steps > self.die_after:
            raise EngineDeadError("engine core died")
        time.sleep(0.005)
        done = self.queue.pop(0)
        return [
            Generation(done.key, text=done.prompt_text.upper(), finish_reason="stop", completion_tokens=1)
        ]


def test_runner_keeps_order_and_isolates_refused_requests() -> None:
    runner = EngineRunner(RecordingBackend())
    out = runner.generate([req("1", "a"), req("2", "bad one"), req("3", "boom"), req("4", "b")])
    assert [g.key for g in out] == ["1", "2", "3", "4"]
    assert out[0].text == "A" and out[3].text == "B"
    assert out[1].failure is not None and out[1].failure.status_code == 400 and out[1].failure.param == "x"
    assert out[2].failure is not None and out[2].failure.status_code == 500
    assert "kaput" in out[2].failure.message
    assert runner.generate([]) == []


def test_concurrent_batches_share_the_engine() -> None:
    backend = RecordingBackend()
    runner = EngineRunner(backend)
    batches = [[req(f"{b}-{i}", f"w{b} {i}") for i in range(20)] for b in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(runner.generate, batches))
    for batch, result in zip(batches, results, strict=True):
        assert [g.key for g in result] == [r.key for r in batch]
        assert all(g.failure is None for g in result)
    assert backend.max_running > 20  # requests of several batches were in the engine at once


def test_a_dead_engine_fails_every_waiting_batch_instead_of_hanging() -> None:
    runner = EngineRunner(RecordingBackend(die_after=3))
    errors: list[BaseException] = []

    def call(n: int) -> None:
        try:
            runner.generate([req(f"{n}-{i}") for i in range(5)])
        except EngineDeadError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 3
    with pytest.raises(EngineDeadError):
        runner.generate([req("late")])


def test_fake_backend_is_deterministic_and_honours_failures() -> None:
    config = EngineConfig(backend=FAKE_BACKEND, backend_options={"fail_custom_ids": ["x"]}, max_model_len=64)
    backend = FakeBackend("unused", config)
    assert backend.max_model_len == 64
    with pytest.raises(RuntimeError, match="simulated"):
        backend.add(req("1", custom_id="x"))
    runner = EngineRunner(FakeBackend("unused", config))
    out = runner.generate([req("1", "<user> one two three <assistant>", max_tokens=4, logprobs=1), req("2")])
    assert out[0].text == "fake reply to: one" and out[0].finish_reason == "length"
    assert out[0].completion_tokens == 4 and out[0].logprobs is not None and len(out[0].logprobs) == 4
    assert out[1].text == "fake reply to: hello there" and out[1].finish_reason == "stop"


class SlotBackend:
    """Every request needs ``steps`` steps; each step advances all requests on it by one and logs
    which keys were on the engine (to check who ran beside whom)."""

    max_model_len = 100
    default_max_tokens: int | None = None

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps
        self.left: dict[str, int] = {}
        self.log: list[set[str]] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.gate = threading.Event()  # cleared: a step waits (the engine holds still)
        self.gate.set()
        self.stepping = threading.Event()  # set once a step has begun

    def add(self, request: GenRequest) -> None:
        self.left[request.key] = self.steps

    def abort(self, keys: list[str]) -> None:
        for key in keys:
            if self.left.pop(key, None) is not None:
                self.aborted.append(key)

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def step(self) -> list[Generation]:
        self.stepping.set()
        assert self.gate.wait(10), "the test never opened the gate"
        time.sleep(0.002)
        self.log.append(set(self.left))
        done = []
        for key in list(self.left):
            self.left[key] -= 1
            if self.left[key] == 0:
                del self.left[key]
                done.append(Generation(key, text=key, finish_reason="stop", completion_tokens=1))
                self.finished.append(key)
        return done


def _in_thread(
    runner: EngineRunner, requests: list[GenRequest], **kw: Any
) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(runner.generate(requests, **kw)))
    thread.start()
    return thread, out


def _wait(predicate: Any) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_higher_priority_takes_the_engine_back_and_runs_alone() -> None:
    backend = SlotBackend(steps=5)
    backend.gate.clear()
    runner = EngineRunner(backend, max_active=4)
    low = [req(f"low{i}") for i in range(12)]
    low_thread, low_out = _in_thread(runner, low, group="low", priority=0)
    _wait(backend.stepping.is_set)  # four low requests on the engine
    high_thread, high_out = _in_thread(runner, [req("high0"), req("high1")], group="high", priority=9)
    _wait(lambda: runner._inbox.qsize() == 1)  # handed over while the low ones are still running
    backend.gate.set()
    high_thread.join(10)
    (high,) = high_out
    assert [g.key for g in high] == ["high0", "high1"] and all(g.failure is None for g in high)
    low_thread.join(10)
    assert [g.key for g in low_out[0]] == [r.key for r in low]
    assert backend.aborted, "the low-priority requests on the engine were taken back"
    assert runner.stats().preempted == len(backend.aborted)
    # while a high-priority request was on the engine, no low-priority one was
    for on_engine in backend.log:
        if any(k.startswith("high") for k in on_engine):
            assert all(k.startswith("high") for k in on_engine), on_engine
    # every request finished exactly once, the aborted ones after running again
    assert sorted(backend.finished) == sorted([r.key for r in low] + ["high0", "high1"])
    assert runner.stats().active == 0 and runner.stats().queued == 0


def test_batches_of_equal_priority_take_turns_on_a_full_engine() -> None:
    backend = SlotBackend(steps=2)
    backend.gate.clear()
    runner = EngineRunner(backend, max_active=2)
    big = [req(f"big{i:03d}") for i in range(40)]
    big_thread, _ = _in_thread(runner, big, group="big")
    _wait(backend.stepping.is_set)  # two big requests on the engine, the other 38 waiting
    small_thread, small_out = _in_thread(runner, [req(f"small{i}") for i in range(3)], group="small")
    # the small batch is handed to the runner before the engine moves on (whatever the machine's
    # load, so the count below does not depend on how fast this thread got here)
    _wait(lambda: runner._inbox.qsize() == 1)
    backend.gate.set()
    small_thread.join(10)
    (small,) = small_out
    assert all(g.failure is None for g in small)
    until_small = backend.finished[: backend.finished.index("small2") + 1]
    big_done_by_then = sum(k.startswith("big") for k in until_small)
    assert big_done_by_then <= 2 + 3, backend.finished  # the two on the engine, then turns (not all 40)
    big_thread.join(10)
    assert not backend.aborted  # equal priorities never preempt


def test_without_a_limit_every_request_goes_to_the_engine_at_once() -> None:
    backend = SlotBackend(steps=1)
    runner = EngineRunner(backend)
    runner.generate([req(str(i)) for i in range(50)])
    assert len(backend.log[0]) == 50


def test_a_call_given_up_leaves_the_engine_and_the_queue_and_the_others_run_on() -> None:
    backend = SlotBackend(steps=3)
    backend.gate.clear()
    runner = EngineRunner(backend, max_active=4)
    stop = threading.Event()
    gone: list[BaseException] = []

    def given_up() -> None:
        with pytest.raises(CallAbandonedError) as raised:
            runner.generate([req(f"gone{i}") for i in range(10)], group="gone", stop=stop)
        gone.append(raised.value)

    gone_thread = threading.Thread(target=given_up)
    gone_thread.start()
    _wait(backend.stepping.is_set)  # four of its requests on the engine, six waiting, the step held
    kept_thread, kept_out = _in_thread(runner, [req(f"kept{i}") for i in range(3)], group="kept")
    _wait(lambda: runner._inbox.qsize() == 1)
    stop.set()
    _wait(lambda: runner._inbox.qsize() == 2)  # the call given up, handed over behind the other one
    backend.gate.set()
    gone_thread.join(10)
    assert gone and not gone_thread.is_alive()
    kept_thread.join(10)
    assert [g.key for g in kept_out[0]] == ["kept0", "kept1", "kept2"]
    # the four on the engine were aborted, the six waiting never reached it, and nothing of it finished
    assert sorted(backend.aborted) == ["gone0", "gone1", "gone2", "gone3"]
    assert not [k for k in backend.finished if k.startswith("gone")]
    assert not [k for on_engine in backend.log[1:] for k in on_engine if k.startswith("gone")]
    stats = runner.stats()
    assert stats.abandoned == 10 and stats.queued == 0 and stats.active == 0
    assert stats.finished == 3


def test_abandoning_a_call_already_answered_changes_nothing() -> None:
    backend = SlotBackend(steps=1)
    runner = EngineRunner(backend, max_active=2)
    out = runner.generate([req("a"), req("b")], stop=threading.Event())
    runner.abandon(["a", "b", "never-sent"])
    assert [g.key for g in runner.generate([req("c")])] == ["c"]  # after the abandon: the runner went on
    assert [g.key for g in out] == ["a", "b"] and runner.stats().abandoned == 0 and not backend.aborted
