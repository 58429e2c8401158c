"""Starting attempts: which queued batches may start now (the shared engines' room), the job spec of
an attempt, its submission (idempotent by submission id), and the batches that cannot start at all
(their model left the registry, their request is gone, their spec no longer validates).

The tracker's loop picks the queued batches and hands each to :meth:`Launcher.start_attempt`; the
in-flight checks resubmit an attempt whose submission was never confirmed through
:meth:`Launcher.submit`. Nothing else submits a job.
"""

from __future__ import annotations

import logging

from llmbatch.dispatcher import logs
from llmbatch.dispatcher.backends.input_sizes import SizeOf
from llmbatch.dispatcher.domain import states
from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.events import Outcome
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.scheduler import (
    Admission,
    EngineLoad,
    engine_capacity,
    short_path_fits,
    window_requests,
)
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import JobRejected, RequestUnavailable
from llmbatch.dispatcher.kafka.request_body import RequestBodies
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.finisher import STOP_FIELDS, Finisher
from llmbatch.dispatcher.runs.jobspec import build_job_spec
from llmbatch.dispatcher.runs.outcomes import OutcomeReader, counter
from llmbatch.dispatcher.settings import ENGINES_ENV
from llmbatch.schemas.dlt import DltReason
from llmbatch.schemas.engines import UnknownModelError
from llmbatch.schemas.errors import SchemaError
from llmbatch.schemas.job import JobSpec, submission_id

log = logging.getLogger(__name__)

ADMISSION_FIELDS = ("model", "priority", "total", "tenant", "input_uri", "via")
"""What admission and routing read of a batch's record (:meth:`Launcher.load_of`,
:meth:`Launcher.takes_job_path`): every in-flight batch is read at each launch, so not its request."""
LAUNCH_FIELDS = (
    *ADMISSION_FIELDS,
    *("batch_id", "attempt", "lifecycle", "cancel_requested", "deadline", "stop_reason", "traceparent"),
)
"""What deciding a queued batch's launch reads of its record (admission, its stop reason, the transition
that starts its attempt); the whole record is read only to submit it or to end it."""

UNSENT = "unsent"
"""``confirmed`` of an attempt the launching leader left to the batch's shard holder to submit (``0``:
sent, not confirmed yet; ``1``: confirmed)."""


