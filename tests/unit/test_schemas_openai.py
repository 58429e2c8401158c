"""OpenAI batch line formats: every validation rule, accepted and rejected."""

from __future__ import annotations

import json
import pickle
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from llmbatch.schemas import (
    BatchInputLine,
    BatchOutputLine,
    ChatCompletionBody,
    CompletionBody,
    Endpoint,
    RequestCounts,
    SchemaError,
    Usage,
    check_input_lines,
    iter_input_lines,
    parse_input_line,
)
from llmbatch.schemas.errors import Reason

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_line(custom_id: str = "r1", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"messages": [{"role": "user", "content": "Hello"}], **body},
    }


def completion_line(custom_id: str = "r1", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": {"prompt": "Once", **body}}


def raw(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def reject(obj: Any, **kwargs: Any) -> SchemaError:
    with pytest.raises(SchemaError) as info:
        parse_input_line(raw(obj) if not isinstance(obj, bytes | str) else obj, 7, **kwargs)
    assert info.value.line == 7
    return info.value


# ------------------------------------------------------------------------------ accepted


def test_chat_line_parses_and_keeps_body_verbatim() -> None:
    obj = chat_line(max_tokens=16, temperature=0.0, top_p=1, stop=["\n"], seed=-3, n=1, stream=False)
    line = parse_input_line(raw(obj), 1)
    assert line.custom_id == "r1"
    assert line.url is Endpoint.CHAT_COMPLETIONS
    assert line.body == obj["body"]
    typed = line.typed_body()
    assert isinstance(typed, ChatCompletionBody)
    assert typed.max_output_tokens() == 16
    assert typed.messages[0].text() == "Hello"
    assert orjson.loads(line.to_jsonl()) == obj


def test_completion_line_parses() -> None:
    line = parse_input_line(raw(completion_line(max_tokens=5, logprobs=2)).decode(), 3)
    typed = line.typed_body()
    assert isinstance(typed, CompletionBody)
    assert typed.prompt == "Once"
    assert typed.logprobs == 2


def test_content_parts_and_all_roles_accepted() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "x", "name": "bot"},
    ]
    line = parse_input_line(raw({**chat_line(), "body": {"messages": messages}}))
    typed = line.typed_body()
    assert isinstance(typed, ChatCompletionBody)
    assert typed.messages[2].text() == "ab"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 1),
        ("max_tokens", 32768),
        ("max_completion_tokens", 100),
        ("temperature", 0),
        ("temperature", 2.0),
        ("top_p", 1.0),
        ("top_p", 0.01),
        ("stop", "END"),
        ("stop", ["a", "b", "c", "d"]),
        ("seed", 2**63 - 1),
        ("presence_penalty", -2.0),
        ("frequency_penalty", 2),
        ("top_k", -1),
        ("min_p", 0.5),
        ("repetition_penalty", 1.1),
        ("user", "u-1"),
        ("model", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ],
)
def test_sampling_params_in_range_accepted(field: str, value: Any) -> None:
    line = parse_input_line(raw(chat_line(**{field: value})))
    assert line.body[field] == value


def test_crlf_and_bom_tolerated() -> None:
    line = parse_input_line(b"\xef\xbb\xbf" + raw(chat_line()) + b"\r\n", 1)
    assert line.custom_id == "r1"


# ------------------------------------------------------------------------------ rejected


