"""SDK behaviour that needs no services: validation before any I/O, fast failure when unreachable."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from llmbatch.producer import (
    BatchClient,
    BatchHandle,
    BrokerUnavailable,
    ClientOptions,
    InvalidInput,
    ProducerError,
    StorageError,
    SyncBatchClient,
    new_batch_id,
)
from llmbatch.producer.cli_events import describe
from llmbatch.producer.client import is_answer
from llmbatch.producer.results import result_uris
from llmbatch.schemas import (
    BatchCompleted,
    BatchRejected,
    BatchStatus,
    Endpoint,
    Envelope,
    Manifest,
    parse_manifest,
)
from llmbatch.schemas.errors import Reason
from llmbatch.schemas.events import RecordRef
from llmbatch.schemas.openai import ErrorObject
from llmbatch.settings import KafkaSettings, LLMBatchSettings, S3Settings

pytestmark = pytest.mark.unit


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def local_settings(kafka_port: int, s3_port: int) -> LLMBatchSettings:
    """Settings whose Kafka and S3 are these ports of 127.0.0.1."""
    return LLMBatchSettings(
        kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{kafka_port}", request_timeout_ms=2000),
        s3=S3Settings(endpoint=f"http://127.0.0.1:{s3_port}"),
    )


@pytest.fixture
def unreachable() -> LLMBatchSettings:
    """Settings whose Kafka and S3 ports have nothing listening."""
    return local_settings(closed_port(), closed_port())


@pytest.fixture
def listening() -> Iterator[tuple[LLMBatchSettings, list[socket.socket]]]:
    """Settings whose Kafka and S3 ports are listening sockets that never answer, to count connects."""
    socks = []
    for _ in range(2):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        socks.append(sock)
    kafka_port, s3_port = (sock.getsockname()[1] for sock in socks)
    yield local_settings(kafka_port, s3_port), socks
    for sock in socks:
        sock.close()


def connects(sock: socket.socket) -> int:
    """How many connections wait on a listening socket (accepted here, so each is counted once)."""
    count = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def line(custom_id: str = "a", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], **body},
    }


def client_for(settings: LLMBatchSettings) -> BatchClient:
    return BatchClient(
        settings, options=ClientOptions(connect_timeout_s=3, publish_timeout_s=3, source="urn:t")
    )


async def test_submit_validates_before_any_io(
    listening: tuple[LLMBatchSettings, list[socket.socket]], tmp_path: Path
) -> None:
    settings, socks = listening
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_text('{"custom_id": "a"}\n')
    cases: list[tuple[dict[str, Any], str]] = [
        ({"requests": [line()], "file": bad_file}, "exactly one"),
        ({}, "exactly one"),
        ({"requests": [line()], "endpoint": "/v1/moderations"}, "unknown endpoint"),
        ({"requests": [line()], "batch_id": "bad id"}, "batch_id"),
        ({"requests": [line()], "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"requests": [line()], "priority": 11}, "priority"),
        ({"requests": [line()], "tenant": "Bad"}, "tenant"),
        ({"requests": [line()], "completion_window": "9d"}, "completion_window"),
        ({"requests": [line()], "deadline": datetime.now(UTC) - timedelta(minutes=1)}, "deadline"),
        ({"requests": [line(), line()]}, "custom_id must be unique"),
        ({"requests": [line(temperature=3)]}, "body.temperature"),
        ({"file": bad_file}, "line 1"),
    ]
    async with client_for(settings) as client:
        for kwargs, hint in cases:
            with pytest.raises(InvalidInput) as info:
                await client.submit(model="m", **kwargs)
            assert hint in str(info.value), (kwargs, str(info.value))
            assert info.value.retriable is False
            # no connection was attempted, to Kafka or to S3
            assert [connects(sock) for sock in socks] == [0, 0], kwargs


async def test_deadline_error_carries_reason(unreachable: LLMBatchSettings) -> None:
    async with client_for(unreachable) as client:
        with pytest.raises(InvalidInput) as info:
            await client.submit([line()], model="m", deadline=datetime.now(UTC) - timedelta(seconds=1))
    assert info.value.errors[0].reason == Reason.DEADLINE_PASSED


async def test_unreachable_broker_fails_fast_and_is_retriable(unreachable: LLMBatchSettings) -> None:
    async with client_for(unreachable) as client:
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable) as info:
            await client.submit([line()], model="m")
        assert time.monotonic() - started < 10
    assert info.value.retriable is True
    assert "LLMBATCH_KAFKA__BOOTSTRAP_SERVERS" in str(info.value)
    assert unreachable.kafka.bootstrap_servers in str(info.value)


async def test_unreachable_broker_stops_file_submit_before_upload(
    unreachable: LLMBatchSettings, tmp_path: Path
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}\n'
    )
    async with client_for(unreachable) as client:
        with pytest.raises(BrokerUnavailable):  # not StorageError: Kafka is checked first
            await client.submit(file=path, model="m", endpoint=Endpoint.COMPLETIONS)


async def test_unreachable_storage_is_a_storage_error(unreachable: LLMBatchSettings) -> None:
    async with client_for(unreachable) as client:
        with pytest.raises(StorageError) as info:
            await client.manifest("b-1")
    assert info.value.retriable is True
    assert "unreachable" in str(info.value)


async def test_cancel_validates_batch_id(unreachable: LLMBatchSettings) -> None:
    async with client_for(unreachable) as client:
        with pytest.raises(InvalidInput, match="batch_id"):
            await client.cancel("no spaces allowed")


def test_new_batch_ids_are_valid_and_unique() -> None:
    ids = {new_batch_id() for _ in range(100)}
    assert len(ids) == 100
    Envelope.new(
        BatchCompleted(
            batch_id=ids.pop(),
            model="m",
            accepted_at=datetime.now(UTC),
            finished_at=datetime.now(UTC),
        ),
        source="s",
    )


def test_result_uris_from_every_source() -> None:
    t = datetime(2026, 1, 1, tzinfo=UTC)
    data = BatchCompleted(
        batch_id="b",
        model="m",
        accepted_at=t,
        finished_at=t,
        output_uris=["s3://res/default/b/output-00000.jsonl"],
        error_uris=["s3://res/default/b/error-00000.jsonl"],
    )
    env = Envelope.new(data, source="s")
    assert result_uris(env, errors=False) == ["s3://res/default/b/output-00000.jsonl"]
    assert result_uris(data, errors=True) == ["s3://res/default/b/error-00000.jsonl"]
    manifest: Manifest = parse_manifest(
        b'{"batch_id": "b", "attempt": 1, "status": "completed", "output_shards": '
        b'[{"uri": "s3://res/default/b/output-a1-00000.jsonl", "lines": 1}],'
        b'"timings": {"started_at": "2026-01-01T00:00:00Z", "finished_at": "2026-01-01T00:01:00Z"}}'
    )
    assert result_uris(manifest, errors=False) == ["s3://res/default/b/output-a1-00000.jsonl"]
    assert result_uris(manifest, errors=True) == []
    assert result_uris(["s3://a/b", "s3://a/c"], errors=False) == ["s3://a/b", "s3://a/c"]
    with pytest.raises(ProducerError, match="no result files"):
        result_uris(
            Envelope.new(data.model_copy(), source="s").model_copy(update={"data": manifest.usage}),
            errors=False,
        )


def test_detached_handle_refuses_to_follow() -> None:
    handle = BatchHandle(
        batch_id="b",
        tenant="default",
        model="m",
        endpoint=Endpoint.COMPLETIONS,
        submitted_at=datetime.now(UTC),
        event_id="e",
        request_count=1,
    )
    with pytest.raises(ProducerError, match="detached"):
        asyncio.run(handle.wait(1))


async def test_sync_client_refuses_a_running_loop(unreachable: LLMBatchSettings) -> None:
    with pytest.raises(ProducerError, match="event loop"):
        SyncBatchClient(unreachable)


def test_sync_client_validates_and_closes(unreachable: LLMBatchSettings) -> None:
    options = ClientOptions(connect_timeout_s=2, publish_timeout_s=2)
    with SyncBatchClient(unreachable, options=options) as client:
        with pytest.raises(InvalidInput, match=r"body\.temperature"):
            client.submit([line(temperature=9)], model="m")
        with pytest.raises(BrokerUnavailable):
            client.cancel("b-1")


def _rejection(request_id: str, status: BatchStatus | None) -> Envelope[BatchRejected]:
    data = BatchRejected(
        batch_id="b",
        request_id=request_id,
        error=ErrorObject(code="model_not_found", message="m", param="model"),
        batch_status=status,
        dead_letter=RecordRef(topic="t.dlt", partition=0, offset=5),
        rejected_at=datetime.now(UTC),
    )
    return Envelope.new(data, source="urn:d")


def test_a_wait_ends_at_its_own_rejection_or_a_final_one() -> None:
    mine, final_other = (
        _rejection("e-mine", BatchStatus.DEAD_LETTERED),
        _rejection("e-x", BatchStatus.DEAD_LETTERED),
    )
    live_other = _rejection("e-x", BatchStatus.RUNNING)
    assert is_answer(mine, "e-mine") and not is_answer(final_other, "e-mine")
    assert is_answer(final_other) and not is_answer(live_other)
    assert is_answer(_rejection("e-mine", BatchStatus.RUNNING), "e-mine")
    done = Envelope.new(
        BatchCompleted(batch_id="b", model="m", accepted_at=datetime.now(UTC), finished_at=datetime.now(UTC)),
        source="urn:d",
    )
    assert is_answer(done) and is_answer(done, "e-mine")
    text = describe(mine)
    assert "rejected" in text and "model_not_found" in text and "t.dlt/0@5" in text