class Launcher:
    """Starts and submits attempts for the tracker (see the module docstring)."""

    def __init__(
        self,
        ctx: RunContext,
        outcomes: OutcomeReader,
        finisher: Finisher,
        *,
        bodies: RequestBodies,
        size_of: SizeOf,
    ) -> None:
        self.ctx = ctx
        self.bodies = bodies
        self.outcomes = outcomes
        self.finisher = finisher
        #: live replicas per model (the engines' figures, refreshed by the service); admission capacity
        self.engine_replicas: dict[str, int] = {}
        #: a job was submitted and is not running yet (the tracker then polls faster)
        self.awaiting_start = False
        #: the input file's size (``s3://`` object), which decides its route as in the RoutedBackend
        #: (the service gives both one :class:`~llmbatch.dispatcher.backends.input_sizes.InputSizes`: one
        #: ask per batch)
        self.size_of = size_of

    def load_of(self, record: BatchRecord, progress: dict[str, str]) -> EngineLoad | None:
        """What a batch has (or, queued, would have) at its model's replicas; ``None`` off the registry."""
        model = record.get("model") or ""
        entry = self.ctx.settings.engines.models.get(model)
        if entry is None:
            return None
        total = counter(progress.get("total")) or counter(record.get("total")) or None
        done = counter(progress.get("completed")) + counter(progress.get("failed"))
        window = window_requests(total, done, entry.batch_window)
        return EngineLoad(model, counter(record.get("priority")), window, record.tenant)

    async def admits(self, admission: Admission | None, record: BatchRecord) -> bool:
        """Whether a queued batch fits the engines' room and, if it would run as a Ray job, a job
        slot (always, without shared engines)."""
        if admission is None:
            return True
        load = self.load_of(record, {})
        if load is None:  # its model left the registry: start_attempt fails it (model_not_found)
            return True
        job = await self.takes_job_path(record)
        return admission.admit(load.model, load.priority, load.requests, job=job, tenant=load.tenant)

    async def route_of(self, record: BatchRecord) -> str:
        """How the batch's next attempt will run: ``ray_job`` or ``batch_runner`` (as
        :attr:`~llmbatch.dispatcher.backends.backend.SubmitResult.via` will say)."""
        if self.ctx.settings.dispatcher.shared_engines and not await self.takes_job_path(record):
            return "batch_runner"
        return "ray_job"

    async def takes_job_path(self, record: BatchRecord) -> bool:
        """Whether the batch would run as a Ray job rather than on the batch runner (the runner
        backend's rule, :func:`~llmbatch.dispatcher.domain.scheduler.short_path_fits`, from the record; a
        file's size
        is asked of ``size_of`` only when the short path could take it)."""
        opts = self.ctx.settings.dispatcher
        pooled = self.ctx.settings.tenants.pool_of(record.tenant) is not None
        uri = record.get("input_uri")
        size = None
        if uri and opts.short_path_max_lines > 0 and not pooled:
            size = await self.size_of(uri)
        lines = None if uri else counter(record.get("total"))
        return not short_path_fits(
            pooled=pooled,
            lines=lines,
            input_size=size,
            max_lines=opts.short_path_max_lines,
            max_bytes=opts.short_path_max_bytes,
        )

    async def admission(self) -> Admission:
        """The shared engines' room now: each model's capacity and its launched batches' load."""
        ids: list[BatchKey] = []
        for state in (State.SUBMITTED, State.RUNNING):  # finalizing batches have nothing at the engines
            ids += await self.ctx.store.ids_in_state(state, limit=10_000)
        found = await self.ctx.store.get_fields_many(ids, ADMISSION_FIELDS)
        records = [r for r in found if r is not None and r.state in states.IN_FLIGHT]
        progress = await self.ctx.store.read_progress_many([r.key for r in records])
        load = [x for r, p in zip(records, progress, strict=True) if (x := self.load_of(r, p)) is not None]
        capacity = {
            model: engine_capacity(
                entry.admit_per_replica,
                live_replicas=self.engine_replicas.get(model),
                min_replicas=entry.scaling.min_replicas,
                max_replicas=entry.scaling.max_replicas,
            )
            for model, entry in self.ctx.settings.engines.models.items()
        }
        for model, cap in capacity.items():
            self.ctx.metrics.admission_capacity.labels(model=model).set(cap)
        jobs = sum(1 for r in records if r.get("via") == "ray_job")
        slots = max(0, self.ctx.settings.dispatcher.max_jobs_in_flight - jobs)
        return Admission.of(capacity, load, job_slots=slots)

    async def job_spec(self, record: BatchRecord, attempt: int) -> JobSpec:
        """:func:`build_job_spec` with the request body read back from Kafka when Redis does not keep
        it (raises :class:`RequestUnavailable` when it is gone, a transient error when Kafka is down)."""
        body = await self.bodies.text(record)
        return build_job_spec(record, attempt, self.ctx.settings, self.ctx.keys, request=body)

    async def fail_request_gone(self, record: BatchRecord, exc: RequestUnavailable) -> None:
        outcome = Outcome(
            State.FAILED,
            self.ctx.clock(),
            counts={"total": int(record.get("total") or 0)},
            error_code=str(DltReason.REQUEST_GONE),
            error_message=str(exc)[:2000],
            dlt_reason=str(DltReason.REQUEST_GONE),
        )
        await self.finisher.finish(record, outcome)

    async def start_attempt(self, record: BatchRecord, *, submit: bool = True) -> bool:
        """Start the next attempt of a queued batch: the transition to ``submitted`` (which takes its
        place in flight), then the submit. With ``submit=False`` the attempt is marked
        :data:`UNSENT` instead, and the replica that tracks the batch's shard builds its spec and
        submits it at its next check (:meth:`submit`): the launching leader only decides. True when the
        batch took its place in flight."""
        attempt = record.attempt + 1
        spec = await self.spec_or_end(record, attempt) if submit else None
        if submit and spec is None:
            return False
        now = self.ctx.clock()
        result = await self.ctx.store.transition(
            record.key,
            State.SUBMITTED,
            expected_version=record.version,
            fields={
                "attempt": str(attempt),
                "submission_id": submission_id(record.batch_id, attempt, record.get("lifecycle") or None),
                "submitted_at": repr(now),
                "confirmed": "0" if submit else UNSENT,
                # the route it is sent on, confirmed by the submit: a job holds its slot from now on,
                # also while its submit is retried through a Ray outage
                "via": await self.route_of(record),
            },
            delete=STOP_FIELDS,
        )
        if not result.ok:
            return False
        self.ctx.metrics.attempts.labels(event="submitted").inc()
        self.awaiting_start = True
        if spec is None:
            return True
        fresh = await self.ctx.store.get(record.key)
        if fresh is not None:
            with logs.bind(attempt=attempt):
                await self.submit(fresh, spec)  # the spec does not change with the transition
        return True

    async def spec_or_end(self, record: BatchRecord, attempt: int) -> JobSpec | None:
        """The spec of ``attempt``, or None when the batch cannot run at all and was ended for it (its
        model left the registry, its request is gone, its stored request no longer validates)."""
        try:
            return await self.job_spec(record, attempt)
        except UnknownModelError as exc:
            await self.fail_unserved(record, exc)
        except RequestUnavailable as exc:
            await self.fail_request_gone(record, exc)
        except (SchemaError, ValueError) as exc:
            outcome = Outcome(
                State.FAILED,
                self.ctx.clock(),
                counts={"total": int(record.get("total") or 0)},
                error_code=str(DltReason.INPUT_INVALID),
                error_message=f"job spec: {exc}"[:2000],
                dlt_reason=str(DltReason.INPUT_INVALID),
            )
            await self.finisher.finish(record, outcome)
        return None

    async def submit(self, record: BatchRecord, spec: JobSpec | None = None) -> None:
        """Submit (or resubmit) the record's current attempt; idempotent by submission id. ``spec`` is
        the attempt's spec when the caller built it already (an offloaded body is read from Kafka once)."""
        if spec is None:
            spec = await self.spec_or_end(record, record.attempt)
            if spec is None:
                return
        try:
            result = await self.ctx.backend.submit(spec)
        except JobRejected as exc:
            outcome = await self.outcomes.partial(
                record,
                State.FAILED,
                error_code=str(DltReason.SUBMIT_REJECTED),
                error_message=str(exc),
                dlt_reason=str(DltReason.SUBMIT_REJECTED),
            )
            await self.finisher.finish(record, outcome)
            return
        self.ctx.crash("after_submit")
        log.info(
            "job submitted",
            extra={
                "submission_id": result.submission_id,
                "already_existed": result.already_existed,
                "via": result.via,
            },
        )
        await self.ctx.store.transition(
            record.key,
            State.SUBMITTED,
            from_states=[State.SUBMITTED],
            expected_version=record.version,
            fields={"confirmed": "1", "via": result.via},
        )

    async def fail_unserved(self, record: BatchRecord, exc: UnknownModelError) -> None:
        """The batch's model left the registry after acceptance: fail it at once (retrying cannot
        help, and it must never run on another model), keeping what earlier attempts wrote. The dead
        letter (``model_not_found``) can be replayed once the model is served again."""
        log.error("model not served; failing the batch", extra={"model": exc.model, "served": exc.known})
        outcome = await self.outcomes.partial(
            record,
            State.FAILED,
            error_code=str(DltReason.MODEL_NOT_FOUND),
            error_message=f"{exc}. Serve it in {ENGINES_ENV} and replay the dead letter, or resend "
            "the batch with a served model",
            dlt_reason=str(DltReason.MODEL_NOT_FOUND),
        )
        await self.finisher.finish(record, outcome)
