"""Progress events of running batches: one when the interval passed and the counts moved.

What this replica last published per batch is kept in memory, for the batches in flight only
(:meth:`ProgressEvents.keep_only`, at each poll): the memory stays bounded, also for batches another
leader ended.
"""

from __future__ import annotations

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.events import build_progress, safe_counts
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.outcomes import counter
from llmbatch.schemas.openai import Usage


class ProgressEvents:
    """Publishes ``batch.progress`` events for the in-flight checks."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self._progress_at: dict[BatchKey, float] = {}
        self._progress_sig: dict[BatchKey, tuple[int, ...]] = {}

    def forget(self, *keys: BatchKey) -> None:
        """Drop what this replica remembers of the progress events of ``keys``."""
        for key in keys:
            self._progress_at.pop(key, None)
            self._progress_sig.pop(key, None)

    def keep_only(self, keys: set[BatchKey]) -> None:
        """Forget the progress events of every batch but ``keys`` (the batches in flight now): the
        maps stay bounded, also for batches another leader ended."""
        self.forget(*[k for k in self._progress_at if k not in keys])

    async def maybe_publish(self, record: BatchRecord, now: float) -> None:
        """Publish a progress event when the interval passed and the counts moved."""
        last = self._progress_at.get(record.key, 0.0)
        if now - last < self.ctx.opts.progress_interval_s:
            return
        progress = await self.ctx.store.read_progress(record.key)
        if not progress:
            return
        counts = safe_counts(
            {k: counter(progress.get(k)) for k in ("total", "completed", "failed")},
            int(record.get("total") or 0) or None,
        )
        usage = Usage(
            prompt_tokens=counter(progress.get("prompt_tokens")),
            completion_tokens=counter(progress.get("completion_tokens")),
        )
        sig = (record.attempt, counts.total, counts.completed, counts.failed)
        self._progress_at[record.key] = now
        if self._progress_sig.get(record.key) == sig:
            return
        self._progress_sig[record.key] = sig
        envelope = build_progress(record, counts, usage, source=self.ctx.opts.source, now=now)
        await self.ctx.producer.publish(self.ctx.settings.kafka.topics.results, envelope)
