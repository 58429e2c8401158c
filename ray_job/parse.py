"""Input lines -> pipeline rows: validate each line, turn bad ones into error lines, skip done ones.

Validation is :func:`schemas.openai.iter_input_lines` (the same rules the producer checks before
upload): invalid JSON, missing/duplicate ``custom_id``, wrong ``method``/``url``, bad body fields.
Every non-blank line yields exactly one result line in the batch's output, except lines an earlier
attempt already finished (:class:`DoneKeys`), which are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import orjson

from ray_job import rows
from ray_job.errors import UNREADABLE_CUSTOM_ID, RequestFailure
from ray_job.formatting import error_line
from schemas.common import Endpoint
from schemas.lines import count_lines
from schemas.openai import iter_input_lines


@dataclass(slots=True)
class DoneKeys:
    """What earlier attempts finished: custom_ids of output lines, line numbers of error lines."""

    custom_ids: set[str] = field(default_factory=set)
    lines: set[int] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.custom_ids) + len(self.lines)


def parse_lines(
    lines: Iterable[bytes | str],
    *,
    batch_id: str,
    endpoint: Endpoint,
    model: str,
    done: DoneKeys | None = None,
    max_line_bytes: int | None = None,
) -> Iterator[rows.Row]:
    """Yield one row per non-blank line not finished before: a ``request`` or an ``error`` row.

    Line numbers are 1-based and count blank lines, like an editor does. A line over
    ``max_line_bytes`` (cut to that length + 1 by :func:`split_lines`) is a ``line_too_large`` error.
    """
    done = done or DoneKeys()
    for result in iter_input_lines(lines, endpoint=endpoint, model=model, max_line_bytes=max_line_bytes):
        line_no = result.line_no
        if result.error is not None:
            if line_no in done.lines:
                continue
            custom_id = result.error.custom_id or UNREADABLE_CUSTOM_ID.format(line=line_no)
            failure = RequestFailure.from_schema_error(result.error)
            payload = error_line(failure, batch_id=batch_id, custom_id=custom_id, line_no=line_no)
            yield rows.Row(line_no, rows.INVALID, custom_id, payload)
            continue
        assert result.line is not None
        custom_id = result.line.custom_id
        if custom_id in done.custom_ids or line_no in done.lines:
            continue
        payload = orjson.dumps({"url": result.line.url.value, "body": result.line.body})
        yield rows.Row(line_no, rows.REQUEST, custom_id, payload)


def count_request_lines(chunks: Iterable[bytes]) -> int:
    """Non-blank lines in a byte stream given in arbitrary chunks (what :func:`parse_lines` counts),
    in constant memory."""
    return count_lines(chunks)
