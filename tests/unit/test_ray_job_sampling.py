"""ray_job per-request sampling arguments and the context-window check."""

from __future__ import annotations

from typing import Any

import pytest

from llmbatch.ray_job.errors import CONTEXT_LENGTH_EXCEEDED
from llmbatch.ray_job.lines.sampling import fit_context, sampling_kwargs, wants_logprobs
from llmbatch.schemas.common import Endpoint

pytestmark = pytest.mark.unit

CHAT, CMPL = Endpoint.CHAT_COMPLETIONS, Endpoint.COMPLETIONS


def test_chat_body_maps_to_vllm_names() -> None:
    body = {
        "messages": [],
        "model": "m",
        "max_completion_tokens": 9,
        "temperature": 0.0,
        "top_p": 0.5,
        "seed": 3,
        "stop": "END",
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "logprobs": True,
        "top_logprobs": 2,
        "user": "u",
        "n": 1,
    }
    assert sampling_kwargs(CHAT, body) == {
        "n": 1,
        "max_tokens": 9,
        "temperature": 0.0,
        "top_p": 0.5,
        "seed": 3,
        "stop": ["END"],
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "logprobs": 2,
    }


def test_absent_fields_stay_absent_so_model_defaults_apply() -> None:
    out = sampling_kwargs(CHAT, {"messages": []})
    assert out == {"n": 1}
    assert not wants_logprobs(out)
    assert sampling_kwargs(CHAT, {"messages": [], "logprobs": True}) == {"n": 1, "logprobs": 0}
    assert sampling_kwargs(CHAT, {"messages": [], "logprobs": False, "top_logprobs": None}) == {"n": 1}


def test_completion_logprobs_is_a_count() -> None:
    assert sampling_kwargs(CMPL, {"prompt": "x", "logprobs": 0, "max_tokens": 4, "stop": ["a", "b"]}) == {
        "n": 1,
        "logprobs": 0,
        "max_tokens": 4,
        "stop": ["a", "b"],
    }


def test_fit_context_defaults_max_tokens_to_the_room_left() -> None:
    sampling: dict[str, object] = {}
    assert fit_context(sampling, 100, 1024) is None
    assert sampling["max_tokens"] == 924
    capped: dict[str, object] = {}
    assert fit_context(capped, 100, 1024, default_max_tokens=50) is None
    assert capped["max_tokens"] == 50


def test_fit_context_rejects_a_prompt_that_does_not_fit() -> None:
    failure = fit_context({}, 1024, 1024)
    assert failure is not None and failure.code == CONTEXT_LENGTH_EXCEEDED and failure.status_code == 400
    assert "1024" in failure.message and failure.param == "messages"
    other = fit_context({}, 5000, 1024, prompt_field="prompt")
    assert other is not None and other.param == "prompt"


def test_fit_context_rejects_max_tokens_beyond_the_room_left() -> None:
    failure = fit_context({"max_tokens": 200}, 900, 1024)
    assert failure is not None and failure.code == CONTEXT_LENGTH_EXCEEDED and failure.param == "max_tokens"
    assert fit_context({"max_tokens": 124}, 900, 1024) is None


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "json_object"}, {"json_object": True}),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True},
            },
            {"json": {"type": "object"}},
        ),
        ({"type": "json_schema", "json_schema": {"name": "p"}}, {"json_object": True}),
    ],
)
def test_response_format_becomes_structured_outputs(
    response_format: dict[str, Any], expected: dict[str, Any]
) -> None:
    body = {"messages": [], "response_format": response_format}
    assert sampling_kwargs(CHAT, body)["structured_outputs"] == expected


@pytest.mark.parametrize("response_format", [None, {"type": "text"}])
def test_free_text_asks_for_no_structured_outputs(response_format: dict[str, Any] | None) -> None:
    body: dict[str, Any] = {"messages": [], "response_format": response_format}
    assert "structured_outputs" not in sampling_kwargs(CHAT, body)


def test_logit_bias_keeps_string_token_ids_for_the_trip_to_the_engine() -> None:
    body = {"prompt": "x", "logit_bias": {"11": -100, "7": 2.5}}
    assert sampling_kwargs(CMPL, body)["logit_bias"] == {"11": -100, "7": 2.5}
    assert "logit_bias" not in sampling_kwargs(CMPL, {"prompt": "x", "logit_bias": {}})
