"""The batch runner's request parsers (ray_job/llmbatch/ray_job/batch_runner/runner_http.py): any body is
either parsed or one ValueError naming the field, never another exception; the route table (the
status-id limit is in test_runner_backend, through the runner)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.ray_job.batch_runner.runner_http import parse_status_ids, parse_submission, route
from llmbatch.schemas.job import RunnerSubmission

pytestmark = pytest.mark.unit
T = TypeVar("T")

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
BODIES = (
    st.binary(max_size=300)
    | JSON.map(orjson.dumps)
    | st.builds(lambda ids: orjson.dumps({"submission_ids": ids}), st.lists(JSON, max_size=5))
)


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


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/llmbatch-runner/runs", ("submit", None)),
        ("POST", "/runs/", ("submit", None)),
        ("GET", "/llmbatch-runner/runs/b-1-a1", ("status", "b-1-a1")),
        ("POST", "/llmbatch-runner/runs/b-1-a1/stop", ("stop", "b-1-a1")),
        ("GET", "/llmbatch-runner/runs", ("", None)),
        ("DELETE", "/llmbatch-runner/runs/x", ("", None)),
        ("POST", "/llmbatch-runner/runs/x/kill", ("", None)),
        ("GET", "/llmbatch-runner/other", ("", None)),
        ("POST", "/llmbatch-runner/statuses", ("statuses", None)),
        ("GET", "/llmbatch-runner/statuses", ("", None)),
        ("GET", "/llmbatch-runner/runs/b-1-a1/stop", ("", None)),
        ("GET", "/elsewhere", ("", None)),
    ],
)
def test_runner_routes(method: str, path: str, expected: tuple[str, str | None]) -> None:
    assert route(method, path) == expected
