"""Ending a batch: the one place a batch moves to its terminal state (:class:`Finisher`).

The launcher ends the batches that cannot start (their model left the registry, their request is
gone, their spec is refused); the in-flight checks end the rest. Both hand the outcome here; its
terminal event goes out later, from the record
(:class:`~llmbatch.dispatcher.kafka.publisher.TerminalPublisher`).
"""

from __future__ import annotations

import logging

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.events import Outcome, terminal_fields
from llmbatch.dispatcher.runs.context import RunContext

log = logging.getLogger(__name__)

STOP_FIELDS = ("stop_reason", "stop_requested_at")
"""Fields of a stop request, cleared when an attempt starts or the batch ends."""


class Finisher:
    """Moves a batch to the terminal state of its outcome (compare-and-set on its record)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    async def finish(self, record: BatchRecord, outcome: Outcome) -> bool:
        """End ``record`` with ``outcome``; False when another replica moved it first."""
        result = await self.ctx.store.transition(
            record.key,
            outcome.state,
            expected_version=record.version,
            fields=terminal_fields(record, outcome),
            delete=STOP_FIELDS,
        )
        if result.ok:
            self.ctx.metrics.attempts.labels(event=outcome.state.value).inc()
            log.info(
                "batch finished", extra={"status": outcome.state.value, "error_code": outcome.error_code}
            )
        return result.ok
