"""One embedding line's bookkeeping on the engine (ray_job.lines.embeddings.EmbeddingLine): a request per
input keyed ``<key>.<index>``, the line's failure (its first failed input's, in input order) and its vectors
in input order whatever order the engine answered in. The whole stage on the fake backend is in
tests/unit/test_embeddings.py."""

from __future__ import annotations

from typing import Any

import pytest

from llmbatch.ray_job.errors import RequestFailure
from llmbatch.ray_job.lines.embeddings import EmbeddingLine
from llmbatch.ray_job.lines.records import Generation

pytestmark = pytest.mark.unit

POOLING = {"pooling": {"normalize": True}}


def prompt(inputs: list[list[int]], encoding_format: str | None = "base64") -> dict[str, Any]:
    """A prompt-stage payload of an embedding line (ray_job.job.prompts)."""
    payload: dict[str, Any] = {"inputs": inputs, "sampling": POOLING}
    if encoding_format is not None:
        payload["encoding_format"] = encoding_format
    return payload


def vector(key: str, value: float) -> Generation:
    return Generation(key, prompt_tokens=2, embedding=[value, -value])


def failed(key: str, code: str) -> Generation:
    return Generation(key, failure=RequestFailure(code, f"{code} on {key}", None, 400))


def test_each_input_is_one_request_keyed_by_line_and_index() -> None:
    inputs = [[1, 2], [3], [4, 5, 6]]
    line = EmbeddingLine.from_prompt("17", prompt(inputs), "emb-a")
    assert [r.key for r in line.requests] == ["17.0", "17.1", "17.2"]
    assert [r.prompt_token_ids for r in line.requests] == inputs
    assert all(r.custom_id == "emb-a" and r.sampling == POOLING for r in line.requests)
    assert line.encoding_format == "base64" and line.answers == {}
    # each request holds its own copies: the engine may change one without touching the others
    line.requests[0].prompt_token_ids.append(9)
    line.requests[0].sampling["extra"] = 1
    assert inputs[0] == [1, 2] and "extra" not in line.requests[1].sampling


@pytest.mark.parametrize(
    ("given", "used"), [(None, "float"), ("", "float"), ("float", "float"), ("base64", "base64")]
)
def test_the_encoding_format_defaults_to_float(given: str | None, used: str) -> None:
    assert EmbeddingLine.from_prompt("1", prompt([[1]], given), "c").encoding_format == used


def test_keys_of_two_lines_never_meet() -> None:
    """Line 1's 11th input and line 11's 1st would meet as "11" + "1" without the separator."""
    first = {r.key for r in EmbeddingLine.from_prompt("1", prompt([[1]] * 11), "a").requests}
    second = {r.key for r in EmbeddingLine.from_prompt("11", prompt([[1]] * 2), "b").requests}
    assert first.isdisjoint(second)


def test_vectors_come_in_input_order_whatever_the_answer_order() -> None:
    line = EmbeddingLine.from_prompt("3", prompt([[1], [2], [3]]), "c")
    for key, value in (("3.2", 2.0), ("3.0", 0.0), ("3.1", 1.0)):
        line.take(vector(key, value))
    assert line.failure() is None
    assert [g.key for g in line.vectors()] == ["3.0", "3.1", "3.2"]
    assert [g.embedding for g in line.vectors()] == [[0.0, -0.0], [1.0, -1.0], [2.0, -2.0]]


def test_the_line_fails_with_its_first_failed_input_in_input_order() -> None:
    line = EmbeddingLine.from_prompt("5", prompt([[1], [2], [3], [4]]), "c")
    line.take(vector("5.0", 0.0))
    line.take(failed("5.3", "too_long"))  # answered first, but a later input
    assert line.failure() == RequestFailure("too_long", "too_long on 5.3", None, 400)
    line.take(failed("5.1", "engine_error"))
    line.take(vector("5.2", 2.0))
    failure = line.failure()
    assert failure is not None and failure.code == "engine_error" and failure.message == "engine_error on 5.1"


def test_inputs_not_answered_yet_are_no_failure() -> None:
    line = EmbeddingLine.from_prompt("8", prompt([[1], [2]]), "c")
    assert line.failure() is None
    line.take(vector("8.1", 1.0))
    assert line.failure() is None
