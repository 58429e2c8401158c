"""The tracker against a real Redis. Launch: with shared engines a batch is launched only while its
model's replicas have room (capacity-aware admission), higher priorities count only work of their
rank, and one model's full replicas do not hold back another model (the Ray side is an in-memory
backend: dispatcher logic only; the engines themselves are proven in test_serve_engine and the e2e
tests). Failed attempts: a real Ray job's exit code decides between retry and failure."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from redis.typing import EncodableT, FieldT

from llmbatch.dispatcher.backends.backend import JobInfo, JobState, SubmitResult
from llmbatch.dispatcher.backends.runner_backend import takes_short_path
from llmbatch.dispatcher.domain import states
from llmbatch.dispatcher.domain.batch_record import BatchRecord, IntakeItem
from llmbatch.dispatcher.domain.events import Outcome, build_accepted, terminal_fields
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.domain.scheduler import ready_score
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import DispatcherError, RayUnavailable
from llmbatch.dispatcher.intake.commands import intake_fields
from llmbatch.dispatcher.job_options import JobOptions
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.jobspec import results_prefix
from llmbatch.dispatcher.runs.results import Shards
from llmbatch.dispatcher.runs.tracker import Tracker
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas.engines import EngineModel, EngineRegistry, Scaling
from llmbatch.schemas.job import EngineConfig, JobSpec
from llmbatch.settings import RaySettings, RedisSettings
from tests.support.dispatcher_kit import batch_request, inline_lines, origin, request_message, wait_for

pytestmark = pytest.mark.integration

SHORT_PATH_MAX_LINES = DispatcherOptions().short_path_max_lines

NOW = 1_790_000_000.0
# windows of 8 requests (engines running 4 at once: twice that, as batch_size 4 x 2 in flight); each
# replica takes 40 requests of launched batches
ENTRY = EngineModel(
    path="fake",
    engine=EngineConfig(backend=FAKE_BACKEND, batch_size=4, batches_in_flight=2),
    scaling=Scaling(min_replicas=0, max_replicas=3),
    max_active_requests=4,
    admit_per_replica=40,
)


@dataclass
class Jobs:
    """Ray as the tracker sees it: every submitted attempt runs, unless ``down`` says what a submit
    meets instead."""

    submitted: list[JobSpec] = field(default_factory=list)
    down: DispatcherError | None = None

    async def submit(self, spec: JobSpec) -> SubmitResult:
        if self.down is not None:
            raise self.down
        self.submitted.append(spec)
        # routed as the RoutedBackend does: small inline batches on the batch runner
        short = takes_short_path(spec, max_lines=SHORT_PATH_MAX_LINES, max_bytes=0, input_size=None)
        return SubmitResult(spec.submission_id, False, via="batch_runner" if short else "ray_job")

    async def status(self, submission_id: str) -> JobInfo:
        return JobInfo(JobState.RUNNING)

    async def stop(self, submission_id: str) -> bool:
        return True

    async def delete(self, submission_id: str) -> bool:
        return False

    async def ping(self) -> bool:
        return self.down is None

    async def close(self) -> None:
        return None

    def batches(self) -> list[str]:
        return [s.batch_id for s in self.submitted]


@pytest.fixture
async def kit(redis_settings: RedisSettings) -> AsyncIterator[tuple[Tracker, StateStore, Jobs]]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings = DispatcherSettings(
        _env_file=None,
        redis=RedisSettings(url=redis_settings.url, password=SecretStr(""), key_prefix=prefix),
        dispatcher=DispatcherOptions(shared_engines=True),
        engines=EngineRegistry(models={"a": ENTRY, "b": ENTRY}),
    )
    store = StateStore.from_url(redis_settings.url, keys=Keys(prefix), finished_ttl_s=3600, dedupe_ttl_s=3600)
    store.clock = lambda: NOW
    jobs = Jobs()
    unused: Any = None  # nothing here reads results or publishes
    tracker = Tracker(
        RunContext(
            settings,
            store,
            jobs,
            results=unused,
            producer=unused,
            metrics=Metrics(),
            clock=lambda: NOW,
        )
    )
    await tracker.leases.step()  # a lone replica: it leads and holds every shard
    try:
        yield tracker, store, jobs
    finally:
        await drop(store)


async def drop(store: StateStore) -> None:
    """Delete every key of the store's prefix and close it."""
    keys = [k async for k in store.client.scan_iter(match=f"{store.keys.prefix}:*")]
    if keys:
        await store.client.delete(*keys)
    await store.close()


