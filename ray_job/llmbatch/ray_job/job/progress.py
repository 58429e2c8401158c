"""Progress counters and a heartbeat, written to a Redis hash the dispatcher chose.

Fields of ``JobSpec.progress_key`` (all cumulative over the batch's attempts): ``completed``,
``failed``, ``prompt_tokens``, ``completion_tokens``, ``attempt``, ``heartbeat_at`` (unix seconds,
float) and ``total`` once known. A background thread writes them every ``progress_interval_s`` even
when no request finished (the heartbeat), so writes are throttled no matter how fast requests end.

Writes are fenced by attempt (``write_progress.lua``): once a later attempt of the batch has written,
or the dispatcher has closed the hash (the batch's terminal event is out), an attempt still running
(a "zombie" whose stop did not take) writes nothing and learns it is :attr:`Progress.superseded`;
it then writes no more shards and no manifest (see :mod:`llmbatch.ray_job.job.main`).

Redis is optional: without ``redis_url``/``progress_key`` nothing is written, and a Redis outage
only logs a warning. The ``redis`` package is imported lazily (``ray_job`` imports without it).
A password may come from ``LLMBATCH_REDIS__PASSWORD`` instead of the URL; neither is ever logged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from llmbatch.ray_job.storage import job_redis

log = logging.getLogger("ray_job.progress")

KEY_TTL_S = 7 * 86400  # the hash outlives its last write by this much (the dispatcher deletes it sooner)
WRITE_PROGRESS_LUA = resources.files("llmbatch.ray_job.job").joinpath("write_progress.lua").read_text()


@dataclass(slots=True)
class Counters:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total: int | None = None


def progress_fields(counters: Counters | None, attempt: int, now: float) -> dict[str, str]:
    """The hash fields for one write (Redis stores strings); without counters (not known yet: the
    resume scan runs) only the heartbeat, leaving the earlier attempts' counters as they are."""
    if counters is None:
        return {"attempt": str(attempt), "heartbeat_at": f"{now:.3f}"}
    fields = {
        "completed": str(counters.completed),
        "failed": str(counters.failed),
        "prompt_tokens": str(counters.prompt_tokens),
        "completion_tokens": str(counters.completion_tokens),
        "attempt": str(attempt),
        "heartbeat_at": f"{now:.3f}",
    }
    if counters.total is not None:
        fields["total"] = str(counters.total)
    return fields


class Progress:
    """Thread-safe counters plus the periodic writer."""

    def __init__(
        self,
        redis_url: str | None,
        key: str | None,
        *,
        attempt: int,
        interval_s: float,
        base: Counters | None,
        on_superseded: Callable[[], None] | None = None,
        client: Any = None,
    ) -> None:
        self.counters = base or Counters()
        self._known = base is not None  # False: heartbeats only, until set_base
        self._attempt = attempt
        self._interval = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._client: Any = None
        self._key = key
        self._warned_at = 0.0
        self._script: Any = None
        self.writes = 0
        self.superseded = False
        """A later attempt of the batch has written progress, or the batch ended: this attempt is stale."""
        self._on_superseded = on_superseded
        """Called once, from whichever thread noticed (the heartbeat's, most often): the attempt stops
        then, not only at its next write (a stale attempt that never writes would run to its deadline)."""
        # a long-lived process (the batch runner) lends its own client: no connection per batch
        self._owns_client = client is None
        if redis_url and key:
            self._client = job_redis.connect(redis_url, timeout_s=5) if client is None else client
            self._script = self._client.register_script(WRITE_PROGRESS_LUA)
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def start(self) -> None:
        if self.enabled:
            self.publish()
            self._thread.start()

    def add(
        self, *, completed: int = 0, failed: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0
    ) -> None:
        with self._lock:
            c = self.counters
            c.completed += completed
            c.failed += failed
            c.prompt_tokens += prompt_tokens
            c.completion_tokens += completion_tokens

    def set_base(self, base: Counters) -> None:
        """The counters the attempt starts from (after the resume scan); writes include them now."""
        with self._lock:
            if base.total is None:
                base.total = self.counters.total
            self.counters = base
            self._known = True

    def set_total(self, total: int) -> None:
        with self._lock:
            self.counters.total = total

    def snapshot(self) -> Counters:
        with self._lock:
            c = self.counters
            return Counters(c.completed, c.failed, c.prompt_tokens, c.completion_tokens, c.total)

    def publish(self) -> None:
        """Write the counters and a fresh heartbeat now (errors are logged, never raised)."""
        if not self.enabled:
            return
        with self._lock:
            known = self._known
        fields = progress_fields(self.snapshot() if known else None, self._attempt, time.time())
        args: list[str] = [str(self._attempt), str(KEY_TTL_S)]
        for name, value in fields.items():
            args += (name, value)
        try:
            written = int(self._script(keys=[self._key], args=args))
        except Exception as exc:  # Redis is best effort: the job's results do not depend on it
            self._warn(exc)
            return
        self.writes += 1
        if not written:
            self._superseded()

    def still_current(self) -> bool:
        """Whether no later attempt has written progress and the batch has not ended (asked now).
        ``True`` without Redis or when Redis cannot answer: the fence is best effort, the resume
        scan's overlap check (:func:`llmbatch.ray_job.job.resume.scan`) is the backstop."""
        if not self.enabled or self.superseded:
            return not self.superseded
        try:
            raw, closed = self._client.hmget(self._key, ["attempt", "closed"])
        except Exception as exc:
            self._warn(exc)
            return True
        try:
            current = int(raw or 0)
        except ValueError:
            current = 0
        if current > self._attempt or closed is not None:
            self._superseded(current)
        return not self.superseded

    def _superseded(self, current: int | None = None) -> None:
        if not self.superseded:
            self.superseded = True
            log.warning(
                "a later attempt (%s) of this batch started or the batch ended: attempt %d stops",
                current or "?",
                self._attempt,
            )
            if self._on_superseded is not None:
                self._on_superseded()

    def _warn(self, exc: BaseException) -> None:
        if time.monotonic() - self._warned_at > 60:
            self._warned_at = time.monotonic()
            log.warning("progress write failed (%s); continuing without it", type(exc).__name__)

    def close(self) -> None:
        """Stop the heartbeat and write the final counters."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.publish()
        if self._client is not None and self._owns_client:
            with contextlib.suppress(Exception):  # closing a best-effort connection
                self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.publish()
