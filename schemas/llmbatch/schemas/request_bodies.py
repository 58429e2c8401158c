"""Typed OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``) and
their limits, validated strictly: a line's ``body`` must be one of these for its ``url``
(:class:`llmbatch.schemas.openai.BatchInputLine`), and :func:`body_error` says what is wrong with one that is
not.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from llmbatch.schemas.common import Endpoint, ModelName
from llmbatch.schemas.errors import Reason, format_loc

MAX_OUTPUT_TOKENS = 32_768
"""Upper bound for ``max_tokens`` / ``max_completion_tokens`` of one request."""
MAX_STOP_SEQUENCES = 4
MAX_LOGIT_BIAS = 1024
"""Most tokens one request may bias."""
MAX_EMBEDDING_INPUTS = 2048
"""Most inputs one ``/v1/embeddings`` line may carry (OpenAI's limit)."""
MAX_TOKEN_ID = 2**31 - 1

TokenId = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0)]

_BODY_CONFIG = ConfigDict(strict=True, extra="forbid", frozen=True)


class TextPart(BaseModel):
    """One text part of a chat message's ``content`` list."""

    model_config = _BODY_CONFIG

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message: ``{role, content}``; content is a string or a list of text parts."""

    model_config = _BODY_CONFIG

    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _content_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                'content must be a string or a non-empty list of {"type": "text", "text": ...} parts'
            ) from None

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingParams(BaseModel):
    """Sampling parameters common to both endpoints (OpenAI names; a few vLLM extensions)."""

    model_config = _BODY_CONFIG

    model: ModelName | None = Field(
        default=None, description="If given, must equal the batch model (OpenAI requires it per line)."
    )
    max_tokens: Annotated[int, Field(ge=1, le=MAX_OUTPUT_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: int | None = Field(default=None, description="Must be 1 (one completion per line).")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    stream: bool | None = Field(default=None, description="Must be false: batch results are not streamed.")
    user: Annotated[str, Field(max_length=256)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = Field(default=None, description="vLLM extension.")
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(default=None, description="vLLM extension.")
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = Field(
        default=None, description="vLLM extension."
    )
    logit_bias: Annotated[dict[TokenId, LogitBias], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        default=None, description="Token id (a decimal string) -> bias added to its logit, -100..100."
    )

    @field_validator("n")
    @classmethod
    def _n_is_one(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("n must be 1: repeat the line with another custom_id for more samples")
        return value

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("stream must be false or absent: batch results are written to files")
        return value

    @field_validator("logit_bias", mode="wrap")
    @classmethod
    def _token_ids(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            if any("[key]" in err["loc"] for err in exc.errors()):
                raise ValueError(
                    'logit_bias keys are token ids as decimal strings, e.g. {"50256": -100}'
                ) from None
            raise

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                f"stop must be a string or a list of at most {MAX_STOP_SEQUENCES} strings"
            ) from None

    def max_output_tokens(self) -> int | None:
        """The output token limit asked for, whichever field carried it."""
        return self.max_tokens


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema every answer must follow (OpenAI's shape)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] = Field(
        description="1-64 letters, digits, '_' or '-'."
    )
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(
        default=None, alias="schema", description="A JSON Schema object; absent = any JSON object."
    )
    strict: bool | None = Field(
        default=None, description="Accepted either way: the engine always decodes within the schema."
    )


class TextFormat(BaseModel):
    """``response_format: {"type": "text"}`` (the default: free text)."""

    model_config = _BODY_CONFIG

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    """``response_format: {"type": "json_object"}``: the answer is one JSON object."""

    model_config = _BODY_CONFIG

    type: Literal["json_object"]


class JsonSchemaResponseFormat(BaseModel):
    """``response_format: {"type": "json_schema", "json_schema": {...}}``."""

    model_config = _BODY_CONFIG

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


class ChatCompletionBody(SamplingParams):
    """Body of a ``/v1/chat/completions`` request line."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_OUTPUT_TOKENS)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = Field(
        default=None,
        description="text, json_object or json_schema: decoded by the engine's structured outputs.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionBody:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise PydanticCustomError(
                "invalid_body",
                "{msg}",
                {
                    "field": "max_completion_tokens",
                    "msg": "set max_tokens or max_completion_tokens, not both",
                },
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError(
                "invalid_body",
                "{msg}",
                {"field": "top_logprobs", "msg": "top_logprobs needs logprobs: true"},
            )
        return self

    def max_output_tokens(self) -> int | None:
        """``max_completion_tokens`` or ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionBody(SamplingParams):
    """Body of a ``/v1/completions`` request line (one string prompt per line)."""

    prompt: Annotated[str, Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, list):
            raise ValueError("prompt must be one string: put each prompt on its own line")
        return handler(value)


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1)]
_INPUTS_COUNT = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)
_INPUT_SHAPE = (
    f"input must be a non-empty string, a list of 1-{MAX_EMBEDDING_INPUTS} non-empty strings, a list of "
    "token ids, or a list of such lists"
)


class EmbeddingBody(BaseModel):
    """Body of a ``/v1/embeddings`` request line: one or many inputs, one vector each."""

    model_config = _BODY_CONFIG

    input: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], _INPUTS_COUNT]
        | TokenIds
        | Annotated[list[TokenIds], _INPUTS_COUNT]
    ) = Field(description="Text, texts, token ids, or lists of token ids; each input gets one embedding.")
    model: ModelName | None = Field(
        default=None, description="If given, must equal the batch model (OpenAI requires it per line)."
    )
    encoding_format: Literal["float", "base64"] | None = Field(
        default=None, description="float (default): lists of numbers; base64: little-endian float32 bytes."
    )
    dimensions: Annotated[int, Field(ge=1, le=65_536)] | None = Field(
        default=None, description="Only for models trained to be cut short (Matryoshka); others refuse it."
    )
    user: Annotated[str, Field(max_length=256)] | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(_INPUT_SHAPE) from None


RequestBody = ChatCompletionBody | CompletionBody | EmbeddingBody
BODY_MODELS: dict[Endpoint, type[RequestBody]] = {
    Endpoint.CHAT_COMPLETIONS: ChatCompletionBody,
    Endpoint.COMPLETIONS: CompletionBody,
    Endpoint.EMBEDDINGS: EmbeddingBody,
}
_NEEDED_FIELD = {
    Endpoint.CHAT_COMPLETIONS: "messages",
    Endpoint.COMPLETIONS: "prompt",
    Endpoint.EMBEDDINGS: "input",
}


_NO_ECHO = frozenset({"invalid_body", "value_error"})


def _nested_fields(parent: list[int | str]) -> list[str]:
    """The fields allowed inside ``parent`` (a body path), for an unknown-field message."""
    if parent == ["response_format"]:
        return ["type", "json_schema"]
    if parent == ["response_format", "json_schema"]:
        return ["name", "description", "schema", "strict"]
    if len(parent) == 2 and parent[0] == "messages":
        return list(ChatMessage.model_fields)
    return []


def body_error(exc: ValidationError, url: Endpoint) -> PydanticCustomError:
    """The first error of a body that did not validate, as one ``invalid_body`` error naming the
    field path (``body.messages[0].content``), what is wrong and, for an unknown field, what is
    supported."""
    first = exc.errors(include_url=False)[0]
    ctx = first.get("ctx") or {}
    parts = list(first["loc"])
    if len(parts) > 1 and parts[0] == "response_format":
        del parts[1]  # the union's tag pydantic puts in the path ("json_schema"), not a field
    loc = format_loc(parts)
    inner = ctx.get("field")
    path = "body" + (f".{loc}" if loc else "") + (f".{inner}" if isinstance(inner, str) and inner else "")
    kind = first["type"]
    if kind == "extra_forbidden":
        fields = BODY_MODELS[url].model_fields if len(parts) == 1 else _nested_fields(parts[:-1])
        supported = ", ".join(sorted(fields)) or "see the OpenAI API reference"
        msg = f"unsupported parameter for {url.value}; supported: {supported}"
        reason: str = Reason.UNKNOWN_FIELD
    elif kind == "missing" and len(parts) == 1:
        msg = f"required for {url.value} (a request needs '{_NEEDED_FIELD[url]}')"
        reason = Reason.MISSING_FIELD
    elif kind == "missing":
        msg = "required"
        reason = Reason.MISSING_FIELD
    elif kind == "union_tag_invalid":
        msg = f"type must be one of {ctx.get('expected_tags')} (got {str(ctx.get('tag'))[:40]!r})"
        reason = Reason.INVALID_FIELD
    else:
        msg = str(ctx.get("msg") or first["msg"]).removeprefix("Value error, ")
        if "input" in first and not isinstance(first["input"], dict | list) and kind not in _NO_ECHO:
            shown = repr(first["input"])
            msg = f"{msg} (got {shown if len(shown) <= 60 else shown[:57] + '...'})"
        reason = Reason.INVALID_FIELD
    # the field path travels in ctx["field"]; loc of the outer error stays at the line level
    return PydanticCustomError(
        "invalid_body", "{field}: {msg}", {"field": path, "msg": msg, "reason": reason}
    )
