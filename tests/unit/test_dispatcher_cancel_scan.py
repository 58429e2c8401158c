"""Cancels applied ahead of a paused consumer (dispatcher.cancel_scan) over an in-memory log and state:
which cancels it applies and which it leaves to the consumer, what it reads (type headers only, from
where the last pass stopped, at most its budget per partition), how failures surface; and the
group-less consumer it reads with (dispatcher.side_consumer). The real-broker half is
tests/integration/test_dispatcher_consumer.py."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from aiokafka.errors import KafkaConnectionError, RequestTimedOutError
from aiokafka.structs import ConsumerRecord, TopicPartition

from llmbatch.dispatcher.domain import states
from llmbatch.dispatcher.domain.batch_record import BatchRecord, TransitionResult
from llmbatch.dispatcher.domain.keys import BatchKey, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import KafkaUnavailable, StateStoreUnavailable
from llmbatch.dispatcher.intake import cancel_scan
from llmbatch.dispatcher.intake import commands as intake
from llmbatch.dispatcher.intake.cancel_scan import CancelScanner
from llmbatch.dispatcher.intake.commands import IntakeRules
from llmbatch.dispatcher.kafka.side_consumer import side_consumer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.batch import CancelRequest
from llmbatch.settings import MIN_MESSAGE_BYTES, KafkaSettings, TopicSettings
from tests.support.dispatcher_kit import MODEL, SOURCE, batch_request, request_message

pytestmark = pytest.mark.unit

NOW = 1_790_000_000.0
TOPIC = "req"
P0, P1 = TopicPartition(TOPIC, 0), TopicPartition(TOPIC, 1)
RULES = IntakeRules(requests_topic=TOPIC, dlt_topic="req.dlt", group_id="g", served_models=frozenset({MODEL}))
KAFKA = KafkaSettings(bootstrap_servers="kafka.test:9092")

Message = tuple[bytes, bytes, list[tuple[str, bytes]]]
Record = Any  # aiokafka's ConsumerRecord[bytes, bytes] (aiokafka ships no types)


# --- an in-memory requests topic, read the way aiokafka's consumer reads -----------------------------


@dataclass
class Log:
    """The requests topic's partitions, and every read of every consumer made on it."""

    records: dict[TopicPartition, list[Record]] = field(default_factory=lambda: {P0: [], P1: []})
    fetch_size: int = 1000
    """Records one fetch returns per partition at most (a broker returns what fits its fetch size)."""
    consumers: list[SideConsumer] = field(default_factory=list)

    def append(self, tp: TopicPartition, *messages: Message) -> list[int]:
        offsets = []
        for key, value, headers in messages:
            offset = len(self.records[tp])
            self.records[tp].append(
                ConsumerRecord(
                    tp.topic,
                    tp.partition,
                    offset,
                    1_700_000_000_000,
                    0,
                    key,
                    value,
                    None,
                    len(key),
                    len(value),
                    headers,
                )
            )
            offsets.append(offset)
        return offsets

    def consumer(self, kafka: KafkaSettings) -> SideConsumer:
        made = SideConsumer(self, kafka)
        self.consumers.append(made)
        return made

    def read(self, tp: TopicPartition, consumer: int = -1) -> list[int]:
        """The offsets of ``tp`` one consumer (default: the last made) was handed."""
        return [offset for where, offset in self.consumers[consumer].handed if where == tp]


