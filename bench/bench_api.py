"""Benchmark: the HTTP API's create/retrieve latency under concurrent clients, and the content
endpoint's streaming rate and memory on a large output file.

    make up && eval "$(.venv/bin/llmbatch stack env)"
    .venv/bin/python bench/bench_api.py [--clients 50] [--calls 10] [--mb 100] [--json]

Starts ``llmbatch api`` (``python -m llmbatch.api``) on a free loopback port against the running local stack
(Kafka, Redis, MinIO; no dispatcher: created batches stay ``validating``, which is what create and
retrieve cost). Then:

1. **Latency.** ``--clients`` concurrent HTTP clients (one connection each) each make ``--calls``
   ``POST /v1/batches`` (a record in MinIO + ``batch.requested`` on Kafka with acks=all), then as many
   ``GET /v1/batches/{id}`` (record + Redis state). Prints p50/p99/max per call and calls/s, beside
   ``GET /livez`` under the same load (the server's own floor).
2. **Content.** Writes ``--mb`` MB of output shards (10,000 lines each) and a manifest for one batch, as
   a job would, and streams ``GET /v1/files/file-output-<id>/content``: MB/s and the API process's peak
   RSS sampled every 50 ms, beside reading the same shards straight from MinIO (the ratio is the API's
   cost). Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import orjson  # noqa: E402
import psutil  # noqa: E402

from bench.bench_ray_job import stack_s3  # noqa: E402
from llmbatch.api.settings import ApiSettings  # noqa: E402
from llmbatch.api.tenancy.auth import hash_api_key  # noqa: E402
from llmbatch.schemas.job import ShardInfo, output_prefix, shard_name  # noqa: E402
from llmbatch.schemas.openai import Usage  # noqa: E402
from llmbatch.stack.ports import free_port  # noqa: E402
from tests.support.dispatcher_kit import MODEL, inline_lines  # noqa: E402

KEY = "sk-bench-" + os.urandom(8).hex()
LINES_PER_SHARD = 10_000


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_api(port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "LLMBATCH_API__KEYS": json.dumps({hash_api_key(KEY): "default"}),
        "LLMBATCH_API__RATE_PER_S": "0",
        "LLMBATCH_API__STATE_FALLBACK_AFTER_S": "0",
    }
    argv = [sys.executable, "-m", "llmbatch.api", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(
        argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/livez", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"the API did not start: {log.read_text()[-2000:]}")


async def load(base: str, clients: int, calls: int, file_id: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEY}"}
    created: list[str] = []
    times: dict[str, list[float]] = {"create": [], "retrieve": [], "livez": []}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=120) as http:

        async def client(n: int) -> None:
            mine: list[str] = []
            for _ in range(calls):
                t0 = time.perf_counter()
                reply = await http.post(
                    "/batches",
                    json={
                        "input_file_id": file_id,
                        "endpoint": "/v1/chat/completions",
                        "completion_window": "24h",
                    },
                )
                times["create"].append(time.perf_counter() - t0)
                reply.raise_for_status()
                mine.append(reply.json()["id"])
            for batch_id in mine:
                t0 = time.perf_counter()
                (await http.get(f"/batches/{batch_id}")).raise_for_status()
                times["retrieve"].append(time.perf_counter() - t0)
            for _ in range(calls):
                t0 = time.perf_counter()
                (await http.get(base.removesuffix("/v1") + "/livez")).raise_for_status()
                times["livez"].append(time.perf_counter() - t0)
            created.extend(mine)

        t0 = time.perf_counter()
        await asyncio.gather(*(client(n) for n in range(clients)))
        wall = time.perf_counter() - t0
    out: dict[str, Any] = {"clients": clients, "calls_per_client": calls, "wall_s": round(wall, 2)}
    for name, values in times.items():
        out[name] = {
            "p50_ms": round(percentile(values, 0.5) * 1000, 1),
            "p99_ms": round(percentile(values, 0.99) * 1000, 1),
            "max_ms": round(max(values) * 1000, 1),
            "calls": len(values),
            "mean_ms": round(statistics.fmean(values) * 1000, 1),
        }
    return out


def write_results(client: Any, settings: ApiSettings, batch_id: str, mb: int) -> tuple[list[str], int]:
    """Output shards of about ``mb`` MB and a manifest under the batch's folder, as a job writes them."""
    from llmbatch.ray_job.job import manifest as manifests

    line = (
        orjson.dumps(
            {
                "id": "x",
                "custom_id": "c",
                "response": {
                    "status_code": 200,
                    "body": {
                        "object": "chat.completion",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "y" * 400}}],
                    },
                },
                "error": None,
            }
        )
        + b"\n"
    )
    shard_bytes = line * LINES_PER_SHARD
    shards = max(1, (mb << 20) // len(shard_bytes))
    bucket = settings.s3.results_bucket
    prefix = output_prefix(bucket, "default", batch_id, "bench").removeprefix(f"s3://{bucket}/")
    infos, uris = [], []
    for i in range(shards):
        key = prefix + shard_name("output", i, 1)
        client.put_object(bucket, key, io.BytesIO(shard_bytes), len(shard_bytes))
        uri = f"s3://{bucket}/{key}"
        uris.append(uri)
        infos.append(ShardInfo(uri=uri, lines=LINES_PER_SHARD, size_bytes=len(shard_bytes), attempt=1))
    now = datetime.now(UTC)
    built = manifests.build(
        batch_id=batch_id,
        attempt=1,
        status="completed",
        total=shards * LINES_PER_SHARD,
        shards=infos,
        usage=Usage(prompt_tokens=0, completion_tokens=0),
        attempts=[],
        started_at=now,
        finished_at=now,
        engine_start_s=None,
        generation_s=None,
    )
    body = built.to_json()
    client.put_object(bucket, prefix + "manifest.json", io.BytesIO(body), len(body))
    return uris, shards * len(shard_bytes)


def stream_content(base: str, file_id: str, pid: int) -> dict[str, Any]:
    peak = [psutil.Process(pid).memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        proc = psutil.Process(pid)
        while not stop.is_set():
            peak.append(proc.memory_info().rss)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    before = peak[0]
    sampler.start()
    received = 0
    t0 = time.perf_counter()
    with httpx.stream(
        "GET", f"{base}/files/{file_id}/content", headers={"Authorization": f"Bearer {KEY}"}, timeout=300
    ) as reply:
        reply.raise_for_status()
        for chunk in reply.iter_bytes():
            received += len(chunk)
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    return {
        "bytes": received,
        "s": round(wall, 2),
        "mb_per_s": round(received / wall / 1e6, 1),
        "api_rss_before_mb": round(before / 1e6, 1),
        "api_rss_peak_mb": round(max(peak) / 1e6, 1),
    }


def direct(client: Any, uris: list[str]) -> dict[str, Any]:
    received = 0
    t0 = time.perf_counter()
    for uri in uris:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        reply = client.get_object(bucket, key)
        try:
            for chunk in reply.stream(1 << 20):
                received += len(chunk)
        finally:
            reply.close()
            reply.release_conn()
    wall = time.perf_counter() - t0
    return {"bytes": received, "s": round(wall, 2), "mb_per_s": round(received / wall / 1e6, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--calls", type=int, default=10, help="creates (and as many retrieves) per client")
    parser.add_argument("--mb", type=int, default=100, help="size of the output file streamed")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    settings = ApiSettings()
    client = stack_s3(settings)
    from llmbatch.adapters.topics import ensure_topics

    asyncio.run(ensure_topics(settings))  # a stack no dispatcher ran on has no topics yet
    port = free_port()
    log = Path("run") / "bench-api.log"
    log.parent.mkdir(exist_ok=True)
    proc = start_api(port, log)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        lines = inline_lines(4, model=MODEL)
        data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
        upload = httpx.post(
            f"{base}/files",
            headers={"Authorization": f"Bearer {KEY}"},
            files={"file": ("in.jsonl", data)},
            data={"purpose": "batch"},
            timeout=60,
        )
        upload.raise_for_status()
        file_id = upload.json()["id"]
        latency = asyncio.run(load(base, args.clients, args.calls, file_id))
        batch = httpx.post(
            f"{base}/batches",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        ).json()
        uris, size = write_results(client, settings, batch["id"], args.mb)
        done = httpx.get(
            f"{base}/batches/{batch['id']}", headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        ).json()
        assert done["status"] == "completed" and done["output_file_id"], done
        via_api = stream_content(base, done["output_file_id"], proc.pid)
        assert via_api["bytes"] == size, (via_api, size)
        straight = direct(client, uris)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    result = {
        "latency": latency,
        "content_via_api": via_api,
        "content_direct_minio": straight,
        "api_to_direct_ratio": round(via_api["mb_per_s"] / straight["mb_per_s"], 2),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.clients} clients x {args.calls} calls each (wall {latency['wall_s']} s)")
    for name in ("create", "retrieve", "livez"):
        f = latency[name]
        print(
            f"  {name:<9} p50 {f['p50_ms']:>7} ms   p99 {f['p99_ms']:>7} ms   max {f['max_ms']:>7} ms   "
            f"({f['calls']} calls)"
        )
    print(f"content of a {size / 1e6:.0f} MB output file ({len(uris)} shards)")
    print(
        f"  via the API     {via_api['mb_per_s']:>7} MB/s  API RSS "
        f"{via_api['api_rss_before_mb']} MB before, {via_api['api_rss_peak_mb']} MB peak"
    )
    print(
        f"  MinIO directly  {straight['mb_per_s']:>7} MB/s  "
        f"(ratio API/direct {result['api_to_direct_ratio']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
