"""Each checkout runs its own code from its own .venv (no venv shared between clones)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import llmbatch.cli
from llmbatch import adapters, api, dispatcher, producer, ray_job, schemas

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "package", [llmbatch.cli, schemas, adapters, producer, dispatcher, ray_job, api], ids=lambda m: m.__name__
)
def test_packages_are_imported_from_this_checkout(package: object) -> None:
    where = Path(package.__file__).resolve()  # type: ignore[attr-defined]
    assert where.is_relative_to(ROOT), f"{package} comes from {where}, not from the checkout {ROOT}"


def test_the_venv_belongs_to_this_checkout() -> None:
    venv = ROOT / ".venv"
    if Path(sys.prefix).resolve() != venv.resolve():
        pytest.fail(f"the suite runs in {sys.prefix}, not in this checkout's {venv} (run `make setup`)")
    # an earlier set-up linked .venv to one venv shared by all clones: each would import another's code
    assert not venv.is_symlink(), f"{venv} links to {venv.readlink()}: a venv shared between checkouts"


@pytest.mark.parametrize("module", ["ray", "ray.data", "pyarrow", "pydantic", "vllm", "torch"])
def test_the_venv_holds_compiled_bytecode(module: str) -> None:
    """Each of the suite's hundreds of Python processes (Ray workers, drivers, replicas) would compile
    these from source again where PYTHONDONTWRITEBYTECODE is set: make setup compiles them once."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    cached = Path(importlib.util.cache_from_source(spec.origin))
    assert cached.exists(), f"no bytecode for {module} ({cached}): run `make setup`"
