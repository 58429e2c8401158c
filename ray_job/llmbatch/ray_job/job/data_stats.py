"""Keeps Ray Data's per-block statistics of a running dataset bounded.

Ray Data (2.60) appends one ``BlockStats`` to each operator's ``_output_blocks_stats`` for every block
it hands downstream and keeps them until the dataset ends (ray-project/ray#66016): the driver of a
batch grows by some 9-10 MiB per million lines with the default block size, and without bound. They
feed only the summary ``Dataset.stats()`` prints at the end, which no part of a job reads (its own
figures, counts and timings come from :mod:`llmbatch.ray_job.job.main`). :class:`BoundedBlockStats`, an
execution callback registered by :func:`llmbatch.ray_job.job.pipeline.configure_data_context`, drops the
oldest of them whenever an operator holds more than ``2 * KEEP``, so Ray's end-of-run summary covers the last
blocks only.

It reaches into two private attributes (the executor's ``_topology``, the operators'
``_output_blocks_stats``); where a Ray version has neither, it does nothing.
"""

from __future__ import annotations

from typing import Any

from ray.data._internal.execution.execution_callback import ExecutionCallback

KEEP = 512
"""Per-block stats kept per operator after a trim (at most twice as many between trims)."""


class BoundedBlockStats(ExecutionCallback):
    """Trims every operator's per-block stats to the last :data:`KEEP` once it holds more than twice
    that (amortized: one trim per ``KEEP`` blocks)."""

    def on_execution_step(self, executor: Any) -> None:
        trim(getattr(executor, "_topology", None) or {})


def trim(operators: Any) -> int:
    """Trim the per-block stats of each of ``operators``; returns how many entries went."""
    dropped = 0
    for op in operators:
        stats = getattr(op, "_output_blocks_stats", None)
        if isinstance(stats, list) and len(stats) > 2 * KEEP:
            dropped += len(stats) - KEEP
            del stats[: len(stats) - KEEP]
    return dropped
