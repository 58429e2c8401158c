"""The stack's one port allocator (llmbatch.stack.ports): pure choice, ephemeral range, reservations.

Reservations live in a per-test folder; the other checks bind real sockets on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from llmbatch.stack import ports as ports_mod
from llmbatch.stack.ports import (
    DEFAULT_EPHEMERAL,
    PortAllocator,
    PortsExhausted,
    bindable,
    candidate_ranges,
    ephemeral_range,
    free_port,
    free_port_range,
    pick,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _in_ephemeral(port: int) -> bool:
    low, high = ephemeral_range()
    return low <= port <= high


def _quiet_window(size: int) -> range:
    """``size`` consecutive ports outside the ephemeral range that are bindable right now."""
    rng = random.Random()
    ranges = candidate_ranges(ephemeral_range())
    for _ in range(200):
        start = pick(size, set(), ranges, rng.randrange(1 << 30))
        assert start is not None
        if all(bindable(p) for p in range(start, start + size)):
            return range(start, start + size)
    raise AssertionError(f"no {size} free consecutive ports found")


def _run_child(folder: Path, code: str, stdin: bool = False) -> subprocess.Popen[str]:
    """A separate Python process using the allocator on ``folder``; it prints one line when ready."""
    script = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\nfrom pathlib import Path\n"
        f"from llmbatch.stack.ports import PortAllocator\nfolder = Path({str(folder)!r})\n"
        + textwrap.dedent(code)
    )
    return subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
    )


# --- pure logic ---------------------------------------------------------------------------------


def test_ephemeral_range_is_read_from_the_kernel_file_with_a_fallback(tmp_path: Path) -> None:
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(f) == (40000, 50000)
    f.write_text("garbage\n")
    assert ephemeral_range(f) == DEFAULT_EPHEMERAL
    f.write_text("50000 40000\n")  # inverted: not a range
    assert ephemeral_range(f) == DEFAULT_EPHEMERAL
    assert ephemeral_range(tmp_path / "missing") == DEFAULT_EPHEMERAL
    low, high = ephemeral_range()  # the real one
    assert 0 < low <= high <= 65535


def test_candidate_ranges_leave_out_the_ephemeral_range_and_low_ports() -> None:
    assert candidate_ranges((32768, 60999)) == [range(20000, 32768), range(61000, 65536)]
    assert candidate_ranges((40000, 50000)) == [range(20000, 40000), range(50001, 65536)]
    assert candidate_ranges((10000, 25000)) == [range(25001, 65536)]
    assert candidate_ranges((30000, 65535)) == [range(20000, 30000)]
    # nothing is left outside: the whole window, reservations still apply
    assert candidate_ranges((1024, 65535)) == [range(20000, 65536)]


def test_pick_finds_a_window_avoiding_taken_ports_and_wraps_around() -> None:
    assert pick(1, set(), [range(100, 105)]) == 100
    assert pick(1, set(), [range(100, 105)], offset=3) == 103
    assert pick(1, set(), [range(100, 105)], offset=5) == 100  # wraps
    assert pick(1, {103, 104}, [range(100, 105)], offset=3) == 100
    assert pick(3, {101}, [range(100, 110)]) == 102
    # a window never spans two ranges (the gap is the ephemeral range)
    assert pick(3, set(), [range(100, 102), range(200, 205)]) == 200
    assert pick(3, {201}, [range(100, 102), range(200, 205)]) == 202
    assert pick(3, {202}, [range(100, 102), range(200, 205)]) is None
    assert pick(6, set(), [range(100, 105)]) is None
    with pytest.raises(ValueError, match="size"):
        pick(0, set(), [range(100, 105)])


def test_pick_never_returns_a_window_touching_taken_ports() -> None:
    """Randomised against a brute force: the window is free and inside one range, or none exists."""
    rng = random.Random(7)
    for _ in range(500):
        ranges = [range(a, a + rng.randrange(0, 40)) for a in (1000, 1100, 1200)]
        taken = {rng.randrange(1000, 1250) for _ in range(rng.randrange(0, 60))}
        size = rng.randrange(1, 12)
        got = pick(size, taken, ranges, rng.randrange(1000))
        fits = [
            s
            for r in ranges
            for s in range(r.start, r.stop - size + 1)
            if not taken & set(range(s, s + size))
        ]
        if got is None:
            assert fits == []
        else:
            assert got in fits


def test_pick_keeps_a_worker_range_clear_of_the_dashboard_port() -> None:
    # the original failure: 'dashboard': 43171 inside 'worker_ports': 43140-43239; once the
    # dashboard's port is known to be taken, no window may contain it
    start = pick(100, {43171}, [range(43140, 43400)])
    assert start is not None and 43171 not in range(start, start + 100)


# --- the allocator ------------------------------------------------------------------------------


def one_ray_head(single: Callable[[], int], block: Callable[[int], int], workers: int) -> None:
    """The ports one Ray head takes (gcs, dashboard, client, agent, worker range), checked as Ray
    checks them at start-up, plus: nothing inside the kernel's ephemeral range."""
    singles = [single() for _ in range(4)]
    first = block(workers)
    worker_ports = set(range(first, first + workers))
    assert len(set(singles)) == 4, singles
    assert not worker_ports & set(singles), f"{singles} inside worker ports {first}-{first + workers - 1}"
    assert not [p for p in [*singles, *worker_ports] if _in_ephemeral(p)], (singles, first)