@dataclass
class SideConsumer:
    """What the scanner calls of aiokafka's ``AIOKafkaConsumer``, over a :class:`Log`."""

    log: Log
    kafka: KafkaSettings
    fail: dict[str, BaseException] = field(default_factory=dict)
    started: bool = False
    stopped: bool = False
    assigned: list[TopicPartition] = field(default_factory=list)
    positions: dict[TopicPartition, int] = field(default_factory=dict)
    handed: list[tuple[TopicPartition, int]] = field(default_factory=list)
    idle_fetches: int = 0
    """Fetches that found nothing (aiokafka waits out their ``timeout_ms``: a second per pass)."""

    def _maybe_fail(self, name: str) -> None:
        if name in self.fail:
            raise self.fail[name]

    async def start(self) -> None:
        self._maybe_fail("start")
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        assert self.started
        self._maybe_fail("end_offsets")
        return {tp: len(self.log.records[tp]) for tp in partitions}

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned = list(partitions)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        assert tp in self.assigned, "seek on a partition not assigned"
        self.positions[tp] = offset

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int, max_records: int
    ) -> dict[TopicPartition, list[Record]]:
        self._maybe_fail("getmany")
        out: dict[TopicPartition, list[Record]] = {}
        for tp in partitions:
            assert tp in self.assigned, "fetch from a partition not assigned"
            start = self.positions[tp]
            batch = self.log.records[tp][start : start + min(self.log.fetch_size, max_records)]
            if batch:
                out[tp] = batch
                self.positions[tp] = start + len(batch)
                self.handed.extend((tp, r.offset) for r in batch)
        if not out:
            self.idle_fetches += 1
        return out


# --- the state the scanner and apply_cancel read and write ---------------------------------------------


class MemoryStore:
    """The :class:`StateStore` calls of the scanner and of ``apply_cancel``, over dicts, with the checks
    the store's compare-and-set script makes (version, from-states, the lifecycle)."""

    def __init__(self, *records: BatchRecord) -> None:
        self.records: dict[BatchKey, BatchRecord] = {r.key: r for r in records}
        self.markers: set[tuple[str, str]] = set()
        self.due: list[BatchKey] = []
        self.fail: BaseException | None = None

    async def markers_exist(self, markers: list[tuple[str, str]]) -> list[bool]:
        return [m in self.markers for m in markers]

    async def states_many(self, keys: list[BatchKey]) -> list[State | None]:
        if self.fail is not None:
            raise self.fail
        return [r.state if (r := self.records.get(k)) else None for k in keys]

    async def get(self, key: BatchKey) -> BatchRecord | None:
        return self.records.get(key)

    async def transition(
        self,
        key: BatchKey,
        to: State,
        *,
        expected_version: int | None = None,
        from_states: list[State] | None = None,
        fields: dict[str, Any] | None = None,
    ) -> TransitionResult:
        record = self.records.get(key)
        if record is None:
            return TransitionResult(False, "missing", None, 0)
        if (expected_version is not None and expected_version != record.version) or (
            from_states is not None and record.state not in from_states
        ):
            return TransitionResult(False, "conflict", record.state, record.version)
        if to is not record.state:
            states.check_transition(record.state, to)
        version = record.version + 1
        merged = {
            **record.fields,
            **{k: str(v) for k, v in (fields or {}).items()},
            "state": to.value,
            "version": str(version),
        }
        self.records[key] = BatchRecord(key, to, version, merged)
        return TransitionResult(True, "ok", to, version)

    async def set_marker(self, marker: tuple[str, str]) -> None:
        self.markers.add(marker)

    async def due_now(self, key: BatchKey, now: float) -> None:
        self.due.append(key)


def stored(batch_id: str, state: State, *, attempt: int = 1, tenant: str | None = None) -> BatchRecord:
    fields = {
        "state": state.value,
        "version": "3",
        "attempt": str(attempt),
        "batch_id": batch_id,
        "total": "3",
        **({"tenant": tenant} if tenant else {}),
    }
    return BatchRecord.from_hash(batch_key(tenant, batch_id), fields)


def cancel(
    batch_id: str,
    event_id: str,
    *,
    tenant: str = "default",
    reason: str | None = "superseded",
) -> Message:
    request = CancelRequest(batch_id=batch_id, tenant=tenant, reason=reason, requested_by="ops@host")
    return request_message(request, event_id=event_id)


def request(batch_id: str) -> Message:
    return request_message(batch_request(batch_id))


