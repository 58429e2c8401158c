"""Bytes stored per tenant on a real MinIO: the tracker leader's gauge
(``llmbatch_tenant_stored_bytes{tenant,bucket}``) and ``llmbatch usage --stored`` show what each tenant
keeps in each bucket, configured tenants by name and every other one as ``other``; a replica that does
not lead exports nothing, and one whose S3 is down keeps running."""

from __future__ import annotations

import asyncio
import io
import uuid

import orjson
import pytest
from minio import Minio
from typer.testing import CliRunner

from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.ops import usage_cli
from llmbatch.dispatcher.runs.stored_bytes import StoredBytes
from llmbatch.settings import LLMBatchSettings, S3Settings

pytestmark = pytest.mark.integration


class Lead:
    is_leader = True


def _put(minio: Minio, bucket: str, key: str, size: int) -> None:
    minio.put_object(bucket, key, io.BytesIO(b"x" * size), size)


def _gauge(metrics: Metrics) -> dict[tuple[str, str], float]:
    found = {}
    for family in metrics.registry.collect():
        if family.name == "llmbatch_tenant_stored_bytes":
            for sample in family.samples:
                found[(sample.labels["tenant"], sample.labels["bucket"])] = sample.value
    return found


async def test_the_leader_exports_each_tenants_bytes_per_bucket(
    node_minio: Minio, s3_settings: S3Settings, settings: LLMBatchSettings
) -> None:
    acme, globex, stranger = (f"{name}-{uuid.uuid4().hex[:6]}" for name in ("acme", "globex", "stranger"))
    _put(node_minio, s3_settings.input_bucket, f"{acme}/files/a.jsonl", 100)
    _put(node_minio, s3_settings.input_bucket, f"{acme}/inputs/b.jsonl", 50)
    _put(node_minio, s3_settings.results_bucket, f"{acme}/b1/0123456789/output-a1-00000.jsonl", 70)
    _put(node_minio, s3_settings.results_bucket, f"{globex}/b2/0123456789/manifest.json", 9)
    _put(node_minio, s3_settings.results_bucket, f"{stranger}/b3/0123456789/manifest.json", 11)
    metrics, stop = Metrics(), asyncio.Event()
    leader = Lead()
    stored = StoredBytes(s3_settings, metrics, leader, frozenset({acme, globex}), stop, every_s=0.05)
    task = asyncio.create_task(stored.run())
    try:
        while (acme, "results") not in _gauge(metrics):
            assert not task.done(), task
            await asyncio.sleep(0.05)
        gauge = _gauge(metrics)
        assert gauge[(acme, "input")] == 150 and gauge[(acme, "results")] == 70
        assert gauge[(globex, "results")] == 9 and (globex, "input") not in gauge
        assert gauge[("other", "results")] >= 11  # every tenant not configured, this test's stranger too
        assert not any(tenant == stranger for tenant, _ in gauge)
        leader.is_leader = False  # another replica leads: this one exports nothing
        while _gauge(metrics):
            assert not task.done(), task
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task

    cli_settings = settings.model_copy(update={"s3": s3_settings})
    shown = await asyncio.to_thread(
        CliRunner().invoke,
        usage_cli.app,
        ["--stored", "--json", "-t", acme, "-t", stranger],
        obj=cli_settings,
    )
    assert shown.exit_code == 0, shown.output
    assert orjson.loads(shown.stdout) == [
        {"tenant": acme, "input_bytes": 150, "results_bytes": 70},
        {"tenant": stranger, "input_bytes": 0, "results_bytes": 11},
    ]


async def test_an_s3_outage_is_survived_and_said_once(
    s3_settings: S3Settings, caplog: pytest.LogCaptureFixture
) -> None:
    down = s3_settings.model_copy(update={"endpoint": "http://127.0.0.1:9"})
    metrics, stop = Metrics(), asyncio.Event()
    stored = StoredBytes(down, metrics, Lead(), frozenset(), stop, every_s=0.01)
    task = asyncio.create_task(stored.run())
    try:
        while sum("cannot measure" in r.getMessage() for r in caplog.records) == 0:
            assert not task.done(), task
            await asyncio.sleep(0.05)
        measured = stored.measures
        while stored.measures < measured + 3:  # it keeps trying, and says so once
            assert not task.done(), task
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task
    assert sum("cannot measure" in r.getMessage() for r in caplog.records) == 1
