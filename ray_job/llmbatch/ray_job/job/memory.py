"""A process's memory with and without Ray's object store, now and at its sampled peak.

Every Ray worker and driver maps the node's whole object store (``/dev/shm/plasma*``); RSS counts each
store page a process has touched, so ``ru_maxrss`` grows with the data that passed through the
process (up to the store's size) even when its own memory does not. USS (pages no other process
shares) leaves most of them out, but not the store pages only this process still maps. A process's
own memory is its RSS without the store's pages (:attr:`MemoryUse.own`). All three come from one read
of ``/proc/<pid>/smaps`` (:func:`read_memory`). :class:`MemoryPeak` samples them in a daemon thread
every few seconds, so a large batch's figures are its peaks, not its values at the end. Figures are
in MiB (``2**20`` bytes), as ``ru_maxrss / 1024`` is.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

SAMPLE_EVERY_S = 2.0
MIB = 1 << 20

PLASMA_NAME = "plasma"
"""How the object store's file is named (``/dev/shm/plasmaXXXXXX``, or in the plasma directory Ray
falls back to when ``/dev/shm`` is too small)."""

_PRIVATE = (b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:")


@dataclass(frozen=True)
class MemoryUse:
    """One reading of a process's memory, in bytes."""

    rss: int
    uss: int  # pages no other process maps (psutil's ``uss``)
    store: int  # resident pages of the object store's mapping

    @property
    def own(self) -> int:
        """RSS without the object store's pages."""
        return self.rss - self.store


def mib(n: int) -> float:
    """Bytes as MiB, one decimal."""
    return round(n / MIB, 1)


def parse_smaps(text: bytes) -> MemoryUse:
    """Sum a ``/proc/<pid>/smaps`` text: RSS, USS and the object store's resident bytes."""
    rss = uss = store = 0
    in_store = False
    for line in text.splitlines():
        key, _, rest = line.partition(b" ")
        if not key.endswith(b":"):  # a mapping's header: "start-end perms offset dev inode [path]"
            parts = line.split(maxsplit=5)
            path = parts[5].strip() if len(parts) == 6 else b""
            in_store = os.path.basename(path).startswith(PLASMA_NAME.encode())
            continue
        if key == b"Rss:":
            kib = int(rest.split()[0])
            rss += kib
            if in_store:
                store += kib
        elif key in _PRIVATE:
            uss += int(rest.split()[0])
    return MemoryUse(rss=rss * 1024, uss=uss * 1024, store=store * 1024)


def read_memory(pid: int | str = "self") -> MemoryUse | None:
    """``pid``'s memory (this process by default); ``None`` when the OS does not say (no such
    process, no permission, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/smaps", "rb") as f:
            return parse_smaps(f.read())
    except (OSError, ValueError):  # the figure is informational: never fail a batch for it
        return None


class MemoryPeak:
    """The highest USS and own memory seen between :meth:`start` and :meth:`stop` (sampled every
    ``every_s`` by one thread); ``sample=None`` samples nothing (a batch run in a shared process has
    no memory of its own)."""

    def __init__(
        self, every_s: float = SAMPLE_EVERY_S, sample: Callable[[], MemoryUse | None] | None = read_memory
    ) -> None:
        self._every = every_s
        self._sample = sample
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._uss = 0
        self._own = 0
        self.samples = 0

    @property
    def uss_mb(self) -> float | None:
        return mib(self._uss) if self.samples else None

    @property
    def own_mb(self) -> float | None:
        return mib(self._own) if self.samples else None

    def now(self) -> MemoryUse | None:
        """A reading now (``None`` when this peak samples nothing: the process is not the attempt's own,
        and reading a big process's ``smaps`` costs more than a small batch's whole run)."""
        return self._sample() if self._sample is not None else None

    def _take(self) -> None:
        use = self._sample() if self._sample is not None else None
        if use is not None:
            self.samples += 1
            self._uss = max(self._uss, use.uss)
            self._own = max(self._own, use.own)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._take()

    def start(self) -> None:
        if self._sample is None:
            return
        self._take()
        self._thread = threading.Thread(target=self._run, name="memory-peak", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (one last sample first); the peaks stay in :attr:`uss_mb` and :attr:`own_mb`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
            self._take()