def test_ray_head_ports_never_collide_and_stay_out_of_the_ephemeral_range(tmp_path: Path) -> None:
    """Regression for 'Ray component worker_ports is trying to use a port number 43171 that is used
    by other components'. The old free_port() (bind to port 0) always lands in the ephemeral range,
    so this fails against it on the first assertion about the ephemeral range; the old
    free_port_range() did not know what free_port() had handed out, so they could also overlap."""
    alloc = PortAllocator(tmp_path / "reservations")
    for size in (100, 200, 100, 200):  # tests/support/private_ray.py, then ray_head.start_ray
        one_ray_head(alloc.port, alloc.port_range, size)


def test_the_process_wide_wrappers_use_the_allocator() -> None:
    # free_port/free_port_range as every caller (services, demo, tests) reaches them
    one_ray_head(free_port, free_port_range, 100)
    mine = ports_mod.allocator().reservations()
    port = free_port()
    assert port in ports_mod.allocator().reservations()
    assert port not in mine


def test_a_range_requested_after_a_single_skips_it(tmp_path: Path) -> None:
    """Deterministic form of the collision: room for a 100-port window only beside the single."""
    window = _quiet_window(201)
    for seed in range(10):
        alloc = PortAllocator(tmp_path / f"r{seed}", ranges=[window], rng=random.Random(seed))
        single = alloc.port()
        first = alloc.port_range(100)
        assert single not in range(first, first + 100)
        assert set(range(first, first + 100)) <= set(window)


def test_singles_and_ranges_interleaved_never_repeat_a_port(tmp_path: Path) -> None:
    window = _quiet_window(400)
    alloc = PortAllocator(tmp_path / "reservations", ranges=[window], rng=random.Random(3))
    handed: list[int] = []

    def until_used_up() -> None:
        sizes = [1, 20, 1, 1, 50, 1, 7, 1, 30, 1]
        for i in range(1000):
            size = sizes[i % len(sizes)]
            first = alloc.port() if size == 1 else alloc.port_range(size)
            handed.extend(range(first, first + size))

    with pytest.raises(PortsExhausted):
        until_used_up()
    assert len(handed) == len(set(handed)), "a port was handed out twice"
    assert set(handed) <= set(window)
    assert len(handed) > len(window) // 2, "gave up long before the window was used up"
    # a second allocator on the same folder (another checkout, same machine) sees all of them
    other = PortAllocator(tmp_path / "reservations", ranges=[window])
    assert set(other.reservations()) >= set(handed)


def test_ports_below_the_ephemeral_range_go_first_and_those_above_only_when_none_is_left(
    tmp_path: Path,
) -> None:
    """Ray picks every port it is not given in ``[an ephemeral port, 65535]``: a port reserved above
    the ephemeral range can be taken by a Ray node before its own service binds it (a CI run lost a
    worker node three attempts running), so those are the last resort."""
    window = _quiet_window(40)
    below, above = range(window.start, window.start + 4), range(window.start + 10, window.stop)
    for seed in range(5):
        alloc = PortAllocator(tmp_path / f"r{seed}", ranges=[below, above], rng=random.Random(seed))
        got = [alloc.port() for _ in range(6)]
        assert sorted(got[:4]) == list(below), got
        assert all(p in above for p in got[4:]), got
        assert alloc.port_range(3) in range(above.start, above.stop - 2)


def test_busy_ports_are_skipped(tmp_path: Path) -> None:
    window = _quiet_window(3)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", window[1]))
        busy.listen()
        alloc = PortAllocator(tmp_path / "reservations", ranges=[window], rng=random.Random(1))
        got = {alloc.port(), alloc.port()}
        assert got == {window[0], window[2]}
        assert not alloc.claim(window[1], grace_s=0.2)
        with pytest.raises(PortsExhausted):
            alloc.port()