async def queue(
    store: StateStore,
    batch_id: str,
    lines: int,
    *,
    model: str = "a",
    priority: int = 0,
    age: float = 0.0,
    offset: int = 0,
    tenant: str = "default",
) -> None:
    lines_of = inline_lines(lines, model=model)
    request = batch_request(batch_id, model=model, priority=priority, requests=lines_of, tenant=tenant)
    key, value, headers = request_message(request)
    record = origin(key, value, headers, offset=offset)
    fields = intake_fields(request, record, "test", batch_id, None, NOW - age)
    [result] = await store.intake_many(
        [
            IntakeItem(
                batch_key(tenant, batch_id),
                fields,
                ("test", batch_id),
                ready_score=ready_score(priority, NOW - age),
            )
        ]
    )
    assert result.is_new


Kit = tuple[Tracker, StateStore, Jobs]


async def test_two_tenants_batches_of_one_id_run_as_two_batches(kit: Kit) -> None:
    tracker, store, jobs = kit
    await queue(store, "same", 3, tenant="acme", offset=1)
    await queue(store, "same", 3, tenant="globex", offset=2)  # scoped ids: no duplicate
    await tracker.launch()
    specs = {s.tenant: s for s in jobs.submitted}
    assert set(specs) == {"acme", "globex"} and len(jobs.submitted) == 2
    acme, globex = specs["acme"], specs["globex"]
    assert acme.batch_id == globex.batch_id == "same"
    assert "/acme/same/" in acme.output_prefix and "/globex/same/" in globex.output_prefix
    assert acme.submission_id != globex.submission_id  # their lifecycles differ (two records)
    assert acme.progress_key == store.keys.progress(batch_key("acme", "same"))
    assert acme.progress_key != globex.progress_key
    for tenant in ("acme", "globex"):
        record = await store.get(batch_key(tenant, "same"))
        assert record is not None and record.state is State.SUBMITTED and record.tenant == tenant
    assert await store.get(batch_key(None, "same")) is None  # the default tenant has no such batch


async def test_small_batches_launch_while_the_replicas_have_room(kit: Kit) -> None:
    tracker, store, jobs = kit
    for i in range(10):
        await queue(store, f"s{i}", 3, age=100 - i)
    await tracker.launch()
    # one replica from zero: 40 requests; batches of 3 lines -> 13 would fit, 10 are queued: all go
    assert len(jobs.submitted) == 10
    for i in range(10):
        await queue(store, f"w{i}", 8, age=50 - i)
    await tracker.launch()
    # 30 requests at the replica; one more 8-line batch makes 38, a second 46 > 40
    assert jobs.batches()[10:] == ["w0"]
    assert await store.count(State.QUEUED) == 9
    assert tracker.metrics.admission_waiting.labels(model="a")._value.get() == 1


async def test_tenants_take_turns_at_the_engines_room(kit: Kit) -> None:
    """Tenant many queued eight batches before tenant lone's one: with room for five, lone's is among
    them (the code before launched many's first five: the queue's order). Weights share the turns."""
    tracker, store, jobs = kit
    for i in range(8):
        await queue(store, f"many{i}", 8, age=100 - i, tenant="many")
    await queue(store, "lone0", 8, age=1, tenant="lone")
    await tracker.launch()  # room for 5 x 8 requests
    assert jobs.batches() == ["many0", "lone0", "many1", "many2", "many3"]
    # the room is taken; a tenant with nothing at the engines still gets its first batch in (the
    # replicas share between tenants), its second and many's next wait
    await queue(store, "late0", 8, age=0.5, tenant="late")
    await queue(store, "late1", 8, age=0.4, tenant="late")
    await tracker.launch()
    assert jobs.batches()[5:] == ["late0"]


