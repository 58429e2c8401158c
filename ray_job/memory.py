"""The driver's own memory, now and at its sampled peak.

Every Ray worker and driver maps the node's whole object store (``/dev/shm/plasma*``); RSS counts each
store page a process has touched, so ``ru_maxrss`` grows with the data that passed through the
process (up to the store's size) even when its own memory does not. USS (pages no other process
shares) leaves most of them out, but not the store pages only this process still maps. The driver's
own memory is its RSS without the store's pages (:func:`driver_own_mb`). :class:`MemoryPeak` samples
a figure in a daemon thread every few seconds, so a large batch's figure is its peak, not its value at
the end.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

SAMPLE_EVERY_S = 2.0


PLASMA_NAME = "plasma"
"""How the object store's file is named (``/dev/shm/plasmaXXXXXX``, or in the plasma directory Ray
falls back to when ``/dev/shm`` is too small)."""


def object_store_bytes(proc: Any) -> int:
    """Bytes of the object store's mapping resident in ``proc`` (a :class:`psutil.Process`)."""
    return sum(int(m.rss) for m in proc.memory_maps(grouped=True)
               if os.path.basename(m.path).startswith(PLASMA_NAME))


def driver_own_mb() -> float | None:
    """This process's RSS without the object store's pages, in MB; ``None`` when the OS does not say."""
    try:
        import psutil

        proc = psutil.Process()
        return round((proc.memory_info().rss - object_store_bytes(proc)) / 1e6, 1)
    except Exception:  # psutil.AccessDenied, no /proc/<pid>/smaps: the figure is informational
        return None


def driver_uss_mb() -> float | None:
    """This process's USS in MB now; ``None`` when the OS does not say."""
    try:
        import psutil

        return round(psutil.Process().memory_full_info().uss / 1e6, 1)
    except Exception:  # psutil.AccessDenied, no /proc/<pid>/smaps: the figure is informational
        return None


class MemoryPeak:
    """The highest ``sample()`` seen between :meth:`start` and :meth:`stop` (every ``every_s``);
    ``sample=None`` samples nothing (a batch run in a shared process has no memory of its own)."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S,
                 sample: Callable[[], float | None] | None = driver_uss_mb) -> None:
        self._every = every_s
        self._sample = sample
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_mb: float | None = None
        self.samples = 0

    def _take(self) -> None:
        value = self._sample() if self._sample is not None else None
        if value is not None:
            self.samples += 1
            self.peak_mb = value if self.peak_mb is None else max(self.peak_mb, value)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._take()

    def start(self) -> None:
        if self._sample is None:
            return
        self._take()
        self._thread = threading.Thread(target=self._run, name="uss-peak", daemon=True)
        self._thread.start()

    def stop(self) -> float | None:
        """Stop sampling (one last sample first); returns the peak in MB."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._take()
        return self.peak_mb