def test_claim_waits_briefly_for_a_port_being_freed(tmp_path: Path) -> None:
    """A restart on the old port right after a kill: the socket may go a moment after the process."""
    window = _quiet_window(1)
    alloc = PortAllocator(tmp_path / "reservations", ranges=[window])
    busy = socket.socket()
    busy.bind(("127.0.0.1", window[0]))
    busy.listen()
    timer = threading.Timer(0.3, busy.close)
    timer.start()
    try:
        assert alloc.claim(window[0], grace_s=5)
    finally:
        timer.cancel()
        busy.close()
    assert window[0] in alloc.reservations()


def test_reservations_of_a_live_process_are_respected(tmp_path: Path) -> None:
    window = _quiet_window(3)
    folder = tmp_path / "reservations"
    child = _run_child(
        folder,
        f"""
        import time
        port = PortAllocator(folder, ranges=[range({window.start}, {window.stop})]).port()
        print(port, flush=True)
        time.sleep(120)
    """,
    )
    try:
        assert child.stdout is not None
        theirs = int(child.stdout.readline())
        alloc = PortAllocator(folder, ranges=[window])
        mine = {alloc.port(), alloc.port()}
        assert theirs not in mine and mine | {theirs} == set(window)
        with pytest.raises(PortsExhausted):
            alloc.port()
        assert not alloc.claim(theirs)
        alloc.release([theirs])  # not ours and its owner lives: stays
        assert alloc.release_owner(child.pid) == []
        assert theirs in alloc.reservations()
    finally:
        child.kill()
        child.wait()
    # the owner is gone: its reservation is stale and can be taken
    assert alloc.claim(theirs)


def test_reservations_of_dead_processes_are_reclaimed(tmp_path: Path) -> None:
    window = _quiet_window(2)
    folder = tmp_path / "reservations"
    child = _run_child(
        folder,
        f"""
        a = PortAllocator(folder, ranges=[range({window.start}, {window.stop})])
        print(a.port(), flush=True)  # exits without releasing
    """,
    )
    assert child.stdout is not None
    dead = int(child.stdout.readline())
    assert child.wait() == 0
    # a reused PID: ours, but with another start time
    reused = window[1] if dead == window[0] else window[0]
    (folder / str(reused)).write_text(f"{os.getpid()} 12345.000")
    alloc = PortAllocator(folder, ranges=[window])
    assert {alloc.port(), alloc.port()} == set(window)


def test_hand_over_makes_the_service_the_owner(tmp_path: Path) -> None:
    window = _quiet_window(1)
    folder = tmp_path / "reservations"
    alloc = PortAllocator(folder, ranges=[window])
    port = alloc.port()
    service = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        alloc.hand_over([port], service.pid)
        assert alloc.reservations()[port].startswith(f"{service.pid} ")
        alloc.release([port])  # no longer ours: the running service keeps it
        assert not alloc.claim(port)
    finally:
        service.kill()
        service.wait()
    assert alloc.release_owner(service.pid) == [port]
    assert alloc.reservations() == {}


def test_two_processes_allocating_at_once_never_share_a_port(tmp_path: Path) -> None:
    window = _quiet_window(300)  # slack: random placement fragments the window
    folder = tmp_path / "reservations"
    code = f"""
        a = PortAllocator(folder, ranges=[range({window.start}, {window.stop})])
        got = []
        for i in range(15):
            got.append(a.port())
            first = a.port_range(3)
            got.extend(range(first, first + 3))
        print(" ".join(map(str, got)), flush=True)
        sys.stdin.readline()  # hold the reservations until both are done (a dead owner frees them)
    """
    children = [_run_child(folder, code, stdin=True) for _ in range(2)]
    outputs = []
    for child in children:
        assert child.stdout is not None
        outputs.append([int(x) for x in child.stdout.readline().split()])
    for child in children:
        child.communicate("\n", timeout=60)
        assert child.returncode == 0
    a, b = outputs
    assert len(a) == len(b) == 60
    assert not set(a) & set(b)


def test_a_restart_claims_its_old_ports_or_names_the_service_and_the_taken_port(tmp_path: Path) -> None:
    from llmbatch.stack.process import StackError
    from llmbatch.stack.start_ports import StartPorts as _StartPorts

    alloc = PortAllocator(tmp_path / "reservations")
    free, taken = alloc.port(), alloc.port()  # both reserved by this (live) process
    alloc.release([free])
    start = _StartPorts(alloc)
    assert start.again("MinIO", {"s3": free}, "s3") == [free] and start.held == [free]
    with pytest.raises(StackError, match=rf"^Kafka cannot restart on port {taken}: something already"):
        _StartPorts(alloc).again("Kafka", {"controller": taken}, "controller")
