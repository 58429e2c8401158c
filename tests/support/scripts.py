"""Load a file that is not in a package (scripts/*.py, deploy/docker/fetch_model.py) as a module, once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_file(name: str, path: Path) -> ModuleType:
    """``path`` as module ``name`` (kept in ``sys.modules``: later loads get the same module)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py."""
    return load_file(name, ROOT / "scripts" / f"{name}.py")
