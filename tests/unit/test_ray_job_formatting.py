"""ray_job output lines: OpenAI batch output shapes, usage, logprobs, error lines."""

from __future__ import annotations

import orjson
import pytest

from llmbatch.ray_job.errors import CONTEXT_LENGTH_EXCEEDED, RequestFailure
from llmbatch.ray_job.lines.formatting import error_line, output_line
from llmbatch.ray_job.lines.records import Generation, TokenLogprob
from llmbatch.schemas.common import Endpoint
from llmbatch.schemas.openai import BatchOutputLine

pytestmark = pytest.mark.unit


def gen(**kw: object) -> Generation:
    base: dict[str, object] = {
        "text": "Paris.",
        "finish_reason": "stop",
        "prompt_tokens": 11,
        "completion_tokens": 3,
    }
    base.update(kw)
    return Generation("7", **base)  # type: ignore[arg-type]


def test_chat_completion_line() -> None:
    raw = output_line(
        Endpoint.CHAT_COMPLETIONS,
        gen(),
        batch_id="b",
        custom_id="q1",
        line_no=7,
        model="m",
        created=1700000000,
    )
    parsed = BatchOutputLine.model_validate_json(raw)
    assert parsed.ok and parsed.custom_id == "q1" and raw.endswith(b"\n")
    assert parsed.response is not None
    body = parsed.response.body
    assert body["object"] == "chat.completion" and body["model"] == "m" and body["created"] == 1700000000
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Paris.", "refusal": None}
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    assert body["id"] == "chatcmpl-" + parsed.id.removeprefix("batch_req_")
    assert parsed.response.request_id == "req_" + parsed.id.removeprefix("batch_req_")


def test_completion_line_with_logprobs() -> None:
    lps = [TokenLogprob("Pa", -0.1, [("Pa", -0.1), ("Lo", -2.5)]), TokenLogprob("ris", -0.2, [("ris", -0.2)])]
    raw = output_line(
        Endpoint.COMPLETIONS,
        gen(text="Paris", finish_reason="length", logprobs=lps),
        batch_id="b",
        custom_id="q1",
        line_no=1,
        model="m",
        created=1,
    )
    body = orjson.loads(raw)["response"]["body"]
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["text"] == "Paris" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["Pa", "ris"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"Pa": -0.1, "Lo": -2.5}, {"ris": -0.2}],
        "text_offset": [0, 2],
    }


def test_chat_logprobs_shape() -> None:
    raw = output_line(
        Endpoint.CHAT_COMPLETIONS,
        gen(logprobs=[TokenLogprob("é", -0.5, [("é", -0.5)])]),
        batch_id="b",
        custom_id="q",
        line_no=1,
        model="m",
        created=1,
    )
    content = orjson.loads(raw)["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert content == [
        {
            "token": "é",
            "logprob": -0.5,
            "bytes": [195, 169],
            "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [195, 169]}],
        }
    ]


def test_error_line_for_a_request_has_an_openai_error_response() -> None:
    failure = RequestFailure(CONTEXT_LENGTH_EXCEEDED, "too long", "messages", 400)
    parsed = BatchOutputLine.model_validate_json(error_line(failure, batch_id="b", custom_id="q", line_no=4))
    assert not parsed.ok
    assert (
        parsed.error is not None and parsed.error.code == CONTEXT_LENGTH_EXCEEDED and parsed.error.line == 4
    )
    assert parsed.response is not None and parsed.response.status_code == 400
    assert parsed.response.body["error"] == {
        "message": "too long",
        "type": "invalid_request_error",
        "param": "messages",
        "code": CONTEXT_LENGTH_EXCEEDED,
    }
    server = error_line(
        RequestFailure("engine_error", "boom", None, 500), batch_id="b", custom_id="q", line_no=4
    )
    assert orjson.loads(server)["response"]["body"]["error"]["type"] == "server_error"


def test_error_line_for_an_unparseable_line_has_no_response() -> None:
    raw = error_line(RequestFailure("invalid_json_line", "bad"), batch_id="b", custom_id="@line-3", line_no=3)
    obj = orjson.loads(raw)
    assert obj["response"] is None and obj["error"]["code"] == "invalid_json_line"
    assert BatchOutputLine.model_validate(obj).custom_id == "@line-3"


def test_ids_depend_on_batch_line_and_custom_id() -> None:
    def ident(batch: str, cid: str, line_no: int) -> str:
        raw = output_line(
            Endpoint.COMPLETIONS, gen(), batch_id=batch, custom_id=cid, line_no=line_no, model="m", created=1
        )
        return str(orjson.loads(raw)["id"])

    assert ident("b", "q", 1) == ident("b", "q", 1)
    assert len({ident("b", "q", 1), ident("b2", "q", 1), ident("b", "q2", 1), ident("b", "q", 2)}) == 4
