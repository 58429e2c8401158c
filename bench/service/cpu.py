"""Measuring during a phase of the service benchmark: the cores each process of the machine used and its
wake-ups and preemptions per second (context switches summed over its threads), by component."""

from __future__ import annotations

from pathlib import Path

ENGINE_LABEL = "llmbatch-engine"
"""What the labels of the engine replicas' processes hold (``ray::ServeReplica:llmbatch-engine-<model>``)."""


def component(cmd: list[str]) -> str:
    """A label for a process: a Ray worker's title (``ray::ServeReplica:...``), a Python script or module,
    else the executable."""
    head = cmd[0]
    if head.startswith("ray::"):
        return head.split(" ")[0][:60]
    if Path(head).name.startswith("python") and len(cmd) > 1:
        arg = cmd[2] if cmd[1] in ("-m", "-u") and len(cmd) > 2 else cmd[1]
        return "python " + (Path(arg).name if "/" in arg else arg)[:50]
    if Path(head).name == "java":
        return "java (Kafka)"
    return Path(head).name[:40]


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every process of this machine, labelled by :func:`component`."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter(["cmdline", "name", "cpu_times"]):
        cmd, times = proc.info["cmdline"] or [proc.info["name"] or "?"], proc.info["cpu_times"]
        if times is None:
            continue
        out[proc.pid] = (component(cmd), times.user + times.system)
    return out


def switch_snapshot() -> dict[int, tuple[str, int, int]]:
    """Context switches of every process of this machine, summed over its threads: voluntary (the
    thread slept and was woken: a wake-up) and involuntary (it was preempted while it could run)."""
    import psutil

    from bench.bench_ray_job import thread_switches

    out: dict[int, tuple[str, int, int]] = {}
    for proc in psutil.process_iter(["cmdline", "name"]):
        switches = thread_switches(proc.pid)
        if switches is not None:
            out[proc.pid] = (component(proc.info["cmdline"] or [proc.info["name"] or "?"]), *switches)
    return out


def switches_by_component(
    before: dict[int, tuple[str, int, int]],
    after: dict[int, tuple[str, int, int]],
    wall_s: float,
    top: int = 10,
) -> dict[str, dict[str, int]]:
    """Wake-ups and preemptions per second of each component between two snapshots, the most waking
    first, and ``outside the engine``: the wake-ups of everything but engine replicas."""
    rates: dict[str, list[float]] = {}
    for pid, (label, woke, preempted) in after.items():
        _, woke0, preempted0 = before.get(pid, (label, 0, 0))
        rate = rates.setdefault(label, [0.0, 0.0])
        rate[0] += (woke - woke0) / wall_s
        rate[1] += (preempted - preempted0) / wall_s
    ranked = sorted(rates.items(), key=lambda kv: -kv[1][0])[:top]
    out = {label: {"wakeups_per_s": round(w), "preempted_per_s": round(p)} for label, (w, p) in ranked}
    outside = sum(w for label, (w, _) in rates.items() if ENGINE_LABEL not in label)
    out["outside the engine"] = {"wakeups_per_s": round(outside), "preempted_per_s": 0}
    return out


def _used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds of each component between two snapshots (processes alive at the end)."""
    used: dict[str, float] = {}
    for pid, (label, seconds) in after.items():
        used[label] = used.get(label, 0.0) + seconds - before.get(pid, (label, 0.0))[1]
    return used


def cpu_by_component(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall_s: float, top: int = 10
) -> dict[str, float]:
    """Share of one core each component used between two snapshots (processes alive at the end)."""
    ranked = sorted(_used(before, after).items(), key=lambda kv: -kv[1])[:top]
    return {label: round(seconds / wall_s, 3) for label, seconds in ranked if seconds > 0}


def cpu_outside_engine(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall_s: float
) -> float:
    """Share of one core every process but the engine replicas used between two snapshots."""
    used = _used(before, after)
    return sum(seconds for label, seconds in used.items() if ENGINE_LABEL not in label) / wall_s
