"""dispatcher.launcher: starting an attempt of a queued batch, and the batches that cannot start.

The records come from real requests through the real intake (dispatcher.intake.classify); the store,
backend and results are small in-memory stand-ins that record what was asked of them, so each
decision (submitted, confirmed, failed and why, which route) is the real code's. The same paths run
against real Redis in tests/integration/test_dispatcher_tracker.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from llmbatch.dispatcher.backends.backend import SubmitResult
from llmbatch.dispatcher.domain.batch_record import BatchRecord, TransitionResult
from llmbatch.dispatcher.domain.events import Outcome
from llmbatch.dispatcher.domain.keys import BatchKey, Keys
from llmbatch.dispatcher.domain.states import State, is_terminal
from llmbatch.dispatcher.errors import JobRejected
from llmbatch.dispatcher.intake.commands import Accept, classify, intake_rules
from llmbatch.dispatcher.kafka.record_reader import RecordReader
from llmbatch.dispatcher.kafka.request_body import RequestBodies
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.finisher import STOP_FIELDS, Finisher
from llmbatch.dispatcher.runs.launcher import Launcher
from llmbatch.dispatcher.runs.outcomes import OutcomeReader
from llmbatch.dispatcher.runs.results import Shards
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.schemas.job import JobSpec
from llmbatch.settings import TenantSettings
from tests.support.dispatcher_kit import MODEL, batch_request, inline_lines, origin, registry, request_message

pytestmark = pytest.mark.unit
NOW = 1_790_000_000.0


@dataclass
class Store:
    keys: Keys = field(default_factory=lambda: Keys("p"))
    records: dict[BatchKey, BatchRecord] = field(default_factory=dict)
    transitions: list[tuple[State, dict[str, Any], tuple[str, ...]]] = field(default_factory=list)
    refuse: bool = False  # every compare-and-set loses (another replica moved the batch)

    async def transition(
        self,
        key: BatchKey,
        to: State,
        *,
        expected_version: int | None = None,
        fields: dict[str, str] | None = None,
        delete: tuple[str, ...] = (),
        from_states: list[State] | None = None,
    ) -> TransitionResult:
        record = self.records[key]
        if self.refuse or (expected_version is not None and expected_version != record.version):
            return TransitionResult(False, "conflict", record.state, record.version)
        kept = {k: v for k, v in record.fields.items() if k not in delete}
        self.records[key] = BatchRecord(key, to, record.version + 1, {**kept, **(fields or {})})
        self.transitions.append((to, dict(fields or {}), tuple(delete)))
        return TransitionResult(True, "ok", to, record.version + 1)

    async def get(self, key: BatchKey) -> BatchRecord | None:
        return self.records.get(key)

    async def read_progress(self, key: BatchKey) -> dict[str, str]:
        return {}


@dataclass
class Backend:
    submitted: list[JobSpec] = field(default_factory=list)
    via: str = "ray_job"
    refuse: str | None = None

    async def submit(self, spec: JobSpec) -> SubmitResult:
        if self.refuse is not None:
            raise JobRejected(self.refuse)
        self.submitted.append(spec)
        return SubmitResult(spec.submission_id, already_existed=False, via=self.via)


class Results:
    async def read_manifest(self, output_prefix: str) -> None:
        return None

    async def list_shards(self, output_prefix: str) -> Shards:
        return Shards([], [])


class NoKafka:
    async def read(self, ref: Any) -> None:
        raise AssertionError("the request is kept in Redis: Kafka is not read")


@dataclass
class Kit:
    launcher: Launcher
    store: Store
    backend: Backend
    sizes: dict[str, int]

    @property
    def finished(self) -> list[tuple[State, Outcome]]:
        """The batch's terminal transitions (the finisher's), with their outcomes."""
        return [
            (to, Outcome.from_json(fields["outcome"]))
            for to, fields, _ in self.store.transitions
            if is_terminal(to)
        ]


def kit(*, served: tuple[str, ...] = (MODEL,), pools: tuple[str, ...] = (), **options: Any) -> Kit:
    settings = DispatcherSettings(
        _env_file=None,
        engines=registry(models=served),
        dispatcher=DispatcherOptions(**options),
        tenants=TenantSettings(pools=list(pools)),
    )
    store, backend = Store(), Backend()
    sizes: dict[str, int] = {}
    results: Any = Results()

    async def size_of(uri: str) -> int | None:
        return sizes.get(uri)

    unused: Any = None  # nothing here publishes
    ctx = RunContext(settings, store, backend, results, unused, Metrics(), clock=lambda: NOW)  # type: ignore[arg-type]
    launcher = Launcher(
        ctx,
        OutcomeReader(ctx),
        Finisher(ctx),
        bodies=RequestBodies(cast(RecordReader, NoKafka())),
        size_of=size_of,
    )
    return Kit(launcher, store, backend, sizes)


def queued(
    k: Kit,
    batch_id: str = "b-1",
    *,
    lines: int = 3,
    tenant: str = "default",
    **overrides: Any,
) -> BatchRecord:
    """A batch as the intake records it, queued (served models: all of the kit's and this one's)."""
    settings = DispatcherSettings(_env_file=None, engines=registry(models=(MODEL, "gone-model")))
    model = overrides.pop("model", MODEL)
    request = batch_request(
        batch_id, model=model, tenant=tenant, requests=inline_lines(lines, model=model), **overrides
    )
    key, value, headers = request_message(request)
    command = classify(origin(key, value, headers), intake_rules(settings), NOW)
    assert isinstance(command, Accept)
    record = BatchRecord(command.item.key, State.QUEUED, 1, {**command.item.fields, "generation": "1"})
    k.store.records[record.key] = record
    return record


async def test_an_attempt_is_submitted_then_confirmed_with_its_route() -> None:
    k = kit()
    k.backend.via = "batch_runner"
    record = queued(k)
    assert await k.launcher.start_attempt(record) is True
    (spec,) = k.backend.submitted
    assert spec.attempt == 1 and spec.batch_id == "b-1"
    (started, started_fields, cleared), (confirmed, confirmed_fields, _) = k.store.transitions
    assert started is State.SUBMITTED and started_fields["confirmed"] == "0"
    assert started_fields["submission_id"] == spec.submission_id and started_fields["attempt"] == "1"
    assert cleared == STOP_FIELDS  # a stop asked of an earlier attempt does not stop this one
    assert confirmed is State.SUBMITTED and confirmed_fields == {"confirmed": "1", "via": "batch_runner"}
    assert k.launcher.awaiting_start and k.finished == []


async def test_a_lost_compare_and_set_submits_nothing() -> None:
    k = kit()
    record = queued(k)
    k.store.refuse = True  # another replica started it first
    assert await k.launcher.start_attempt(record) is False
    assert k.backend.submitted == [] and k.finished == []


async def test_a_model_that_left_the_registry_fails_the_batch_never_runs_another() -> None:
    k = kit()
    record = queued(k, model="gone-model")
    assert await k.launcher.start_attempt(record) is False
    ((_, outcome),) = k.finished
    assert outcome.state is State.FAILED and outcome.error_code == "model_not_found"
    assert "gone-model" in (outcome.error_message or "") and k.backend.submitted == []


async def test_a_refused_submit_fails_the_batch_with_the_reason() -> None:
    k = kit()
    k.backend.refuse = "entrypoint too long"
    record = queued(k)
    assert await k.launcher.start_attempt(record) is True  # started; its submit was refused
    ((_, outcome),) = k.finished
    assert outcome.state is State.FAILED and outcome.error_code == "submit_rejected"
    assert outcome.error_message == "entrypoint too long"


async def test_the_route_follows_size_and_tenant_pools() -> None:
    k = kit(shared_engines=True, short_path_max_lines=5, pools=("iso",))
    assert await k.launcher.route_of(queued(k, "small", lines=5)) == "batch_runner"
    assert await k.launcher.route_of(queued(k, "big", lines=6)) == "ray_job"
    # a tenant with a worker pool of its own never runs on the shared runner, however small
    assert await k.launcher.route_of(queued(k, "iso-1", lines=1, tenant="iso")) == "ray_job"


def test_a_batchs_load_is_its_window_of_what_is_left() -> None:
    k = kit()
    record = queued(k, lines=3, priority=7)
    load = k.launcher.load_of(record, {"total": "1000", "completed": "990", "failed": "4"})
    assert load is not None and (load.model, load.priority, load.requests) == (MODEL, 7, 6)
    gone = BatchRecord(record.key, State.QUEUED, 1, {**record.fields, "model": "gone-model"})
    assert k.launcher.load_of(gone, {}) is None
