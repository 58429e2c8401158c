"""The stack's state file: which services run, their PIDs, ports and addresses."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CACHE_DIR = Path(os.environ.get("LLMBATCH_CACHE", Path.home() / ".cache" / "llmbatch"))


def default_run_dir() -> Path:
    """Where a stack keeps data, logs and its state file (``LLMBATCH_RUN_DIR`` or ./run/stack)."""
    return Path(os.environ.get("LLMBATCH_RUN_DIR", Path.cwd() / "run" / "stack")).resolve()


@dataclass
class ServiceRecord:
    """One running service as recorded in the state file."""

    name: str
    pid: int
    ports: dict[str, int]
    address: str
    log: str
    data_dir: str
    healthy_after_s: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class StackState:
    run_dir: Path
    services: dict[str, ServiceRecord] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.run_dir / "state.json"

    @classmethod
    def load(cls, run_dir: Path) -> StackState:
        state = cls(run_dir=run_dir)
        with contextlib.suppress(FileNotFoundError):
            raw: dict[str, Any] = json.loads(state.path.read_text())
            for name, rec in raw.get("services", {}).items():
                state.services[name] = ServiceRecord(**rec)
        return state

    def save(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        # holds the MinIO root credentials of this local stack: owner-only
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"services": {n: asdict(r) for n, r in self.services.items()}}, fh, indent=2)
        os.replace(tmp, self.path)
