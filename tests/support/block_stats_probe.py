"""Run as a Ray job by tests/integration/test_ray_job_fake.py: one dataset of many blocks through a map
stage with the job's DataContext, then the same without the stats bound; prints what Ray's own summary
counts for the map stage and the rows that came through."""

from __future__ import annotations

import re
import sys

import ray
import ray.data

from llmbatch.ray_job.job import data_stats
from llmbatch.ray_job.job.pipeline import configure_data_context


def run(bounded: bool, blocks: int) -> None:
    ctx = configure_data_context()
    if not bounded:
        ctx.custom_execution_callback_classes = [
            c for c in ctx.custom_execution_callback_classes if c is not data_stats.BoundedBlockStats
        ]
    ds = ray.data.range(blocks * 5, override_num_blocks=blocks).map_batches(
        lambda batch: batch, batch_size=None, num_cpus=0.1
    )
    rows = sum(len(b["id"]) for b in ds.iter_batches(batch_size=None))
    [line] = [ln for ln in ds.stats().splitlines() if "MapBatches" in ln and "blocks produced" in ln]
    counted = int(re.search(r"(\d+) blocks produced", line).group(1))  # type: ignore[union-attr]
    print(f"PROBE bounded={bounded} rows={rows} counted={counted}", flush=True)


def main() -> None:
    data_stats.KEEP = int(sys.argv[1])
    blocks = int(sys.argv[2])
    ray.init()
    run(True, blocks)
    run(False, blocks)


if __name__ == "__main__":
    main()