@pytest.mark.parametrize(
    ("obj", "reason", "field"),
    [
        (chat_line(temperature=2.5), Reason.INVALID_FIELD, "body.temperature"),
        (chat_line(temperature=-0.1), Reason.INVALID_FIELD, "body.temperature"),
        (chat_line(temperature="0.5"), Reason.INVALID_FIELD, "body.temperature"),
        (chat_line(top_p=0), Reason.INVALID_FIELD, "body.top_p"),
        (chat_line(top_p=1.5), Reason.INVALID_FIELD, "body.top_p"),
        (chat_line(max_tokens=0), Reason.INVALID_FIELD, "body.max_tokens"),
        (chat_line(max_tokens=32769), Reason.INVALID_FIELD, "body.max_tokens"),
        (chat_line(max_tokens=True), Reason.INVALID_FIELD, "body.max_tokens"),
        (chat_line(max_tokens=5.5), Reason.INVALID_FIELD, "body.max_tokens"),
        (
            chat_line(max_tokens=5, max_completion_tokens=5),
            Reason.INVALID_FIELD,
            "body.max_completion_tokens",
        ),
        (chat_line(n=2), Reason.INVALID_FIELD, "body.n"),
        (chat_line(stream=True), Reason.INVALID_FIELD, "body.stream"),
        (chat_line(stop=["a", "b", "c", "d", "e"]), Reason.INVALID_FIELD, "body.stop"),
        (chat_line(stop=5), Reason.INVALID_FIELD, "body.stop"),
        (chat_line(seed=2**64), Reason.INVALID_FIELD, "body.seed"),
        (chat_line(presence_penalty=3), Reason.INVALID_FIELD, "body.presence_penalty"),
        (chat_line(top_logprobs=3), Reason.INVALID_FIELD, "body.top_logprobs"),
        (chat_line(max_token=5), Reason.UNKNOWN_FIELD, "body.max_token"),
        (chat_line(model="bad model name"), Reason.INVALID_FIELD, "body.model"),
        ({**chat_line(), "body": {"messages": []}}, Reason.INVALID_FIELD, "body.messages"),
        ({**chat_line(), "body": {}}, Reason.MISSING_FIELD, "body.messages"),
        (
            {**chat_line(), "body": {"messages": [{"role": "robot", "content": "x"}]}},
            Reason.INVALID_FIELD,
            "body.messages[0].role",
        ),
        (
            {**chat_line(), "body": {"messages": [{"role": "user", "content": 5}]}},
            Reason.INVALID_FIELD,
            "body.messages[0].content",
        ),
        (
            {**chat_line(), "body": {"messages": [{"role": "user", "content": []}]}},
            Reason.INVALID_FIELD,
            "body.messages[0].content",
        ),
        (
            {**chat_line(), "body": {"messages": [{"role": "user"}]}},
            Reason.MISSING_FIELD,
            "body.messages[0].content",
        ),
        (
            {**chat_line(), "body": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}},
            Reason.INVALID_FIELD,
            "body.messages[0].content",
        ),
        ({**chat_line(), "body": "text"}, Reason.INVALID_FIELD, "body"),
        (completion_line(prompt=["a", "b"]), Reason.INVALID_FIELD, "body.prompt"),
        (completion_line(prompt=""), Reason.INVALID_FIELD, "body.prompt"),
        (completion_line(logprobs=6), Reason.INVALID_FIELD, "body.logprobs"),
        (
            {**completion_line(), "body": {"messages": [{"role": "user", "content": "x"}]}},
            Reason.MISSING_FIELD,
            "body.prompt",
        ),
        ({**chat_line(), "method": "GET"}, Reason.INVALID_FIELD, "method"),
        ({**chat_line(), "url": "/v1/moderations"}, Reason.INVALID_FIELD, "url"),
        ({**chat_line(), "custom_id": ""}, Reason.INVALID_FIELD, "custom_id"),
        ({**chat_line(), "custom_id": "x" * 513}, Reason.INVALID_FIELD, "custom_id"),
        ({**chat_line(), "custom_id": 5}, Reason.INVALID_FIELD, "custom_id"),
        ({k: v for k, v in chat_line().items() if k != "custom_id"}, Reason.MISSING_FIELD, "custom_id"),
        ({**chat_line(), "extra": 1}, Reason.UNKNOWN_FIELD, "extra"),
    ],
)
def test_invalid_lines_name_reason_and_field(obj: Any, reason: str, field: str) -> None:
    error = reject(obj)
    assert (error.reason, error.field) == (reason, field)
    assert str(error).startswith(f"line 7: {field}: ")


def test_unknown_parameter_message_lists_supported_ones() -> None:
    error = reject(chat_line(max_token=5))
    assert "supported:" in error.message
    assert "max_tokens" in error.message
    assert error.openai_code == "unsupported_parameter"


def test_error_carries_custom_id_when_readable() -> None:
    assert reject(chat_line("abc", temperature=9)).custom_id == "abc"
    assert reject({"custom_id": 5}).custom_id is None