async def test_a_garbled_priority_in_redis_does_not_stop_the_tenants_turns(kit: Kit) -> None:
    tracker, store, jobs = kit
    await queue(store, "many0", 8, age=10, tenant="many")
    await queue(store, "lone0", 8, age=5, tenant="lone")
    await store.client.hset(store.keys.batch(batch_key("many", "many0")), "priority", "not-a-number")
    await tracker.launch()
    assert sorted(jobs.batches()) == ["lone0", "many0"]


@pytest.mark.parametrize(
    ("field", "garbled"),
    [("state", "not-a-state"), ("version", "1e9"), ("state", b"\xff\xfe"), ("request", b"\xc3(")],
)
async def test_one_garbled_record_in_redis_does_not_stop_the_launch_or_the_checks_of_the_others(
    kit: Kit, field: str, garbled: str | bytes
) -> None:
    """Before, the batch records were read all or nothing: a state or version that does not parse, or
    a byte that is not UTF-8 anywhere in a hash, failed every tick's reads (no launch, no check) for
    as long as the hash stayed."""
    tracker, store, jobs = kit
    for name in ("first", "bad", "second"):
        await queue(store, name, 2)
    await tracker.launch()  # all three in flight
    assert sorted(jobs.batches()) == ["bad", "first", "second"]
    await store.client.hset(store.keys.batch(batch_key("default", "bad")), field, garbled)
    await queue(store, "third", 2)
    await tracker.tick()  # checks the ones in flight, then launches third
    assert sorted(jobs.batches()) == ["bad", "first", "second", "third"]
    await tracker.tick()  # checks third too
    for name in ("first", "second", "third"):
        record = await store.get(batch_key("default", name))
        assert record is not None and record.state is State.RUNNING  # checked: Ray said running


async def test_a_tenants_weight_gives_it_more_turns_at_launch(kit: Kit) -> None:
    tracker, store, jobs = kit
    tracker.settings = tracker.settings.model_copy(
        update={"tenants": tracker.settings.tenants.model_copy(update={"weights": {"gold": 3.0}})}
    )
    for i in range(6):
        await queue(store, f"plain{i}", 8, age=100 - i, tenant="plain")
    for i in range(6):
        await queue(store, f"gold{i}", 8, age=50 - i, tenant="gold")
    await tracker.launch()  # room for five: gold takes three turns for plain's one
    assert sorted(jobs.batches()) == sorted(["plain0", "gold0", "gold1", "gold2", "plain1"])


async def test_finished_work_and_new_replicas_make_room(kit: tuple[Tracker, StateStore, Jobs]) -> None:
    tracker, store, jobs = kit
    for i in range(8):
        await queue(store, f"b{i}", 8, age=100 - i)
    await tracker.launch()
    assert jobs.batches() == [f"b{i}" for i in range(5)]  # 5 x 8 = 40
    # b0 answered everything it had: its window leaves the replicas
    progress: dict[FieldT, EncodableT] = {"total": "8", "completed": "7", "failed": "1"}
    await store.client.hset(store.keys.progress(batch_key(None, "b0")), mapping=progress)
    await tracker.launch()
    assert jobs.batches()[5:] == ["b5"]
    tracker.launcher.engine_replicas = {
        "a": 2
    }  # the autoscaler added a replica (the engines' figures say so)
    await tracker.launch()
    assert jobs.batches()[6:] == ["b6", "b7"]
    assert tracker.metrics.admission_capacity.labels(model="a")._value.get() == 80


