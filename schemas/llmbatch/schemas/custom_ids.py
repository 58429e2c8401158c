"""Which custom_ids a stream of input lines has used so far, exactly and in bounded memory.

A batch may have millions of lines. A dict of every custom_id costs ~130 bytes a line (1M lines:
~130 MB in the job's reader task). :class:`CustomIdIndex` keeps up to ``memory_limit`` ids in a dict;
past that it moves them to a private temporary SQLite database (stdlib: a B-tree that lives in a
page cache of ``cache_kib`` and spills to a file SQLite deletes when the connection closes). Memory
then stays flat whatever the size, and the answer stays exact: no hashing, so no false duplicates.
"""

from __future__ import annotations

import sqlite3
from types import TracebackType

MEMORY_LIMIT = 100_000
"""Distinct custom_ids kept in a dict before the index moves to SQLite (~13 MB of dict)."""
CACHE_KIB = 8192
"""SQLite's page cache once spilled (the rest of the index is on disk)."""
_COMMIT_EVERY = 10_000


class CustomIdIndex:
    """The first line of each custom_id seen so far (see the module docstring)."""

    def __init__(self, memory_limit: int = MEMORY_LIMIT, *, cache_kib: int = CACHE_KIB) -> None:
        if memory_limit < 1:
            raise ValueError("memory_limit must be at least 1")
        self._limit = memory_limit
        self._cache_kib = cache_kib
        self._memory: dict[str, int] = {}
        self._db: sqlite3.Connection | None = None
        self._pending = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def spilled(self) -> bool:
        """True once the ids live in SQLite."""
        return self._db is not None

    def first_line(self, custom_id: str, line_no: int) -> int | None:
        """The line that used ``custom_id`` first; ``None`` when it is new (``line_no`` is then recorded
        as its first line)."""
        if self._db is None:
            first = self._memory.get(custom_id)
            if first is not None:
                return first
            self._memory[custom_id] = line_no
            self._count += 1
            if len(self._memory) >= self._limit:
                self._spill()
            return None
        row = self._db.execute("SELECT line FROM ids WHERE id = ?", (custom_id,)).fetchone()
        if row is not None:
            return int(row[0])
        self._db.execute("INSERT INTO ids (id, line) VALUES (?, ?)", (custom_id, line_no))
        self._count += 1
        self._pending += 1
        if self._pending >= _COMMIT_EVERY:
            self._db.commit()
            self._pending = 0
        return None

    def __contains__(self, custom_id: object) -> bool:
        """Whether ``custom_id`` was seen (a lookup only: nothing is recorded)."""
        if not isinstance(custom_id, str):
            return False
        if self._db is None:
            return custom_id in self._memory
        return self._db.execute("SELECT 1 FROM ids WHERE id = ?", (custom_id,)).fetchone() is not None

    def _spill(self) -> None:
        db = sqlite3.connect("")  # "" = a private temporary database, deleted on close
        db.execute("PRAGMA journal_mode = OFF")
        db.execute("PRAGMA synchronous = OFF")
        db.execute(f"PRAGMA cache_size = -{int(self._cache_kib)}")
        db.execute("CREATE TABLE ids (id TEXT PRIMARY KEY, line INTEGER NOT NULL) WITHOUT ROWID")
        db.executemany("INSERT INTO ids (id, line) VALUES (?, ?)", self._memory.items())
        db.commit()
        self._memory = {}
        self._db = db

    def close(self) -> None:
        """Drop the index (the SQLite file goes with its connection)."""
        if self._db is not None:
            self._db.close()
            self._db = None
        self._memory = {}
        self._count = self._pending = 0

    def __enter__(self) -> CustomIdIndex:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
