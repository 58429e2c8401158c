"""The driver's own memory: USS (pages no other process shares), now and at its sampled peak.

``ru_maxrss`` also counts the object-store pages the driver mapped to read results, so it grows with
a batch's size even when the driver's own memory does not. :class:`UssPeak` samples the USS in a
daemon thread every few seconds, so a large batch's figure is its peak, not its value at the end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

SAMPLE_EVERY_S = 2.0


def driver_uss_mb() -> float | None:
    """This process's USS in MB now; ``None`` when the OS does not say."""
    try:
        import psutil

        return round(psutil.Process().memory_full_info().uss / 1e6, 1)
    except Exception:  # psutil.AccessDenied, no /proc/<pid>/smaps: the figure is informational
        return None


class UssPeak:
    """The highest USS seen between :meth:`start` and :meth:`stop` (sampled every ``every_s``);
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
