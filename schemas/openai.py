"""OpenAI Batch API line formats: input lines, typed request bodies, output/error lines.

The per-line parser :func:`parse_input_line` is shared by the producer (validating a file before
upload) and the Ray job (turning a bad line into an error-file line while the rest run), so both
agree on what is valid. It raises only :class:`~schemas.errors.SchemaError`; its ``reason`` maps to
an OpenAI error code through :attr:`~schemas.errors.SchemaError.openai_code`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PrivateAttr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from schemas.common import Endpoint, ModelName
from schemas.custom_ids import CustomIdIndex
from schemas.errors import Reason, SchemaError, format_loc

MAX_OUTPUT_TOKENS = 32_768
"""Upper bound for ``max_tokens`` / ``max_completion_tokens`` of one request."""
MAX_STOP_SEQUENCES = 4
MAX_LOGIT_BIAS = 1024
"""Most tokens one request may bias."""
MAX_CUSTOM_ID_LENGTH = 512
MAX_EMBEDDING_INPUTS = 2048
"""Most inputs one ``/v1/embeddings`` line may carry (OpenAI's limit)."""
MAX_TOKEN_ID = 2**31 - 1

CustomId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_CUSTOM_ID_LENGTH,
        description="Caller's id of this request, unique within the batch (1-512 chars).",
        examples=["request-1"],
    ),
]

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


def _body_error(exc: ValidationError, url: Endpoint) -> PydanticCustomError:
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
            raise _body_error(exc, self.url) from None
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


# --------------------------------------------------------------------------------------------
# JSONL parsing


def _load_object(raw: bytes | str, line_no: int | None) -> dict[str, Any]:
    if line_no in (None, 1):  # tolerate a UTF-8 byte order mark at the start of a file
        raw = raw.removeprefix(b"\xef\xbb\xbf") if isinstance(raw, bytes) else raw.removeprefix("\ufeff")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(Reason.INVALID_JSON, f"not valid JSON ({exc})", line=line_no) from None
    if not isinstance(obj, dict):
        raise SchemaError(
            Reason.INVALID_JSON,
            f"each line must be a JSON object {{custom_id, method, url, body}}, got {type(obj).__name__}",
            line=line_no,
        )
    return obj


_CUSTOM_ID_RE = re.compile(rb'"custom_id"\s*:\s*"((?:[^"\\]|\\.){1,256})"')
_CUSTOM_ID_SCAN_BYTES = 4096


def _cheap_custom_id(raw: bytes | str) -> str | None:
    """The ``custom_id`` of a line too large to parse, when it is among its first bytes."""
    head = raw[:_CUSTOM_ID_SCAN_BYTES]
    match = _CUSTOM_ID_RE.search(head.encode("utf-8", "replace") if isinstance(head, str) else head)
    if match is None:
        return None
    try:
        value = orjson.loads(b'"' + match.group(1) + b'"')
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def parse_input_line(
    raw: bytes | str,
    line_no: int | None = None,
    *,
    endpoint: Endpoint | str | None = None,
    model: str | None = None,
    max_line_bytes: int | None = None,
) -> BatchInputLine:
    """Parse and validate one JSONL input line.

    Args:
        raw: the line (bytes or str, surrounding whitespace allowed).
        line_no: 1-based line number, reported in errors.
        endpoint: when given, the line's ``url`` must equal it (``url_mismatch``).
        model: when given, a ``body.model`` present on the line must equal it (``model_mismatch``).
        max_line_bytes: when given, a longer line is refused unparsed (``line_too_large``), its
            custom_id read from its first bytes if it is there.

    Raises:
        SchemaError: with ``line``, ``field`` and, when it could be read, ``custom_id`` set.
    """
    if max_line_bytes is not None and len(raw) > max_line_bytes:
        err = SchemaError(
            Reason.LINE_TOO_LARGE,
            f"the line is longer than {max_line_bytes} bytes (LLMBATCH_JOB__MAX_LINE_BYTES): shorten its "
            "content or split the request",
            line=line_no,
        )
        err.custom_id = _cheap_custom_id(raw)
        raise err
    obj = _load_object(raw, line_no)
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    try:
        line = BatchInputLine.model_validate(obj)
    except ValidationError as exc:
        err = SchemaError.from_validation_error(exc, line=line_no)
        err.custom_id = custom_id
        raise err from None
    if endpoint is not None and line.url != endpoint:
        err = SchemaError(
            Reason.URL_MISMATCH,
            f"{line.url.value!r} differs from the batch endpoint {Endpoint(endpoint).value!r}",
            field="url",
            line=line_no,
        )
        err.custom_id = custom_id
        raise err
    body_model = line.body.get("model")
    if model is not None and body_model is not None and body_model != model:
        err = SchemaError(
            Reason.MODEL_MISMATCH,
            f"{body_model!r} differs from the batch model {model!r}: drop body.model or make it match",
            field="body.model",
            line=line_no,
        )
        err.custom_id = custom_id
        raise err
    return line


