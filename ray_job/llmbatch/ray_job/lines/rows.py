"""The one row schema every pipeline stage reads and writes (an explicit Arrow schema, so blocks
from different stages and batches always concatenate).

``kind`` says what a row is:

- ``request``: a valid input line still to run; ``payload`` is JSON (``url``, ``body`` and, after
  the prompt stage, ``prompt_token_ids``/``sampling``);
- ``output`` / ``error``: finished; ``payload`` is the final output-file / error-file line;
- ``invalid``: finished, an input line that failed validation (an ``error`` the engine never saw;
  a batch whose every line is ``invalid`` fails with ``input_invalid``, as OpenAI's does).

The driver keeps the line numbers it has written in :class:`SeenLines`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

REQUEST = "request"
OUTPUT = "output"
ERROR = "error"
INVALID = "invalid"

SCHEMA = pa.schema(
    [
        ("line_no", pa.int64()),
        ("kind", pa.string()),
        ("custom_id", pa.string()),
        ("payload", pa.binary()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("engine_start_s", pa.float64()),
        ("engine_ready_at", pa.float64()),
    ]
)


@dataclass(slots=True)
class Row:
    """One row of the pipeline (see the module docstring)."""

    line_no: int
    kind: str
    custom_id: str
    payload: bytes
    prompt_tokens: int = 0
    completion_tokens: int = 0
    engine_start_s: float = 0.0
    engine_ready_at: float = 0.0


def to_table(rows: list[Row]) -> pa.Table:
    """Rows -> an Arrow table with :data:`SCHEMA`."""
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for row in rows:
        for name in SCHEMA.names:
            columns[name].append(getattr(row, name))
    return pa.table(columns, schema=SCHEMA)


def from_table(table: pa.Table) -> list[Row]:
    """An Arrow table (any column order, extra columns ignored) -> rows."""
    data = table.select(SCHEMA.names).to_pydict()
    return [Row(*values) for values in zip(*(data[name] for name in SCHEMA.names), strict=True)]


class SeenLines:
    """A bitmap of input line numbers already written by this attempt (guards against a retried
    Ray task delivering a block twice); one bit per line."""

    def __init__(self) -> None:
        self._bits = bytearray()

    def add(self, line_no: int) -> bool:
        """Mark ``line_no``; False when it was already marked."""
        byte, bit = divmod(line_no, 8)
        if byte >= len(self._bits):
            self._bits.extend(b"\x00" * (byte + 1 - len(self._bits) + 4096))
        if self._bits[byte] & (1 << bit):
            return False
        self._bits[byte] |= 1 << bit
        return True
