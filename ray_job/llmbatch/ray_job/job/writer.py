"""Rolling shard writer: buffers result lines and puts each shard to S3 as one object.

A shard is closed after ``max_lines`` lines, ``max_bytes`` bytes or ``max_seconds`` since its first
line, whichever comes first, so memory stays bounded and a crash loses at most one open shard per
kind. Names are per attempt (``output-a2-00000.jsonl``): an attempt never touches another
attempt's shards, so retries cannot duplicate or clobber results. A ``fence`` (the attempt's
:meth:`~llmbatch.ray_job.job.progress.Progress.still_current`) is asked before every put: a stale attempt
stops with :class:`~llmbatch.ray_job.errors.SupersededError` instead of adding shards beside a later
attempt's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from pyarrow import fs as pafs

from llmbatch.ray_job.errors import SupersededError
from llmbatch.ray_job.storage import s3
from llmbatch.schemas.job import ShardInfo, shard_name


class ShardWriter:
    """Writes ``kind`` shards of one attempt under ``prefix_path`` (``bucket/tenant/batch/``)."""

    def __init__(
        self,
        fs: pafs.FileSystem,
        prefix_path: str,
        kind: Literal["output", "error"],
        attempt: int,
        *,
        start_index: int = 0,
        max_lines: int = 10_000,
        max_bytes: int = 64 << 20,
        max_seconds: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        fence: Callable[[], bool] | None = None,
    ) -> None:
        self._fs = fs
        self._prefix = prefix_path if prefix_path.endswith("/") else prefix_path + "/"
        self.kind: Literal["output", "error"] = kind
        self._attempt = attempt
        self._index = start_index
        self._max_lines, self._max_bytes, self._max_seconds = max_lines, max_bytes, max_seconds
        self._clock = clock
        self._fence = fence
        self._buf = bytearray()
        self._lines = 0
        self._opened_at = 0.0
        self._tokens = (0, 0)
        self.shards: list[ShardInfo] = []
        self.prompt_tokens = 0
        """Prompt tokens of the lines in written shards."""
        self.completion_tokens = 0
        """Completion tokens of the lines in written shards."""

    @property
    def buffered_lines(self) -> int:
        """Lines waiting in the open shard."""
        return self._lines

    def add(self, line: bytes, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Append one line (must end with a newline) and its usage; may close the shard."""
        if not self._lines:
            self._opened_at = self._clock()
        self._buf += line
        self._lines += 1
        self._tokens = (self._tokens[0] + prompt_tokens, self._tokens[1] + completion_tokens)
        if self._lines >= self._max_lines or len(self._buf) >= self._max_bytes:
            self.flush()

    def roll_if_old(self) -> None:
        """Close the open shard when it has been open for ``max_seconds``."""
        if self._lines and self._clock() - self._opened_at >= self._max_seconds:
            self.flush()

    def flush(self) -> ShardInfo | None:
        """Write the open shard (if it has lines) and start the next one."""
        if not self._lines:
            return None
        if self._fence is not None and not self._fence():
            raise SupersededError(
                f"a later attempt of the batch is running: attempt {self._attempt} "
                f"writes no more {self.kind} shards"
            )
        path = self._prefix + shard_name(self.kind, self._index, self._attempt)
        s3.write_bytes(self._fs, path, bytes(self._buf))
        info = ShardInfo(
            uri=s3.uri_of(path), lines=self._lines, size_bytes=len(self._buf), attempt=self._attempt
        )
        self.shards.append(info)
        self.prompt_tokens += self._tokens[0]
        self.completion_tokens += self._tokens[1]
        self._tokens = (0, 0)
        self._index += 1
        self._buf = bytearray()
        self._lines = 0
        return info
