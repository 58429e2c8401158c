"""Starting, watching and stopping local service processes by PID (never by name)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from llmbatch.schemas.errors import LLMBatchError


class StackError(LLMBatchError, RuntimeError):
    """A local service could not be prepared, started or stopped. The message is one line."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail
        if log_tail:  # shown in tracebacks (a test's failure report), not in str()
            self.add_note(f"last lines of its output:\n{log_tail}")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def spawn(
    argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> int:
    """Start ``argv`` detached in its own session, stdout+stderr to ``log_path``; return its PID."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=str(cwd) if cwd else None,
            start_new_session=True,
        )
    return proc.pid


def alive(pid: int | None) -> bool:
    """``pid`` runs, or is still exiting: a multi-threaded process (Redis, Java, Go, Ray) shows as a
    zombie as soon as its main thread is gone, but keeps its files and listening sockets until its
    last thread has exited."""
    if not pid:
        return False
    try:
        return _running(psutil.Process(pid))
    except psutil.Error:
        return False


def _running(proc: psutil.Process) -> bool:
    """:func:`alive` for a handle (which also tells a reused PID apart)."""
    with contextlib.suppress(psutil.Error):
        return bool(proc.is_running() and (proc.status() != psutil.STATUS_ZOMBIE or proc.num_threads() > 1))
    return False


def stop_tree(pid: int, timeout: float = 20.0) -> list[int]:
    """SIGTERM ``pid`` and let it stop its own children, as an orchestrator stops a container; then
    SIGTERM whatever of its tree is left, and SIGKILL what is still there ``timeout`` seconds after
    the first signal. Returns the PIDs that had to be killed (none: the tree stopped on SIGTERM).

    Root first because a process tree's shutdown has an order: ``ray start --block`` stops its Ray
    head in 4 s (without the drain it does first: :data:`~llmbatch.stack.ray_head.ONE_NODE_STOP_ENV`),
    while SIGTERM to every process at once made the raylet wait for a GCS already exiting until the
    SIGKILL, 20 s later.
    """
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    deadline = time.monotonic() + timeout
    procs = _tree(root)
    with contextlib.suppress(psutil.Error):
        root.send_signal(signal.SIGTERM)
    psutil.wait_procs([root], timeout=timeout)  # gone once it has stopped its tree, or given up on it
    # the rest of the tree, with what started after the first listing (e.g. Ray workers)
    left = [proc for proc in _unique(procs + _tree(root)) if _running(proc)]
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, left = psutil.wait_procs(left, timeout=max(deadline - time.monotonic(), 1.0))
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=5)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    return [proc.pid for proc in left]


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return [root]


def _unique(procs: list[psutil.Process]) -> list[psutil.Process]:
    return list({proc.pid: proc for proc in procs}.values())


class StartedTree:
    """The processes of a start-up seen so far. ``ray start`` that gives up (its raylet not registered
    with the GCS within the 30 s Ray 2.60 fixes, which happens on a loaded machine) exits before its
    children, which then outlive it: :meth:`stop` stops them too (psutil's handles check the start
    time, so a reused PID is never signalled)."""

    def __init__(self) -> None:
        self.procs: dict[int, psutil.Process] = {}

    def remember(self, pid: int | None) -> None:
        """Note ``pid`` and its descendants as they are now."""
        if pid is None:
            return
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                self.procs.setdefault(proc.pid, proc)

    def checking(self, pid: int | None, check: Callable[[], bool]) -> Callable[[], bool]:
        """``check`` for :func:`wait_until` that first notes ``pid``'s tree as it is then."""

        def remembered() -> bool:
            self.remember(pid)
            return check()

        return remembered

    def stop(self) -> None:
        """Stop every noted process that still runs (by PID, with its own tree)."""
        for proc in self.procs.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running():
                    stop_tree(proc.pid, timeout=5)
        self.procs = {}


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        data = path.read_bytes()[-16_000:]
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    pid: int | None,
    name: str,
    log_path: Path,
    interval: float = 0.25,
) -> float:
    """Poll ``check`` until it passes; return seconds waited. Fails fast if ``pid`` dies."""
    start = time.monotonic()
    while True:
        ok = False
        with contextlib.suppress(Exception):
            ok = check()
        if ok:
            return time.monotonic() - start
        if pid is not None and not alive(pid):
            raise StackError(f"{name} exited during start-up (see {log_path})", log_tail(log_path))
        if time.monotonic() - start > timeout:
            raise StackError(
                f"{name} did not become healthy within {timeout:.0f}s (see {log_path})", log_tail(log_path)
            )
        time.sleep(interval)


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (PSS where the kernel offers it)."""
    total = 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            try:
                total += int(proc.memory_full_info().pss)
            except (psutil.AccessDenied, AttributeError):
                total += int(proc.memory_info().rss)
    return total


def http_ok(url: str, timeout: float = 2.0, ca_cert: str | None = None) -> bool:
    """``url`` answers 2xx (verified against ``ca_cert`` when https)."""
    context = ssl.create_default_context(cafile=ca_cert) if ca_cert else None
    with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:  # noqa: S310 - our URL
        return 200 <= int(resp.status) < 300


def run_checked(
    argv: list[str],
    what: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 1800,
) -> None:
    """Run ``argv`` to its end; :class:`StackError` naming ``what`` with the last 25 lines of its
    output if it fails."""
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise StackError(f"{what} failed (exit {proc.returncode})", tail)
