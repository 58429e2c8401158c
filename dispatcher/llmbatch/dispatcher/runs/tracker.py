"""The tracking loop: launch queued batches, watch their Ray jobs, finish them, publish outcomes.

Every replica runs it, on what its leases give it (:mod:`llmbatch.dispatcher.runs.leases`): one replica,
the launching leader, takes the steps that judge all batches at once; the in-flight batches are split
into shards shared by the live replicas, each checking and ending its shards' batches (a stale holder
is harmless: every state change is a compare-and-set and submission ids are idempotent). Each tick:

1. (leader) promote queued batches whose retry backoff elapsed;
2. (leader) expire queued batches past their deadline;
3. (shards) check the job of every in-flight batch of this replica's shards and move the batch on
   (:mod:`llmbatch.dispatcher.runs.in_flight`: finalize, progress events, deadline risk; stop, retry,
   finish: :mod:`llmbatch.dispatcher.runs.endings`);
4. (leader) launch ready batches while fewer than ``max_in_flight`` hold a job (priority, then the
   nearest deadline); with shared engines only while the model's replicas have room
   (:class:`~llmbatch.dispatcher.domain.scheduler.Admission`). The leader decides and takes the place
   in flight; a batch of another replica's shard is submitted by that replica at its next check;
5. (shards) publish the pending terminal events (and dead letters) of its shards' batches idempotently;
6. (leader) refresh gauges.

The parts it wires, all on one :class:`~llmbatch.dispatcher.runs.context.RunContext`: starting and
submitting an attempt (its spec, the engines' room) is the
:class:`~llmbatch.dispatcher.runs.launcher.Launcher`'s alone; checking an in-flight batch,
:class:`~llmbatch.dispatcher.runs.in_flight.InFlight`'s; ending a batch, the
:class:`~llmbatch.dispatcher.runs.finisher.Finisher`'s; what a batch's outcome is when it did not end
with its own manifest, :mod:`llmbatch.dispatcher.runs.outcomes`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from llmbatch.dispatcher import logs
from llmbatch.dispatcher.backends.input_sizes import InputSizes, SizeOf
from llmbatch.dispatcher.domain import states
from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.scheduler import launch_slots
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.domain.tenant_turns import launch_order
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.kafka.publisher import TerminalPublisher
from llmbatch.dispatcher.kafka.record_reader import RecordReader
from llmbatch.dispatcher.kafka.request_body import RequestBodies
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.finisher import Finisher
from llmbatch.dispatcher.runs.in_flight import InFlight
from llmbatch.dispatcher.runs.job_cleanup import JobCleanup
from llmbatch.dispatcher.runs.launcher import LAUNCH_FIELDS, Launcher
from llmbatch.dispatcher.runs.leases import LEASE, TrackerLeases
from llmbatch.dispatcher.runs.outcomes import OutcomeReader, counter
from llmbatch.dispatcher.runs.wakeups import Wakeups

log = logging.getLogger(__name__)

__all__ = ["LEASE", "Tracker"]

WARN_EVERY_S = 30.0  # the same dependency outage is logged at most this often
FAST_POLL_S = 0.2
MIN_TICK_GAP_S = 0.05  # poll interval while a submitted job has not started yet (event -> RUNNING latency)


class Tracker:
    def __init__(
        self,
        ctx: RunContext,
        *,
        bodies: RequestBodies | None = None,
        input_sizes: SizeOf | None = None,
    ) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.opts = ctx.opts
        self.store = ctx.store
        self.metrics = ctx.metrics
        topics = ctx.settings.kafka.topics
        self.job_cleanup = JobCleanup(
            ctx.store,
            ctx.backend,
            retry_after_s=self.opts.job_delete_recheck_s,
            settle_s=self.opts.job_delete_settle_s,
            clock=ctx.clock,
        )
        bodies = bodies or RequestBodies(RecordReader(ctx.settings.kafka))
        self.publisher = TerminalPublisher(
            ctx.store,
            ctx.producer,
            results_topic=topics.results,
            dlt_topic=topics.dead_letter,
            group_id=self.opts.group_id,
            source=self.opts.source,
            metrics=ctx.metrics,
            crash=ctx.crash,
            after_publish=self.forget_jobs,
            bodies=bodies,
            known_tenants=ctx.settings.tenants.known(),
        )
        self.token = f"{self.opts.instance_id}/{uuid.uuid4().hex[:8]}"
        self.leases = TrackerLeases(
            ctx.store,
            ctx.metrics,
            token=self.token,
            ttl_s=self.opts.lease_ttl_s,
            shard_count=self.opts.tracker_shards,
            on_change=self._leases_changed,
        )
        self.wakeups = Wakeups(ctx.store, others=lambda: not self.leases.alone, wake=self.wake)
        self._tell = False  # wake the other replicas before the next tick (this one accepted batches)
        self.last_tick = time.monotonic()
        self._sweep_at = 0.0
        self._cleanup_at = time.monotonic()
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._warned: dict[str, float] = {}
        self._failing: dict[tuple[str, BatchKey], str] = {}  # (step, batch) -> its permanent error, said
        self._sem = asyncio.Semaphore(16)
        self.outcomes = OutcomeReader(ctx)
        self.finisher = Finisher(ctx)
        self.launcher = Launcher(
            ctx,
            self.outcomes,
            self.finisher,
            bodies=bodies,
            size_of=InputSizes(self._object_size) if input_sizes is None else input_sizes,
        )
        self.checks = InFlight(ctx, self.outcomes, self.finisher, self.launcher)

    async def _object_size(self, uri: str) -> int | None:
        return await self.ctx.results.object_size(uri)

    @property
    def is_leader(self) -> bool:
        """Whether this replica is the launching leader (launch, queued deadlines, gauges, reconcile)."""
        return self.leases.is_leader

    @is_leader.setter
    def is_leader(self, value: bool) -> None:  # tests and tools that drive one tracker by hand
        self.leases.is_leader = value

    @property
    def active(self) -> bool:
        """Whether this replica has tracker work: it leads or holds a shard."""
        return self.leases.is_leader or bool(self.leases.shards)

    # -- loop ----------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def wake(self) -> None:
        """Run the next tick now."""
        self._wake.set()

    def accepted(self) -> None:
        """This replica's consumer queued new batches: tick now, and wake the launching leader if it is
        another replica."""
        self._tell = True
        self._wake.set()

    async def run(self) -> None:
        keeper = asyncio.create_task(self.leases.run(self._stopping), name="tracker-lease")
        listener = asyncio.create_task(self.wakeups.listen(self._stopping), name="tracker-wakeups")
        try:
            while not self._stopping.is_set():
                self.last_tick = time.monotonic()
                if self._tell:
                    self._tell = False
                    if not self.is_leader:
                        await self.wakeups.tell()
                if self.active:
                    try:
                        await self.tick()
                    except DispatcherError as exc:
                        log.warning("tracker tick incomplete", extra={"error": str(exc)})
                    except Exception:
                        log.exception("tracker tick failed")
                interval = self.opts.poll_interval_s
                if self.launcher.awaiting_start:
                    interval = min(interval, FAST_POLL_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), interval)
                self._wake.clear()
                # a burst of wake-ups (intake at full speed) still ticks at most every MIN_TICK_GAP_S
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), MIN_TICK_GAP_S)
        finally:
            for task in (keeper, listener):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.leases.release()

    def _postponed(self, what: str, exc: DispatcherError) -> None:
        """A step that met an outage: counted each time, logged once per component every
        ``WARN_EVERY_S`` (an outage meets every launch and every batch's step, tick after tick)."""
        component = _component(exc)
        self.metrics.transient_errors.labels(component=component).inc()
        now = time.monotonic()
        if now - self._warned.get(component, -1e9) > WARN_EVERY_S:
            self._warned[component] = now
            log.warning(
                f"{what} postponed (repeats are not logged for a while)",
                extra={"error": str(exc), "component": component},
            )

    def _leases_changed(self) -> None:
        """What this replica remembered of batches it no longer tracks is stale: forget it (the next
        poll keeps what it still checks)."""
        self.checks.keep_only({k for k in self.checks.remembered() if self.leases.owns(k)})
        self._failing = {k: v for k, v in self._failing.items() if self.leases.owns(k[1])}
        self.wake()

    async def forget_jobs(self, record: BatchRecord) -> None:
        """Delete the Ray jobs of a batch whose terminal event is out (see
        :mod:`llmbatch.dispatcher.runs.job_cleanup`)."""
        await self.job_cleanup.forget(record)

    async def tick(self) -> None:
        leader = self.is_leader
        if leader:
            await self.store.promote_due()
            await self.expire_queued()
        await self.poll_in_flight()
        if leader:
            await self.launch()
        await self.publisher.publish_pending(keep=None if self.leases.owns_all else self.leases.owns)
        if not leader:
            return
        await self.refresh_gauges()
        now = time.monotonic()
        if now - self._sweep_at > 300:
            self._sweep_at = now
            await self.store.sweep_finished()
            await self.sweep_orphans()
        if now - self._cleanup_at > 10:
            self._cleanup_at = now
            await self.job_cleanup.retry_due()

    async def sweep_orphans(self, page: int = 1000) -> int:
        """Remove the stale entries of the state indexes no step reads whole: ``queued`` (its count
        is intake's backpressure) and ``accepted``; return how many went."""
        removed = 0
        for state in (State.QUEUED, State.ACCEPTED):
            offset = 0
            while ids := await self.store.ids_in_state(state, limit=page, offset=offset):
                found = await self.store.get_many(ids)
                stale = [k for k, r in zip(ids, found, strict=True) if r is None or r.state is not state]
                gone = await self.store.drop_orphans(state, stale)
                removed += gone
                offset += len(ids) - gone
        return removed

    async def _each(
        self, records: list[BatchRecord], fn: Callable[[BatchRecord], Awaitable[None]], step: str = "check"
    ) -> None:
        """``fn`` on each record, 16 at a time; an outage is logged as :meth:`_postponed` says, a
        permanent error once per batch and ``step`` until it changes or the step works again."""

        async def guarded(record: BatchRecord) -> None:
            async with self._sem:
                with logs.bind(
                    batch_id=record.batch_id,
                    tenant=record.tenant,
                    attempt=record.attempt,
                    trace_id=logs.trace_id_of(record.get("traceparent")),
                ):
                    failing = (step, record.key)
                    try:
                        await fn(record)
                    except DispatcherError as exc:
                        if exc.retriable:
                            self._postponed("batch step", exc)
                        elif self._failing.get(failing) != str(exc):  # said once per batch and error
                            self._failing[failing] = str(exc)
                            log.error(
                                "batch step failed (said again only if the error changes)",
                                extra={"error": str(exc), "step": step},
                            )
                    except Exception:
                        log.exception("batch step crashed")
                    else:
                        if self._failing.pop(failing, None) is not None:
                            log.info("batch step works again", extra={"step": step})
                    finally:
                        self.last_tick = time.monotonic()  # a long tick that moves is not a stall

        await asyncio.gather(*(guarded(r) for r in records))
        # batches no longer handed to this step (ended, or not due) are forgotten: the map stays bounded
        keys = {r.key for r in records}
        for gone in [k for k in self._failing if k[0] == step and k[1] not in keys]:
            del self._failing[gone]

    # -- 2. deadlines of queued batches --------------------------------------------------------------
    async def expire_queued(self) -> None:
        """Finish queued batches past their deadline, and queued retries a cancel asked to stop
        (:meth:`StateStore.due_now` puts them in the deadline index)."""
        now = self.ctx.clock()
        ids = await self.store.due_deadlines(now, limit=500)
        found = await self.store.get_many(ids)
        await self.store.drop_orphans(
            "deadlines",
            [k for k, r in zip(ids, found, strict=True) if r is None or states.is_terminal(r.state)],
        )
        records = [r for r in found if r is not None and r.state in {State.ACCEPTED, State.QUEUED}]
        stops = [(r, self.checks.stop_reason(r, now)) for r in records]
        due = {r.key: reason for r, reason in stops if reason in {"cancel", "deadline"}}
        await self._each(
            [r for r in records if r.key in due],
            lambda r: self.checks.finish_stopped(r, due[r.key]),
            step="expire",
        )

    # -- 3. in-flight --------------------------------------------------------------------------------
    async def poll_in_flight(self) -> None:
        records: list[BatchRecord] = []
        for state in (State.SUBMITTED, State.RUNNING, State.FINALIZING):
            # this replica's shards' batches only (the ids of all are cheap; their records are not)
            ids = self.leases.mine(await self.store.ids_in_state(state, limit=10_000))
            found = await self.store.get_many(ids)
            # an entry whose batch is gone or moved on would count against max_in_flight for ever
            await self.store.drop_orphans(
                state, [k for k, r in zip(ids, found, strict=True) if r is None or r.state is not state]
            )
            now_here = [r for r in found if r is not None and r.state is state]
            if state is State.SUBMITTED:
                self.launcher.awaiting_start = bool(now_here)
            records += now_here
        self.checks.keep_only({r.key for r in records})
        await self._each(records, self.checks.check)

    # -- 4. launch -----------------------------------------------------------------------------------
    async def launch(self) -> None:
        in_flight = await self.store.in_flight_count()
        slots = launch_slots(in_flight, self.opts.launch_limit)
        admission = await self.launcher.admission() if self.opts.shared_engines and slots else None
        # a few extra: cancelled or expired entries at the head are finished, not launched (and with
        # shared engines a model without room must not hold back the other models' batches)
        extra = 64 if admission is not None else 8
        ids = await self.store.ready_ids(slots + extra if slots else 8)
        if not ids:
            return
        launched = 0
        found = await self.store.get_fields_many(ids, LAUNCH_FIELDS)
        # entries of batches gone or launched already would hold the head of the queue for ever
        await self.store.drop_orphans(
            "ready", [k for k, r in zip(ids, found, strict=True) if r is None or r.state is not State.QUEUED]
        )
        found = await self._tenant_turns(found)
        for record in found:
            if record is None or record.state is not State.QUEUED:
                continue
            with logs.bind(
                batch_id=record.batch_id,
                tenant=record.tenant,
                trace_id=logs.trace_id_of(record.get("traceparent")),
            ):
                reason = self.checks.stop_reason(record, self.ctx.clock())
                try:
                    if reason is not None:
                        if whole := await self._whole(record):
                            await self.checks.finish_stopped(whole, reason)
                    elif launched < slots and await self.launcher.admits(admission, record):
                        submit = self._submits(record.key)
                        start = await self._whole(record) if submit else record
                        if start is not None and await self.launcher.start_attempt(start, submit=submit):
                            launched += 1
                except DispatcherError as exc:
                    if not exc.retriable:
                        log.warning("launch postponed", extra={"error": str(exc)})
                        continue
                    self._postponed("launch", exc)
                    return
        if launched:  # their shards' holders check them at once
            await self.wakeups.tell()
        if admission is not None:
            for model in self.settings.engines.models:
                self.metrics.admitted.labels(model=model).set(admission.requests(model))
                self.metrics.admission_waiting.labels(model=model).set(1 if model in admission.blocked else 0)

    async def _whole(self, record: BatchRecord) -> BatchRecord | None:
        """The whole record of a queued batch read for launching by a few fields (None: it moved on)."""
        whole = await self.store.get(record.key)
        return whole if whole is not None and whole.state is State.QUEUED else None

    def _submits(self, key: BatchKey) -> bool:
        """Whether the launching leader submits ``key``'s attempt itself: when the batch's shard is its
        own, or it holds no shard at all (a tracker driven by hand, more replicas than shards).
        Otherwise the shard's holder builds the spec and submits it, so the launch's cost per batch
        (the request read back, the spec, the backend's round trip) is shared by the replicas."""
        return not self.leases.shards or self.leases.owns(key)

    async def _tenant_turns(self, found: list[BatchRecord | None]) -> list[BatchRecord | None]:
        """``found`` (ready, in the queue's order) in the order to try them: within a priority, tenants
        in turns (:mod:`llmbatch.dispatcher.domain.tenant_turns`). One tenant alone: as they are."""
        ready = [r for r in found if r is not None and r.state is State.QUEUED]
        if len({r.tenant for r in ready}) < 2:
            return found
        in_flight = await self.store.in_flight_tenants()
        # read as admission reads it (a garbled value is 0, never an error that stops every launch)
        candidates = [(r.tenant, counter(r.get("priority"))) for r in ready]
        return [ready[i] for i in launch_order(candidates, in_flight, self.settings.tenants.weights)]

    # -- 6. gauges -----------------------------------------------------------------------------------
    async def refresh_gauges(self) -> None:
        counts = await self.store.counts()
        for state, n in counts.items():
            self.metrics.batches.labels(state=state.value).set(n)
        self.metrics.in_flight.set(sum(counts[s] for s in states.IN_FLIGHT))


def _component(exc: DispatcherError) -> str:
    return {
        "redis_unavailable": "redis",
        "kafka_unavailable": "kafka",
        "ray_unavailable": "ray",
        "storage_unavailable": "s3",
    }.get(exc.code, "other")
