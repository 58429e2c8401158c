"""The batch runner's request parsers (ray_job/runner_http.py): any body is either parsed or one
ValueError naming the field, never another exception; the route table."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_job.runner_http import MAX_STATUS_IDS, parse_status_ids, parse_submission, route
from schemas.job import RunnerSubmission

pytestmark = pytest.mark.unit
T = TypeVar("T")

JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
                    | st.text(),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
BODIES = st.binary(max_size=300) | JSON.map(orjson.dumps) | st.builds(
    lambda ids: orjson.dumps({"submission_ids": ids}), st.lists(JSON, max_size=5))


def _parsed(parse: Callable[[bytes], T], raw: bytes) -> tuple[T | None, str | None]:
    """``(result, None)`` or ``(None, the ValueError's text)``; any other exception propagates."""
    try:
        return parse(raw), None
    except ValueError as exc:
        return None, str(exc)


@given(BODIES)
def test_any_statuses_body_is_ids_or_one_clear_error(raw: bytes) -> None:
    ids, error = _parsed(parse_status_ids, raw)
    if error is not None:
        assert "submission_ids" in error or "JSON" in error
    else:
        assert ids is not None
        assert all(isinstance(i, str) and 0 < len(i) <= 256 for i in ids)


@given(BODIES | JSON.map(lambda spec: orjson.dumps({"spec": spec})))
def test_any_submit_body_is_a_submission_or_one_clear_error(raw: bytes) -> None:
    submission, error = _parsed(parse_submission, raw)
    if error is not None:
        assert error.startswith("invalid job spec: ")
    else:
        assert isinstance(submission, RunnerSubmission)


def test_too_many_ids_are_refused_with_the_limit() -> None:
    raw = orjson.dumps({"submission_ids": [f"s{i}" for i in range(MAX_STATUS_IDS + 1)]})
    with pytest.raises(ValueError, match=f"at most {MAX_STATUS_IDS} per request"):
        parse_status_ids(raw)


@pytest.mark.parametrize(("method", "path", "wanted"), [
    ("POST", "/llmbatch-runner/runs", ("submit", None)),
    ("GET", "/llmbatch-runner/runs/s-1", ("status", "s-1")),
    ("POST", "/llmbatch-runner/runs/s-1/stop", ("stop", "s-1")),
    ("POST", "/llmbatch-runner/statuses", ("statuses", None)),
    ("GET", "/llmbatch-runner/runs/s-1/stop", ("", None)),
    ("DELETE", "/llmbatch-runner/runs/s-1", ("", None)),
    ("GET", "/elsewhere", ("", None)),
])
def test_routes(method: str, path: str, wanted: tuple[str, str | None]) -> None:
    assert route(method, path) == wanted
