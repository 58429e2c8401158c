"""Benchmark: one tenant's lone batch beside another tenant's many batches of the same priority (issue 54
item 5). Fake engine whose requests each take ``--fake-delay-s``, ``--max-active`` at a time on its one
replica (so the engine, not this machine's CPU, is the bottleneck; the stack's entry otherwise), one run.

    .venv/bin/python bench/bench_tenant_share.py [--batches 50] [--lines 40] [--many-lines 20]
        [--max-active 16] [--fake-delay-s 2] [--json] [--report PATH]

Starts a private local stack and a dispatcher process (the service harness of ``bench/bench_service.py``),
warms the path with one batch, then:

1. idle: tenant ``lone``'s ``--lines``-line batch alone: its submit -> terminal time ``T``;
2. loaded: tenant ``many``'s ``--batches`` batches of ``--many-lines`` lines at once and, once one of
   them made progress, ``lone``'s batch again, all at priority 5. When batches take turns at the
   engine, ``lone``'s batch gets one share of ``--batches`` + 1; when tenants do, half. ``many``'s
   batches still running when ``lone``'s ended are cancelled.

Prints ``lone``'s times and their ratio. Target: beside ``many``, within 2x ``T``. Everything started is
stopped by PID. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_deadlines import ended  # noqa: E402
from bench.bench_ray_job import prompts  # noqa: E402
from bench.service.common import add_fake_engine_args, fake_engine_entry, say  # noqa: E402
from bench.service.harness import Service, run_main  # noqa: E402

LONE, MANY = "lone", "many"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=50, help="batches of the tenant with many")
    parser.add_argument("--lines", type=int, default=40, help="lines of the lone tenant's batch")
    parser.add_argument("--many-lines", type=int, default=20, help="lines of each of the other's batches")
    parser.add_argument("--max-active", type=int, default=16, help="requests the engine replica runs at once")
    add_fake_engine_args(parser, delay_s=2.0, timeout_s=900.0, waits="any one batch")
    args = parser.parse_args()
    for name in ("batches", "lines", "many_lines", "max_active"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return fake_engine_entry(args)


async def measure(svc: Service, args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"setup": await svc.start()}
    client, proc, _, _ = svc.need()
    say("[warm-up] one batch (the runner's replicas, the engine, the paths) ...")
    report["warmup"] = await svc.phase("warm", [(prompts(4), 5)])

    say(f"[idle] {LONE}'s {args.lines}-line batch alone ...")
    alone = await svc.submit(prompts(args.lines), priority=5, name="alone", tenant=LONE)
    await svc.wait([alone], "the batch alone")
    idle = ended(svc, alone)
    report["idle"] = idle

    say(f"[loaded] {MANY}'s {args.batches} batches of {args.many_lines} lines, then {LONE}'s beside them ...")
    many = await asyncio.gather(
        *(
            svc.submit(prompts(args.lines), priority=5, name=f"many{i}", tenant=MANY)
            for i in range(args.batches)
        )
    )
    await svc.ledger.until(
        lambda: any(
            svc.ledger.progress.get(s.batch_id, 0) > 0 or s.batch_id in svc.ledger.terminal for s in many
        ),
        args.timeout,
        proc,
        f"progress of {MANY}'s batches",
    )
    lone = await svc.submit(prompts(args.lines), priority=5, name="lone", tenant=LONE)
    await svc.wait([lone], f"{LONE}'s batch")
    running = [s for s in many if s.batch_id not in svc.ledger.terminal]
    for sub in running:
        await client.cancel(sub.batch_id, tenant=MANY, reason="bench: the lone batch ended")
    await svc.wait(list(many), f"{MANY}'s batches")
    loaded = ended(svc, lone)
    report["loaded"] = {
        **loaded,
        "vs_idle": round(loaded["submit_to_terminal_s"] / idle["submit_to_terminal_s"], 2),
        "many_still_running": len(running),  # 0: the figure is void (they all ended first)
        "many_batches": args.batches,
    }
    return report


def show(report: dict[str, Any]) -> None:
    idle, loaded = report["idle"], report["loaded"]
    print(
        f"{LONE}'s batch ({idle['lines']} lines) alone: {idle['submit_to_terminal_s']} s submit -> terminal; "
        f"beside {MANY}'s {loaded['many_batches']} batches of its priority: {loaded['status']} in "
        f"{loaded['submit_to_terminal_s']} s ({loaded['vs_idle']}x alone); {loaded['many_still_running']} of "
        f"{MANY}'s batches were still running then"
    )
    if not loaded["many_still_running"]:
        print(f"  {MANY}'s batches all ended first: the figure is void (give them more lines)")
    met = loaded["vs_idle"] <= 2 and loaded["many_still_running"] > 0
    print(f"  {'within 2x its time alone':32} {'met' if met else 'NOT met'}")


def main() -> int:
    return run_main(parse_args(), measure, show)


if __name__ == "__main__":
    sys.exit(main())
