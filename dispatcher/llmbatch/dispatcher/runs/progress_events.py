"""Progress events of running batches: one when the interval passed and the counts moved; and which
of them are at risk of their deadline (:mod:`llmbatch.schemas.deadlines`, judged from the same reading
of their progress: ``llmbatch_batches_at_risk{model}``, one log line when a batch falls behind and one
when it is back on time).

What this replica last published and judged per batch is kept in memory, for the batches in flight
only (:meth:`ProgressEvents.keep_only`, at each poll): the memory stays bounded, also for batches
another leader ended.
"""

from __future__ import annotations

import logging
from collections import Counter

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.events import build_progress, safe_counts
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.outcomes import counter
from llmbatch.schemas.deadlines import outlook
from llmbatch.schemas.openai import Usage

log = logging.getLogger(__name__)


class ProgressEvents:
    """Publishes ``batch.progress`` events for the in-flight checks."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self._progress_at: dict[BatchKey, float] = {}
        self._progress_sig: dict[BatchKey, tuple[int, ...]] = {}
        self.at_risk: dict[BatchKey, str] = {}  # batch -> its model, while it is at risk

    def forget(self, *keys: BatchKey) -> None:
        """Drop what this replica remembers of the progress events of ``keys``."""
        for key in keys:
            self._progress_at.pop(key, None)
            self._progress_sig.pop(key, None)
            self.at_risk.pop(key, None)
        self._export_risk()

    def remembered(self) -> set[BatchKey]:
        """The batches whose progress events or deadline risk this replica remembers."""
        return set(self._progress_at) | set(self.at_risk)

    def keep_only(self, keys: set[BatchKey]) -> None:
        """Forget the progress events of every batch but ``keys`` (the batches in flight now): the
        maps stay bounded, also for batches another leader ended."""
        self.forget(*[k for k in self.remembered() if k not in keys])

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
        self.judge(record, counts.completed + counts.failed, counts.total or None, now)
        sig = (record.attempt, counts.total, counts.completed, counts.failed)
        self._progress_at[record.key] = now
        if self._progress_sig.get(record.key) == sig:
            return
        self._progress_sig[record.key] = sig
        envelope = build_progress(record, counts, usage, source=self.ctx.opts.source, now=now)
        await self.ctx.producer.publish(self.ctx.settings.kafka.topics.results, envelope)

    def judge(self, record: BatchRecord, done: int, total: int | None, now: float) -> None:
        """Whether ``record`` (``done`` of ``total`` requests answered at ``now``) is at risk of its
        deadline at its rate since it first started; said once per change, counted by model."""
        seen = outlook(done, total, record.number("started_at"), record.number("deadline"), now)
        if seen.at_risk == (record.key in self.at_risk):
            return
        if seen.at_risk:
            self.at_risk[record.key] = record.get("model") or "-"
            log.warning(
                "batch at risk of missing its deadline at its rate so far",
                extra={
                    "done": done,
                    "total": total,
                    "needs_s": round(seen.need_s or 0),
                    "left_s": round(seen.left_s or 0),
                },
            )
        else:
            del self.at_risk[record.key]
            log.info("batch back on time for its deadline", extra={"done": done, "total": total})
        self._export_risk()

    def _export_risk(self) -> None:
        by_model = Counter(self.at_risk.values())
        gauge = self.ctx.metrics.at_risk
        for model in {*self.ctx.settings.engines.models, *by_model}:
            gauge.labels(model=model).set(by_model.get(model, 0))