async def test_a_big_batch_counts_its_window_and_an_urgent_one_is_not_held_back(
    kit: tuple[Tracker, StateStore, Jobs],
) -> None:
    tracker, store, jobs = kit
    for i in range(6):
        await queue(store, f"big{i}", 1000, age=100 - i)  # each has 8 requests at the replicas at once
    await tracker.launch()
    assert jobs.batches() == [f"big{i}" for i in range(5)]
    await queue(store, "urgent", 8, priority=9)
    await queue(store, "other-model", 8, model="b", age=1)
    await tracker.launch()
    # p9 competes only with work of its rank; model b has its own replicas; big5 still waits
    assert sorted(jobs.batches()[5:]) == ["other-model", "urgent"]
    assert [
        r.batch_id for r in await store.get_many([batch_key(None, "big5")]) if r and r.state is State.QUEUED
    ] == ["big5"]


async def test_batches_that_run_as_ray_jobs_wait_for_a_job_slot(kit: Kit) -> None:
    tracker, store, jobs = kit
    opts = tracker.settings.dispatcher.model_copy(update={"max_jobs_in_flight": 2})
    settings = tracker.settings.model_copy(update={"dispatcher": opts})
    tracker.launcher.ctx = dataclasses.replace(tracker.ctx, settings=settings)
    big = SHORT_PATH_MAX_LINES + 1  # a Ray job each; a window of 8 requests at the replicas
    for i in range(4):
        await queue(store, f"job{i}", big, age=100 - i)
    for i in range(2):
        await queue(store, f"small{i}", 3, age=50 - i)
    await tracker.launch()
    # two jobs; the small batches behind the waiting jobs go on (the short path needs no slot)
    assert jobs.batches() == ["job0", "job1", "small0", "small1"]
    await tracker.launch()
    assert len(jobs.submitted) == 4
    # job0's driver ended (its batch is finalizing): its slot goes to the oldest waiting job
    key = batch_key(None, "job0")
    record = await store.get(key)
    assert record is not None and record.get("via") == "ray_job"
    assert (await store.transition(key, State.FINALIZING, expected_version=record.version)).ok
    await tracker.launch()
    assert jobs.batches()[4:] == ["job2"]
    assert await store.count(State.QUEUED) == 1


async def test_a_job_whose_submit_waits_for_ray_holds_its_slot(kit: Kit) -> None:
    """Ray is down: a job-path batch's submit fails (retriable) and it stays submitted, unconfirmed.
    It holds its job slot meanwhile, so the next job-path batch waits in queued instead of piling up
    drivers for when Ray is back; short-path batches go on."""
    tracker, store, jobs = kit
    opts = tracker.settings.dispatcher.model_copy(update={"max_jobs_in_flight": 1})
    settings = tracker.settings.model_copy(update={"dispatcher": opts})
    tracker.launcher.ctx = dataclasses.replace(tracker.ctx, settings=settings)

    big = SHORT_PATH_MAX_LINES + 1
    await queue(store, "job0", big, age=100)
    await queue(store, "job1", big, age=90)
    await queue(store, "small0", 3, age=80)
    jobs.down = RayUnavailable("the Jobs API does not answer")
    await tracker.launch()
    record = await store.get(batch_key(None, "job0"))
    assert record is not None and record.state is State.SUBMITTED and record.get("confirmed") == "0"
    jobs.down = None
    await tracker.launch()
    await tracker.launch()
    assert jobs.batches() == ["small0"]  # job1 waits for job0's slot
    assert await store.count(State.QUEUED) == 1


