"""What every part of the service benchmark shares: its error, one submitted batch, its progress lines."""

from __future__ import annotations

import sys
from dataclasses import dataclass


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
