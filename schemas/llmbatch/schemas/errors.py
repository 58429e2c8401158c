"""The one error type of :mod:`llmbatch.schemas`: :class:`SchemaError`, with a machine-readable reason.

Every parser and decoder in this package raises only :class:`SchemaError` for bad input, so a
consumer needs exactly one ``except`` clause to route a poison message to the dead-letter topic.
``reason`` is a stable code (see :class:`Reason`); ``field`` names the offending header or JSON path
(``requests[3].body.temperature``); ``line`` is the 1-based line number inside a JSONL file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from llmbatch.schemas.compat import StrEnum


class Reason(StrEnum):
    """Stable machine-readable reason codes carried by :class:`SchemaError`."""

    INVALID_JSON = "invalid_json"
    """The payload (or a JSONL line) is not valid UTF-8 JSON, or not a JSON object."""
    MISSING_HEADER = "missing_header"
    """A required CloudEvents header (``ce_id``, ``ce_type``, ...) is absent."""
    INVALID_HEADER = "invalid_header"
    """A header is present but malformed (not UTF-8, bad time, duplicated, key/subject mismatch)."""
    INVALID_KEY = "invalid_key"
    """The record key is absent or differs from ``ce_subject`` (it must be the batch_id)."""
    UNSUPPORTED_SPECVERSION = "unsupported_specversion"
    """``ce_specversion`` is not ``1.0``."""
    WRONG_CONTENT_TYPE = "wrong_content_type"
    """``content-type`` is not ``application/json``."""
    UNSUPPORTED_TYPE = "unsupported_type"
    """``ce_type`` names no known event type (or the wrong one for the caller)."""
    MISSING_FIELD = "missing_field"
    """A required JSON field is absent."""
    UNKNOWN_FIELD = "unknown_field"
    """A JSON field is not part of the contract (typo or unsupported parameter)."""
    INVALID_FIELD = "invalid_field"
    """A JSON field has the wrong type or an out-of-range value."""
    URL_MISMATCH = "url_mismatch"
    """An input line's ``url`` differs from the batch ``endpoint``."""
    MODEL_MISMATCH = "model_mismatch"
    """An input line's ``body.model`` differs from the batch ``model``."""
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
    """Two input lines of one batch share a ``custom_id``."""
    TOKEN_LIMIT_EXCEEDED = "token_limit_exceeded"  # noqa: S105 (an error code, not a secret)
    """The tenant's enqueued tokens (estimated at intake) would pass its limit
    (``LLMBATCH_TENANTS__MAX_ENQUEUED_TOKENS``): send the batch again once earlier batches end."""
    STORAGE_QUOTA_EXCEEDED = "storage_quota_exceeded"
    """What the tenant keeps (its inputs and results, as last measured) is over its limit
    (``LLMBATCH_TENANTS__MAX_STORED_BYTES``): send the batch again once files were deleted or expired."""
    LINE_TOO_LARGE = "line_too_large"
    """An input line is longer than ``LLMBATCH_JOB__MAX_LINE_BYTES`` (answered without being read whole)."""
    EMPTY_INPUT = "empty_input"
    """A batch has no request lines."""
    LIMIT_EXCEEDED = "limit_exceeded"
    """Inline requests exceed the configured count or byte limit."""
    DEADLINE_PASSED = "deadline_passed"
    """The batch deadline is not in the future at submission time."""
    MODEL_NOT_FOUND = "model_not_found"
    """The batch names a ``model`` the service does not serve (not in its engine registry)."""
    DUPLICATE_BATCH_ID = "duplicate_batch_id"
    """Another request already holds this ``batch_id`` (a new event id for a batch that is known)."""


#: Reason -> the error ``code`` OpenAI's Batch API uses for the same problem in an error file.
OPENAI_ERROR_CODES: dict[str, str] = {
    Reason.INVALID_JSON: "invalid_json_line",
    Reason.MISSING_FIELD: "missing_required_parameter",
    Reason.UNKNOWN_FIELD: "unsupported_parameter",
    Reason.INVALID_FIELD: "invalid_value",
    Reason.URL_MISMATCH: "invalid_url",
    Reason.MODEL_MISMATCH: "mismatched_model",
    Reason.DUPLICATE_CUSTOM_ID: "duplicate_custom_id",
    Reason.LINE_TOO_LARGE: "line_too_large",  # no OpenAI equivalent: it refuses the whole file
    Reason.EMPTY_INPUT: "empty_file",
    Reason.LIMIT_EXCEEDED: "too_many_tasks",
    Reason.MODEL_NOT_FOUND: "model_not_found",
}