async def test_an_outage_met_by_every_launch_is_logged_once_not_per_tick(
    kit: Kit,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """S3 (or Ray) is down: each tick's launch meets it again (a runner batch's session cannot be
    minted). It is counted every time and logged once, not once per tick."""
    import logging

    from llmbatch.dispatcher.errors import StorageUnavailable

    tracker, store, jobs = kit
    for i in range(4):
        await queue(store, f"small{i}", 3, age=100 - i)
    jobs.down = StorageUnavailable("S3 STS at http://127.0.0.1:9 did not answer")
    counted = tracker.metrics.transient_errors.labels(component="s3")
    before = counted._value.get()
    with caplog.at_level(logging.WARNING, logger="llmbatch.dispatcher.runs.tracker"):
        for _ in range(4):
            await tracker.launch()
    said = [r.getMessage() for r in caplog.records if "postponed" in r.getMessage()]
    assert said == ["launch postponed (repeats are not logged for a while)"]
    assert counted._value.get() - before == 4
    assert await store.count(State.SUBMITTED) == 4  # each tick still moved one batch on


async def test_without_shared_engines_max_in_flight_alone_decides(
    kit: tuple[Tracker, StateStore, Jobs],
) -> None:
    tracker, store, jobs = kit
    tracker.opts = tracker.opts.model_copy(update={"shared_engines": False})
    for i in range(6):
        await queue(store, f"own{i}", 1000, age=100 - i)
    await tracker.launch()
    assert len(jobs.submitted) == 4  # an engine each: the default limit of 4


async def test_a_python_that_exits_2_is_retried_not_taken_for_an_invalid_spec(
    redis_settings: RedisSettings, ray_settings: RaySettings, tmp_path: Path
) -> None:
    """Exit 2 is Python's own usage error (here: an interpreter that rejects ``-P``), a problem of the
    cluster: the attempt is retried instead of failing the batch as an invalid spec (real Ray job)."""
    from llmbatch.dispatcher.backends.ray_backend import RayJobsBackend

    python = tmp_path / "old-python"
    python.write_text("#!/bin/sh\necho 'Unknown option: -P' >&2\nexit 2\n")
    python.chmod(0o755)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings = DispatcherSettings(
        _env_file=None,
        redis=RedisSettings(url=redis_settings.url, password=SecretStr(""), key_prefix=prefix),
        ray=ray_settings,
        job=JobOptions(python=str(python), ship_modules=False),
        dispatcher=DispatcherOptions(shared_engines=False),
        engines=EngineRegistry(models={"a": ENTRY}),
    )
    store = StateStore.from_url(redis_settings.url, keys=Keys(prefix), finished_ttl_s=3600, dedupe_ttl_s=3600)
    backend = RayJobsBackend(settings)
    unused: Any = None  # nothing here reads results or publishes
    tracker = Tracker(
        RunContext(settings, store, backend, results=unused, producer=unused, metrics=Metrics())
    )
    await tracker.leases.step()  # a lone replica: it leads and holds every shard
    batch_id = f"py2-{uuid.uuid4().hex[:8]}"
    try:
        await queue(store, batch_id, 2)
        await tracker.launch()

        async def retried() -> BatchRecord | None:
            await tracker.poll_in_flight()
            record = await store.get(batch_key(None, batch_id))
            return record if record is not None and record.state not in states.IN_FLIGHT else None

        record = await wait_for(retried, 180, interval=1, what="the failed attempt to be handled")
        assert record.state is State.QUEUED and record.attempts_made == 1, record.fields
        assert record.get("last_error_code") != "input_invalid", record.fields
        assert "exit code 2" in (record.get("last_error_message") or ""), record.fields
    finally:
        await drop(store)
        await backend.close()


async def test_a_batch_id_used_again_after_its_record_is_gone_is_a_new_lifecycle(
    redis_settings: RedisSettings, ray_settings: RaySettings, tmp_path: Path
) -> None:
    """Batch X ran; its record expired (here: a second Redis namespace that never knew X). X sent again
    is a new lifecycle: another Ray submission id and results prefix, so Ray's "already exists" cannot
    hand it the old job's outcome and it never reads the old shards. The finished job of the first
    lifecycle is deleted from the head once its terminal event is out (a running one cannot be)."""
    from llmbatch.dispatcher.backends.ray_backend import RayJobsBackend

    python = tmp_path / "slow-python"
    python.write_text("#!/bin/sh\nexec sleep 8\n")
    python.chmod(0o755)

    def settings_for(prefix: str) -> DispatcherSettings:
        return DispatcherSettings(
            _env_file=None,
            redis=RedisSettings(url=redis_settings.url, password=SecretStr(""), key_prefix=prefix),
            ray=ray_settings,
            job=JobOptions(python=str(python), ship_modules=False),
            dispatcher=DispatcherOptions(shared_engines=False),
            engines=EngineRegistry(models={"a": ENTRY}),
        )

    def setup(settings: DispatcherSettings) -> tuple[StateStore, Tracker]:
        keys = Keys(settings.redis.key_prefix)
        store = StateStore.from_url(redis_settings.url, keys=keys, finished_ttl_s=3600, dedupe_ttl_s=3600)
        unused: Any = None  # nothing here reads results or publishes
        tracker = Tracker(
            RunContext(settings, store, backend, results=unused, producer=unused, metrics=Metrics())
        )
        return store, tracker

    settings1 = settings_for(f"t{uuid.uuid4().hex[:8]}")
    settings2 = settings_for(f"t{uuid.uuid4().hex[:8]}")
    backend = RayJobsBackend(settings1)
    batch_id = f"again-{uuid.uuid4().hex[:8]}"
    store1, tracker1 = setup(settings1)
    store2, tracker2 = setup(settings2)
    try:
        await queue(store1, batch_id, 2, offset=10)
        await tracker1.launch()
        first = await store1.get(batch_key(None, batch_id))
        assert first is not None and first.state in states.IN_FLIGHT, first
        sid1 = first.submission_id or ""
        assert sid1.startswith(batch_id + "-") and sid1.endswith("-a1")
        with pytest.raises(RayUnavailable):  # still running: Ray keeps it, the cleanup asks again later
            await backend.delete(sid1)

        await queue(store2, batch_id, 2, offset=99)  # the same id, sent again: another record
        await tracker2.launch()
        second = await store2.get(batch_key(None, batch_id))
        assert second is not None and second.state in states.IN_FLIGHT, second
        sid2 = second.submission_id or ""
        assert sid2.startswith(batch_id + "-") and sid2 != sid1
        # and its events are its own: a consumer deduping by ce_id keeps both lifecycles' events
        assert build_accepted(first, source="urn:t").id != build_accepted(second, source="urn:t").id
        done = Outcome(State.COMPLETED, NOW, counts={"total": 2, "completed": 2})
        assert (
            terminal_fields(first, done)["terminal_event_id"]
            != terminal_fields(second, done)["terminal_event_id"]
        )
        prefix1 = results_prefix(settings1, first)
        prefix2 = results_prefix(settings2, second)
        assert prefix1 != prefix2
        assert prefix1.startswith(f"s3://{settings1.s3.results_bucket}/default/{batch_id}/")
        assert (await backend.status(sid2)).state is not JobState.NOT_FOUND

        async def finished(sid: str) -> bool:
            return (await backend.status(sid)).state.is_terminal

        await wait_for(lambda: finished(sid1), 120, interval=1, what="the first lifecycle's job to end")
        tracker1.job_cleanup.settle_s = 0
        await tracker1.forget_jobs(first)  # what the publisher does after the terminal event
        assert await tracker1.job_cleanup.retry_due() == 1  # what the leader's tick does once it settled
        assert (await backend.status(sid1)).state is JobState.NOT_FOUND
        await wait_for(lambda: finished(sid2), 120, interval=1, what="the second lifecycle's job to end")
        assert await backend.delete(sid2) and not await backend.delete(sid2)
    finally:
        await drop(store1)
        await drop(store2)
        await backend.close()


@dataclass
class FlakyRay:
    """A job Ray calls RUNNING until stopped; its stop API fails while ``down``."""

    down: bool = False
    stops: int = 0
    state: JobState = JobState.RUNNING
    submitted: list[JobSpec] = field(default_factory=list)

    async def submit(self, spec: JobSpec) -> SubmitResult:
        self.submitted.append(spec)
        self.state = JobState.RUNNING
        return SubmitResult(spec.submission_id, False)

    async def status(self, submission_id: str) -> JobInfo:
        return JobInfo(self.state, start_time=NOW)

    async def stop(self, submission_id: str) -> bool:
        if self.down:
            raise RayUnavailable("the Ray head does not answer")
        self.stops += 1
        return True

    async def delete(self, submission_id: str) -> bool:
        return False

    async def close(self) -> None:
        return None


async def test_a_hung_attempt_is_stopped_and_the_next_starts_only_once_it_ended(
    redis_settings: RedisSettings,
) -> None:
    """Silent past heartbeat_timeout_s while Ray says RUNNING: a stop that fails is tried again (no new
    attempt meanwhile), and once requested the next attempt waits until Ray says the old one ended."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings = DispatcherSettings(
        _env_file=None,
        redis=RedisSettings(url=redis_settings.url, password=SecretStr(""), key_prefix=prefix),
        dispatcher=DispatcherOptions(shared_engines=False),
        engines=EngineRegistry(models={"a": ENTRY}),
    )
    clock = [NOW]
    store = StateStore.from_url(redis_settings.url, keys=Keys(prefix), finished_ttl_s=3600, dedupe_ttl_s=3600)
    store.clock = lambda: clock[0]
    ray = FlakyRay()
    backend: Any = ray
    unused: Any = None  # nothing here reads results or publishes
    tracker = Tracker(
        RunContext(
            settings,
            store,
            backend,
            results=unused,
            producer=unused,
            metrics=Metrics(),
            clock=lambda: clock[0],
        )
    )
    await tracker.leases.step()  # a lone replica: it leads and holds every shard
    try:
        hung = batch_key(None, "hung")
        await queue(store, "hung", 2)
        await tracker.launch()
        await tracker.poll_in_flight()
        record = await store.get(hung)
        assert record is not None and record.state is State.RUNNING

        clock[0] += settings.dispatcher.heartbeat_timeout_s + 1  # silent since it started
        ray.down = True
        await tracker.poll_in_flight()
        record = await store.get(hung)
        assert record is not None
        assert record.state is State.RUNNING, record.fields
        assert record.attempts_made == 1

        ray.down = False
        await tracker.poll_in_flight()  # the stop goes through; Ray still says RUNNING
        await tracker.poll_in_flight()
        record = await store.get(hung)
        assert record is not None
        assert record.state is State.RUNNING and ray.stops == 1, record.fields
        assert len(ray.submitted) == 1

        ray.state = JobState.STOPPED  # the old attempt ended: now it is retried
        await tracker.poll_in_flight()
        record = await store.get(hung)
        assert record is not None
        assert record.state is State.QUEUED, record.fields
        assert record.get("last_error_code") == "heartbeat_expired"
    finally:
        await drop(store)


class NoResults:
    """The results bucket of a batch whose attempts left nothing."""

    async def read_manifest(self, output_prefix: str) -> None:
        return None

    async def list_shards(self, output_prefix: str) -> Shards:
        return Shards([], [])


async def test_a_cancel_of_a_queued_retry_finishes_it_at_the_next_tick(redis_settings: RedisSettings) -> None:
    """A batch waiting in the queue for its retry (attempt 1 failed, backoff running) is cancelled by
    the next tick, not when the queue reaches it."""
    from llmbatch.dispatcher.intake.cancel import apply_cancel
    from llmbatch.dispatcher.intake.commands import Cancel
    from llmbatch.schemas.batch import CancelRequest

    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings = DispatcherSettings(
        _env_file=None,
        redis=RedisSettings(url=redis_settings.url, password=SecretStr(""), key_prefix=prefix),
        dispatcher=DispatcherOptions(shared_engines=False),
        engines=EngineRegistry(models={"a": ENTRY}),
    )
    store = StateStore.from_url(redis_settings.url, keys=Keys(prefix), finished_ttl_s=3600, dedupe_ttl_s=3600)
    store.clock = lambda: NOW
    ray = FlakyRay()
    backend: Any = ray
    results: Any = NoResults()
    unused: Any = None  # nothing here publishes
    tracker = Tracker(
        RunContext(
            settings,
            store,
            backend,
            results=results,
            producer=unused,
            metrics=Metrics(),
            clock=lambda: NOW,
        )
    )
    await tracker.leases.step()  # a lone replica: it leads and holds every shard
    try:
        retrying = batch_key(None, "retrying")
        await queue(store, "retrying", 2)
        await tracker.launch()
        ray.state = JobState.FAILED  # attempt 1 fails: a retry waits in the queue (backoff)
        await tracker.poll_in_flight()
        record = await store.get(retrying)
        assert record is not None
        assert record.state is State.QUEUED and record.attempt == 1, record.fields

        request = CancelRequest(batch_id="retrying", reason="not needed any more")
        cancel = Cancel("retrying", request, ("test", "cancel-1"), None, origin(None, None, []))
        await apply_cancel(store, tracker.metrics, cancel, lambda: NOW)
        await tracker.expire_queued()  # the tick's step for queued batches
        record = await store.get(retrying)
        assert record is not None
        assert record.state is State.CANCELLED, record.fields
        assert len(ray.submitted) == 1  # no second attempt
    finally:
        await drop(store)


# --- indexes repair themselves: orphan entries never block the batches behind them -----------------


async def test_orphan_entries_are_removed_where_found_and_block_nothing_behind_them(kit: Kit) -> None:
    """Entries whose batch hash is gone (a lost write, a partial restore) at the head of the ready
    queue, filling the in-flight indexes (max_in_flight) and the due deadlines (more than a tick
    reads): before, each was skipped and never removed, so the real batches behind never moved."""
    tracker, store, jobs = kit
    client, keys = store.client, store.keys
    limit = tracker.opts.launch_limit
    await client.zadd(keys.ready, {f"default/ghost-{i}": -1e9 + i for i in range(50)})
    await client.zadd(keys.state_index(State.SUBMITTED), {f"default/busy-{i}": NOW for i in range(limit)})
    await client.zadd(keys.state_index(State.QUEUED), {f"default/gone-{i}": NOW for i in range(2500)})
    await client.zadd(keys.deadlines, {f"default/late-{i}": NOW - 10 for i in range(1200)})
    await queue(store, "real", 2)
    await queue(store, "real-late", 2)  # a retry waiting for its backoff: only its deadline ends it
    late_key = batch_key("default", "real-late")
    await client.hset(keys.batch(late_key), "deadline", repr(NOW - 5))
    await client.zrem(keys.ready, late_key)
    await client.zadd(keys.delayed, {late_key: NOW + 3600})
    await client.zadd(keys.deadlines, {late_key: NOW - 5})  # behind the 1,200 orphans
    for _ in range(10):  # ticks, each removing what it met (at most a page of each index)
        await tracker.expire_queued()
        await tracker.poll_in_flight()
        await tracker.launch()
        late = await store.get(late_key)
        if "real" in jobs.batches() and late is not None and late.state is State.EXPIRED:
            break
    assert jobs.batches() == ["real"]
    assert await client.zcard(keys.ready) == 0  # the ghosts went, and "real" was launched
    assert await store.in_flight_count() == 1  # only "real" holds a slot
    late = await store.get(late_key)
    assert late is not None and late.state is State.EXPIRED
    assert await client.zcard(keys.deadlines) == 0
    assert await tracker.sweep_orphans(page=1000) == 2500  # the queued count behind backpressure
    assert await store.queued_count() == 0
