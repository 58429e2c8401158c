"""``llmbatch jobs list | get | cancel`` (dispatcher.ops.jobs_cli) over an in-memory state store and a
Kafka producer that keeps what it is sent: the options it parses, the columns it shows, the cancel event
it publishes, and the one-line errors (with their exit codes) of every refusal. The same commands on
real Redis and Kafka: tests/integration/test_redis_acl.py and the e2e suite."""

from __future__ import annotations

import asyncio
import getpass
import socket
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from aiokafka.errors import KafkaConnectionError
from typer.testing import CliRunner, Result

from llmbatch.adapters.errors import WaitTimeout
from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.keys import BatchKey, Keys, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.ops import jobs_cli
from llmbatch.dispatcher.ops.common import EXIT_USAGE, OpsError
from llmbatch.dispatcher.ops.jobs import Counts, JobSummary
from llmbatch.dispatcher.ops.jobs_cli import _done, app, operator_name, parse_states
from llmbatch.producer.client import BatchClient
from llmbatch.schemas.batch import CancelRequest
from llmbatch.schemas.cloudevents import Envelope, decode
from llmbatch.schemas.events import BatchCancelled, EventType
from llmbatch.settings import KafkaSettings, LLMBatchSettings, RedisSettings, TopicSettings

pytestmark = pytest.mark.unit

NOW = datetime.now(UTC).timestamp()
runner = CliRunner()


# --- an in-memory Redis for the commands ---------------------------------------------------------------


class Zsets:
    """The one sorted-set read ``list_jobs`` makes (redis-py's reply with ``withscores=True``)."""

    def __init__(self) -> None:
        self.sets: dict[str, dict[str, float]] = {}

    async def zrevrangebyscore(
        self, key: str, high: str, low: str | float, *, start: int, num: int, withscores: bool
    ) -> list[tuple[str, float]]:
        assert high == "+inf" and withscores
        floor = float(low)
        rows = sorted(((m, s) for m, s in self.sets.get(key, {}).items() if s >= floor), key=lambda r: -r[1])
        return rows[start : start + num]


@dataclass
class MemoryStore:
    """What the jobs commands read of :class:`~llmbatch.dispatcher.state.store.StateStore`, over dicts."""

    keys: Keys = field(default_factory=lambda: Keys("p"))
    client: Zsets = field(default_factory=Zsets)
    records: dict[BatchKey, BatchRecord] = field(default_factory=dict)
    progress: dict[BatchKey, dict[str, str]] = field(default_factory=dict)
    opened: int = 0
    closed: int = 0

    def add(
        self,
        batch_id: str,
        state: State,
        *,
        ago_s: float,
        tenant: str | None = None,
        progress: dict[str, str] | None = None,
        **fields: str,
    ) -> BatchRecord:
        key, at = batch_key(tenant, batch_id), time.time() - ago_s
        data = {
            "state": state.value,
            "version": "5",
            "batch_id": batch_id,
            "state_at": repr(at),
            "model": "m",
            **({"tenant": tenant} if tenant else {}),
            **fields,
        }
        record = BatchRecord.from_hash(key, data)
        self.records[key] = record
        self.client.sets.setdefault(self.keys.state_index(state), {})[key] = at
        if progress:
            self.progress[key] = progress
        return record

    async def get(self, key: BatchKey) -> BatchRecord | None:
        return self.records.get(key)

    async def get_many(self, keys: list[BatchKey]) -> list[BatchRecord | None]:
        return [self.records.get(k) for k in keys]

    async def read_progress(self, key: BatchKey) -> dict[str, str]:
        return dict(self.progress.get(key, {}))

    async def close(self) -> None:
        self.closed += 1


@dataclass
class Sent:
    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


@dataclass
class Kafka:
    """aiokafka's producer as the SDK's publisher drives it: keeps each record sent."""

    sent: list[Sent] = field(default_factory=list)
    producers: int = 0
    refuse_start: bool = False

    def producer(self, **kwargs: Any) -> Any:
        kafka = self
        kafka.producers += 1

        class Producer:
            async def start(self) -> None:
                if kafka.refuse_start:
                    raise KafkaConnectionError("Unable to bootstrap from [('kafka.test', 9092)]")

            async def stop(self) -> None:
                return None

            async def send(
                self, topic: str, *, value: bytes, key: bytes, headers: list[tuple[str, bytes]]
            ) -> asyncio.Future[Any]:
                kafka.sent.append(Sent(topic, key, value, headers))
                done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                done.set_result(SimpleNamespace(topic=topic, partition=1, offset=len(kafka.sent) + 40))
                return done

        return Producer()


