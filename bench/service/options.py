"""The command line of the service benchmark: its options, ``--quick``'s smaller sizes and the checks that
refuse an unknown phase or scheduling, a CPU this process does not have and sizes below 1."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from llmbatch.stack.dispatcher_env import local_engine_threads

PHASES = ("ab", "throughput", "fairness", "after-cancel", "plain", "plain-procs")
SCHEDULINGS = ("normal", "nice19", "batch-out", "batch", "both", "split")
"""``--background`` modes (:meth:`Service.scheduling`)."""

QUICK = {"small": 8, "per_batch": 8, "warm_runs": 3, "conc": 4, "conc_size": 64, "big": 400}
"""``--quick``: the same phases on smaller sizes (the throughput phase still generates 256 prompts)."""


def parse_args(description: str | None) -> argparse.Namespace:
    """The run's options from ``sys.argv``, ``--quick`` applied; exits 2 naming a bad one."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("vllm", "fake"), default="vllm")
    parser.add_argument("--small", type=int, default=16, help="small batches in A")
    parser.add_argument("--per-batch", type=int, default=8, help="prompts per small batch")
    parser.add_argument("--warm-runs", type=int, default=10)
    parser.add_argument("--conc", type=int, default=4, help="batches at once in the throughput phase")
    parser.add_argument("--conc-size", type=int, default=128, help="prompts per batch there")
    parser.add_argument(
        "--big",
        type=int,
        default=2000,
        help="lines of the priority-0 batch (fairness) and of the cancelled one",
    )
    parser.add_argument(
        "--cancel-big",
        action="store_true",
        help="cancel the big batch once the urgent one finished (saves its remaining time)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--batch-size",
        type=int,
        help="the model entry's batch_size (default: the local stack's own entry, as shipped)",
    )
    parser.add_argument(
        "--batches-in-flight", type=int, help="engine calls of a batch at once (default: the entry's)"
    )
    parser.add_argument(
        "--omp-threads",
        type=int,
        default=local_engine_threads(),
        help="the engine replica's OMP_NUM_THREADS (default: the local stack's, every "
        "core; 0: Ray's, its num_cpus, 1 thread)",
    )
    parser.add_argument(
        "--max-replicas", type=int, default=1, help="engine replicas at most, sharing one Ray CPU"
    )
    parser.add_argument(
        "--idle-s",
        type=float,
        default=0.0,
        help="after the warm runs, measure the cores each process uses this long with no batch (0: not)",
    )
    parser.add_argument("--fake-delay-s", type=float, default=0.5, help="fake engine: seconds per request")
    parser.add_argument(
        "--skip",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help=f"comma list of {','.join(PHASES)}",
    )
    parser.add_argument(
        "--background",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help=f"experiment, comma list of {','.join(SCHEDULINGS)}: run "
        "the throughput phase once per scheduling of the run's processes",
    )
    parser.add_argument(
        "--plain-cpus",
        type=lambda s: {int(x) for x in s.split(",") if x},
        default=set(),
        help="experiment, comma list of CPU numbers: the plain runs on these cores only, "
        "with as many OpenMP threads (compare with --background split)",
    )
    parser.add_argument(
        "--stack-dir",
        type=Path,
        default=None,
        help="use the stack running there (left up) instead of a private one",
    )
    parser.add_argument("--keep", action="store_true", help="leave the private stack up")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for one phase")
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    parser.add_argument("--report", type=Path, default=None, help="also write the JSON report here")
    quick = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in QUICK.items())
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smaller defaults ({quick}): about 15 minutes on 2 cores instead of over an "
        "hour; sizes given explicitly win",
    )
    args = parser.parse_args()
    if args.quick:
        given = {a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("--")}
        for name, value in QUICK.items():
            if f"--{name.replace('_', '-')}" not in given:
                setattr(args, name, value)
    for option, values, known in (
        ("--skip", args.skip, PHASES),
        ("--background", args.background, SCHEDULINGS),
    ):
        if unknown := set(values) - set(known):
            parser.error(f"{option}: unknown {sorted(unknown)}; choose from {', '.join(known)}")
    if bad := args.plain_cpus - os.sched_getaffinity(0):
        parser.error(
            f"--plain-cpus: {sorted(bad)} not among this process' CPUs {sorted(os.sched_getaffinity(0))}"
        )
    if (
        min(
            args.small, args.per_batch, args.warm_runs, args.conc, args.conc_size, args.big, args.max_replicas
        )
        < 1
    ):
        parser.error("sizes and --max-replicas must be at least 1")
    return args
