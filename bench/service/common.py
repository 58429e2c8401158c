"""What every part of the service benchmark shares: its error, one submitted batch, its progress lines."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path


class BenchError(Exception):
    """The run cannot go on; the dispatcher's log tail is printed with it."""


@dataclass
class Sub:
    """One submitted batch."""

    batch_id: str
    lines: int
    priority: int
    submitted: float  # wall clock just before the SDK call


def say(text: str) -> None:
    """A progress line, on stderr: stdout holds the report."""
    print(text, file=sys.stderr, flush=True)


def add_fake_engine_args(
    parser: argparse.ArgumentParser, *, delay_s: float, timeout_s: float, waits: str
) -> None:
    """The options of a service bench on the fake engine: its delay, how long to wait, where the stack is,
    what to keep and where the report goes."""
    parser.add_argument(
        "--fake-delay-s", type=float, default=delay_s, help="fake engine: seconds per request"
    )
    parser.add_argument("--timeout", type=float, default=timeout_s, help=f"seconds to wait for {waits}")
    parser.add_argument("--stack-dir", type=Path, help="a running stack to use (left up)")
    parser.add_argument("--keep", action="store_true", help="leave the stack running afterwards")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--report", type=Path, help="also write the report here as JSON")


def fake_engine_entry(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with what the service harness reads for the fake engine on the stack's own entry."""
    args.engine, args.max_tokens = "fake", 8
    args.batch_size = args.batches_in_flight = args.omp_threads = None
    return args
