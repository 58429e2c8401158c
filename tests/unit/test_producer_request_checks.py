"""The SDK's checks of a batch request's fields, before anything is uploaded or published."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from llmbatch.adapters.errors import InvalidInput
from llmbatch.producer.request_checks import build_request, check_fields, check_request, fits_inline
from llmbatch.schemas import BatchInputLine, BatchRequest, Endpoint, InlineLimits

pytestmark = pytest.mark.unit


def fields(**overrides: Any) -> dict[str, Any]:
    return {
        "batch_id": "b-1",
        "model": "m",
        "endpoint": Endpoint.CHAT_COMPLETIONS,
        "metadata": {},
        "priority": 5,
        "tenant": "default",
        "completion_window": None,
        "deadline": None,
        **overrides,
    }


def lines(n: int, content: str = "hi") -> list[BatchInputLine]:
    return [
        BatchInputLine.model_validate(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": content}]},
            }
        )
        for i in range(n)
    ]


def test_good_fields_pass_without_any_input() -> None:
    check_fields(fields(metadata={"team": "a"}, priority=9))


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"priority": 11}, "priority"),
        ({"model": ""}, "model"),
        ({"batch_id": "has space"}, "batch_id"),
        ({"deadline": datetime.now(UTC) - timedelta(minutes=1)}, "deadline"),
    ],
)
def test_a_bad_field_is_invalid_input_naming_it(bad: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidInput) as err:
        check_fields(fields(**bad))
    assert named in str(err.value)


def test_build_request_keeps_the_lines_and_refuses_both_or_neither_input() -> None:
    request = build_request(fields(requests=lines(2)))
    assert isinstance(request, BatchRequest) and [r.custom_id for r in request.requests or []] == ["r0", "r1"]
    with pytest.raises(InvalidInput):
        build_request(fields())
    with pytest.raises(InvalidInput):
        build_request(fields(requests=lines(1), input_uri="s3://in/x.jsonl"))


def test_inline_limits_decide_between_inline_and_a_file() -> None:
    limits = InlineLimits(max_requests=3, max_bytes=4096)
    assert fits_inline(build_request(fields(requests=lines(3))), limits)
    assert not fits_inline(build_request(fields(requests=lines(4))), limits)
    assert not fits_inline(build_request(fields(requests=lines(2, "x" * 5000))), limits)


def test_check_request_refuses_what_is_over_the_limits_or_past_its_deadline() -> None:
    limits = InlineLimits(max_requests=3)
    check_request(build_request(fields(requests=lines(3))), limits)
    with pytest.raises(InvalidInput) as err:
        check_request(build_request(fields(requests=lines(4))), limits)
    assert err.value.errors and err.value.errors[0].reason == "limit_exceeded"
    # a deadline can pass between the fields' check and the publish
    passed = build_request(fields(requests=lines(1))).model_copy(
        update={"deadline": datetime.now(UTC) - timedelta(seconds=1)}
    )
    with pytest.raises(InvalidInput) as err:
        check_request(passed, limits)
    assert "deadline" in str(err.value)