@dataclass(frozen=True, slots=True)
class LineResult:
    """Outcome of one non-blank line: exactly one of ``line`` and ``error`` is set."""

    line_no: int
    line: BatchInputLine | None = None
    error: SchemaError | None = None
    raw: bytes | str = b""
    """The line as read (for callers that copy valid lines byte for byte)."""

    @property
    def ok(self) -> bool:
        """True when the line is valid."""
        return self.error is None


def iter_input_lines(
    lines: Iterable[bytes | str],
    *,
    endpoint: Endpoint | str | None = None,
    model: str | None = None,
    start_line: int = 1,
    max_line_bytes: int | None = None,
) -> Iterator[LineResult]:
    """Validate a JSONL stream line by line, skipping blank lines and rejecting duplicate custom_ids.

    The first line with a given ``custom_id`` wins; later ones yield a ``duplicate_custom_id`` error.
    Memory stays bounded whatever the number of lines (:class:`~schemas.custom_ids.CustomIdIndex`).
    """
    with CustomIdIndex() as seen:
        for line_no, raw in enumerate(lines, start=start_line):
            if not raw.strip():
                continue
            try:
                parsed = parse_input_line(raw, line_no, endpoint=endpoint, model=model,
                                          max_line_bytes=max_line_bytes)
            except SchemaError as exc:
                yield LineResult(line_no, error=exc, raw=raw)
                continue
            first = seen.first_line(parsed.custom_id, line_no)
            if first is not None:
                err = SchemaError(
                    Reason.DUPLICATE_CUSTOM_ID,
                    f"{parsed.custom_id!r} is already used on line {first}; custom_id must be unique",
                    field="custom_id",
                    line=line_no,
                )
                err.custom_id = parsed.custom_id
                yield LineResult(line_no, error=err, raw=raw)
                continue
            yield LineResult(line_no, line=parsed, raw=raw)


@dataclass(slots=True)
class InputReport:
    """Summary of validating a whole input: counts plus the first ``max_errors`` errors."""

    valid: int = 0
    invalid: int = 0
    errors: list[SchemaError] = field(default_factory=list)
    max_errors: int = 20

    @property
    def ok(self) -> bool:
        """True when there is at least one line and no invalid one."""
        return self.invalid == 0 and self.valid > 0

    def add(self, result: LineResult) -> None:
        """Count one :class:`LineResult`."""
        if result.error is None:
            self.valid += 1
            return
        self.invalid += 1
        if len(self.errors) < self.max_errors:
            self.errors.append(result.error)

    def summary(self, noun: str = "line") -> str:
        """One human-readable paragraph: counts, then one error per line."""
        if self.valid == 0 and self.invalid == 0:
            return f"the input has no request {noun}s"
        total = self.valid + self.invalid
        head = f"{self.invalid} invalid {noun}{'s' if self.invalid != 1 else ''} of {total}"
        shown = "\n".join(f"  {err}" for err in self.errors)
        more = self.invalid - len(self.errors)
        tail = f"\n  ... and {more} more" if more > 0 else ""
        return f"{head}\n{shown}{tail}" if self.errors else head


def check_input_lines(
    lines: Iterable[bytes | str],
    *,
    endpoint: Endpoint | str | None = None,
    model: str | None = None,
    max_errors: int = 20,
) -> InputReport:
    """Validate every line and return an :class:`InputReport` (never raises for bad lines)."""
    report = InputReport(max_errors=max_errors)
    for result in iter_input_lines(lines, endpoint=endpoint, model=model):
        report.add(result)
    return report
