"""ray_job engine stage without Ray: the prompt stage's chat normalisation and template errors, and
the prompt + engine stages run back to back on the fake backend."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from llmbatch.ray_job.engines.backend_fake import WhitespaceTokenizer
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.job.engine import EngineStage
from llmbatch.ray_job.job.prompts import build_rows, chat_messages
from llmbatch.ray_job.lines import rows
from llmbatch.ray_job.lines.parse import parse_lines
from llmbatch.schemas.common import Endpoint
from llmbatch.schemas.job import EngineConfig
from llmbatch.schemas.openai import BatchOutputLine

pytestmark = pytest.mark.unit


def test_chat_messages_normalisation() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "bob",
            },
        ]
    }
    assert chat_messages(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab", "name": "bob"},
    ]


class ExplodingTemplate(WhitespaceTokenizer):
    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if len(messages) > 1:
            raise ValueError("Conversation roles must alternate")
        return super().render_chat(messages)


def lines_for(*bodies: dict[str, Any], url: str = "/v1/chat/completions") -> list[bytes]:
    return [
        orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": b})
        for i, b in enumerate(bodies)
    ]


def test_prompt_stage_tokenizes_and_isolates_template_errors() -> None:
    lines = lines_for(
        {"messages": [{"role": "user", "content": "one two"}], "max_tokens": 3},
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
    )
    parsed = list(parse_lines(lines, batch_id="b", endpoint=Endpoint.CHAT_COMPLETIONS, model="m"))
    out = build_rows(ExplodingTemplate(), Endpoint.CHAT_COMPLETIONS, parsed, batch_id="b", keep_text=True)
    assert out[0].kind == rows.REQUEST and out[0].prompt_tokens == 4  # "<user> one two <assistant>"
    prompt = orjson.loads(out[0].payload)
    assert prompt["sampling"] == {"n": 1, "max_tokens": 3} and len(prompt["prompt_token_ids"]) == 4
    assert out[1].kind == rows.ERROR
    assert orjson.loads(out[1].payload)["error"]["code"] == "invalid_prompt"


def test_prompt_and_engine_stages_end_to_end_on_the_fake_backend() -> None:
    lines = [
        *lines_for(
            {"messages": [{"role": "user", "content": "short question"}], "max_tokens": 20},
            {"messages": [{"role": "user", "content": "word " * 80}]},  # 82 tokens > max_model_len 64
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 62},  # 3 + 62 > 64
            {"messages": [{"role": "user", "content": "fail me"}]},
        ),
        b"garbage",
    ]
    parsed = list(parse_lines(lines, batch_id="b", endpoint=Endpoint.CHAT_COMPLETIONS, model="m"))
    prompted = build_rows(
        WhitespaceTokenizer(), Endpoint.CHAT_COMPLETIONS, parsed, batch_id="b", keep_text=True
    )
    config = EngineConfig(backend=FAKE_BACKEND, max_model_len=64, backend_options={"fail_custom_ids": ["c3"]})
    stage = EngineStage(
        model_path="unused",
        engine=config.model_dump_json(),
        endpoint="/v1/chat/completions",
        batch_id="b",
        model="m",
    )
    out = {r.custom_id: r for r in stage.process(prompted)}
    assert {k: r.kind for k, r in out.items()} == {
        "c0": rows.OUTPUT,
        "c1": rows.ERROR,
        "c2": rows.ERROR,
        "c3": rows.ERROR,
        "@line-5": rows.INVALID,
    }
    ok = BatchOutputLine.model_validate_json(out["c0"].payload)
    assert ok.response is not None
    body = ok.response.body
    assert body["choices"][0]["message"]["content"] == "fake reply to: short question"
    assert body["usage"]["prompt_tokens"] == out["c0"].prompt_tokens == 4
    assert body["usage"]["completion_tokens"] == out["c0"].completion_tokens == 5
    codes = {k: orjson.loads(r.payload)["error"]["code"] for k, r in out.items() if r.kind != rows.OUTPUT}
    assert codes == {
        "c1": "context_length_exceeded",
        "c2": "context_length_exceeded",
        "c3": "engine_error",
        "@line-5": "invalid_json_line",
    }
    assert orjson.loads(out["c3"].payload)["response"]["status_code"] == 500
    assert out["c0"].engine_ready_at > 0
