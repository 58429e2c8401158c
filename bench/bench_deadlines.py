"""Benchmark: a batch with a tight deadline beside a big batch of the same priority (issue 53 item 4).
Fake engine whose requests each take ``--fake-delay-s`` (the engine is the bottleneck; the stack's entry
otherwise), one run.

    .venv/bin/python bench/bench_deadlines.py [--tight 1000] [--big 4500] [--fake-delay-s 2]
        [--deadline-factor 1.6] [--json] [--report PATH]

Starts a private local stack and a dispatcher process (the service harness of ``bench/bench_service.py``),
warms the path with one batch, then:

1. idle: the ``--tight``-line batch alone (default window): its accepted -> terminal time ``T``;
2. loaded: the ``--big``-line batch, and once it makes progress the tight batch again, at the same
   priority, with a deadline ``--deadline-factor`` x ``T`` after it is sent. Batches of one priority take
   turns on the engine, so beside the big one the tight batch gets half the engine and needs about
   2 x ``T``: it misses its deadline unless the engine takes a batch at risk of its deadline first.
   The big batch is cancelled once the tight one ended.

Prints the tight batch's times, how it ended (``completed`` or ``expired``) and how many of its requests
were answered. Target: it completes before its deadline. Everything started is stopped by PID. Not a
test.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_ray_job import prompts  # noqa: E402
from bench.service.common import Sub, add_fake_engine_args, fake_engine_entry, say  # noqa: E402
from bench.service.harness import Service, run_main  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tight", type=int, default=1000, help="lines of the batch with the tight deadline")
    parser.add_argument("--big", type=int, default=4500, help="lines of the big batch beside it")
    parser.add_argument(
        "--deadline-factor", type=float, default=1.6, help="the tight deadline, in times its idle run"
    )
    add_fake_engine_args(parser, delay_s=2.0, timeout_s=900.0, waits="any one batch")
    args = parser.parse_args()
    for name in ("tight", "big"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.deadline_factor <= 1:
        parser.error("--deadline-factor must be above 1 (the batch alone needs 1)")
    return fake_engine_entry(args)


def ended(svc: Service, sub: Sub) -> dict[str, Any]:
    """How ``sub`` ended, from its events: status, requests answered, accepted -> terminal seconds."""
    done = svc.ledger.terminal[sub.batch_id]
    accepted = svc.ledger.accepted.get(sub.batch_id)
    start = accepted.time.timestamp() if accepted is not None else sub.submitted
    counts = done.data.request_counts
    return {
        "status": str(done.data.status),
        "completed": counts.completed,
        "lines": sub.lines,
        "accepted_to_terminal_s": round(done.time.timestamp() - start, 2),
        "submit_to_terminal_s": round(done.time.timestamp() - sub.submitted, 2),
    }


async def measure(svc: Service, args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"setup": await svc.start()}
    client, _, _, _ = svc.need()
    say("[warm-up] one batch (the runner's replicas, the engine, the paths) ...")
    report["warmup"] = await svc.phase("warm", [(prompts(4), 5)])

    say(f"[idle] the {args.tight}-line batch alone ...")
    alone = await svc.submit(prompts(args.tight), priority=5, name="alone")
    await svc.wait([alone], "the batch alone")
    idle = ended(svc, alone)
    report["idle"] = idle

    say(f"[loaded] a {args.big}-line batch, then the {args.tight}-line one beside it ...")
    big = await svc.submit(prompts(args.big), priority=5, name="big")
    await svc.under_way(big, "the big batch")
    budget = args.deadline_factor * idle["submit_to_terminal_s"]
    deadline = datetime.now(UTC) + timedelta(seconds=budget)
    tight = await svc.submit(prompts(args.tight), priority=5, name="tight", deadline=deadline)
    await svc.wait([tight], "the tight batch")
    big_first = big.batch_id in svc.ledger.terminal
    if not big_first:
        await client.cancel(big.batch_id, reason="bench: the tight batch ended")
    await svc.wait([big], "the big batch")
    loaded = ended(svc, tight)
    report["loaded"] = {
        **loaded,
        "deadline_s": round(budget, 2),
        "made_it": loaded["status"] == "completed",
        "vs_idle": round(loaded["submit_to_terminal_s"] / idle["submit_to_terminal_s"], 2),
        "big_finished_first": big_first,  # True: the figure is void
        "big": ended(svc, big),
    }
    return report


def show(report: dict[str, Any]) -> None:
    idle, loaded = report["idle"], report["loaded"]
    print(
        f"tight batch ({idle['lines']} lines) alone: {idle['submit_to_terminal_s']} s submit -> terminal; "
        f"beside a {loaded['big']['lines']}-line batch of its priority with a deadline "
        f"{loaded['deadline_s']} s after it was sent: {loaded['status']} in "
        f"{loaded['submit_to_terminal_s']} s ({loaded['vs_idle']}x alone), "
        f"{loaded['completed']} of {loaded['lines']} answered"
    )
    if loaded["big_finished_first"]:
        print("  the big batch ended first: the figure is void (give it more lines)")
    met = loaded["made_it"] and not loaded["big_finished_first"]
    print(f"  {'completes before its deadline':32} {'met' if met else 'NOT met'}")


def main() -> int:
    return run_main(parse_args(), measure, show)


if __name__ == "__main__":
    sys.exit(main())
