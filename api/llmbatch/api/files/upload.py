"""Validating an uploaded batch input file in one streaming pass, with the producer's rules.

Every line goes through :func:`llmbatch.schemas.iter_input_lines` (the parser the producer's
:func:`llmbatch.producer.inputs.prepare_file` and the Ray job use: same fields, same messages, duplicate
``custom_id``\\ s found in bounded memory), split by :func:`llmbatch.schemas.lines.split_lines` (a line over
the
job's limit is refused unread). An OpenAI batch file also holds one batch: this adds what a file alone
must satisfy, since no batch names the endpoint and model yet: every line has the same ``url`` and
names the same ``body.model`` (the batch runs on it). The bytes are hashed and counted on the way.

Pure and synchronous (the caller runs it in a worker thread): chunks in, :class:`ValidatedFile` out,
or :class:`llmbatch.adapters.errors.InvalidInput` whose errors carry line numbers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from llmbatch.adapters.errors import InvalidInput
from llmbatch.schemas import Endpoint, InputReport, LineResult, iter_input_lines
from llmbatch.schemas.errors import Reason, SchemaError
from llmbatch.schemas.lines import DEFAULT_MAX_LINE_BYTES, split_lines


@dataclass(frozen=True, slots=True)
class ValidatedFile:
    """A valid batch file: its size and hash, its request count, the endpoint and model it names."""

    size: int
    sha256: str
    requests: int
    endpoint: Endpoint
    model: str


class _Tally:
    """Counts and hashes the chunks that go by; refuses more than ``max_bytes``."""

    def __init__(self, chunks: Iterable[bytes], max_bytes: int | None) -> None:
        self._chunks = chunks
        self._max = max_bytes
        self.size = 0
        self.digest = hashlib.sha256()

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._chunks:
            self.size += len(chunk)
            if self._max is not None and self.size > self._max:
                raise InvalidInput(
                    f"the file is larger than {self._max} bytes (LLMBATCH_API__MAX_UPLOAD_BYTES): split it",
                    [SchemaError(Reason.LIMIT_EXCEEDED, f"larger than {self._max} bytes")],
                )
            self.digest.update(chunk)
            yield chunk


class _OneBatch:
    """The first valid line fixes the file's endpoint and model; later lines must agree."""

    def __init__(self) -> None:
        self.endpoint: Endpoint | None = None
        self.model: str | None = None
        self.first_line = 0

    def check(self, result: LineResult) -> SchemaError | None:
        assert result.line is not None
        line, number = result.line, result.line_no
        model = line.body.get("model")
        if not isinstance(model, str):
            return _error(
                Reason.MISSING_FIELD,
                "body.model",
                number,
                line.custom_id,
                "required in a batch file: every line names the model the batch runs on",
            )
        if self.endpoint is None or self.model is None:
            self.endpoint, self.model, self.first_line = line.url, model, number
            return None
        if line.url != self.endpoint:
            return _error(
                Reason.URL_MISMATCH,
                "url",
                number,
                line.custom_id,
                f"{line.url.value!r} differs from {self.endpoint.value!r} of line "
                f"{self.first_line}: every line of a batch file targets the same endpoint",
            )
        if model != self.model:
            return _error(
                Reason.MODEL_MISMATCH,
                "body.model",
                number,
                line.custom_id,
                f"{model!r} differs from {self.model!r} of line {self.first_line}: "
                "every line of a batch file names the same model",
            )
        return None


def _error(reason: str, field: str, line: int, custom_id: str, message: str) -> SchemaError:
    return SchemaError(reason, message, field=field, line=line, custom_id=custom_id)


def validate_batch_file(
    chunks: Iterable[bytes],
    *,
    max_bytes: int | None = None,
    max_requests: int | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_errors: int = 20,
) -> ValidatedFile:
    """Validate a JSONL batch file given as byte chunks (any split) and describe it.

    Raises:
        InvalidInput: a line is invalid (``errors`` hold the first ``max_errors``, each with its
            ``line``), the file has no request line, or it is over ``max_bytes`` / ``max_requests``.
    """
    tally = _Tally(chunks, max_bytes)
    report = InputReport(max_errors=max_errors)
    batch = _OneBatch()
    lines = split_lines(tally, max_line_bytes)
    for result in iter_input_lines(lines, max_line_bytes=max_line_bytes):
        if result.ok:
            error = batch.check(result)
            if error is not None:
                result = LineResult(result.line_no, error=error)
        report.add(result)
        if max_requests is not None and report.valid > max_requests:
            raise InvalidInput(
                f"the file has more than {max_requests} requests (LLMBATCH_API__MAX_FILE_REQUESTS): split it",
                [SchemaError(Reason.LIMIT_EXCEEDED, f"more than {max_requests} requests")],
            )
    if report.valid == 0 and report.invalid == 0:
        raise InvalidInput(
            "the file has no request lines (it is empty)",
            [SchemaError(Reason.EMPTY_INPUT, "the file has no request lines")],
        )
    if report.invalid:
        raise InvalidInput(report.summary(), report.errors, invalid_count=report.invalid)
    assert batch.endpoint is not None and batch.model is not None
    return ValidatedFile(tally.size, tally.digest.hexdigest(), report.valid, batch.endpoint, batch.model)