SETTINGS = LLMBatchSettings(
    redis=RedisSettings(key_prefix="p"),
    kafka=KafkaSettings(bootstrap_servers="kafka.test:9092", topics=TopicSettings(requests="t.req")),
)


@pytest.fixture
def store(clean_env: pytest.MonkeyPatch) -> MemoryStore:
    made = MemoryStore()

    async def open_store(settings: LLMBatchSettings) -> MemoryStore:
        assert settings is SETTINGS
        made.opened += 1
        return made

    clean_env.setattr(jobs_cli, "open_store", open_store)
    return made


@pytest.fixture
def kafka(monkeypatch: pytest.MonkeyPatch) -> Kafka:
    import aiokafka

    made = Kafka()
    monkeypatch.setattr(aiokafka, "AIOKafkaProducer", made.producer)
    return made


def jobs(*args: str) -> Result:
    return runner.invoke(app, list(args), obj=SETTINGS)


def error_line(result: Result, code: int = 1) -> str:
    """The one ``error:`` line of a failed command (exit ``code``, no traceback)."""
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    [line] = [ln for ln in lines if ln.startswith("error: ")]
    assert line == lines[-1]
    return line


def table_rows(text: str) -> list[list[str]]:
    """The body rows of a rich table, cell by cell."""
    return [
        [cell.strip() for cell in ln.strip("│").split("│")] for ln in text.splitlines() if ln.startswith("│")
    ]


# --- pure parts ----------------------------------------------------------------------------------------


def test_states_may_be_repeated_or_comma_separated_in_any_case() -> None:
    assert parse_states(["Running, queued", "failed,,", " "]) == [State.RUNNING, State.QUEUED, State.FAILED]
    assert parse_states(None) == [] and parse_states([]) == []
    with pytest.raises(OpsError) as caught:
        parse_states(["running,finished"])
    assert caught.value.code == EXIT_USAGE
    assert str(caught.value).startswith("--state 'finished': unknown state; choose from ")
    assert all(s.value in str(caught.value) for s in State)


@pytest.mark.parametrize(
    ("counts", "shown"),
    [
        (Counts(), "-"),
        (Counts(total=10), "0/10"),
        (Counts(total=10, completed=3, failed=1), "4/10 (1 failed)"),
        (Counts(completed=2), "2/?"),
        (Counts(failed=2), "2/? (2 failed)"),
    ],
)
def test_the_done_column(counts: Counts, shown: str) -> None:
    summary = JobSummary(
        batch_id="b",
        state=State.RUNNING,
        state_at=None,
        tenant="default",
        model="m",
        attempt=1,
        counts=counts,
    )
    assert _done(summary) == shown


def test_the_operator_is_user_at_host_with_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(getpass, "getuser", lambda: "ada")
    monkeypatch.setattr(socket, "gethostname", lambda: "box")
    assert operator_name() == "ada@box"

    def no_user() -> str:
        raise KeyError("uid 1234 has no passwd entry")

    monkeypatch.setattr(getpass, "getuser", no_user)
    monkeypatch.setattr(socket, "gethostname", lambda: "")
    assert operator_name() == "unknown@localhost"

    def no_home() -> str:
        raise OSError("no USER, LOGNAME or passwd entry")

    monkeypatch.setattr(getpass, "getuser", no_home)
    assert operator_name() == "unknown@localhost"


# --- list -------------------------------------------------------------------------------------------------


def test_list_shows_the_chosen_states_newest_first(store: MemoryStore) -> None:
    store.add(
        "b-run",
        State.RUNNING,
        ago_s=3000,
        attempt="2",
        progress={"total": "10", "completed": "3", "failed": "1"},
    )
    store.add("b-q", State.QUEUED, ago_s=1200, tenant="acme")
    store.add("b-old", State.QUEUED, ago_s=4 * 3600)
    store.add("b-done", State.FAILED, ago_s=600, error_code="engine_error", error_message="boom")
    result = jobs("list", "--state", "running,QUEUED", "--json")
    assert result.exit_code == 0, result.output
    listed = orjson.loads(result.stdout)
    assert [j["batch_id"] for j in listed["jobs"]] == ["b-q", "b-run", "b-old"] and listed["count"] == 3
    assert listed["jobs"][1]["counts"] == {"total": 10, "completed": 3, "failed": 1}
    assert listed["jobs"][0]["tenant"] == "acme"

    result = jobs("list", "--since", "30m")
    assert result.exit_code == 0, result.output
    assert table_rows(result.stdout) == [
        ["b-done", "failed", "10m ago", "-", "-", "default", "m", "engine_error"],
        ["b-q", "queued", "20m ago", "-", "-", "acme", "m", ""],
    ]
    assert result.stderr.strip() == "2 batch(es)"
    assert [row[0] for row in table_rows(jobs("list", "--limit", "1").stdout)] == ["b-done"]
    [running] = table_rows(jobs("list", "-s", "running").stdout)
    assert running[:5] == ["b-run", "running", "50m ago", "2", "4/10 (1 failed)"]
    assert store.opened == store.closed == 4


