"""The driver's USS peak: sampled while the attempt runs, so a large batch's figure is its highest, not
its value at the end (ray_job.memory)."""

from __future__ import annotations

import threading

import pytest

from ray_job.memory import UssPeak, driver_uss_mb

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

    peak = UssPeak(every_s=0.01, sample=sample)
    peak.start()
    assert took.wait(10)
    assert peak.stop() == 250.0 and seen[-1] == 110.0
    assert peak.samples == len([v for v in seen if v is not None])


def test_no_sampler_means_no_figure_and_no_thread() -> None:
    before = threading.active_count()
    peak = UssPeak(sample=None)
    peak.start()
    assert threading.active_count() == before
    assert peak.stop() is None and peak.samples == 0


def test_this_process_has_a_uss() -> None:
    now = driver_uss_mb()
    assert now is not None and now > 1.0
    peak = UssPeak(every_s=60)
    peak.start()
    found = peak.stop()
    assert found is not None and found >= now / 2
