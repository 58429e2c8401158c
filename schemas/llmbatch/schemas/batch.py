"""Commands on ``llm.batch.requests.v1``: :class:`BatchRequest` and :class:`CancelRequest`.

Structural rules (formats, exactly one input, endpoint consistency, unique custom_ids) are enforced
by the models themselves, so a decoded event is always well-formed. Rules that depend on settings or
on the clock are separate functions applied once, at acceptance: :func:`check_inline_limits`
(limits are settings) and :func:`check_deadline` (a redelivered event may legitimately be past its
deadline by the time it is read again). :func:`check_submittable` applies both.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from llmbatch.schemas.common import (
    BatchId,
    Duration,
    Endpoint,
    ExpiresAfter,
    Metadata,
    ModelName,
    S3Uri,
    Tenant,
    UtcDatetime,
    parse_duration,
    utcnow,
)
from llmbatch.schemas.errors import Reason, SchemaError
from llmbatch.schemas.openai import BatchInputLine

DEFAULT_COMPLETION_WINDOW = "24h"
"""Completion window applied when a request names neither ``completion_window`` nor ``deadline``."""
DEFAULT_PRIORITY = 5


class InlineLimits(BaseModel):
    """Bounds on inline ``requests`` (settings: the dispatcher and the producer share them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_requests: int = Field(default=1000, ge=1, le=100_000, description="Most inline requests.")
    max_bytes: int = Field(
        default=1 << 20, ge=1024, le=64 << 20, description="Most bytes of the inline requests as JSON."
    )


class BatchRequest(BaseModel):
    """Data of ``llmbatch.batch.requested.v1``: one OpenAI-compatible batch.

    Exactly one of ``input_uri`` (a JSONL file of :class:`~llmbatch.schemas.openai.BatchInputLine`) and
    ``requests`` (inline lines, small batches only) is set. Unknown fields are rejected so typos in
    upstream services fail loudly.
    """

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "batch_id": "nightly-eval-2024-06-01",
                    "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                    "endpoint": "/v1/chat/completions",
                    "input_uri": "s3://llmbatch-input/default/inputs/9f86d081884c7d65.jsonl",
                    "completion_window": "24h",
                    "priority": 5,
                    "metadata": {"team": "search"},
                    "tenant": "default",
                }
            ]
        },
    )

    batch_id: BatchId
    model: ModelName
    endpoint: Endpoint
    input_uri: S3Uri | None = Field(default=None, description="JSONL input file; or use 'requests'.")
    requests: Annotated[list[BatchInputLine], Field(min_length=1)] | None = Field(
        default=None, description="Inline request lines (bounded by the inline limits); or 'input_uri'."
    )
    completion_window: Duration | None = Field(
        default=None,
        description="Time allowed after acceptance (OpenAI style, e.g. '24h'). With neither this nor "
        "'deadline', 24h applies; with both, the earlier end wins.",
    )
    deadline: UtcDatetime | None = Field(
        default=None, description="Absolute deadline (RFC 3339 with offset); must be in the future at submit."
    )
    priority: int = Field(default=DEFAULT_PRIORITY, ge=0, le=9, strict=True, description="0-9, higher first.")
    metadata: Metadata = Field(default_factory=dict)
    tenant: Tenant = "default"
    output_expires_after: ExpiresAfter | None = Field(
        default=None,
        description="How long the batch's result files and state are kept after it ends, as OpenAI's "
        "output_expires_after: {'anchor': 'created_at', 'seconds': 3600-2592000}. Left out: the "
        "tenant's retention (LLMBATCH_RETENTION__BY_TENANT, else LLMBATCH_RETENTION__DEFAULT_S).",
    )

    @model_validator(mode="after")
    def _one_input(self) -> BatchRequest:
        if (self.input_uri is None) == (self.requests is None):
            raise PydanticCustomError(
                "one_input",
                "{msg}",
                {
                    "field": "input_uri",
                    "msg": "set exactly one of input_uri (s3://bucket/key of a JSONL file) "
                    "or requests (inline lines)",
                    "reason": Reason.MISSING_FIELD if self.input_uri is None else Reason.INVALID_FIELD,
                },
            )
        if self.requests is not None:
            self._check_inline_lines(self.requests)
        return self

    def _check_inline_lines(self, lines: list[BatchInputLine]) -> None:
        seen: dict[str, int] = {}
        for index, line in enumerate(lines):
            if line.url != self.endpoint:
                raise _line_error(
                    index,
                    "url",
                    Reason.URL_MISMATCH,
                    f"{line.url.value!r} differs from the batch endpoint {self.endpoint.value!r}",
                )
            body_model = line.body.get("model")
            if body_model is not None and body_model != self.model:
                raise _line_error(
                    index,
                    "body.model",
                    Reason.MODEL_MISMATCH,
                    f"{body_model!r} differs from the batch model {self.model!r}",
                )
            first = seen.setdefault(line.custom_id, index)
            if first != index:
                raise _line_error(
                    index,
                    "custom_id",
                    Reason.DUPLICATE_CUSTOM_ID,
                    f"{line.custom_id!r} is already used by requests[{first}]; custom_id must be unique",
                )

    @property
    def request_count(self) -> int | None:
        """Number of inline requests, or ``None`` for a file input (unknown until read)."""
        return len(self.requests) if self.requests is not None else None

    def effective_deadline(self, accepted_at: datetime) -> datetime:
        """When the batch expires, given when it was accepted.

        ``deadline`` alone -> ``deadline``; ``completion_window`` alone -> ``accepted_at + window``;
        both -> the earlier; neither -> ``accepted_at + 24h``.
        """
        if self.deadline is not None and self.completion_window is None:
            return self.deadline
        window_end = accepted_at + parse_duration(self.completion_window or DEFAULT_COMPLETION_WINDOW)
        return window_end if self.deadline is None else min(self.deadline, window_end)

    def inline_size_bytes(self) -> int:
        """Size of the inline requests as compact JSON (0 for a file input)."""
        if self.requests is None:
            return 0
        return len(orjson.dumps([line.model_dump(mode="json") for line in self.requests]))


