"""Fuzzing the input-line parser (hypothesis): whatever a line holds, the parser returns a line or
raises :class:`SchemaError` naming a field and the line; it never raises anything else, and what it
accepts is exactly what the typed body model accepts."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmbatch.schemas import BatchInputLine, SchemaError, parse_input_line
from llmbatch.schemas.errors import OPENAI_ERROR_CODES

pytestmark = pytest.mark.unit

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
CHAT = "/v1/chat/completions"
_FIELDS = [
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "model",
    "response_format",
    "top_k",
    "min_p",
    "logit_bias",
]
_numbers = st.integers(-3, 40) | st.floats(-1, 3, allow_nan=False)
_schema = st.just({"type": "object"}) | st.just({"type": "string", "format": "x"}) | _json
_response_format = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "json_schema", "xml"])},
    optional={
        "json_schema": st.fixed_dictionaries(
            {"name": st.from_regex(r"[a-z_-]{1,8}", fullmatch=True) | st.text(max_size=70)},
            optional={
                "schema": _schema,
                "strict": st.booleans() | _json,
                "description": st.text(max_size=5) | _json,
            },
        ),
        "extra": _json,
    },
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "user", "system", "assistant", "robot"]),
        "content": st.text(max_size=10)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "text", "image_url"]), "text": st.text(max_size=5) | _json}
            ),
            max_size=2,
        )
        | _json,
    },
    optional={"name": st.text(max_size=5) | _json},
)
_chat_body = st.fixed_dictionaries(
    {"messages": st.lists(_message, min_size=1, max_size=3) | _json},
    optional={"response_format": _response_format | _json},
)
_extra_fields = st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=6), _numbers | _json, max_size=2)
_body = st.tuples(
    _chat_body | st.fixed_dictionaries({"prompt": st.text(max_size=8) | _json}), _extra_fields
).map(lambda parts: {**parts[1], **parts[0]})
_line = st.fixed_dictionaries(
    {
        "custom_id": st.text(min_size=1, max_size=20),
        "method": st.sampled_from(["POST", "POST", "POST", "GET"]),
        "url": st.sampled_from([CHAT, CHAT, "/v1/completions", "/v1/embeddings"]),
        "body": _body,
    },
)
_FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _outcome(raw: bytes | str, line_no: int) -> BatchInputLine | SchemaError:
    try:
        return parse_input_line(raw, line_no)
    except SchemaError as err:
        return err


@_FUZZ
@given(_line)
def test_any_json_line_parses_or_names_the_field(obj: dict[str, Any]) -> None:
    got = _outcome(json.dumps(obj, allow_nan=False), 3)
    if isinstance(got, SchemaError):
        assert got.line == 3 and got.field, got
        assert got.openai_code in OPENAI_ERROR_CODES.values()
        assert str(got).startswith(f"line 3: {got.field}: ")
        return
    assert got.body == obj["body"]  # kept verbatim
    got.typed_body()  # and valid for its endpoint


@_FUZZ
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_any_bytes_parse_or_raise_schema_error(raw: bytes | str) -> None:
    got = _outcome(raw, 1)
    assert isinstance(got, BatchInputLine) or got.line == 1
