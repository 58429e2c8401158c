"""ray_job.job.data_stats: Ray Data's per-block stats trimmed to the last KEEP entries (the trim rule; the
integration test test_ray_job_fake.py shows it on a real dataset)."""

from __future__ import annotations

from typing import Any

import pytest
from ray.data import DataContext

from llmbatch.ray_job.job import data_stats
from llmbatch.ray_job.job.data_stats import KEEP, BoundedBlockStats, trim
from llmbatch.ray_job.job.pipeline import configure_data_context

pytestmark = pytest.mark.unit


class Op:
    def __init__(self, n: int) -> None:
        self._output_blocks_stats: Any = list(range(n))


def test_an_operator_over_twice_keep_keeps_its_last_keep_entries_in_order() -> None:
    over, at, empty, other = Op(2 * KEEP + 7), Op(2 * KEEP), Op(0), object()
    assert trim([over, at, empty, other]) == KEEP + 7
    assert over._output_blocks_stats == list(range(KEEP + 7, 2 * KEEP + 7))  # the newest, oldest first
    assert at._output_blocks_stats == list(range(2 * KEEP))  # at the bound: untouched
    assert empty._output_blocks_stats == []
    assert trim([over]) == 0  # trimmed once per KEEP new blocks, not at every step


def test_the_callback_trims_the_executors_topology_and_tolerates_none() -> None:
    class Executor:
        def __init__(self, ops: dict[Any, Any] | None) -> None:
            self._topology = ops

    op = Op(3 * KEEP)
    op._output_blocks_stats = tuple(op._output_blocks_stats)  # not a list: another Ray's type, left alone
    listed = Op(3 * KEEP)
    BoundedBlockStats().on_execution_step(Executor({op: None, listed: None}))
    assert len(op._output_blocks_stats) == 3 * KEEP and len(listed._output_blocks_stats) == KEEP
    BoundedBlockStats().on_execution_step(Executor(None))  # before execution starts
    BoundedBlockStats().on_execution_step(object())  # a Ray whose executor has no _topology


def test_the_jobs_data_context_registers_the_callback_once(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = DataContext.get_current()
    monkeypatch.setattr(ctx, "custom_execution_callback_classes", [])
    configure_data_context()
    configure_data_context()
    assert ctx.custom_execution_callback_classes == [data_stats.BoundedBlockStats]
