"""Benchmark: what one small Ray job costs the machine (the Ray-job path's fixed cost per batch).

    llmbatch stack up minio ray && eval "$(.venv/bin/llmbatch stack env)"
    .venv/bin/python bench/bench_job_overhead.py [--jobs 5] [--lines 8] [--json]

Runs ``--jobs`` Ray jobs one after another, each a batch of ``--lines`` inline chat lines on the fake
engine (no delay: only the fixed cost is left), and prints per job the wall time from submit to the
end and the CPU seconds the whole machine spent meanwhile (``/proc/stat``: run it on an idle machine,
it counts every process, the Ray workers each job starts included). Start the Ray head with other
``RAY_*`` variables in its environment to compare them. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

from llmbatch.ray_job.engines.backends import FAKE_BACKEND

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def machine_cpu_s() -> float:
    """CPU seconds spent by every process of this machine since boot (busy time of all cores)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def one_job(jobs: Any, lines: int) -> dict[str, float]:
    from bench.bench_ray_job import run_job
    from llmbatch.ray_job.job.submit import runtime_env
    from llmbatch.schemas.job import EngineConfig, JobSpec
    from llmbatch.schemas.openai import BatchInputLine
    from llmbatch.settings import LLMBatchSettings

    s3 = LLMBatchSettings().s3
    batch_id = f"bench-overhead-{uuid.uuid4().hex[:8]}"
    requests = [
        BatchInputLine.model_validate(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": f"Say {i}"}],
                    "max_tokens": 8,
                },
            }
        )
        for i in range(lines)
    ]
    spec = JobSpec(
        batch_id=batch_id,
        attempt=1,
        endpoint="/v1/chat/completions",
        model="fake-model",
        model_path="fake",
        requests=requests,
        output_prefix=f"s3://{s3.results_bucket}/bench/{batch_id}/",
        engine=EngineConfig(backend=FAKE_BACKEND, batch_size=4, num_cpus_per_replica=0.5),
    )
    cpu0 = machine_cpu_s()
    wall, _ = run_job(jobs, spec, runtime_env(s3_endpoint=s3.endpoint), poll_s=0.25)
    cpu = machine_cpu_s() - cpu0
    jobs.delete_job(spec.submission_id)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=5, help="jobs run one after another")
    parser.add_argument("--lines", type=int, default=8, help="inline lines per job")
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    args = parser.parse_args()
    if "LLMBATCH_RAY__ADDRESS" not in os.environ:
        print(
            'no stack in the environment: run `llmbatch stack up minio ray && eval "$(.venv/bin/llmbatch '
            'stack env)"` first',
            file=sys.stderr,
        )
        return 2
    from ray.job_submission import JobSubmissionClient

    from llmbatch.adapters.storage import ensure_buckets, make_client
    from llmbatch.settings import LLMBatchSettings

    s3 = LLMBatchSettings().s3
    ensure_buckets(make_client(s3), s3)
    jobs = JobSubmissionClient(os.environ["LLMBATCH_RAY__ADDRESS"])
    rows = []
    for i in range(args.jobs):
        rows.append(one_job(jobs, args.lines))
        if not args.json:
            print(f"job {i + 1}: {rows[-1]}", flush=True)
    report = {
        "jobs": args.jobs,
        "lines": args.lines,
        "wall_s_median": statistics.median(r["wall_s"] for r in rows),
        "cpu_s_median": statistics.median(r["cpu_s"] for r in rows),
        "runs": rows,
    }
    print(json.dumps(report, indent=None if not args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