def _line_error(index: int, field: str, reason: str, msg: str) -> PydanticCustomError:
    return PydanticCustomError(
        "invalid_request_line",
        "{field}: {msg}",
        {"field": f"requests[{index}].{field}", "msg": msg, "reason": reason},
    )


class CancelRequest(BaseModel):
    """Data of ``llmbatch.batch.cancel_requested.v1``: stop a batch, keeping partial results."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"batch_id": "nightly-eval-2024-06-01", "reason": "superseded"}]},
    )

    batch_id: BatchId
    tenant: Tenant = Field(
        default="default",
        description="The tenant whose batch it is: a cancel naming another tenant than the batch's is "
        "ignored (and with tenant keys on the dispatcher it must be signed by this tenant).",
    )
    reason: Annotated[str, Field(max_length=1024)] | None = Field(
        default=None, description="Why, for humans."
    )
    requested_by: Annotated[str, Field(max_length=256)] | None = Field(
        default=None, description="Who asked (user or service), for audit."
    )


def check_inline_limits(request: BatchRequest, limits: InlineLimits) -> None:
    """Raise ``SchemaError(limit_exceeded)`` when inline requests exceed ``limits``."""
    if request.requests is None:
        return
    count = len(request.requests)
    if count > limits.max_requests:
        raise SchemaError(
            Reason.LIMIT_EXCEEDED,
            f"{count} inline requests exceed the limit of {limits.max_requests}: "
            "upload a JSONL file and pass input_uri instead",
            field="requests",
        )
    size = request.inline_size_bytes()
    if size > limits.max_bytes:
        raise SchemaError(
            Reason.LIMIT_EXCEEDED,
            f"inline requests take {size} bytes, over the limit of {limits.max_bytes}: "
            "upload a JSONL file and pass input_uri instead",
            field="requests",
        )


def check_deadline(request: BatchRequest, now: datetime | None = None) -> None:
    """Raise ``SchemaError(deadline_passed)`` unless ``deadline`` is in the future (or unset)."""
    if request.deadline is None:
        return
    now = now or utcnow()
    if request.deadline <= now:
        raise SchemaError(
            Reason.DEADLINE_PASSED,
            f"{request.deadline.isoformat()} is not in the future (now {now.isoformat()}): "
            "set a later deadline or use completion_window",
            field="deadline",
        )


def check_submittable(
    request: BatchRequest, limits: InlineLimits | None = None, now: datetime | None = None
) -> None:
    """Acceptance-time checks: inline limits and a future deadline. Raises :class:`SchemaError`."""
    check_inline_limits(request, limits or InlineLimits())
    check_deadline(request, now)


def parse_batch_request(data: bytes | str | dict[str, object]) -> BatchRequest:
    """Validate a batch request from JSON (bytes/str) or a dict; raises :class:`SchemaError`."""
    try:
        if isinstance(data, dict):
            return BatchRequest.model_validate(data)
        return BatchRequest.model_validate_json(data)
    except ValidationError as exc:
        raise SchemaError.from_validation_error(exc) from None


__all__ = [
    "DEFAULT_COMPLETION_WINDOW",
    "DEFAULT_PRIORITY",
    "BatchRequest",
    "CancelRequest",
    "InlineLimits",
    "check_deadline",
    "check_inline_limits",
    "check_submittable",
    "parse_batch_request",
]
