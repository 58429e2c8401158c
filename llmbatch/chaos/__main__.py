"""``python -m llmbatch.chaos`` (``make chaos``): one chaos run; prints the verdict table and exits 1 on
any broken promise (2 on bad arguments)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from pathlib import Path

from llmbatch.chaos.faults import FAULT_KINDS
from llmbatch.chaos.runner import ChaosConfig, run

SHORT = ChaosConfig(
    batches=20,
    malformed=80,
    replicas=2,
    rounds=1,
    fault_every_s=8.0,
    down_s=3.0,
    pause_s=10.0,
    kafka_brokers=3,
    send_over_s=30.0,
    drain_timeout_s=900.0,
)


def _faults(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fault {unknown[0]!r}: one of {', '.join(FAULT_KINDS)}")
    return kinds


def main(argv: list[str] | None = None) -> int:
    full = ChaosConfig()
    parser = argparse.ArgumentParser(prog="python -m llmbatch.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="the short version (20 batches, one fault each)")
    parser.add_argument("--batches", type=int, help=f"valid batches (default {full.batches})")
    parser.add_argument("--malformed", type=int, help=f"malformed records (default {full.malformed})")
    parser.add_argument("--replicas", type=int, help=f"dispatcher replicas (default {full.replicas})")
    parser.add_argument("--rounds", type=int, help=f"times each fault is injected (default {full.rounds})")
    parser.add_argument("--faults", type=_faults, help=f"comma-separated, of {', '.join(FAULT_KINDS)}")
    parser.add_argument(
        "--shared-engines",
        action="store_true",
        help="run the batches on the warm shared engine (the service's default path) "
        "instead of a Ray job each (the driver fault then finds no driver and is skipped)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        dest="drain_timeout_s",
        help=f"seconds the batches get to end after the workload is sent (default "
        f"{full.drain_timeout_s:g}); one not ended then counts as stuck or lost",
    )
    parser.add_argument(
        "--down",
        type=float,
        dest="down_s",
        help=f"seconds a killed service stays down before its restart (default {full.down_s:g})",
    )
    parser.add_argument(
        "--pause",
        type=float,
        dest="pause_s",
        help=f"seconds a paused process stays stopped (default {full.pause_s:g})",
    )
    parser.add_argument(
        "--kafka-brokers",
        type=int,
        choices=(1, 3),
        help=f"1: the stack's broker (killed whole); 3: a KRaft cluster with min.insync.replicas 2 whose "
        f"partition leader is killed (default {full.kafka_brokers})",
    )
    parser.add_argument(
        "--job-clock-offset",
        type=float,
        dest="job_clock_offset_s",
        help=f"seconds the job side's wall clock runs ahead (libfaketime; 0: none; default "
        f"{full.job_clock_offset_s:g})",
    )
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument("--run-dir", type=Path, help="the stack's data (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="leave the stack running afterwards")
    args = parser.parse_args(argv)
    config = dataclasses.replace(SHORT) if args.short else full  # SHORT itself stays as it is
    names = (
        "batches",
        "malformed",
        "replicas",
        "rounds",
        "faults",
        "run_dir",
        "drain_timeout_s",
        "down_s",
        "pause_s",
        "kafka_brokers",
        "job_clock_offset_s",
    )
    for name in names:
        value = getattr(args, name)
        if value is not None:
            least = 1 if name in {"batches", "replicas", "rounds"} else 0
            if isinstance(value, int | float) and value < least:
                parser.error(f"--{name.replace('_', '-').removesuffix('-s')} must be at least {least}")
            setattr(config, name, value)
    config.seed, config.keep, config.shared_engines = args.seed, args.keep, args.shared_engines
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    result = asyncio.run(run(config))
    print(result.table())
    for line in result.fault_log:
        print(f"fault {line}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
