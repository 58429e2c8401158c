"""Errors of the HTTP API: one hierarchy, each class one OpenAI error shape and status code.

Every error answers with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``, so the
official SDKs raise their usual exceptions (``BadRequestError``, ``AuthenticationError``,
``NotFoundError``, ``ConflictError``, ``RateLimitError``, ``InternalServerError``). ``param`` names
the field at fault whenever one is; ``message`` says what to change.

:func:`from_exception` translates the errors of the code the API reuses (producer SDK, schemas,
dispatcher state store) at this boundary, so domain modules raise their own types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmbatch.adapters.errors import InvalidInput, ProducerError
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.schemas.errors import LLMBatchError, SchemaError


class ApiError(LLMBatchError):
    """Base: an answer the API gives on purpose (never a traceback)."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:  # errors raised by the framework (unknown route, bad multipart)
            self.status = status
            self.type = "invalid_request_error" if status < 500 else "server_error"
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(ApiError):
    """400: a field of the request is missing or wrong (``param`` names it)."""

    status = 400
    type = "invalid_request_error"


class InvalidApiKey(ApiError):
    """401: no API key, or one the server does not know."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(ApiError):
    """404: no such object for this key's tenant (another tenant's objects do not exist for it)."""

    status = 404
    type = "invalid_request_error"


class Conflict(ApiError):
    """409: the object is in a state that does not allow the operation (e.g. cancel a finished batch)."""

    status = 409
    type = "invalid_request_error"


class PayloadTooLarge(ApiError):
    """413: the request body is over the configured limit."""

    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class RateLimited(ApiError):
    """429: the tenant is over its request quota; ``Retry-After`` says when to come back."""

    retriable = True
    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class QuotaExceeded(ApiError):
    """429: the tenant holds as much as it may (waiting does not help: it must free some first)."""

    status = 429
    type = "insufficient_quota"


class ServiceUnavailable(ApiError):
    """503: Kafka, Redis or object storage is unreachable; the same call may succeed later."""

    retriable = True
    status = 503
    type = "server_error"
    code = "service_unavailable"


class InternalError(ApiError):
    """500: a dependency refused the call for a reason retrying will not fix."""

    status = 500
    type = "server_error"
    code = "internal_error"


def invalid_file(errors: Sequence[SchemaError], summary: str, *, param: str = "file") -> InvalidRequest:
    """A 400 for an uploaded file with bad lines: the message names every reported line."""
    first = errors[0] if errors else None
    head, *items = [part.strip() for part in summary.splitlines() if part.strip()] or ["invalid lines"]
    text = f"{head}: {'; '.join(items)}" if items else head
    return InvalidRequest(
        f"the file is not a valid batch input: {text}. Fix those lines (numbers start at 1) and upload again",
        param=param,
        code=first.openai_code if first is not None else "invalid_file",
    )


def from_exception(exc: Exception, *, param: str | None = None) -> ApiError:
    """The API error for an exception of the reused code (producer, schemas, dispatcher)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidInput):
        if exc.errors and any(e.line is not None for e in exc.errors):
            return invalid_file(exc.errors, exc.message, param=param or "file")
        field = exc.errors[0].field if exc.errors else None
        return InvalidRequest(exc.message, param=field or param)
    if isinstance(exc, SchemaError):
        return InvalidRequest(exc.message, param=exc.field or param, code=exc.openai_code)
    if isinstance(exc, ProducerError | DispatcherError):
        # the detail (addresses, settings) goes to the server's log, not to the client
        backend = _BACKENDS.get(type(exc).__name__, "a backend service")
        if exc.retriable:
            return ServiceUnavailable(f"{backend} is unavailable right now; try again later")
        return InternalError(f"{backend} refused the operation; the server log says why")
    return InternalError(f"unexpected {type(exc).__name__}; the server log says more")


_BACKENDS = {
    "BrokerUnavailable": "Kafka",
    "KafkaUnavailable": "Kafka",
    "PublishFailed": "Kafka",
    "TopicMissing": "Kafka",
    "StorageError": "object storage",
    "StateStoreUnavailable": "Redis",
}
