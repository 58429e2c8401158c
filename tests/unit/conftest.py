"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ``LLMBATCH_*`` variable from the caller's environment and no ``.env`` file is read."""
    for key in [k for k in os.environ if k.startswith("LLMBATCH_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir("/")
    return monkeypatch