def test_list_says_so_when_nothing_matches(store: MemoryStore) -> None:
    result = jobs("list", "--state", "expired")
    assert result.exit_code == 0 and result.stdout == "" and result.stderr.strip() == "no batches match"
    assert orjson.loads(jobs("list", "--json").stdout) == {"jobs": [], "count": 0}


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--state", "done"], "--state 'done': unknown state; choose from accepted, queued"),
        (["--since", "yesterday"], "--since 'yesterday': use a duration such as 30m"),
        (["--since", "2026-01-31T12:00:00"], "add a UTC offset"),
    ],
)
def test_list_refuses_a_bad_option_before_opening_redis(
    store: MemoryStore, args: list[str], fragment: str
) -> None:
    assert fragment in error_line(jobs("list", *args), EXIT_USAGE)
    assert store.opened == 0


# --- get ------------------------------------------------------------------------------------------------


def test_get_shows_one_batch_of_the_tenant_named(store: MemoryStore) -> None:
    store.add(
        "b1",
        State.RUNNING,
        ago_s=60,
        tenant="acme",
        attempt="2",
        cancel_requested="1",
        progress={"total": "5", "completed": "2"},
    )
    store.add("b1", State.QUEUED, ago_s=5)  # the default tenant's b1
    result = jobs("get", "b1", "--tenant", "acme", "--json")
    assert result.exit_code == 0, result.output
    detail = orjson.loads(result.stdout)
    assert detail["state"] == "running" and detail["tenant"] == "acme" and detail["cancel_requested"]
    assert [a["submission_id"] for a in detail["attempts"]] == ["b1-a1", "b1-a2"]
    assert detail["counts"] == {"total": 5, "completed": 2, "failed": 0}
    table = jobs("get", "b1", "--tenant", "acme").stdout
    assert "acme / m" in table and "b1-a2 (current)" in table
    assert any(ln.split() == ["cancel", "requested"] for ln in table.splitlines())
    assert orjson.loads(jobs("get", "b1", "--json").stdout)["state"] == "queued"
    assert store.opened == store.closed == 3


def test_get_shows_a_running_batchs_expected_end_once_and_none_for_an_ended_one(store: MemoryStore) -> None:
    now = time.time()
    # 25 of 100 answered in the 100 s since it started: 300 s more, 200 s left
    store.add(
        "late",
        State.RUNNING,
        ago_s=100,
        started_at=repr(now - 100),
        deadline=repr(now + 200),
        progress={"total": "100", "completed": "25"},
    )
    store.add("done", State.COMPLETED, ago_s=5, started_at=repr(now - 100), deadline=repr(now + 200))
    table = jobs("get", "late").stdout
    ends = [ln for ln in table.splitlines() if ln.split()[:2] == ["expected", "end"]]
    assert len(ends) == 1 and "AT RISK" in ends[0], table
    assert not any(ln.split()[:2] == ["expected", "end"] for ln in jobs("get", "done").stdout.splitlines())


def test_get_of_an_unknown_batch_names_it_the_prefix_and_how_long_batches_are_kept(
    store: MemoryStore,
) -> None:
    store.add("b1", State.RUNNING, ago_s=60, tenant="acme")
    line = error_line(jobs("get", "b1"))
    assert "no batch 'b1' of tenant 'default' in Redis at this key prefix ('p')" in line
    assert "LLMBATCH_DISPATCHER__FINISHED_TTL_S" in line
    assert store.closed == 1


# --- cancel ---------------------------------------------------------------------------------------------


