"""Benchmark: memory of the ray_job pipeline on very large inputs (10k, 100k, 1M lines), fake engine.

    make up && eval "$(.venv/bin/llmbatch stack env)"   # the local stack's MinIO + Ray head
    .venv/bin/python bench/bench_large_batch.py [--lines 10000,100000,1000000] [--json]

For each size: a ``.jsonl.gz`` input of that many chat lines is written and uploaded to MinIO as a
stream, one Ray job runs it on the fake engine (no delay: the pipeline is what is measured), and
every process of the Ray node is sampled every 0.5 s. Prints, per size: wall time, lines/s, the
driver's peak RSS (the job's own ``ru_maxrss``), USS and RSS without the object store's pages
(:attr:`llmbatch.ray_job.job.memory.MemoryUse.own`), the peak RSS, USS and RSS without the object
store's pages of the Ray workers by task (the input reader, the prompt and engine stages, the writer),
the output shards and their largest line count. Flat memory means USS and RSS without the store do not
grow with the line count: RSS alone also counts the shared object-store pages a process has touched,
which grow with the data that passed through it, up to the store's size. Not a test.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from llmbatch.ray_job.engines.backends import FAKE_BACKEND

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def write_input(path: Path, lines: int) -> None:
    """``lines`` chat lines, gzip-compressed, written as a stream."""
    with gzip.open(path, "wb", compresslevel=3) as out:
        for i in range(lines):
            line = {
                "custom_id": f"req-{i:08d}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": f"question number {i} about the sea"}],
                    "max_tokens": 8,
                },
            }
            out.write(json.dumps(line).encode() + b"\n")


class RssSampler:
    """Peak memory per Ray worker title (``ray::<task>``) over the processes of this machine: RSS,
    USS (the pages only that process holds) and RSS without the shared object-store pages."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.peaks: dict[str, int] = defaultdict(int)
        self.uss_peaks: dict[str, int] = defaultdict(int)
        self.own_peaks: dict[str, int] = defaultdict(int)
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        from llmbatch.ray_job.job.memory import read_memory

        while not self._stop.is_set():
            for proc in psutil.process_iter(["cmdline"]):
                cmd = proc.info.get("cmdline") or []
                if not cmd or not cmd[0].startswith("ray::"):
                    continue
                # one worker's title changes with the method it runs ("...(PromptStage)).submit")
                title = cmd[0].split(" ")[0].removesuffix(".submit").removesuffix(".__init__")
                use = read_memory(proc.pid)  # one read of its smaps for all three figures
                if use is None:  # gone, or not ours to read
                    continue
                self.peaks[title] = max(self.peaks[title], use.rss)
                self.uss_peaks[title] = max(self.uss_peaks[title], use.uss)
                self.own_peaks[title] = max(self.own_peaks[title], use.own)
            self._stop.wait(self._interval)

    def top(self, n: int) -> dict[str, dict[str, float]]:
        """The ``n`` largest workers by RSS: title -> {rss_mb, uss_mb, own_rss_mb}."""
        ranked = sorted(self.peaks.items(), key=lambda kv: -kv[1])[:n]
        return {
            title: {
                "rss_mb": round(rss / 2**20, 1),
                "uss_mb": round(self.uss_peaks[title] / 2**20, 1),
                "own_rss_mb": round(self.own_peaks[title] / 2**20, 1),
            }
            for title, rss in ranked
        }


