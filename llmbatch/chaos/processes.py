"""Dispatcher replicas as separate processes, started from settings and stopped by PID only (the chaos
suite's replicas, and the kill -9 tests')."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, SecretStr


def settings_env(settings: BaseModel, prefix: str = "LLMBATCH_") -> dict[str, str]:
    """Environment variables that reproduce ``settings`` (nested with ``__``; lists/dicts as JSON)."""
    out: dict[str, str] = {}

    def walk(value: Any, path: list[str]) -> None:
        if isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name), [*path, name])
            return
        key = prefix + "__".join(p.upper() for p in path)
        if value is None:
            return
        if isinstance(value, SecretStr):
            out[key] = value.get_secret_value()
        elif isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, list | dict):
            out[key] = orjson.dumps(
                value, default=lambda v: v.model_dump(mode="json") if isinstance(v, BaseModel) else str(v)
            ).decode()
        else:
            out[key] = str(value)

    walk(settings, [])
    return out


class DispatcherProcess:
    """``python -m llmbatch.dispatcher`` (or another of the project's services: ``module``, with ``args``) in
    its own session with ``settings`` as its environment, logs to a file; stopped by PID only."""

    def __init__(
        self,
        settings: BaseModel,
        log_path: Path,
        *,
        module: str = "llmbatch.dispatcher",
        args: Sequence[str] = (),
        **env: str,
    ) -> None:
        self.settings = settings
        self.log_path = log_path
        self.module = module
        self.args = list(args)
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopped = False

    def start(self, **env: str) -> DispatcherProcess:
        self._stopped = False
        full = {k: v for k, v in os.environ.items() if not k.startswith("LLMBATCH_")}
        full.update(settings_env(self.settings))
        full.update(self.env)
        full.update(env)
        full["PYTHONUNBUFFERED"] = "1"
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return int(self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.proc is not None and self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def ended_on_its_own(self) -> int | None:
        """The exit code when the process ended without being stopped (terminate) and not by SIGKILL
        (kill9, or a crash point's simulated kill -9); ``None`` while it runs or when it was stopped
        so. A service runs until stopped: anything else is a death a harness must report."""
        if self.proc is None or self._stopped:
            return None
        code = self.proc.poll()
        return None if code is None or code == -signal.SIGKILL else code

    def stop_checked(self, timeout: float = 60) -> None:
        """:meth:`terminate`, then raise ``AssertionError`` (with the log's tail) when the process had
        ended on its own before (:meth:`ended_on_its_own`)."""
        code = self.ended_on_its_own()
        self.terminate(timeout)
        if code is not None:
            raise AssertionError(
                f"{self.module} ended on its own with exit code {code} before it was "
                f"stopped; its log ({self.log_path}) ends:\n{self.tail(40)}"
            )

    def terminate(self, timeout: float = 60) -> int:
        self._stopped = True
        if self.proc is not None and self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return int(self.proc.wait(timeout))
            except subprocess.TimeoutExpired:
                self.kill9()
        return int(self.proc.returncode or 0) if self.proc is not None else 0

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
