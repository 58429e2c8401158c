"""Turn a local JSONL file or a list of requests into validated batch input, before anything is sent.

Every line is validated with the same parser the Ray job uses (:func:`llmbatch.schemas.parse_input_line`).
If any line is invalid, :class:`~llmbatch.adapters.errors.InvalidInput` lists them (line numbers and fields)
and nothing is uploaded or published, unless ``skip_invalid`` is set: then only the valid lines are
kept, copied byte for byte into a temporary file that is uploaded instead.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llmbatch.adapters.errors import InputFileError, InvalidInput
from llmbatch.schemas import BatchInputLine, Endpoint, InputReport, SchemaError, iter_input_lines
from llmbatch.schemas.errors import Reason
from llmbatch.schemas.lines import DEFAULT_MAX_LINE_BYTES, split_lines


@dataclass(slots=True)
class PreparedFile:
    """A validated JSONL file ready for upload."""

    path: Path
    sha256: str
    size: int
    valid: int
    skipped: int
    temporary: bool
    report: InputReport

    def cleanup(self) -> None:
        """Remove the filtered copy, if one was written."""
        if self.temporary:
            self.path.unlink(missing_ok=True)


def _open_lines(path: Path) -> Iterable[bytes]:
    """The file's lines in bounded memory (a file without newlines is not read into one line)."""
    with path.open("rb") as handle:
        yield from split_lines(iter(lambda: handle.read(1 << 20), b""), DEFAULT_MAX_LINE_BYTES)


def prepare_file(
    path: str | os.PathLike[str],
    *,
    endpoint: Endpoint,
    model: str,
    skip_invalid: bool = False,
    max_errors: int = 20,
) -> PreparedFile:
    """Validate ``path`` line by line (streaming) and hash what will be uploaded.

    Raises:
        InputFileError: the file cannot be read.
        InvalidInput: a line is invalid (and ``skip_invalid`` is false) or no line is valid.
    """
    source = Path(path)
    if not source.exists():
        raise InputFileError(f"{source}: no such file")
    if source.is_dir():
        raise InputFileError(f"{source}: is a directory, expected a JSONL file")
    report = InputReport(max_errors=max_errors)
    digest = hashlib.sha256()
    size = 0
    out = None
    out_path: Path | None = None
    try:
        if skip_invalid:
            fd, name = tempfile.mkstemp(prefix="llmbatch-input-", suffix=".jsonl")
            out, out_path = os.fdopen(fd, "wb"), Path(name)
        lines = _open_lines(source)
        limit = DEFAULT_MAX_LINE_BYTES
        for result in iter_input_lines(lines, endpoint=endpoint, model=model, max_line_bytes=limit):
            report.add(result)
            if out is not None and result.ok:
                raw = result.raw if isinstance(result.raw, bytes) else result.raw.encode()
                chunk = raw if raw.endswith(b"\n") else raw + b"\n"
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        if out_path is not None:
            out_path.unlink(missing_ok=True)
        raise InputFileError(f"{source}: {exc.strerror or exc}") from exc
    finally:
        if out is not None:
            out.close()
    if report.valid == 0:
        if out_path is not None:
            out_path.unlink(missing_ok=True)
        if not report.invalid:
            raise InvalidInput(f"{source}: no request lines (the file is empty)")
        summary = report.summary().replace("\n", " (no valid request lines)\n", 1)
        raise InvalidInput(f"{source}: {summary}", report.errors, invalid_count=report.invalid)
    if report.invalid and not skip_invalid:
        raise InvalidInput(f"{source}: {report.summary()}", report.errors, invalid_count=report.invalid)
    if out_path is not None:
        return PreparedFile(out_path, digest.hexdigest(), size, report.valid, report.invalid, True, report)
    file_digest = hashlib.sha256()
    file_size = 0
    with source.open("rb") as handle:
        while block := handle.read(1 << 20):
            file_digest.update(block)
            file_size += len(block)
    return PreparedFile(source, file_digest.hexdigest(), file_size, report.valid, 0, False, report)


def prepare_requests(
    requests: Iterable[BatchInputLine | Mapping[str, Any]],
    *,
    endpoint: Endpoint,
    model: str,
    skip_invalid: bool = False,
    max_errors: int = 20,
) -> tuple[list[BatchInputLine], InputReport]:
    """Validate in-memory requests (models or dicts shaped like input lines).

    Raises:
        InvalidInput: a request is invalid (and ``skip_invalid`` is false) or none is valid.
    """
    report = InputReport(max_errors=max_errors)
    valid: list[BatchInputLine] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(requests):
        error: SchemaError | None = None
        line: BatchInputLine | None = None
        try:
            line = item if isinstance(item, BatchInputLine) else BatchInputLine.model_validate(item)
        except ValidationError as exc:
            error = SchemaError.from_validation_error(exc, prefix=f"requests[{index}]")
        if line is not None:
            body_model = line.typed_body().model
            if line.url != endpoint:
                error = SchemaError(
                    Reason.URL_MISMATCH,
                    f"{line.url.value!r} differs from the batch endpoint {endpoint.value!r}",
                    field=f"requests[{index}].url",
                )
            elif body_model is not None and body_model != model:
                error = SchemaError(
                    Reason.MODEL_MISMATCH,
                    f"{body_model!r} differs from the batch model {model!r}",
                    field=f"requests[{index}].body.model",
                )
            elif line.custom_id in seen:
                error = SchemaError(
                    Reason.DUPLICATE_CUSTOM_ID,
                    f"{line.custom_id!r} is already used by requests[{seen[line.custom_id]}]; "
                    "custom_id must be unique",
                    field=f"requests[{index}].custom_id",
                )
        if error is None and line is not None:
            seen[line.custom_id] = index
            valid.append(line)
            report.valid += 1
        else:
            report.invalid += 1
            if error is not None and len(report.errors) < max_errors:
                report.errors.append(error)
    if not valid:
        raise InvalidInput(
            f"no valid requests: {report.summary('request')}", report.errors, invalid_count=report.invalid
        )
    if report.invalid and not skip_invalid:
        raise InvalidInput(report.summary("request"), report.errors, invalid_count=report.invalid)
    return valid, report


def write_jsonl(lines: Iterable[BatchInputLine]) -> PreparedFile:
    """Write request lines to a temporary JSONL file (to upload requests too big to send inline)."""
    fd, name = tempfile.mkstemp(prefix="llmbatch-input-", suffix=".jsonl")
    digest = hashlib.sha256()
    size = count = 0
    with os.fdopen(fd, "wb") as out:
        for line in lines:
            data = line.to_jsonl()
            out.write(data)
            digest.update(data)
            size += len(data)
            count += 1
    report = InputReport(valid=count)
    return PreparedFile(Path(name), digest.hexdigest(), size, count, 0, True, report)
