"""The benchmarks' context-switch figures: what bench_service prints as wake-ups and preemptions per
process, and what the plain vLLM worker reports of its own threads."""

from __future__ import annotations

import os
import threading
import time

import pytest

from bench.bench_ray_job import thread_switches
from bench.bench_service import core_split, switches_by_component

pytestmark = pytest.mark.unit


def test_thread_switches_counts_the_wake_ups_of_every_thread_of_a_process() -> None:
    napped, release = threading.Event(), threading.Event()

    def nap() -> None:
        for _ in range(50):
            time.sleep(0.001)  # each sleep ends in a wake-up: a voluntary switch
        napped.set()
        release.wait()  # stay alive: /proc counts the threads that exist

    before = thread_switches()
    sleeper = threading.Thread(target=nap)
    sleeper.start()
    try:
        napped.wait()  # the main thread sleeps once meanwhile
        after = thread_switches(os.getpid())
    finally:
        release.set()
        sleeper.join()
    assert before is not None and after is not None
    assert after[0] - before[0] >= 50  # the sleeper's, summed with the main thread's


def test_thread_switches_of_a_process_that_is_gone_is_none() -> None:
    assert thread_switches(2**22 + 7) is None  # above the default pid_max: no such process


def test_switches_by_component_sums_processes_of_a_label_and_ranks_the_most_waking_first() -> None:
    before = {
        1: ("java (Kafka)", 100, 5),
        2: ("raylet", 0, 0),
        3: ("raylet", 10, 0),
        4: ("ray::ServeReplica:llmbatch-engine-m", 0, 0),
    }
    after = {
        1: ("java (Kafka)", 300, 9),
        2: ("raylet", 50, 2),
        3: ("raylet", 60, 2),
        4: ("ray::ServeReplica:llmbatch-engine-m", 2000, 3700),
        5: ("redis-server", 40, 0),
    }
    rates = switches_by_component(before, after, wall_s=2.0)
    engine = "ray::ServeReplica:llmbatch-engine-m"
    assert list(rates)[:4] == [engine, "java (Kafka)", "raylet", "redis-server"]
    assert rates[engine] == {"wakeups_per_s": 1000, "preempted_per_s": 1850}
    assert rates["raylet"] == {"wakeups_per_s": 50, "preempted_per_s": 2}  # (50 + 50) / 2 s and (2 + 2) / 2 s
    assert rates["java (Kafka)"] == {"wakeups_per_s": 100, "preempted_per_s": 2}
    assert rates["redis-server"]["wakeups_per_s"] == 20  # started during the phase: counted from 0
    assert rates["outside the engine"]["wakeups_per_s"] == 100 + 50 + 20


def test_core_split_gives_the_engines_the_last_core_alone_and_the_rest_the_others() -> None:
    assert core_split({0, 1}, "split") == ({1}, {0})
    assert core_split({2, 5, 7}, "split") == ({7}, {2, 5})
    # every other mode, and a single core, leaves every thread on every core
    assert core_split({0, 1}, "normal") == ({0, 1}, {0, 1})
    assert core_split({0, 1}, "batch") == ({0, 1}, {0, 1})
    assert core_split({3}, "split") == ({3}, {3})


def test_cores_outside_the_engine_count_every_process_not_only_the_busiest() -> None:
    from bench.service.cpu import cpu_by_component, cpu_outside_engine

    engine = "ray::ServeReplica:llmbatch-engine-m"
    before = {1: (engine, 0.0), 2: ("java (Kafka)", 0.0), **{10 + i: (f"p{i}", 0.0) for i in range(12)}}
    after = {1: (engine, 90.0), 2: ("java (Kafka)", 6.0), **{10 + i: (f"p{i}", 0.5) for i in range(12)}}
    assert cpu_outside_engine(before, after, 60.0) == pytest.approx((6.0 + 12 * 0.5) / 60.0)
    # the busiest ten alone would leave two of the small ones out
    assert len(cpu_by_component(before, after, 60.0)) == 10
