"""One port allocator for every local service of the stack (and the tests' helper servers).

Why: a port taken from the kernel's ephemeral range (``bind(0)``) can be handed to an outgoing
client socket before the server binds it, and two independent pickers (one for single ports, one
for Ray's worker range) can hand out the same port twice. So every port here:

- lies OUTSIDE the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``) and above the
  well-known defaults (Redis 6379, MinIO 9000, Kafka 9092, Ray 6379/8265/10001 and its default
  worker ports 10002-19999); BELOW the ephemeral range while ports are left there, because Ray
  picks every port it is not given as ``randint(<an ephemeral port>, 65535)``, which can land on a
  port reserved here above the range before its service has bound it;
- is bindable on 127.0.0.1 when handed out;
- is reserved machine-wide by a file ``<folder>/<port>`` created with ``O_EXCL`` that holds the
  owner's PID (and its start time, so a reused PID does not keep a reservation alive). A
  reservation whose owner is dead is stale and reclaimed. Starters hand their ports over to the
  service's PID, so the reservation lives exactly as long as the service; ``release_owner`` tidies
  up when the stack stops. Reading and writing reservations happens under an ``flock`` of
  ``<folder>/.lock``, so two test sessions or two checkouts never collide.

The choice itself (:func:`pick`) is pure: a window of ``size`` ports inside the candidate ranges
that avoids a given set of taken ports.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path

import psutil

from llmbatch.stack.process import StackError, alive

EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default
FLOOR = 20000  # below: well-known service defaults and Ray's default worker ports (10002-19999)
CEILING = 65535


class PortsExhausted(StackError):
    """No free window of the wanted size is left in the candidate ranges."""


def ephemeral_range(path: Path = EPHEMERAL_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive); Linux's default when it cannot be read."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    if not 0 < low <= high <= CEILING:
        return DEFAULT_EPHEMERAL
    return low, high


def candidate_ranges(ephemeral: tuple[int, int], floor: int = FLOOR, ceiling: int = CEILING) -> list[range]:
    """Ports in ``[floor, ceiling]`` outside the inclusive ``ephemeral`` range, in order of preference:
    the ports below it first, then those above it (see the module doc: Ray's own picks land there).

    When the ephemeral range covers everything, the whole window is returned: reservations and the
    bind check still apply, only the protection against client sockets is lost.
    """
    low, high = ephemeral
    parts = [range(floor, min(low, ceiling + 1)), range(max(high + 1, floor), ceiling + 1)]
    kept = [r for r in parts if len(r) > 0]
    return kept or [range(floor, ceiling + 1)]


def pick(size: int, taken: Collection[int], ranges: Sequence[range], offset: int = 0) -> int | None:
    """First port of ``size`` consecutive ports, all inside one of ``ranges`` and none in ``taken``.

    The search starts at the ``offset``-th possible window (counted over all ranges) and wraps
    around, so concurrent callers with different offsets spread out. ``None`` when nothing fits.
    """
    if size < 1:
        raise ValueError("size must be at least 1")
    starts = [range(r.start, r.stop - size + 1) for r in ranges if len(r) >= size]
    total = sum(len(s) for s in starts)
    if total == 0:
        return None
    for start in _rotated(starts, offset % total):
        if not any(p in taken for p in range(start, start + size)):
            return start
    return None


def _rotated(parts: list[range], skip: int) -> Iterator[int]:
    """The concatenation of ``parts`` from its ``skip``-th element on, then its first ``skip``."""
    seen = 0
    heads: list[range] = []
    for part in parts:
        cut = min(max(skip - seen, 0), len(part))
        yield from part[cut:]
        heads.append(part[:cut])
        seen += len(part)
    for head in heads:
        yield from head


def bindable(port: int, host: str = "127.0.0.1", reuse: bool = False) -> bool:
    """A server could bind ``host:port`` right now.

    Without ``reuse`` (fresh ports) even a connection in TIME_WAIT on that port counts as busy;
    with it (a restart on the old port) only what a server with SO_REUSEADDR would trip over does,
    as Redis, Kafka, MinIO and Ray all set it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _identity(pid: int) -> str:
    """``"<pid> <start time>"``: a reservation stays valid only for that very process."""
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        started = 0.0
    return f"{pid} {started:.3f}"


def _owner_alive(content: str) -> bool:
    try:
        pid_text, started_text = content.split()
        pid, started = int(pid_text), float(started_text)
    except ValueError:
        return False
    try:
        same = abs(psutil.Process(pid).create_time() - started) < 0.01
    except psutil.Error:
        return False
    return same and alive(pid)


def default_folder() -> Path:
    """Where reservations live: ``LLMBATCH_PORTS_DIR`` or ``<tempdir>/llmbatch-ports``."""
    return Path(os.environ.get("LLMBATCH_PORTS_DIR", Path(tempfile.gettempdir()) / "llmbatch-ports"))


class PortAllocator:
    """Hands out ports that no other holder of a reservation in ``folder`` has (see module doc)."""

    def __init__(
        self,
        folder: Path | None = None,
        ranges: Sequence[range] | None = None,
        rng: random.Random | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.folder = folder or default_folder()
        self.ranges = list(ranges) if ranges is not None else candidate_ranges(ephemeral_range())
        self.host = host
        self._rng = rng or random.Random()
        self._thread_lock = threading.Lock()

    # --- public API -------------------------------------------------------------------------

    def port(self) -> int:
        """One port, reserved for this process."""
        return self.port_range(1)

    def port_range(self, size: int) -> int:
        """First port of ``size`` consecutive ports, all reserved for this process."""
        with self._locked():
            taken = self._live_reservations()
            while True:
                start = self._pick_preferred(size, taken)
                if start is None:
                    raise PortsExhausted(
                        f"no {size} consecutive free ports left in {_describe(self.ranges)} "
                        f"(reservations in {self.folder})"
                    )
                busy = [p for p in range(start, start + size) if not bindable(p, self.host)]
                if busy:
                    taken |= set(busy)  # in use by something that holds no reservation
                    continue
                clash = self._create_all(range(start, start + size))
                if clash is None:
                    return start
                taken.add(clash)  # a reservation file we could not read: leave that port alone

    def _pick_preferred(self, size: int, taken: Collection[int]) -> int | None:
        """A free window in the first range that has one (a random place in it: concurrent callers
        spread out)."""
        for part in self.ranges:
            start = pick(size, taken, [part], self._rng.randrange(1 << 30))
            if start is not None:
                return start
        return None

    def claim(self, port: int, grace_s: float = 2.0) -> bool:
        """Reserve exactly ``port`` for this process (a restart on its old port); False if taken.

        A live owner's reservation refuses at once. A port that is not bindable is retried for
        ``grace_s``: the kernel tears a killed server's sockets down a few milliseconds after the
        process is gone.
        """
        deadline = time.monotonic() + grace_s
        while True:
            with self._locked():
                if port in self._live_reservations():
                    return False
                if bindable(port, self.host, reuse=True):
                    return self._create_all([port]) is None
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def hand_over(self, ports: Iterable[int], pid: int) -> None:
        """Make ``pid`` (the started service) the owner of these reservations."""
        identity = _identity(pid)
        with self._locked():
            for port in ports:
                tmp = self.folder / f".{port}.{os.getpid()}.tmp"
                tmp.write_text(identity)
                os.replace(tmp, self.folder / str(port))

    def release(self, ports: Iterable[int]) -> None:
        """Drop reservations of ``ports`` that this process or a dead process holds."""
        mine = _identity(os.getpid())
        with self._locked():
            for port in ports:
                path = self.folder / str(port)
                content = _read(path)
                if content is not None and (content == mine or not _owner_alive(content)):
                    path.unlink(missing_ok=True)

    def release_owner(self, pid: int) -> list[int]:
        """Drop the reservations of ``pid`` once it has stopped (a live owner keeps them)."""
        prefix = f"{pid} "
        dropped: list[int] = []
        with self._locked():
            for path, content in list(self._entries()):
                if content.startswith(prefix) and not _owner_alive(content):
                    path.unlink(missing_ok=True)
                    dropped.append(int(path.name))
        return sorted(dropped)

    def reservations(self) -> dict[int, str]:
        """Live reservations: port -> ``"<pid> <start time>"`` of the owner (stale ones are removed)."""
        with self._locked():
            self._live_reservations()
            return {int(path.name): content for path, content in self._entries()}

    # --- internals (call with the lock held) ------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            self._make_folder()
            fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing drops the flock

    def _make_folder(self) -> None:
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # shared by every user of the machine, like /tmp
                os.chmod(self.folder, 0o1777)  # noqa: S103 - sticky: nobody deletes others' files

    def _entries(self) -> Iterator[tuple[Path, str]]:
        for path in self.folder.iterdir():
            if path.name.isdigit():
                content = _read(path)
                if content is not None:
                    yield path, content

    def _live_reservations(self) -> set[int]:
        """Ports with a live owner; reservations of dead owners are removed on the way."""
        live: set[int] = set()
        known: dict[str, bool] = {}
        for path, content in list(self._entries()):
            if content not in known:
                known[content] = _owner_alive(content)
            if known[content]:
                live.add(int(path.name))
            else:
                with contextlib.suppress(OSError):  # e.g. another user's file in the sticky folder
                    path.unlink()
                if path.exists():
                    live.add(int(path.name))
        return live

    def _create_all(self, ports: Iterable[int]) -> int | None:
        """Create every reservation file with O_EXCL; on a clash undo and return that port."""
        identity = _identity(os.getpid())
        made: list[Path] = []
        for port in ports:
            path = self.folder / str(port)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                for done in made:
                    done.unlink(missing_ok=True)
                return port
            with os.fdopen(fd, "w") as fh:
                fh.write(identity)
            made.append(path)
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _describe(ranges: Sequence[range]) -> str:
    return ", ".join(f"{r.start}-{r.stop - 1}" for r in ranges)


_DEFAULT: PortAllocator | None = None
_DEFAULT_LOCK = threading.Lock()


def allocator() -> PortAllocator:
    """The process-wide allocator every part of the stack uses."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = PortAllocator()
        return _DEFAULT


def free_port() -> int:
    """A TCP port on 127.0.0.1, reserved for this process by the stack's one allocator.

    Outside the kernel's ephemeral range, bindable now, and never handed out again while this
    process lives (see :mod:`llmbatch.stack.ports`).
    """
    return allocator().port()


def free_port_range(size: int) -> int:
    """First port of ``size`` consecutive ports reserved like :func:`free_port` (Ray worker ports)."""
    return allocator().port_range(size)