@dataclass
class Rig:
    log: Log
    store: MemoryStore
    metrics: Metrics
    scanner: CancelScanner

    def counted(self, outcome: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "llmbatch_dispatcher_events_processed_total", {"outcome": outcome}
        )
        return value or 0.0


@pytest.fixture
def rig(clean_env: pytest.MonkeyPatch) -> Rig:
    log, store, metrics = Log(), MemoryStore(), Metrics()
    clean_env.setattr(cancel_scan, "side_consumer", log.consumer)
    settings = DispatcherSettings(_env_file=None, kafka=KAFKA)
    scanner = CancelScanner(settings, cast(StateStore, store), RULES, metrics, clock=lambda: NOW)
    return Rig(log, store, metrics, scanner)


# --- which cancels it applies ---------------------------------------------------------------------------


async def test_a_cancel_behind_the_backlog_flags_a_known_running_batch(rig: Rig) -> None:
    rig.store.records[BatchKey("b-run")] = stored("b-run", State.RUNNING)
    rig.log.append(P0, request("b-new"), request("b-other"), cancel("b-run", "c-1"))
    assert await rig.scanner.scan({P0: 0}) == 1
    record = rig.store.records[BatchKey("b-run")]
    # the tracker stops the job: the batch stays running, flagged, with who asked and why
    assert record.state is State.RUNNING and record.version == 4
    assert record.flag("cancel_requested") and record.get("cancel_reason") == "superseded"
    assert record.get("cancel_requested_by") == "ops@host"
    # the consumer meets the record later and skips it by this marker
    assert rig.store.markers == {(SOURCE, "c-1")}
    assert rig.counted("cancel_ahead") == 1
    [consumer] = rig.log.consumers
    assert consumer.kafka is KAFKA and consumer.stopped


async def test_a_cancel_of_a_batch_never_launched_cancels_it_at_once(rig: Rig) -> None:
    rig.store.records[BatchKey("b-q")] = stored("b-q", State.QUEUED, attempt=0)
    rig.store.records[BatchKey("acme/b-q")] = stored("b-q", State.RUNNING, tenant="acme")
    rig.log.append(P1, cancel("b-q", "c-2", tenant="acme"), cancel("b-q", "c-3"))
    assert await rig.scanner.scan({P1: 0}) == 2
    assert rig.store.records[BatchKey("b-q")].state is State.CANCELLED
    # the other tenant's batch of the same id is its own cancel's business
    acme = rig.store.records[BatchKey("acme/b-q")]
    assert acme.state is State.RUNNING and acme.flag("cancel_requested")


async def test_cancels_of_unknown_or_ended_batches_are_left_to_the_consumer(rig: Rig) -> None:
    done = stored("b-done", State.COMPLETED)
    rig.store.records[done.key] = done
    rig.store.records[BatchKey("b-run")] = stored("b-run", State.RUNNING)
    rig.log.append(
        P0,
        request("b-late"),
        cancel("b-late", "c-1"),  # its request is still in the backlog
        cancel("b-done", "c-2"),  # ended (a replay of it may be in the backlog)
        cancel("b-run", "c-3", tenant="acme"),  # acme has no batch b-run
    )
    assert await rig.scanner.scan({P0: 0}) == 0
    # no marker: the consumer applies each in its turn, in order
    assert rig.store.markers == set()
    assert rig.store.records[done.key] == done
    assert not rig.store.records[BatchKey("b-run")].flag("cancel_requested")
    assert rig.counted("cancel_ahead") == 0 and rig.counted("cancel_ignored") == 0


async def test_a_cancel_applied_by_an_earlier_pass_is_skipped_by_its_marker(rig: Rig) -> None:
    running = stored("b-run", State.RUNNING)
    rig.store.records[running.key] = running
    rig.store.markers.add((SOURCE, "c-1"))
    rig.log.append(P0, cancel("b-run", "c-1"))
    assert await rig.scanner.scan({P0: 0}) == 0
    assert rig.store.records[running.key] == running
    assert rig.counted("cancel_ahead") == 0 and rig.counted("duplicate_cancel") == 0


