"""What a local process was started with, read from ``/proc`` as code running beside it could read it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path


def raw_environ(pid: int) -> bytes:
    """``/proc/<pid>/environ`` as it is: NUL-separated ``NAME=value`` items."""
    return (Path("/proc") / str(pid) / "environ").read_bytes()


def environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with, by name."""
    raw = raw_environ(pid)
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)


def parent_pid(pid: int) -> int:
    """The parent of process ``pid`` (for a Ray worker: the raylet that started it)."""
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def environ_of_first(pids: Iterable[int], matches: Callable[[list[str]], bool]) -> dict[str, str] | None:
    """The environment of the first of ``pids`` whose command line ``matches``, or None. Processes gone
    or turned zombie meanwhile (a Ray head's short-lived children) are passed over."""
    import psutil

    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if matches(proc.cmdline()):
                return proc.environ()
        except psutil.Error:
            continue
    return None
