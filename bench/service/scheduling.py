"""The ``--background`` experiment of the service benchmark: the CPU scheduling of the run's processes
(SCHED_BATCH, autogroup nice) and their cores (:func:`core_split`: the engine replicas on a core of their
own under ``split``)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any


def core_split(cores: set[int], mode: str) -> tuple[set[int], set[int]]:
    """The cores of the engine replicas' threads and of every other thread under ``mode``: with
    ``split`` the last core for the engines alone and the others for the rest (all of them on one
    core), else every core for every thread."""
    if mode != "split" or len(cores) < 2:
        return set(cores), set(cores)
    last = max(cores)
    return {last}, set(cores) - {last}


def schedule(mode: str, cores: set[int], state: Any, dispatcher_pid: int | None) -> dict[str, int]:
    """Set ``mode`` (see :meth:`bench.service.harness.Service.scheduling`) on every thread of the sessions
    of the stack's services in ``state``, of the dispatcher and of this process, with ``cores`` this
    process' affinity at start. Returns how many threads and sessions it set."""
    import psutil

    engine_cores, other_cores = core_split(cores, mode)

    ray_sid = os.getsid(state.services["ray"].pid)
    others = [r.pid for n, r in state.services.items() if n != "ray"]
    if dispatcher_pid is not None:
        others.append(dispatcher_pid)
    others.append(os.getpid())
    other_sids = {os.getsid(p) for p in others}
    counts = {"threads_batch": 0, "threads_other": 0, "sessions_niced": 0}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            sid = os.getsid(proc.pid)
        except OSError:
            continue
        if sid != ray_sid and sid not in other_sids:
            continue
        engine = (proc.info["cmdline"] or [""])[0].startswith("ray::ServeReplica:llmbatch-engine")
        if proc.pid in others:
            with contextlib.suppress(OSError):
                Path(f"/proc/{proc.pid}/autogroup").write_text(
                    "19\n" if mode in ("nice19", "both") else "0\n"
                )
                counts["sessions_niced"] += mode in ("nice19", "both")
        for tid_dir in Path(f"/proc/{proc.pid}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                tid = int(tid_dir.name)
                comm = (tid_dir / "comm").read_text().strip()
                batch = mode in ("batch", "batch-out", "both") and (
                    not engine or (mode != "batch-out" and comm == "gloo_tcp_loop")
                )
                os.sched_setscheduler(tid, os.SCHED_BATCH if batch else os.SCHED_OTHER, os.sched_param(0))
                os.sched_setaffinity(tid, engine_cores if engine else other_cores)
                counts["threads_batch" if batch else "threads_other"] += 1
    return counts
