"""Local stack figures: time for each service to become healthy, idle memory, cache disk use, and the
time each one takes to stop (by PID, one after the other).

Run: ``.venv/bin/python bench/bench_stack.py [--idle-seconds 20] [--serve]``. Starts a private stack in a
temp folder (free ports), measures, stops it by PID. Prints a table and one JSON line. ``--serve``: a
small Serve application runs on the Ray head first (as the batch runner and the engines do).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ray.job_submission import JobStatus, JobSubmissionClient

from llmbatch.stack import manager
from llmbatch.stack.state import CACHE_DIR


def serve_an_app(address: str, port: int) -> None:
    """Deploy a small Serve application on the head at ``address`` (Serve's proxy on ``port``), as the
    stack's batch runner and engines are, and leave it running."""
    code = (
        "from ray import serve\n"
        "@serve.deployment(ray_actor_options={'num_cpus': 0})\n"
        "class Hi:\n"
        "    def __call__(self, request): return 'hi'\n"
        f"serve.start(http_options={{'host': '127.0.0.1', 'port': {port}}})\n"
        "serve.run(Hi.bind(), name='hi', route_prefix='/hi')\n"
    )
    client = JobSubmissionClient(address)
    sid = client.submit_job(entrypoint=f"python -c {shlex.quote(code)}", entrypoint_num_cpus=0)
    end = time.monotonic() + 240
    while not client.get_job_status(sid).is_terminal():
        assert time.monotonic() < end, f"job {sid} did not end"
        time.sleep(0.5)
    assert client.get_job_status(sid) is JobStatus.SUCCEEDED, client.get_job_logs(sid)


def _du(path: Path) -> int:
    if not path.exists():
        return 0
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=False).stdout
    return int(out.split()[0]) if out else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument(
        "--serve", action="store_true", help="run a small Serve application on the Ray head before the stops"
    )
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="llmbatch-bench-stack-"))
    t0 = time.monotonic()
    state = manager.up(run_dir)
    up_s = time.monotonic() - t0
    stop_s: dict[str, float] = {}
    try:
        if args.serve:
            ray = state.services["ray"]
            serve_an_app(ray.address, ray.ports["serve"])
        time.sleep(args.idle_seconds)
        rows = manager.status(run_dir)
        for name in state.services:
            t = time.monotonic()
            manager.down(run_dir, [name])
            stop_s[name] = round(time.monotonic() - t, 2)
    finally:
        manager.down(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
    result: dict[str, Any] = {
        "stack_up_wall_s": round(up_s, 2),
        "healthy_after_s": {n: r.healthy_after_s for n, r in state.services.items()},
        "idle_pss_mib": {r.name: round(r.rss_bytes / 2**20, 1) for r in rows},
        "idle_total_mib": round(sum(r.rss_bytes for r in rows) / 2**20, 1),
        "stop_s": stop_s,
        "cache_mib": {p.name: round(_du(p) / 2**20, 1) for p in sorted(CACHE_DIR.iterdir()) if p.is_dir()},
    }
    print(f"stack up (parallel start): {result['stack_up_wall_s']} s")
    for name, secs in result["healthy_after_s"].items():
        print(f"  {name:6} healthy after {secs:6.2f} s   idle PSS {result['idle_pss_mib'][name]:7.1f} MiB")
    print(f"  total idle PSS {result['idle_total_mib']} MiB")
    for name, secs in stop_s.items():
        print(f"  {name:6} stopped in {secs:6.2f} s")
    for name, mib in result["cache_mib"].items():
        print(f"  cache {name:28} {mib:9.1f} MiB")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
