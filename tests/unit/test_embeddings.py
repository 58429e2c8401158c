"""``/v1/embeddings`` batches: the line schema, the dispatcher's endpoint check, the prompt and engine
stages on the fake backend, and the output format (validated with the official SDK's types)."""

from __future__ import annotations

import base64
import struct
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.dispatcher.intake.intake_checks import check_served
from llmbatch.ray_job.engines.backend_fake import WhitespaceTokenizer
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.job.engine import EngineStage
from llmbatch.ray_job.job.prompts import build_rows
from llmbatch.ray_job.lines import rows
from llmbatch.ray_job.lines.formatting import embedding_body, encode_embedding
from llmbatch.ray_job.lines.parse import parse_lines
from llmbatch.ray_job.lines.records import Generation
from llmbatch.schemas.common import Endpoint
from llmbatch.schemas.errors import Reason, SchemaError
from llmbatch.schemas.input_lines import parse_input_line
from llmbatch.schemas.job import EngineConfig
from llmbatch.schemas.openai import BatchOutputLine
from llmbatch.schemas.request_bodies import MAX_EMBEDDING_INPUTS
from tests.support.dispatcher_kit import batch_request

pytestmark = pytest.mark.unit

EMBED = "/v1/embeddings"


def line(body: dict[str, Any], custom_id: str = "e1") -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": EMBED, "body": body})


# --- the line schema ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["one text", ["a", "b"], [1, 2, 3], [[1], [2, 3]], ["x"] * MAX_EMBEDDING_INPUTS],
    ids=["string", "strings", "token-ids", "token-id-lists", "most-inputs"],
)
def test_every_openai_input_shape_is_accepted(value: Any) -> None:
    parsed = parse_input_line(line({"input": value, "encoding_format": "base64", "model": "m"}), 1)
    assert parsed.body["input"] == value


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ({"input": ""}, "body.input", Reason.INVALID_FIELD),
        ({"input": []}, "body.input", Reason.INVALID_FIELD),
        ({"input": ["a", ""]}, "body.input", Reason.INVALID_FIELD),
        ({"input": [1, "a"]}, "body.input", Reason.INVALID_FIELD),
        ({"input": [-1]}, "body.input", Reason.INVALID_FIELD),
        ({"input": [[]]}, "body.input", Reason.INVALID_FIELD),
        ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "body.input", Reason.INVALID_FIELD),
        ({"input": 3}, "body.input", Reason.INVALID_FIELD),
        ({}, "body.input", Reason.MISSING_FIELD),
        ({"input": "x", "encoding_format": "hex"}, "body.encoding_format", Reason.INVALID_FIELD),
        ({"input": "x", "dimensions": 0}, "body.dimensions", Reason.INVALID_FIELD),
        ({"input": "x", "max_tokens": 3}, "body.max_tokens", Reason.UNKNOWN_FIELD),
        ({"input": "x", "messages": []}, "body.messages", Reason.UNKNOWN_FIELD),
    ],
)
def test_bad_bodies_name_the_field_and_the_fix(body: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(SchemaError) as caught:
        parse_input_line(line(body), 4)
    assert (caught.value.reason, caught.value.field, caught.value.line) == (reason, field, 4)
    if field == "body.input" and reason == Reason.INVALID_FIELD:
        assert "a list of token ids" in caught.value.message  # says what is accepted
    if reason == Reason.UNKNOWN_FIELD:
        assert "supported: dimensions, encoding_format, input, model, user" in caught.value.message


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=12,
)


@given(
    st.dictionaries(
        st.sampled_from(["input", "encoding_format", "dimensions", "user", "model", "x"]), _JSON, max_size=4
    )
)
def test_any_body_is_accepted_or_refused_with_a_schema_error(body: dict[str, Any]) -> None:
    try:
        parsed = parse_input_line(line(body), 1)
    except SchemaError as exc:
        refused: SchemaError | None = exc
    else:
        refused = None
    if refused is not None:
        assert refused.field is not None and refused.field.startswith("body")
    else:
        tokenized = build_rows(
            WhitespaceTokenizer(),
            Endpoint.EMBEDDINGS,
            [rows.Row(1, rows.REQUEST, "e1", orjson.dumps({"body": parsed.body}))],
            batch_id="b",
            keep_text=False,
        )
        assert tokenized[0].kind == rows.REQUEST


# --- which models serve it -----------------------------------------------------------------------------


def _request(model: str, endpoint: Endpoint) -> Any:
    return batch_request(model=model, endpoint=endpoint, input_uri="s3://inputs/default/in.jsonl")


def test_an_embedding_batch_runs_only_on_an_embedding_model_and_a_chat_batch_never_does() -> None:
    served, pooling = frozenset({"chat-model", "embed-model"}), frozenset({"embed-model"})
    check_served(_request("embed-model", Endpoint.EMBEDDINGS), served, pooling)
    check_served(_request("chat-model", Endpoint.CHAT_COMPLETIONS), served, pooling)
    with pytest.raises(SchemaError) as caught:
        check_served(_request("chat-model", Endpoint.EMBEDDINGS), served, pooling)
    assert caught.value.reason == Reason.MODEL_NOT_FOUND and caught.value.field == "endpoint"
    assert "'chat-model' is a text-generation model" in caught.value.message
    assert "Models that do: 'embed-model'" in caught.value.message
    with pytest.raises(SchemaError) as caught:
        check_served(_request("embed-model", Endpoint.COMPLETIONS), served, pooling)
    assert "'embed-model' is an embedding model: it does not serve /v1/completions" in caught.value.message
    assert "Models that do: 'chat-model'" in caught.value.message