def run_size(lines: int, args: argparse.Namespace) -> dict[str, Any]:
    from ray.job_submission import JobSubmissionClient

    from bench.bench_ray_job import run_job, stack_s3
    from llmbatch.ray_job.job.submit import runtime_env
    from llmbatch.schemas.job import EngineConfig, JobSpec, parse_manifest
    from llmbatch.settings import LLMBatchSettings

    settings = LLMBatchSettings()
    s3 = settings.s3
    client = stack_s3(settings)
    batch_id = f"bench-large-{lines}-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "input.jsonl.gz"
        t0 = time.perf_counter()
        write_input(path, lines)
        input_mb = path.stat().st_size / 2**20
        key = f"bench/{batch_id}.jsonl.gz"
        client.fput_object(s3.input_bucket, key, str(path))
        prepare_s = time.perf_counter() - t0
    spec = JobSpec(
        batch_id=batch_id,
        attempt=1,
        endpoint="/v1/chat/completions",
        model="fake-model",
        model_path="fake",
        input_uri=f"s3://{s3.input_bucket}/{key}",
        output_prefix=f"s3://{s3.results_bucket}/bench/{batch_id}/",
        engine=EngineConfig(
            backend=FAKE_BACKEND, batch_size=args.batch_size, batches_in_flight=4, num_cpus_per_replica=0.5
        ),
        shard_max_lines=args.shard_max_lines,
    )
    jobs = JobSubmissionClient(settings.ray.address)
    with RssSampler() as sampler:
        env = runtime_env(s3_endpoint=s3.endpoint, env_vars=dict(args.env))
        wall, result = run_job(jobs, spec, env, poll_s=1.0)
    resp = client.get_object(s3.results_bucket, spec.manifest_uri.removeprefix(f"s3://{s3.results_bucket}/"))
    try:
        manifest = parse_manifest(resp.read())
    finally:
        resp.close()
        resp.release_conn()
    if not args.keep:
        for obj in client.list_objects(s3.results_bucket, prefix=f"bench/{batch_id}/", recursive=True):
            client.remove_object(s3.results_bucket, obj.object_name)
        client.remove_object(s3.input_bucket, key)
        jobs.delete_job(spec.submission_id)
    return {
        "lines": lines,
        "input_gz_mb": round(input_mb, 1),
        "prepare_s": round(prepare_s, 1),
        "wall_s": round(wall, 1),
        "lines_per_s": round(lines / wall, 1),
        "completed": manifest.request_counts.completed,
        "shards": len(manifest.output_shards),
        "max_shard_lines": max((s.lines for s in manifest.output_shards), default=0),
        "driver_max_rss_mb": result.get("driver_max_rss_mb"),
        "driver_uss_mb": result.get("driver_uss_mb"),
        "driver_uss_peak_mb": result.get("driver_uss_peak_mb"),
        "driver_own_peak_mb": result.get("driver_own_peak_mb"),
        "worker_peaks": sampler.top(4),
    }


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--env takes NAME=VALUE, not {text!r}")
    return name, value


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lines",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[10_000, 100_000, 1_000_000],
        help="comma-separated sizes",
    )
    parser.add_argument("--batch-size", type=int, default=512, help="lines per engine call")
    parser.add_argument("--shard-max-lines", type=int, default=10_000)
    parser.add_argument("--keep", action="store_true", help="keep the inputs, outputs and Ray jobs")
    parser.add_argument(
        "--env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment of the job and its workers (repeatable), e.g. "
        "ARROW_DEFAULT_MEMORY_POOL=system to compare memory allocators",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    args = parser.parse_args()
    if "LLMBATCH_RAY__ADDRESS" not in os.environ:
        print(
            'no stack in the environment: run `make up && eval "$(.venv/bin/llmbatch stack env)"` first',
            file=sys.stderr,
        )
        return 2
    rows = []
    for lines in args.lines:
        row = run_size(lines, args)
        rows.append(row)
        if not args.json:
            print(json.dumps(row), flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"\n{'lines':>9} {'gz MB':>6} {'wall s':>7} {'lines/s':>8} {'shards':>6} {'max/shard':>9} "
        f"{'driver MB':>9} {'drv USS':>7} {'USS peak':>8} {'own peak':>8}  "
        f"worker peaks MB (RSS / USS / RSS without the object store's pages)"
    )
    for r in rows:
        workers = ", ".join(
            f"{t}={v['rss_mb']}/{v['uss_mb']}/{v['own_rss_mb']}" for t, v in r["worker_peaks"].items()
        )
        print(
            f"{r['lines']:>9} {r['input_gz_mb']:>6} {r['wall_s']:>7} {r['lines_per_s']:>8} "
            f"{r['shards']:>6} {r['max_shard_lines']:>9} {r['driver_max_rss_mb']!s:>9} "
            f"{r['driver_uss_mb']!s:>7} {r['driver_uss_peak_mb']!s:>8} "
            f"{r['driver_own_peak_mb']!s:>8}  {workers}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
