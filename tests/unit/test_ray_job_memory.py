"""The driver's USS peak: sampled while the attempt runs, so a large batch's figure is its highest, not
its value at the end (ray_job.memory)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ray_job.memory import MemoryPeak, driver_uss_mb

pytestmark = pytest.mark.unit


def test_the_peak_is_the_highest_sample_not_the_last() -> None:
    values = iter([100.0, 180.0, 250.0, 120.0, None, 110.0])
    took = threading.Event()
    seen: list[float | None] = []

    def sample() -> float | None:
        value = next(values, 110.0)
        seen.append(value)
        if len(seen) >= 5:
            took.set()
        return value

    peak = MemoryPeak(every_s=0.01, sample=sample)
    peak.start()
    assert took.wait(10)
    assert peak.stop() == 250.0 and seen[-1] == 110.0
    assert peak.samples == len([v for v in seen if v is not None])


def test_no_sampler_means_no_figure_and_no_thread() -> None:
    before = threading.active_count()
    peak = MemoryPeak(sample=None)
    peak.start()
    assert threading.active_count() == before
    assert peak.stop() is None and peak.samples == 0


def test_this_process_has_a_uss() -> None:
    now = driver_uss_mb()
    assert now is not None and now > 1.0
    peak = MemoryPeak(every_s=60)
    peak.start()
    found = peak.stop()
    assert found is not None and found >= now / 2


def test_the_object_stores_pages_are_not_the_drivers_own(tmp_path: Path) -> None:
    """A mapping named like Ray's object store (``/dev/shm/plasma*``; here a file of that name) counts in
    RSS but not in the driver's own memory."""
    import mmap

    import psutil

    from ray_job.memory import driver_own_mb, object_store_bytes

    size = 32 << 20
    path = tmp_path / "plasma-test"
    with path.open("wb") as f:
        f.truncate(size)
    proc = psutil.Process()
    before_store, before_own = object_store_bytes(proc), driver_own_mb()
    with path.open("r+b") as f, mmap.mmap(f.fileno(), size) as store:
        for offset in range(0, size, mmap.PAGESIZE):  # touch every page, as a read of results does
            store[offset] = 1
        touched = object_store_bytes(proc) - before_store
        own = driver_own_mb()
        rss_mb = proc.memory_info().rss / 1e6
    assert touched >= size * 0.9, touched
    assert before_own is not None and own is not None
    assert own < rss_mb - size / 1e6 * 0.9  # the store's pages are left out ...
    assert abs(own - before_own) < 8, (before_own, own)  # ... so the own figure did not move
