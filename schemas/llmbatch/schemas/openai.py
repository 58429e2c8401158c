"""OpenAI Batch API line formats: input lines, output/error lines, request counts and usage.

The typed request bodies are :mod:`llmbatch.schemas.request_bodies`; parsing files line by line is
:mod:`llmbatch.schemas.input_lines`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from llmbatch.schemas.common import Endpoint
from llmbatch.schemas.request_bodies import BODY_MODELS, RequestBody, body_error

MAX_CUSTOM_ID_LENGTH = 512

CustomId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_CUSTOM_ID_LENGTH,
        description="Caller's id of this request, unique within the batch (1-512 chars).",
        examples=["request-1"],
    ),
]


class BatchInputLine(BaseModel):
    """One line of an OpenAI batch input file: ``{custom_id, method, url, body}``.

    ``body`` keeps the caller's JSON exactly (it is what the engine receives); it is validated
    against the endpoint's typed model, available as :meth:`typed_body`.
    """

    model_config = ConfigDict(extra="forbid")

    custom_id: CustomId
    method: Literal["POST"] = Field(description="Always POST.")
    url: Endpoint
    body: dict[str, Any] = Field(
        description="The request body, sent to the engine as is: see chat-completion-body.schema.json "
        "(url /v1/chat/completions), completion-body.schema.json (url /v1/completions) or "
        "embedding-body.schema.json (url /v1/embeddings)."
    )

    _typed: RequestBody | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _validate_body(self) -> BatchInputLine:
        try:
            self._typed = BODY_MODELS[self.url].model_validate(self.body)
        except ValidationError as exc:
            raise body_error(exc, self.url) from None
        return self

    def typed_body(self) -> RequestBody:
        """The body validated as the endpoint's model (:class:`ChatCompletionBody`,
        :class:`CompletionBody` or :class:`EmbeddingBody`)."""
        private = self.__pydantic_private__  # direct access: this is on the per-line hot path
        typed = private.get("_typed") if private else None
        if typed is None:
            typed = BODY_MODELS[self.url].model_validate(self.body)
            self._typed = typed
        return typed

    def to_jsonl(self) -> bytes:
        """This line as compact JSON plus a newline."""
        return orjson.dumps(self.model_dump(mode="json")) + b"\n"


class ErrorObject(BaseModel):
    """``{code, message}`` as in OpenAI error files and failed-batch events."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    code: Annotated[str, Field(min_length=1, max_length=128)] = Field(examples=["invalid_value"])
    message: Annotated[str, Field(max_length=65_536)]
    param: str | None = Field(default=None, description="The offending parameter, when known.")
    line: int | None = Field(default=None, ge=1, description="Line of the input file, when known.")


class ResponseObject(BaseModel):
    """``response`` of an output line: the HTTP-like status and the OpenAI response body."""

    model_config = ConfigDict(extra="ignore")

    status_code: int = Field(ge=100, le=599)
    request_id: str
    body: dict[str, Any]


class BatchOutputLine(BaseModel):
    """One line of an output or error file: ``{id, custom_id, response, error}``."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, examples=["batch_req_0001"])
    custom_id: CustomId
    response: ResponseObject | None = None
    error: ErrorObject | None = None

    @model_validator(mode="after")
    def _has_outcome(self) -> BatchOutputLine:
        if self.response is None and self.error is None:
            raise ValueError("an output line needs a response or an error")
        return self

    @property
    def ok(self) -> bool:
        """True when the request succeeded (2xx response and no error)."""
        return self.error is None and self.response is not None and 200 <= self.response.status_code < 300

    def to_jsonl(self) -> bytes:
        """This line as compact JSON plus a newline (``response``/``error`` always present)."""
        return orjson.dumps(self.model_dump(mode="json")) + b"\n"


class RequestCounts(BaseModel):
    """How many requests a batch has, and how many ended well or badly so far."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    total: NonNegativeInt = 0
    completed: NonNegativeInt = 0
    failed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _not_over_total(self) -> RequestCounts:
        if self.completed + self.failed > self.total:
            raise ValueError(
                f"completed ({self.completed}) + failed ({self.failed}) exceeds total ({self.total})"
            )
        return self

    @property
    def pending(self) -> int:
        """Requests not yet ended."""
        return self.total - self.completed - self.failed


class Usage(BaseModel):
    """Token usage; ``total_tokens`` defaults to (and must equal) prompt + completion."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    prompt_tokens: NonNegativeInt = 0
    completion_tokens: NonNegativeInt = 0
    total_tokens: NonNegativeInt = 0

    @model_validator(mode="before")
    @classmethod
    def _fill_total(cls, data: Any) -> Any:
        if isinstance(data, dict) and "total_tokens" not in data:
            prompt, completion = data.get("prompt_tokens", 0), data.get("completion_tokens", 0)
            if isinstance(prompt, int) and isinstance(completion, int):
                return {**data, "total_tokens": prompt + completion}
        return data

    @model_validator(mode="after")
    def _total_matches(self) -> Usage:
        if self.total_tokens != self.prompt_tokens + self.completion_tokens:
            raise ValueError("total_tokens must equal prompt_tokens + completion_tokens")
        return self

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
        )
