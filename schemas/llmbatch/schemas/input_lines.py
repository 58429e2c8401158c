"""JSONL input files, line by line: :func:`parse_input_line` (one line), :func:`iter_input_lines` (a
stream, duplicate custom_ids refused, memory bounded) and :func:`check_input_lines` (a whole file's
report).

The per-line parser is shared by the producer (validating a file before upload) and the Ray job
(turning a bad line into an error-file line while the rest run), so both agree on what is valid. It
raises only :class:`~llmbatch.schemas.errors.SchemaError`; its ``reason`` maps to an OpenAI error code through
:attr:`~llmbatch.schemas.errors.SchemaError.openai_code`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError

from llmbatch.schemas.common import Endpoint
from llmbatch.schemas.custom_ids import CustomIdIndex
from llmbatch.schemas.errors import Reason, SchemaError
from llmbatch.schemas.openai import BatchInputLine


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
        raise SchemaError(
            Reason.LINE_TOO_LARGE,
            f"the line is longer than {max_line_bytes} bytes (LLMBATCH_JOB__MAX_LINE_BYTES): shorten its "
            "content or split the request",
            line=line_no,
            custom_id=_cheap_custom_id(raw),
        )
    obj = _load_object(raw, line_no)
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    try:
        line = BatchInputLine.model_validate(obj)
    except ValidationError as exc:
        err = SchemaError.from_validation_error(exc, line=line_no)
        err.custom_id = custom_id
        raise err from None
    if endpoint is not None and line.url != endpoint:
        raise SchemaError(
            Reason.URL_MISMATCH,
            f"{line.url.value!r} differs from the batch endpoint {Endpoint(endpoint).value!r}",
            field="url",
            line=line_no,
            custom_id=custom_id,
        )
    body_model = line.body.get("model")
    if model is not None and body_model is not None and body_model != model:
        raise SchemaError(
            Reason.MODEL_MISMATCH,
            f"{body_model!r} differs from the batch model {model!r}: drop body.model or make it match",
            field="body.model",
            line=line_no,
            custom_id=custom_id,
        )
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
    Memory stays bounded whatever the number of lines (:class:`~llmbatch.schemas.custom_ids.CustomIdIndex`).
    """
    with CustomIdIndex() as seen:
        for line_no, raw in enumerate(lines, start=start_line):
            if not raw.strip():
                continue
            try:
                parsed = parse_input_line(
                    raw, line_no, endpoint=endpoint, model=model, max_line_bytes=max_line_bytes
                )
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