def test_cancel_publishes_the_event_on_the_requests_topic(
    store: MemoryStore, kafka: Kafka, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_cli, "operator_name", lambda: "ada@box")
    store.add("b1", State.RUNNING, ago_s=60, tenant="acme")
    result = jobs("cancel", "b1", "--tenant", "acme", "--reason", "superseded", "--json")
    assert result.exit_code == 0, result.output
    [sent] = kafka.sent
    assert sent.topic == "t.req" and sent.key == b"b1"
    event = decode(sent.key, sent.value, sent.headers, expect={EventType.CANCEL_REQUESTED})
    assert event.data == CancelRequest(
        batch_id="b1", tenant="acme", reason="superseded", requested_by="ada@box"
    )
    shown = orjson.loads(result.stdout)
    assert shown["batch_id"] == "b1" and shown["state"] == "running" and shown["requested_by"] == "ada@box"
    assert shown["published"]["topic"] == "t.req"
    assert store.closed == 1


def test_cancel_refuses_an_unknown_batch_unless_forced(store: MemoryStore, kafka: Kafka) -> None:
    line = error_line(jobs("cancel", "b9"))
    assert "no batch 'b9' of tenant 'default' in Redis; pass --force" in line
    assert kafka.producers == 0 and kafka.sent == []
    result = jobs("cancel", "b9", "--force")
    assert result.exit_code == 0, result.output
    assert "cancel requested for b9 (was unknown)" in result.stderr
    [sent] = kafka.sent
    assert decode(sent.key, sent.value, sent.headers).data.batch_id == "b9"


@pytest.mark.parametrize("state", [State.COMPLETED, State.CANCELLED, State.DEAD_LETTERED])
def test_cancel_refuses_a_batch_that_ended(store: MemoryStore, kafka: Kafka, state: State) -> None:
    store.add("b1", state, ago_s=60)
    for args in (["cancel", "b1"], ["cancel", "b1", "--force"]):
        line = error_line(jobs(*args))
        assert line == f"error: batch 'b1' already ended {state.value}; nothing to cancel"
    assert kafka.producers == 0


def test_cancel_reports_kafka_unreachable_in_one_line(store: MemoryStore, kafka: Kafka) -> None:
    store.add("b1", State.RUNNING, ago_s=60)
    kafka.refuse_start = True
    line = error_line(jobs("cancel", "b1"))
    assert line.startswith("error: Kafka at kafka.test:9092 is unreachable (KafkaConnectionError: ")
    assert line.endswith("check LLMBATCH_KAFKA__BOOTSTRAP_SERVERS and that the broker is running")


def test_cancel_wait_follows_from_before_acceptance_and_times_out_with_exit_4(
    store: MemoryStore, kafka: Kafka, monkeypatch: pytest.MonkeyPatch
) -> None:
    accepted = NOW - 3600
    store.add("b1", State.RUNNING, ago_s=60, tenant="acme", accepted_at=repr(accepted))
    asked: list[dict[str, Any]] = []

    async def wait(
        self: BatchClient,
        batch_id: str,
        timeout: float | None = None,  # noqa: ASYNC109
        **kwargs: Any,
    ) -> Any:
        asked.append({"batch_id": batch_id, "timeout": timeout, **kwargs})
        at = datetime.fromtimestamp(NOW, UTC)
        return Envelope.new(
            BatchCancelled(batch_id=batch_id, tenant="acme", model="m", accepted_at=at, finished_at=at),
            source="urn:d",
            id="t-1",
        )

    monkeypatch.setattr(BatchClient, "wait", wait)
    result = jobs("cancel", "b1", "--tenant", "acme", "--wait", "--timeout", "9", "--json")
    assert result.exit_code == 0, result.output
    [call] = asked
    assert call["since"] == datetime.fromtimestamp(accepted, UTC) - timedelta(minutes=5)
    assert (call["batch_id"], call["timeout"], call["tenant"]) == ("b1", 9.0, "acme")
    assert orjson.loads(result.stdout)["terminal"] == {
        "type": EventType.CANCELLED.value,
        "id": "t-1",
        "status": "cancelled",
    }

    async def late(
        self: BatchClient,
        batch_id: str,
        timeout: float | None = None,  # noqa: ASYNC109
        **kwargs: Any,
    ) -> Any:
        raise WaitTimeout(f"batch {batch_id} did not finish within {timeout:g}s")

    monkeypatch.setattr(BatchClient, "wait", late)
    line = error_line(jobs("cancel", "b1", "--tenant", "acme", "--wait", "--timeout", "9"), 4)
    assert line == "error: batch b1 did not finish within 9s"
    assert len(kafka.sent) == 2  # the cancel was published all the same
