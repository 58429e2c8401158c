"""Applying a consumed ``cancel_requested`` command to the batch's state in Redis.

A cancel names a batch of its own tenant (batch ids are scoped by tenant: another tenant's batch of
the same id is another batch, which the cancel never reaches). A batch
that never launched is cancelled at once; one with a job (or a queued retry) is flagged
``cancel_requested`` and the tracker stops the job and reports partial results (a queued retry at its
next tick, not when the queue reaches it). A redelivered cancel
(its event id marker is set) is skipped; every write is a compare-and-set, so the whole step may be
retried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from llmbatch.dispatcher import logs
from llmbatch.dispatcher.domain.events import Outcome, terminal_fields
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import TransientError
from llmbatch.dispatcher.intake.commands import Cancel
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.state.store import StateStore

log = logging.getLogger(__name__)


async def apply_cancel(
    store: StateStore, metrics: Metrics, cancel: Cancel, clock: Callable[[], float]
) -> None:
    """Record ``cancel``; raises :class:`TransientError` when the batch kept changing meanwhile."""
    with logs.bind(
        batch_id=cancel.batch_id, tenant=cancel.request.tenant, trace_id=logs.trace_id_of(cancel.traceparent)
    ):
        if (await store.markers_exist([cancel.marker]))[0]:
            metrics.processed.labels(outcome="duplicate_cancel").inc()
            return
        for _ in range(20):
            record = await store.get(cancel.key)
            if record is None or record.state.is_terminal:
                log.info(
                    "cancel ignored: batch unknown or finished",
                    extra={"state": record.state.value if record else None},
                )
                metrics.processed.labels(outcome="cancel_ignored").inc()
                break
            reason = cancel.request.reason or "cancel requested"
            if record.state in {State.ACCEPTED, State.QUEUED} and record.attempt == 0:
                outcome = Outcome(State.CANCELLED, clock(), counts={"total": int(record.get("total") or 0)})
                result = await store.transition(
                    cancel.key,
                    State.CANCELLED,
                    expected_version=record.version,
                    fields={
                        **terminal_fields(record, outcome),
                        "cancel_requested": "1",
                        "cancel_reason": reason,
                    },
                )
            else:  # the tracker stops the job and reports partial results (a queued retry: at once)
                result = await store.transition(
                    cancel.key,
                    record.state,
                    expected_version=record.version,
                    from_states=[record.state],
                    fields={
                        "cancel_requested": "1",
                        "cancel_reason": reason,
                        "cancel_requested_at": repr(clock()),
                        "cancel_requested_by": cancel.request.requested_by or "",
                    },
                )
            if result.ok:
                if record.state is State.QUEUED and record.attempt > 0:
                    await store.due_now(cancel.key, clock())  # a queued retry: the next tick
                log.info("cancel recorded", extra={"state": record.state.value})
                metrics.processed.labels(outcome="cancel").inc()
                break
        else:  # the batch kept changing under us: try the whole record again (nothing committed)
            raise TransientError(f"cancel of {cancel.key}: state kept changing")
        await store.set_marker(cancel.marker)