@pytest.mark.parametrize("payload", [b"{bad", b"[1, 2]", b'"text"', b"\xff\xfe{}", b"null", "{", b""])
def test_non_object_json_is_invalid_json(payload: bytes | str) -> None:
    error = reject(payload)
    assert error.reason == Reason.INVALID_JSON
    assert error.openai_code == "invalid_json_line"


def test_url_and_model_must_match_the_batch() -> None:
    error = reject(chat_line(), endpoint=Endpoint.COMPLETIONS)
    assert (error.reason, error.field) == (Reason.URL_MISMATCH, "url")
    error = reject(chat_line(model="other"), model="mine")
    assert (error.reason, error.field) == (Reason.MODEL_MISMATCH, "body.model")
    assert parse_input_line(raw(chat_line(model="mine")), model="mine").body["model"] == "mine"
    assert parse_input_line(raw(chat_line()), endpoint="/v1/chat/completions", model="mine").custom_id == "r1"


def test_schema_error_pickles_for_ray_workers() -> None:
    error = reject(chat_line("c9", temperature=5))
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.reason, clone.field, clone.line, clone.custom_id, str(clone)) == (
        error.reason,
        error.field,
        error.line,
        error.custom_id,
        str(error),
    )
    assert clone.retriable is False


# ------------------------------------------------------------------------------ files


def test_iter_input_lines_numbers_lines_skips_blanks_and_flags_duplicates() -> None:
    lines = [
        raw(chat_line("a")),
        b"\n",
        b"   ",
        raw(chat_line("b", temperature=9)),
        raw(chat_line("a")),
        raw(chat_line("c")),
    ]
    results = list(iter_input_lines(lines))
    assert [r.line_no for r in results] == [1, 4, 5, 6]
    assert [r.ok for r in results] == [True, False, False, True]
    assert results[1].error is not None
    assert results[1].error.field == "body.temperature"
    dup = results[2].error
    assert dup is not None
    assert dup.reason == Reason.DUPLICATE_CUSTOM_ID
    assert "line 1" in dup.message
    assert dup.line == 5
    assert results[0].raw == lines[0]


def test_check_input_lines_report_caps_errors_but_counts_all() -> None:
    lines = [raw(chat_line(f"id{i}", temperature=9)) for i in range(30)] + [raw(chat_line("ok"))]
    report = check_input_lines(lines, max_errors=5)
    assert (report.valid, report.invalid, len(report.errors)) == (1, 30, 5)
    assert not report.ok
    summary = report.summary()
    assert summary.startswith("30 invalid lines of 31")
    assert "... and 25 more" in summary
    assert "line 1: body.temperature" in summary


def test_empty_input_report() -> None:
    report = check_input_lines([b"", b"\n"])
    assert not report.ok
    assert report.summary() == "the input has no request lines"


# ------------------------------------------------------------------------------ outputs


def test_output_line_success_and_error_forms() -> None:
    ok = BatchOutputLine.model_validate(
        {
            "id": "batch_req_1",
            "custom_id": "a",
            "response": {"status_code": 200, "request_id": "r", "body": {}},
            "error": None,
        }
    )
    assert ok.ok
    failed = BatchOutputLine.model_validate(
        {
            "id": "batch_req_2",
            "custom_id": "b",
            "response": None,
            "error": {"code": "invalid_value", "message": "m"},
        }
    )
    assert not failed.ok
    http_error = BatchOutputLine.model_validate(
        {
            "id": "batch_req_3",
            "custom_id": "c",
            "response": {"status_code": 400, "request_id": "r", "body": {}},
        }
    )
    assert not http_error.ok
    dumped = orjson.loads(failed.to_jsonl())
    assert dumped["response"] is None
    assert dumped["error"]["code"] == "invalid_value"
    with pytest.raises(ValueError, match="needs a response or an error"):
        BatchOutputLine.model_validate({"id": "x", "custom_id": "d"})


