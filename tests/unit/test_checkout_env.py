"""Each checkout runs its own code from its own .venv (no venv shared between clones)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import dispatcher
import llmbatch
import producer
import ray_job
import schemas

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


@pytest.mark.parametrize("package", [llmbatch, producer, dispatcher, ray_job, schemas],
                         ids=lambda m: m.__name__)
def test_packages_are_imported_from_this_checkout(package: object) -> None:
    where = Path(package.__file__).resolve()  # type: ignore[attr-defined]
    assert where.is_relative_to(ROOT), f"{package} comes from {where}, not from the checkout {ROOT}"


def test_the_venv_belongs_to_this_checkout() -> None:
    venv = ROOT / ".venv"
    if Path(sys.prefix).resolve() != venv.resolve():
        pytest.fail(f"the suite runs in {sys.prefix}, not in this checkout's {venv} (run `make setup`)")
    # an earlier set-up linked .venv to one venv shared by all clones: each would import another's code
    assert not venv.is_symlink(), f"{venv} links to {venv.readlink()}: a venv shared between checkouts"
