"""OpenAI-shaped error bodies and status codes (api.errors), through the app where they surface."""

from __future__ import annotations

from typing import Any

import pytest

from llmbatch.adapters.errors import BrokerUnavailable, InvalidInput, PublishFailed, StorageError
from llmbatch.api.errors import (
    ApiError,
    Conflict,
    InternalError,
    InvalidApiKey,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ServiceUnavailable,
    from_exception,
)
from llmbatch.dispatcher.errors import StateStoreUnavailable
from llmbatch.schemas.errors import Reason, SchemaError
from tests.support.api_fakes import chat_line, jsonl, make_api

pytestmark = pytest.mark.unit


def shape(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return dict(body["error"])


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidRequest("x", param="limit"), 400, "invalid_request_error"),
        (InvalidApiKey("x"), 401, "invalid_request_error"),
        (NotFound("x"), 404, "invalid_request_error"),
        (Conflict("x"), 409, "invalid_request_error"),
        (PayloadTooLarge("x"), 413, "invalid_request_error"),
        (RateLimited("x"), 429, "requests"),
        (InternalError("x"), 500, "server_error"),
        (ServiceUnavailable("x"), 503, "server_error"),
    ],
)
def test_each_error_has_its_status_and_type(error: ApiError, status: int, kind: str) -> None:
    assert error.status == status
    assert shape(error.body())["type"] == kind


def test_codes_and_params_are_carried() -> None:
    assert shape(InvalidRequest("bad", param="limit").body())["param"] == "limit"
    assert shape(InvalidApiKey("no").body())["code"] == "invalid_api_key"
    assert shape(RateLimited("slow").body())["code"] == "rate_limit_exceeded"
    assert shape(Conflict("x", code="batch_not_cancellable").body())["code"] == "batch_not_cancellable"


def test_reused_code_errors_map_to_status_codes_without_leaking_addresses() -> None:
    down = from_exception(BrokerUnavailable("Kafka at 10.0.0.7:9092 is unreachable"))
    assert isinstance(down, ServiceUnavailable) and "10.0.0.7" not in down.message and "Kafka" in down.message
    assert isinstance(from_exception(StorageError("denied", retriable=False)), InternalError)
    assert isinstance(from_exception(StorageError("unreachable")), ServiceUnavailable)
    assert isinstance(from_exception(PublishFailed("too large")), InternalError)
    assert isinstance(from_exception(StateStoreUnavailable("redis down")), ServiceUnavailable)
    assert isinstance(from_exception(RuntimeError("boom")), InternalError)
    field_error = from_exception(SchemaError(Reason.INVALID_FIELD, "too long", field="metadata"))
    assert isinstance(field_error, InvalidRequest) and field_error.param == "metadata"


def test_a_file_with_bad_lines_names_them_all_in_one_message() -> None:
    errors = [
        SchemaError(Reason.INVALID_JSON, "not JSON", line=2),
        SchemaError(Reason.INVALID_FIELD, "x", line=5),
    ]
    error = from_exception(InvalidInput("2 invalid lines of 6\n  line 2: not JSON\n  line 5: x", errors))
    body = shape(error.body())
    assert error.status == 400 and body["param"] == "file" and body["code"] == "invalid_json_line"
    assert "2 invalid lines of 6: line 2: not JSON; line 5: x" in body["message"]


# --- through the app ------------------------------------------------------------------------------


def test_validation_errors_of_fastapi_answer_400_with_the_param() -> None:
    api = make_api()
    answer = api.client.get("/v1/batches?limit=many", headers=api.auth())
    assert answer.status_code == 400 and shape(answer.json())["param"] == "limit"
    answer = api.client.post("/v1/batches", headers=api.auth(), json={"endpoint": "/v1/chat/completions"})
    assert answer.status_code == 400 and shape(answer.json())["param"] == "input_file_id"
    body = {"input_file_id": "f", "endpoint": "/v1/x", "colour": "red"}
    answer = api.client.post("/v1/batches", headers=api.auth(), json=body)
    assert answer.status_code == 400
    assert shape(answer.json())["param"] in {"endpoint", "colour"}
    assert "more" in answer.json()["error"]["message"]
    answer = api.client.post(
        "/v1/batches", headers={**api.auth(), "content-type": "application/json"}, content=b"{nope"
    )
    assert answer.status_code == 400 and shape(answer.json())["message"] == "the body is not valid JSON"


def test_unknown_routes_and_methods_answer_in_openai_shape() -> None:
    api = make_api()
    answer = api.client.get("/v1/models", headers=api.auth())
    assert answer.status_code == 404 and "GET /v1/models" in shape(answer.json())["message"]
    answer = api.client.put("/v1/batches", headers=api.auth())
    assert answer.status_code == 405 and shape(answer.json())["type"] == "invalid_request_error"


def test_bodies_over_the_limit_are_refused_by_length_and_while_streaming() -> None:
    api = make_api(max_json_bytes=2048, max_upload_bytes=4096)
    big = b'{"input_file_id": "' + b"x" * 4000 + b'"}'
    answer = api.client.post(
        "/v1/batches", headers={**api.auth(), "content-type": "application/json"}, content=big
    )
    assert answer.status_code == 413 and shape(answer.json())["code"] == "payload_too_large"

    def chunks() -> Any:  # no Content-Length: counted as it arrives
        for _ in range(4):
            yield b" " * 1000
        yield b'{"input_file_id": "x"}'

    answer = api.client.post(
        "/v1/batches", headers={**api.auth(), "content-type": "application/json"}, content=chunks()
    )
    assert answer.status_code == 413 and shape(answer.json())["code"] == "payload_too_large"

    huge = jsonl(*(chat_line(str(i)) for i in range(8000)))  # ~1.4 MB over 4096 + the multipart slack
    answer = api.upload(huge)
    assert answer.status_code == 413
    assert api.objects.keys("llmbatch-input") == []


def test_an_upload_between_the_file_limit_and_the_body_limit_is_refused_by_the_validator() -> None:
    api = make_api(max_upload_bytes=4096)
    data = jsonl(*(chat_line(str(i)) for i in range(40)))
    assert 4096 < len(data) < 4096 + (1 << 20)
    answer = api.upload(data)
    body = shape(answer.json())
    assert answer.status_code == 400 and body["param"] == "file" and "MAX_UPLOAD_BYTES" in body["message"]


def test_backends_that_are_down_answer_503_naming_which_without_its_address() -> None:
    from llmbatch.adapters.errors import StorageError
    from llmbatch.dispatcher.errors import StateStoreUnavailable

    api = make_api()
    file_id = api.upload(jsonl(chat_line("a"))).json()["id"]

    api.objects.failing["list_keys"] = StorageError("object storage at http://10.1.2.3:9000 is unreachable")
    answer = api.client.get("/v1/batches", headers=api.auth())
    assert answer.status_code == 503 and "object storage" in answer.json()["error"]["message"]
    assert "10.1.2.3" not in answer.text

    created = api.client.post(
        "/v1/batches", headers=api.auth(), json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    )
    api.dispatcher.down = StateStoreUnavailable("redis://10.1.2.4:6379 refused")
    answer = api.client.get(f"/v1/batches/{created.json()['id']}", headers=api.auth())
    assert answer.status_code == 503 and "Redis" in answer.json()["error"]["message"]
    assert "10.1.2.4" not in answer.text
