"""A process's memory with and without Ray's object store, from one read of its smaps, and the peaks
sampled while an attempt runs (ray_job.job.memory)."""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import pytest

from llmbatch.ray_job.job.memory import MIB, MemoryPeak, MemoryUse, parse_smaps, read_memory

pytestmark = pytest.mark.unit

SMAPS = b"""\
55d0c0a00000-55d0c0a21000 r--p 00000000 fd:01 1234                       /usr/bin/python3.11
Size:                132 kB
Rss:                 100 kB
Pss:                  50 kB
Shared_Clean:         60 kB
Private_Clean:        40 kB
Private_Dirty:         0 kB
VmFlags: rd mr mw me dw sd
7f0000000000-7f0040000000 rw-s 00000000 00:1a 99                         /dev/shm/plasmaXyZ01 (deleted)
Size:            1048576 kB
Rss:                8192 kB
Private_Clean:         0 kB
Private_Dirty:      2048 kB
VmFlags: rd wr sh mr mw me ms sd
7f1000000000-7f1000100000 rw-p 00000000 00:00 0
Rss:                 400 kB
Private_Dirty:       400 kB
Private_Hugetlb:       4 kB
THPeligible:    0
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
Rss:                   0 kB
"""


def test_smaps_sums_rss_uss_and_the_stores_pages() -> None:
    use = parse_smaps(SMAPS)
    assert use == MemoryUse(
        rss=(100 + 8192 + 400) * 1024, uss=(40 + 2048 + 400 + 4) * 1024, store=8192 * 1024
    )
    assert use.own == (100 + 400) * 1024


def test_a_store_mapping_ends_where_the_next_mapping_starts() -> None:
    """The anonymous mapping after the store's is not counted as store, whatever its size."""
    text = SMAPS.replace(b"Rss:                 400 kB", b"Rss:              999999 kB")
    use = parse_smaps(text)
    assert use.store == 8192 * 1024 and use.own == (100 + 999999) * 1024


def test_no_such_process_has_no_figure() -> None:
    assert read_memory(2**22 + 12345) is None


def test_the_object_stores_pages_are_not_this_processs_own(tmp_path: Path) -> None:
    """A mapping named like Ray's object store (``/dev/shm/plasma*``; here a file of that name) counts in
    RSS but not in the process's own memory."""
    size = 32 * MIB
    path = tmp_path / "plasma-test"
    with path.open("wb") as f:
        f.truncate(size)
    before = read_memory()
    with path.open("r+b") as backing, mmap.mmap(backing.fileno(), size) as store:
        for offset in range(0, size, mmap.PAGESIZE):  # touch every page, as a read of results does
            store[offset] = 1
        during = read_memory()
    assert before is not None and during is not None
    assert during.store - before.store >= size * 0.9
    assert during.rss - before.rss >= size * 0.9
    assert abs(during.own - before.own) < 8 * MIB, (before, during)  # the own figure did not move
    assert before.uss > MIB


def test_the_peaks_are_the_highest_samples_not_the_last() -> None:
    values = iter(
        [
            MemoryUse(rss=100 * MIB, uss=90 * MIB, store=0),
            MemoryUse(rss=300 * MIB, uss=250 * MIB, store=200 * MIB),  # own 100
            MemoryUse(rss=180 * MIB, uss=120 * MIB, store=10 * MIB),  # own 170
            None,
        ]
    )
    took = threading.Event()
    seen: list[MemoryUse | None] = []

    def sample() -> MemoryUse | None:
        value = next(values, MemoryUse(rss=110 * MIB, uss=100 * MIB, store=0))
        seen.append(value)
        if len(seen) >= 6:
            took.set()
        return value

    peak = MemoryPeak(every_s=0.01, sample=sample)
    peak.start()
    assert took.wait(10)
    peak.stop()
    assert (peak.uss_mb, peak.own_mb) == (250.0, 170.0)
    assert peak.samples == len([v for v in seen if v is not None])


def test_no_sampler_means_no_figures_and_no_thread() -> None:
    before = threading.active_count()
    peak = MemoryPeak(sample=None)
    peak.start()
    assert threading.active_count() == before
    peak.stop()
    assert peak.uss_mb is None and peak.own_mb is None and peak.samples == 0


def test_this_process_is_sampled_once_at_start_and_once_at_stop() -> None:
    peak = MemoryPeak(every_s=60)
    peak.start()
    peak.stop()
    assert peak.samples == 2 and peak.uss_mb is not None and peak.own_mb is not None
    assert peak.own_mb >= peak.uss_mb / 4
