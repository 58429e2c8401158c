"""What the tests' kubelet node (tests/support/kube_node.py) changes on this machine beyond its own
folder, and how it is given back: the kernel tunables the kubelet writes (not per namespace), the
cgroup v1 hierarchies its pods' cgroups live in, processes killed by PID, mounts under a folder.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil

# what the kubelet writes at start (pkg/kubelet/cm: setupKernelTunables): read before, restored after
KERNEL_TUNABLES = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
CGROUP_FS = Path("/sys/fs/cgroup")


def read_tunables() -> dict[str, str]:
    """The current values of :data:`KERNEL_TUNABLES`."""
    return {key: (Path("/proc/sys") / key).read_text().strip() for key in KERNEL_TUNABLES}


def write_tunables(values: dict[str, str]) -> None:
    """Write back values :func:`read_tunables` read (one that cannot be written is left)."""
    for key, value in values.items():
        with contextlib.suppress(OSError):
            (Path("/proc/sys") / key).write_text(value)


def cgroup_hierarchies() -> list[Path]:
    """This machine's cgroup v1 hierarchies (one folder per mounted controller set)."""
    return sorted(
        p for p in CGROUP_FS.iterdir() if p.is_dir() and (p / "cgroup.procs").exists() and p.name != "unified"
    )


def kill_all(pids: set[int]) -> None:
    """SIGKILL every process of ``pids`` still there and wait (10 s at most) until they are gone."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGKILL)
            procs.append(proc)
    psutil.wait_procs(procs, timeout=10)


def mounts_under(folder: Path) -> Iterator[str]:
    """The mount points of this mount namespace under ``folder``."""
    prefix = str(folder.resolve()) + "/"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount_point = line.split()[4].replace("\\040", " ")
        if mount_point.startswith(prefix):
            yield mount_point


def remove_cgroup(path: Path) -> None:
    """rmdir a cgroup and its children, deepest first (a cgroup folder holds no files to delete)."""
    if not path.exists():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()