def test_request_counts_and_usage_rules() -> None:
    assert RequestCounts(total=10, completed=6, failed=3).pending == 1
    with pytest.raises(ValueError, match="exceeds total"):
        RequestCounts(total=2, completed=2, failed=1)
    with pytest.raises(ValidationError, match="total"):
        RequestCounts(total=-1)
    usage = Usage(prompt_tokens=3, completion_tokens=4)
    assert usage.total_tokens == 7
    assert (usage + Usage(prompt_tokens=1, completion_tokens=1)).total_tokens == 9
    with pytest.raises(ValueError, match="total_tokens"):
        Usage(prompt_tokens=1, completion_tokens=1, total_tokens=5)
    assert (
        Usage.model_validate({"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}).total_tokens
        == 4
    )


def test_input_line_model_rejects_body_for_wrong_endpoint_when_built_directly() -> None:
    with pytest.raises(ValueError, match=r"body\.prompt"):
        BatchInputLine(custom_id="x", method="POST", url=Endpoint.COMPLETIONS, body={"messages": []})


# ------------------------------------------------------------------------------ response_format

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
        {"type": "json_schema", "json_schema": {"name": "any-object_1", "description": "d"}},
    ],
)
def test_response_format_accepted_and_kept_verbatim(response_format: dict[str, Any]) -> None:
    parsed = parse_input_line(raw(chat_line(response_format=response_format)), 1)
    assert parsed.body["response_format"] == response_format


@pytest.mark.parametrize(
    ("response_format", "reason", "field", "says"),
    [
        ("json", Reason.INVALID_FIELD, "body.response_format", "valid dictionary"),
        (
            {"type": "xml"},
            Reason.INVALID_FIELD,
            "body.response_format",
            "'text', 'json_object', 'json_schema'",
        ),
        ({"type": "json_schema"}, Reason.MISSING_FIELD, "body.response_format.json_schema", "required"),
        (
            {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            Reason.MISSING_FIELD,
            "body.response_format.json_schema.name",
            "required",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "has space"}},
            Reason.INVALID_FIELD,
            "body.response_format.json_schema.name",
            "pattern",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}},
            Reason.INVALID_FIELD,
            "body.response_format.json_schema.schema",
            "dictionary",
        ),
        (
            {"type": "json_object", "strict": True},
            Reason.UNKNOWN_FIELD,
            "body.response_format.strict",
            "supported: json_schema, type",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schemas": {}}},
            Reason.UNKNOWN_FIELD,
            "body.response_format.json_schema.schemas",
            "supported: description, name, schema, strict",
        ),
    ],
)
def test_bad_response_format_names_the_field_and_the_fix(
    response_format: Any, reason: str, field: str, says: str
) -> None:
    error = reject(chat_line(response_format=response_format))
    assert (error.reason, error.field) == (reason, field)
    assert says in error.message


def test_response_format_is_for_chat_only() -> None:
    error = reject(completion_line(response_format={"type": "json_object"}))
    assert (error.reason, error.field) == (Reason.UNKNOWN_FIELD, "body.response_format")


def test_unknown_field_inside_a_message_lists_the_message_fields() -> None:
    error = reject({**chat_line(), "body": {"messages": [{"role": "user", "content": "x", "tool": 1}]}})
    assert error.field == "body.messages[0].tool" and "supported: content, name, role" in error.message


# ------------------------------------------------------------------------------ logit_bias


def test_logit_bias_accepted_on_both_endpoints() -> None:
    bias = {"50256": -100, "7": 2.5}
    assert parse_input_line(raw(chat_line(logit_bias=bias)), 1).body["logit_bias"] == bias
    assert parse_input_line(raw(completion_line(logit_bias=bias)), 1).body["logit_bias"] == bias


@pytest.mark.parametrize(
    ("bias", "field", "says"),
    [
        ({"the": 1}, "body.logit_bias", "token ids as decimal strings"),
        ({"5": 101}, "body.logit_bias.5", "less than or equal to 100"),
        ({"5": "1"}, "body.logit_bias.5", "valid number"),
        ([5], "body.logit_bias", "dictionary"),
        ({str(i): 1 for i in range(1025)}, "body.logit_bias", "at most 1024"),
    ],
)
def test_bad_logit_bias_names_the_field(bias: Any, field: str, says: str) -> None:
    error = reject(chat_line(logit_bias=bias))
    assert (error.reason, error.field) == (Reason.INVALID_FIELD, field)
    assert says in error.message
