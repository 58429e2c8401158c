"""Benchmark: what a runner batch's own S3 session costs (``llmbatch.dispatcher.backends.s3_sessions``).

    .venv/bin/llmbatch stack up minio && eval "$(.venv/bin/llmbatch stack env)"
    .venv/bin/python bench/bench_s3_sessions.py [--batches 200] [--json]

For each of ``--batches`` batch specs (distinct ids, each with an input file): (a) the dispatcher mints
its session (one STS ``AssumeRole`` with a policy naming its input and prefix), (b) the runner's
first S3 call on the batch, a HEAD of its input, with a filesystem built from the session, against
(c) the same HEAD with a filesystem built from the node's keys. Prints p50 / p95 / max milliseconds of
each and the per-batch cost of sessions, (a) + (b) - (c). With ``--job-handoff`` (the stack's Redis
too: ``llmbatch stack up minio redis``) also (d) what a Ray job attempt adds: the dispatcher stores the
session in Redis (``SET NX EX``) and the driver takes it (``GETDEL`` + parse,
``llmbatch.ray_job.storage.s3_session``).
One process, one run. Not a test.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _figures(ms: list[float]) -> dict[str, float]:
    ranked = sorted(ms)
    return {
        "p50": round(statistics.median(ranked), 2),
        "p95": round(ranked[min(len(ranked) - 1, int(len(ranked) * 0.95))], 2),
        "max": round(ranked[-1], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=200, help="batches (sessions minted), >= 2")
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    parser.add_argument(
        "--job-handoff",
        action="store_true",
        help="also time a Ray job's handoff through Redis (needs the stack's Redis)",
    )
    args = parser.parse_args()
    if args.batches < 2:
        parser.error("--batches must be at least 2")

    import os

    from bench.bench_ray_job import stack_s3
    from llmbatch.dispatcher.backends.s3_sessions import SessionMinter
    from llmbatch.ray_job.storage import s3
    from llmbatch.schemas.job import JobSpec, output_prefix
    from llmbatch.settings import LLMBatchSettings

    settings = LLMBatchSettings()
    client = stack_s3(settings)
    bucket = settings.s3.input_bucket
    os.environ.setdefault("LLMBATCH_S3__ENDPOINT", settings.s3.endpoint)
    os.environ["AWS_ACCESS_KEY_ID"] = settings.s3.access_key.get_secret_value()  # the node's keys
    os.environ["AWS_SECRET_ACCESS_KEY"] = settings.s3.secret_key.get_secret_value()
    run = uuid.uuid4().hex[:8]
    minter = SessionMinter(settings.s3, duration_s=900)
    node_fs = s3.filesystem()
    mint_ms: list[float] = []
    session_head_ms: list[float] = []
    node_head_ms: list[float] = []
    handoff_ms: list[float] = []
    keys: list[str] = []
    import asyncio

    import orjson

    from llmbatch.dispatcher.state.store import StateStore
    from llmbatch.ray_job.storage import s3_session

    loop = asyncio.new_event_loop()
    store = StateStore.from_settings(settings.redis) if args.job_handoff else None
    try:
        for i in range(args.batches):
            key = f"bench-sessions/{run}/in-{i}.jsonl"
            client.put_object(bucket, key, io.BytesIO(b"{}\n"), 3)
            keys.append(key)
            batch_id = f"bs-{run}-{i}"
            spec = JobSpec(
                batch_id=batch_id,
                attempt=1,
                endpoint="/v1/chat/completions",
                model="m",
                input_uri=f"s3://{bucket}/{key}",
                output_prefix=output_prefix(settings.s3.results_bucket, "default", batch_id),
            )
            t0 = time.perf_counter()
            session = minter.mint(spec)
            t1 = time.perf_counter()
            s3.check_readable(s3.filesystem(session), f"{bucket}/{key}")
            t2 = time.perf_counter()
            s3.check_readable(node_fs, f"{bucket}/{key}")
            t3 = time.perf_counter()
            mint_ms.append((t1 - t0) * 1000)
            session_head_ms.append((t2 - t1) * 1000)
            node_head_ms.append((t3 - t2) * 1000)
            if store is not None:
                nonce = f"bench-{run}-{i}"
                t4 = time.perf_counter()
                loop.run_until_complete(store.put_s3_session(nonce, orjson.dumps(session.plain()), 900))
                s3_session.fetch(settings.redis.url_without_password(), store.keys.s3_session(nonce))
                handoff_ms.append((time.perf_counter() - t4) * 1000)
    finally:
        for key in keys:
            client.remove_object(bucket, key)
        if store is not None:
            loop.run_until_complete(store.close())
        loop.close()
    report: dict[str, Any] = {
        "batches": args.batches,
        "mint_ms": _figures(mint_ms),
        "head_with_session_ms (new filesystem)": _figures(session_head_ms),
        "head_with_node_keys_ms (one filesystem)": _figures(node_head_ms),
        **({"job_handoff_ms (store + take via Redis)": _figures(handoff_ms)} if handoff_ms else {}),
        "per_batch_cost_p50_ms": round(
            statistics.median(mint_ms) + statistics.median(session_head_ms) - statistics.median(node_head_ms),
            2,
        ),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.batches} batches, one session each (ms: p50 / p95 / max)")
    for name, value in report.items():
        if isinstance(value, dict):
            print(f"  {name:42} {value['p50']:8} {value['p95']:8} {value['max']:8}")
    print(f"  per-batch cost of sessions (p50): {report['per_batch_cost_p50_ms']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
