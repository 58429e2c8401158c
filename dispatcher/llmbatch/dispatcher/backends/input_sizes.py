"""Sizes of batches' input files, asked of object storage once and shared by admission and routing.

A file batch's route (the batch runner or a Ray job) depends on its input's size. The tracker needs it
to admit the batch (a Ray job needs a job slot) and the runner backend needs it again to submit: one
cache in front of both means one S3 HEAD per batch instead of one each, and the route a batch was
admitted for is the route it is submitted on.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

SizeOf = Callable[[str], Awaitable[int | None]]
"""The size in bytes of the object at an ``s3://`` URI; ``None`` when it does not exist."""

TTL_S = 300.0
"""How long an answer is kept: inputs are written before their request is published, and a batch
waits in ``queued`` at most this long between two asks."""
KEPT = 10_000
"""Answers kept at most (one per queued file batch); past that the oldest are dropped."""


class InputSizes:
    """:data:`SizeOf` with a bounded, expiring memory of its answers (missing objects included)."""

    def __init__(
        self,
        fetch: SizeOf,
        *,
        ttl_s: float = TTL_S,
        kept: int = KEPT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if kept < 1:
            raise ValueError("kept must be at least 1")
        self._fetch = fetch
        self._ttl_s = ttl_s
        self._kept = kept
        self._clock = clock
        self._sizes: dict[str, tuple[float, int | None]] = {}

    async def __call__(self, uri: str) -> int | None:
        now = self._clock()
        known = self._sizes.get(uri)
        if known is not None and now - known[0] < self._ttl_s:
            return known[1]
        size = await self._fetch(uri)
        self._sizes.pop(uri, None)
        while len(self._sizes) >= self._kept:  # dicts keep insertion order: the first is the oldest
            del self._sizes[next(iter(self._sizes))]
        self._sizes[uri] = (now, size)
        return size

    def __len__(self) -> int:
        return len(self._sizes)
