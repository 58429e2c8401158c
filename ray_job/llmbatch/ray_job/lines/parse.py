"""Input lines -> pipeline rows: validate each line, turn bad ones into error lines, skip done ones.

Validation is :func:`llmbatch.schemas.input_lines.iter_input_lines` (the same rules the producer checks before
upload): invalid JSON, missing/duplicate ``custom_id``, wrong ``method``/``url``, bad body fields.
Every non-blank line yields exactly one result line in the batch's output, except lines an earlier
attempt already finished (:class:`DoneKeys`), which are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import orjson

from llmbatch.ray_job.errors import UNREADABLE_CUSTOM_ID, RequestFailure
from llmbatch.ray_job.lines import rows
from llmbatch.ray_job.lines.formatting import error_line
from llmbatch.schemas.common import Endpoint
from llmbatch.schemas.custom_ids import MEMORY_LIMIT, CustomIdIndex
from llmbatch.schemas.input_lines import iter_input_lines
from llmbatch.schemas.lines import count_lines


class DoneKeys:
    """What earlier attempts finished: custom_ids of output lines, line numbers of error lines.

    Bounded memory whatever the batch's size: the keys live in a :class:`CustomIdIndex` (a dict up to
    its limit, then a private temporary SQLite file). Not picklable: a task that needs the keys builds
    its own from the shards (:func:`llmbatch.ray_job.job.resume.done_keys`).
    """

    __slots__ = ("_index",)

    def __init__(
        self, custom_ids: Iterable[str] = (), lines: Iterable[int] = (), *, memory_limit: int = MEMORY_LIMIT
    ) -> None:
        self._index = CustomIdIndex(memory_limit)
        for custom_id in custom_ids:
            self.add_custom_id(custom_id)
        for line_no in lines:
            self.add_line(line_no)

    # custom_ids and line numbers share one index under prefixes that cannot collide
    def add_custom_id(self, custom_id: str) -> None:
        self._index.first_line("c" + custom_id, 0)

    def add_line(self, line_no: int) -> None:
        self._index.first_line(f"l{line_no}", 0)

    def has_custom_id(self, custom_id: str) -> bool:
        return ("c" + custom_id) in self._index

    def has_line(self, line_no: int) -> bool:
        return f"l{line_no}" in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def spilled(self) -> bool:
        """True once the keys live on disk (SQLite)."""
        return self._index.spilled

    def close(self) -> None:
        """Drop the keys (and the SQLite file, if any)."""
        self._index.close()

    def __reduce__(self) -> Any:
        raise TypeError("DoneKeys is not picklable: send the shard paths (Prior.done_shards) instead")


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
    if done is None:
        done = DoneKeys()
    for result in iter_input_lines(lines, endpoint=endpoint, model=model, max_line_bytes=max_line_bytes):
        line_no = result.line_no
        if result.error is not None:
            if done.has_line(line_no):
                continue
            custom_id = result.error.custom_id or UNREADABLE_CUSTOM_ID.format(line=line_no)
            failure = RequestFailure.from_schema_error(result.error)
            payload = error_line(failure, batch_id=batch_id, custom_id=custom_id, line_no=line_no)
            yield rows.Row(line_no, rows.INVALID, custom_id, payload)
            continue
        assert result.line is not None
        custom_id = result.line.custom_id
        if done.has_custom_id(custom_id) or done.has_line(line_no):
            continue
        payload = orjson.dumps({"url": result.line.url.value, "body": result.line.body})
        yield rows.Row(line_no, rows.REQUEST, custom_id, payload)


def count_request_lines(chunks: Iterable[bytes]) -> int:
    """Non-blank lines in a byte stream given in arbitrary chunks (what :func:`parse_lines` counts),
    in constant memory."""
    return count_lines(chunks)
