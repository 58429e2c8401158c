"""Benchmark: what retention costs where a batch's end is published, and how fast the collector deletes.

Starts its own Redis and MinIO (a private folder, stopped by PID at the end), then, side by side in
one run:

- ``mark_published``: the script that marks a batch's terminal event published, for ``--marks`` ended
  batches kept ``retention_s`` (it dates them in the retention index) and as many without (what it did
  before retention: nothing more), one call at a time; microseconds a call and the ratio;
- ``collect``: ``--batches`` expired lifecycles (each its state hash and three result objects: two
  shards and a manifest), removed by one collector, then as many again by two at once; lifecycles and
  objects removed a second, and the ratio of two collectors to one.

    .venv/bin/python bench/bench_retention.py [--batches 500] [--marks 2000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llmbatch.adapters.storage import ensure_buckets, make_client  # noqa: E402
from llmbatch.api.retention.collector import Collector, Report  # noqa: E402
from llmbatch.api.store.state import RedisStateReader  # noqa: E402
from llmbatch.api.store.storage import MinioObjectStore  # noqa: E402
from llmbatch.dispatcher.domain.batch_record import IntakeItem  # noqa: E402
from llmbatch.dispatcher.domain.keys import BatchKey, Keys  # noqa: E402
from llmbatch.dispatcher.domain.retention import batch_member  # noqa: E402
from llmbatch.dispatcher.domain.states import State  # noqa: E402
from llmbatch.dispatcher.state.retention import RetentionIndex  # noqa: E402
from llmbatch.dispatcher.state.store import StateStore  # noqa: E402
from llmbatch.schemas.job import output_prefix  # noqa: E402
from llmbatch.settings import S3Settings  # noqa: E402
from llmbatch.settings.retention import RetentionSettings  # noqa: E402
from llmbatch.stack import services  # noqa: E402
from llmbatch.stack.process import stop_tree  # noqa: E402

TENANT = "acme"
LIFECYCLE = "0123456789"


async def ended(store: StateStore, n: int, *, keep: bool) -> BatchKey:
    """A batch taken in and failed (its terminal event id recorded), not yet marked published."""
    key = BatchKey(f"{TENANT}/m{n:06d}-{uuid.uuid4().hex[:6]}")
    fields = {"model": "m", "attempt": "0", "source": "bench", "event_id": key, "lifecycle": LIFECYCLE}
    if keep:
        fields["retention_s"] = "3600"
    item = IntakeItem(key=key, fields=fields, marker=("bench", key), initial=State.QUEUED, ready_score=1.0)
    await store.intake(item)
    for to in (State.SUBMITTED, State.RUNNING, State.FAILED):
        await store.transition_or_raise(key, to, fields={"terminal_event_id": f"t-{key}"})
    return key


async def marks(store: StateStore, count: int) -> dict[str, Any]:
    """Microseconds a ``mark_published`` call, with and without retention, interleaved in one run."""
    kept = [await ended(store, n, keep=True) for n in range(count)]
    plain = [await ended(store, count + n, keep=False) for n in range(count)]
    spent = {"with retention": 0.0, "without": 0.0}
    for with_key, without_key in zip(kept, plain, strict=True):
        for name, key in (("with retention", with_key), ("without", without_key)):
            started = time.perf_counter()
            assert await store.mark_published(key, f"t-{key}", ended_at=time.time()) == "counted"
            spent[name] += time.perf_counter() - started
    us = {name: round(total / count * 1e6, 1) for name, total in spent.items()}
    return {"us_per_call": us, "ratio": round(us["with retention"] / us["without"], 3)}


async def expired(store: StateStore, objects: MinioObjectStore, bucket: str, count: int) -> list[str]:
    """``count`` lifecycles whose retention has passed: a hash each, three result objects each."""
    index = RetentionIndex(store.client, store.keys)
    members = []
    for n in range(count):
        batch_id = f"c{n:06d}-{uuid.uuid4().hex[:6]}"
        folder = output_prefix(bucket, TENANT, batch_id, LIFECYCLE).removeprefix(f"s3://{bucket}/")
        for name in ("output-a1-00000.jsonl", "error-a1-00000.jsonl", "manifest.json"):
            await objects.put(bucket, folder + name, io.BytesIO(b"{}\n"), 3, content_type="application/json")
        await store.client.hset(
            store.keys.batch(BatchKey(f"{TENANT}/{batch_id}")),
            mapping={"state": "completed", "lifecycle": LIFECYCLE},
        )
        member = batch_member(TENANT, batch_id, LIFECYCLE)
        await index.schedule(member, time.time() - 1)
        members.append(member)
    return members


async def collect(
    store: StateStore, objects: MinioObjectStore, s3: S3Settings, count: int, collectors: int
) -> dict[str, Any]:
    await expired(store, objects, s3.results_bucket, count)
    index = RetentionIndex(store.client, store.keys)
    made = [
        Collector.over(
            index,
            objects,
            RedisStateReader(store),
            input_bucket=s3.input_bucket,
            results_bucket=s3.results_bucket,
            settings=RetentionSettings(),
            fallback_after_s=60.0,
        )
        for _ in range(collectors)
    ]
    started = time.perf_counter()
    reports = await asyncio.gather(*(c.collect() for c in made))
    seconds = time.perf_counter() - started
    total = Report()
    for report in reports:
        total.add(report)
    assert total.batches == count and total.result_objects == 3 * count, total
    assert (await index.pending(time.time()))[1] == 0  # nothing expired is left
    return {
        "collectors": collectors,
        "lifecycles": total.batches,
        "objects": total.result_objects,
        "seconds": round(seconds, 2),
        "lifecycles_per_s": round(total.batches / seconds, 1),
        "objects_per_s": round(total.result_objects / seconds, 1),
    }


async def main_async(args: argparse.Namespace, redis_url: str, s3: S3Settings) -> dict[str, Any]:
    store = StateStore.from_url(redis_url, keys=Keys(f"bench{uuid.uuid4().hex[:6]}"))
    objects = MinioObjectStore(s3)
    try:
        marked = await marks(store, args.marks)
        one = await collect(store, objects, s3, args.batches, 1)
        two = await collect(store, objects, s3, args.batches, 2)
    finally:
        await store.close()
    return {
        "mark_published": marked,
        "collect": [one, two],
        "two_vs_one": round(two["lifecycles_per_s"] / one["lifecycles_per_s"], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=500, help="expired lifecycles per collector run")
    parser.add_argument("--marks", type=int, default=2000, help="mark_published calls of each kind")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-retention-"))
    redis_rec = services.start_redis(run_dir)
    minio_rec = None
    try:
        minio_rec = services.start_minio(run_dir)
        s3 = S3Settings(
            endpoint=minio_rec.address,
            access_key=minio_rec.extra["access_key"],
            secret_key=minio_rec.extra["secret_key"],
        )
        ensure_buckets(make_client(s3), s3)
        result = asyncio.run(main_async(args, redis_rec.address, s3))
    finally:
        if minio_rec is not None:
            stop_tree(minio_rec.pid)
        stop_tree(redis_rec.pid)
    if args.json:
        print(json.dumps(result))
        return 0
    m = result["mark_published"]
    print(
        f"mark_published: {m['us_per_call']['with retention']} us a call with retention, "
        f"{m['us_per_call']['without']} us without ({m['ratio']}x)"
    )
    for run in result["collect"]:
        print(
            f"collect, {run['collectors']} collector(s): {run['lifecycles']} lifecycles and "
            f"{run['objects']} objects in {run['seconds']} s = {run['lifecycles_per_s']} lifecycles/s, "
            f"{run['objects_per_s']} objects/s"
        )
    print(f"two collectors vs one: {result['two_vs_one']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