class LLMBatchError(Exception):
    """The root of every error llmbatch raises on purpose, in every unit (contracts, SDK, job,
    dispatcher, API, stack). ``retriable`` tells the caller whether the same call may succeed later
    (a dependency was down) or never will (the input, a setting or a permission is wrong); each
    unit's own base (:class:`SchemaError`, ``ProducerError``, ``JobError``, ``DispatcherError``,
    ``ApiError``, ...) derives from it and sets it per class."""

    retriable: bool = False


class SchemaError(LLMBatchError):
    """Input that violates a contract. Never retriable: the same bytes fail the same way.

    Attributes:
        reason: a :class:`Reason` value (a ``str``), stable for machines.
        field: the offending header name or JSON path, or ``None`` when it concerns the whole input.
        line: 1-based line number inside a JSONL file, when parsing one.
        custom_id: the ``custom_id`` of the offending input line, when it could be read.
        message: human-readable text naming the field and the fix.
    """

    retriable: bool = False

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        field: str | None = None,
        line: int | None = None,
        custom_id: str | None = None,
    ) -> None:
        self.reason = str(reason)
        self.field = field
        self.line = line
        self.custom_id = custom_id
        self.message = message
        super().__init__(self._render())

    def _render(self) -> str:
        parts = []
        if self.line is not None:
            parts.append(f"line {self.line}")
        if self.field:
            parts.append(self.field)
        parts.append(self.message)
        return ": ".join(parts)

    @property
    def openai_code(self) -> str:
        """The closest OpenAI Batch API error code (for error-file lines)."""
        return OPENAI_ERROR_CODES.get(self.reason, "invalid_request")

    def with_line(self, line: int) -> SchemaError:
        """A copy of this error located at ``line`` of a JSONL file."""
        return SchemaError(self.reason, self.message, field=self.field, line=line, custom_id=self.custom_id)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across Ray workers
        return (_rebuild, (self.reason, self.message, self.field, self.line, self.custom_id))

    @classmethod
    def from_validation_error(
        cls, exc: ValidationError, *, prefix: str = "", line: int | None = None
    ) -> SchemaError:
        """Convert pydantic's error into a :class:`SchemaError` naming the first offending field.

        ``prefix`` is prepended to the field path (e.g. ``"data"``).
        """
        errors = exc.errors(include_url=False)
        if not errors:  # pragma: no cover - pydantic never raises an empty ValidationError
            return cls(Reason.INVALID_FIELD, str(exc), field=prefix or None, line=line)
        first = errors[0]
        ctx = first.get("ctx") or {}
        path = format_loc(first["loc"])
        inner = ctx.get("field")
        if isinstance(inner, str) and inner:
            path = f"{path}.{inner}" if path else inner
        if prefix:
            path = f"{prefix}.{path}" if path else prefix
        reason = ctx.get("reason")
        if not isinstance(reason, str):
            reason = _reason_for(first["type"])
        message = _clean(str(ctx.get("msg") or first["msg"]))
        if first["type"] not in _NO_INPUT_ECHO and "input" in first and not inner:
            message = f"{message} (got {_short(first['input'])})"
        if len(errors) > 1:
            message = f"{message} (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
        return cls(reason, message, field=path or None, line=line)


_NO_INPUT_ECHO = frozenset({"missing", "json_invalid", "value_error", "assertion_error"})


def _clean(message: str) -> str:
    for noise in ("Value error, ", "Assertion failed, "):
        if message.startswith(noise):
            return message[len(noise) :]
    return message


def _rebuild(
    reason: str, message: str, field: str | None, line: int | None, custom_id: str | None
) -> SchemaError:
    return SchemaError(reason, message, field=field, line=line, custom_id=custom_id)


def _reason_for(error_type: str) -> str:
    if error_type == "missing":
        return Reason.MISSING_FIELD
    if error_type == "extra_forbidden":
        return Reason.UNKNOWN_FIELD
    if error_type.startswith("json_"):
        return Reason.INVALID_JSON
    return Reason.INVALID_FIELD


def format_loc(loc: Sequence[int | str]) -> str:
    """``("requests", 3, "body")`` -> ``"requests[3].body"``."""
    out = ""
    for part in loc:
        if part == "[key]":  # a dict key failed validation: name the dict, not the bad key
            out = out.rpartition(".")[0] + " (key)" if "." in out else out + " (key)"
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out


def _short(value: object, limit: int = 60) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