# --- prompt stage, engine stage, output ----------------------------------------------------------------


def _run(lines: list[bytes], config: EngineConfig) -> dict[str, rows.Row]:
    parsed = list(parse_lines(lines, batch_id="b", endpoint=Endpoint.EMBEDDINGS, model="m"))
    prompted = build_rows(WhitespaceTokenizer(), Endpoint.EMBEDDINGS, parsed, batch_id="b", keep_text=True)
    stage = EngineStage(
        model_path="unused", engine=config.model_dump_json(), endpoint=EMBED, batch_id="b", model="m"
    )
    return {r.custom_id: r for r in stage.process(prompted)}


def test_prompt_stage_tokenizes_texts_and_keeps_token_ids() -> None:
    parsed = list(
        parse_lines(
            [line({"input": ["one two", "three"]}), line({"input": [[7, 8, 9]]}, "e2")],
            batch_id="b",
            endpoint=Endpoint.EMBEDDINGS,
            model="m",
        )
    )
    out = build_rows(WhitespaceTokenizer(), Endpoint.EMBEDDINGS, parsed, batch_id="b", keep_text=False)
    first, second = (orjson.loads(r.payload) for r in out)
    tok = WhitespaceTokenizer()
    assert first["inputs"] == [tok.encode(text, add_special_tokens=True) for text in ("one two", "three")]
    assert second["inputs"] == [[7, 8, 9]]
    assert [r.prompt_tokens for r in out] == [3, 3]
    assert first["sampling"] == {"pooling": {}} and first["encoding_format"] == "float"


def test_each_input_gets_its_vector_in_order_and_a_line_fails_alone() -> None:
    config = EngineConfig(
        backend=FAKE_BACKEND, runner="pooling", max_model_len=16, backend_options={"fail_custom_ids": ["bad"]}
    )
    out = _run(
        [
            line({"input": ["alpha", "beta gamma", "alpha"]}, "many"),
            line({"input": ["ok", "word " * 17]}, "long"),  # 17 tokens > max_model_len 16
            line({"input": "fine", "dimensions": 3, "encoding_format": "base64"}, "b64"),
            line({"input": "x"}, "bad"),
            line({"input": [[1, 2], [3]]}, "ids"),
        ],
        config,
    )
    assert {k: r.kind for k, r in out.items()} == {
        "many": rows.OUTPUT,
        "long": rows.ERROR,
        "b64": rows.OUTPUT,
        "bad": rows.ERROR,
        "ids": rows.OUTPUT,
    }
    many = BatchOutputLine.model_validate_json(out["many"].payload)
    assert many.ok and many.response is not None
    body = many.response.body
    vectors = [item["embedding"] for item in body["data"]]
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert vectors[0] == vectors[2] != vectors[1]  # equal inputs, equal vectors; in order
    assert (
        body["usage"]
        == {"prompt_tokens": 4, "total_tokens": 4}
        == {"prompt_tokens": out["many"].prompt_tokens, "total_tokens": out["many"].prompt_tokens}
    )
    assert out["many"].completion_tokens == 0
    long_error = orjson.loads(out["long"].payload)["error"]
    assert long_error["code"] == "context_length_exceeded" and long_error["param"] == "input"
    assert "input 1 has 17 tokens" in long_error["message"]
    assert orjson.loads(out["bad"].payload)["error"]["code"] == "engine_error"
    b64 = orjson.loads(out["b64"].payload)["response"]["body"]["data"][0]["embedding"]
    assert len(struct.unpack("<3f", base64.b64decode(b64))) == 3
    from openai.types import CreateEmbeddingResponse

    for key in ("many", "ids"):  # the SDK types a float vector (it decodes base64 itself)
        parsed = CreateEmbeddingResponse.model_validate(orjson.loads(out[key].payload)["response"]["body"])
        assert parsed.model == "m" and parsed.object == "list"


def test_base64_is_little_endian_float32_of_the_same_vector() -> None:
    vector = [0.5, -1.25, 3.0e-3]
    encoded = encode_embedding(vector, "base64")
    assert isinstance(encoded, str)
    decoded = struct.unpack("<3f", base64.b64decode(encoded))
    assert decoded == pytest.approx(vector, rel=1e-6)
    assert encode_embedding(vector, "float") == vector


def test_usage_counts_the_tokens_of_every_input() -> None:
    gens = [
        Generation("1.0", prompt_tokens=3, embedding=[1.0]),
        Generation("1.1", prompt_tokens=4, embedding=[0.0]),
    ]
    body = embedding_body(gens, model="m", encoding_format="float")
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["embedding"] for d in body["data"]] == [[1.0], [0.0]]


def test_a_line_over_the_per_request_token_limit_fails_alone() -> None:
    from llmbatch.ray_job.lines.sampling import MAX_EMBEDDING_TOKENS_PER_LINE, fit_inputs

    inputs = [[1] * 200] * (MAX_EMBEDDING_TOKENS_PER_LINE // 200 + 1)
    failure = fit_inputs(inputs, max_model_len=256)
    assert failure is not None and (failure.code, failure.param) == ("max_tokens_per_request", "input")
    assert f"max {MAX_EMBEDDING_TOKENS_PER_LINE} tokens per request" in failure.message
    assert fit_inputs(inputs[:-1], max_model_len=256) is None