async def test_only_cancel_records_are_parsed_and_an_invalid_one_is_left_alone(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[int] = []
    real = intake.classify  # what the scanner parses a record with

    def spy(origin: Any, rules: IntakeRules, now: float) -> Any:
        parsed.append(origin.offset)
        return real(origin, rules, now)

    monkeypatch.setattr(cancel_scan, "classify_record", spy)
    running = stored("b-run", State.RUNNING)
    rig.store.records[running.key] = running
    key, _, headers = cancel("b-run", "c-bad")
    garbage_request = (b"b-x", b"{not json", request("b-x")[2])
    rig.log.append(
        P0,
        request("b-1"),  # 0
        garbage_request,  # 1: invalid, but not a cancel: the consumer dead-letters it
        (b"b-y", b"whatever", []),  # 2: no headers at all
        (key, b"{not json", headers),  # 3: an invalid cancel naming a running batch
        request("b-2"),  # 4
    )
    assert await rig.scanner.scan({P0: 0}) == 0
    assert parsed == [3]
    assert rig.store.records[running.key] == running and rig.store.markers == set()
    assert rig.log.read(P0) == [0, 1, 2, 3, 4]


# --- what it reads ----------------------------------------------------------------------------------------


async def test_a_pass_resumes_where_the_last_one_stopped(rig: Rig) -> None:
    rig.store.records[BatchKey("b-run")] = stored("b-run", State.RUNNING)
    rig.log.append(P0, request("b-1"), request("b-2"), request("b-3"))
    assert await rig.scanner.scan({P0: 1}) == 0
    assert rig.log.read(P0) == [1, 2]
    rig.log.append(P0, request("b-4"), cancel("b-run", "c-1"))
    assert await rig.scanner.scan({P0: 1}) == 1  # the consumer is still paused at 1
    assert rig.log.read(P0) == [3, 4]
    # nothing new: no partition assigned, nothing fetched, the consumer stopped all the same
    assert await rig.scanner.scan({P0: 1}) == 0
    last = rig.log.consumers[-1]
    assert last.assigned == [] and last.handed == [] and last.stopped
    # the consumer moved on past what was scanned: from its position
    rig.log.append(P0, request("b-5"), request("b-6"), request("b-7"))
    assert await rig.scanner.scan({P0: 6}) == 0
    assert rig.log.read(P0) == [6, 7]
    assert all(c.idle_fetches == 0 for c in rig.log.consumers)  # no pass waited for a fetch timeout


async def test_forget_scans_from_the_consumers_positions_again(rig: Rig) -> None:
    rig.log.append(P0, request("b-1"), request("b-2"))
    await rig.scanner.scan({P0: 0})
    rig.scanner.forget()
    await rig.scanner.scan({P0: 0})
    assert rig.log.read(P0) == [0, 1]


async def test_one_pass_reads_at_most_its_budget_of_each_partition(rig: Rig) -> None:
    rig.store.records[BatchKey("b-run")] = stored("b-run", State.RUNNING)
    rig.log.fetch_size = 2
    rig.scanner.max_records = 4
    rig.log.append(P0, *(request(f"b-{i}") for i in range(10)))
    rig.log.append(P1, *(request(f"c-{i}") for i in range(5)), cancel("b-run", "c-1"), request("c-6"))
    assert await rig.scanner.scan({P0: 0, P1: 0}) == 0
    assert rig.log.read(P0) == [0, 1, 2, 3] and rig.log.read(P1) == [0, 1, 2, 3]
    assert await rig.scanner.scan({P0: 0, P1: 0}) == 1
    assert rig.log.read(P0) == [4, 5, 6, 7] and rig.log.read(P1) == [4, 5, 6]
    assert await rig.scanner.scan({P0: 0, P1: 0}) == 0
    assert rig.log.read(P0) == [8, 9] and rig.log.read(P1) == []
    assert rig.store.records[BatchKey("b-run")].flag("cancel_requested")


# --- failures --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", ["start", "end_offsets", "getmany"])
@pytest.mark.parametrize(
    "error",
    [KafkaConnectionError("gone"), RequestTimedOutError(), TimeoutError()],
    ids=["connection", "request-timeout", "timeout"],
)
async def test_kafka_failures_are_a_retriable_broker_outage_and_the_consumer_is_stopped(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, step: str, error: BaseException
) -> None:
    def failing(kafka: KafkaSettings) -> SideConsumer:
        made = rig.log.consumer(kafka)
        made.fail[step] = error
        return made

    monkeypatch.setattr(cancel_scan, "side_consumer", failing)
    rig.log.append(P0, request("b-1"))
    with pytest.raises(KafkaUnavailable) as caught:
        await rig.scanner.scan({P0: 0})
    assert caught.value.retriable and caught.value.__cause__ is error
    assert rig.log.consumers[-1].stopped


async def test_a_state_store_failure_surfaces_as_is_and_the_consumer_is_stopped(rig: Rig) -> None:
    rig.store.fail = StateStoreUnavailable("redis: connection refused")
    rig.log.append(P0, request("b-1"), cancel("b-run", "c-1"))
    with pytest.raises(StateStoreUnavailable, match="connection refused"):
        await rig.scanner.scan({P0: 0})
    assert rig.log.consumers[-1].stopped
    # the cancel was not scanned past: the next pass tries it again
    rig.store.fail = None
    rig.store.records[BatchKey("b-run")] = stored("b-run", State.RUNNING)
    assert await rig.scanner.scan({P0: 0}) == 1
    assert rig.log.read(P0) == [1]


# --- the consumer it reads with (dispatcher.side_consumer) -----------------------------------------------


@pytest.mark.parametrize(
    ("max_message_bytes", "fetch_bytes"),
    [(8 << 20, 8 << 20), (MIN_MESSAGE_BYTES, 1 << 20), (1 << 20, 1 << 20)],
)
def test_side_consumers_read_committed_records_in_no_group_and_fetch_the_largest(
    monkeypatch: pytest.MonkeyPatch, max_message_bytes: int, fetch_bytes: int
) -> None:
    import aiokafka

    made: list[dict[str, Any]] = []
    real_signature = inspect.signature(aiokafka.AIOKafkaConsumer)

    def recorder(*topics: str, **kwargs: Any) -> str:
        real_signature.bind(*topics, **kwargs)  # every keyword is one aiokafka's consumer takes
        made.append(kwargs)
        return "consumer"

    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", recorder)
    kafka = KafkaSettings(
        bootstrap_servers="k1:9092,k2:9092",
        client_id="disp",
        topics=TopicSettings(max_message_bytes=max_message_bytes),
    )
    assert side_consumer(kafka) == "consumer"
    [kwargs] = made
    assert kwargs["group_id"] is None and kwargs["enable_auto_commit"] is False
    assert kwargs["isolation_level"] == "read_committed" and kwargs["auto_offset_reset"] == "earliest"
    assert kwargs["max_partition_fetch_bytes"] == fetch_bytes
    assert kwargs["bootstrap_servers"] == "k1:9092,k2:9092" and kwargs["client_id"] == "disp"


async def test_the_budget_holds_when_a_fetch_overshoots_it(rig: Rig) -> None:
    # fetches of 2 against a budget of 3: the second fetch hands over offsets 2 and 3, only 2 is read
    rig.store.records[BatchKey("b-run")] = stored("b-run", State.RUNNING)
    rig.log.fetch_size = 2
    rig.scanner.max_records = 3
    rig.log.append(P0, *(request(f"b-{i}") for i in range(3)), cancel("b-run", "c-1"))
    assert await rig.scanner.scan({P0: 0}) == 0
    assert not rig.store.records[BatchKey("b-run")].flag("cancel_requested")
    assert await rig.scanner.scan({P0: 0}) == 1  # the next pass starts at the record left over
    assert rig.log.read(P0) == [3]
