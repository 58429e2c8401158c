"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.scripted_http import ScriptedHttpServer


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ``LLMBATCH_*`` variable from the caller's environment and no ``.env`` file is read."""
    for key in [k for k in os.environ if k.startswith("LLMBATCH_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir("/")
    return monkeypatch


@pytest.fixture
def dashboard() -> Iterator[ScriptedHttpServer]:
    """A local HTTP server in the Ray dashboard's place: 200 with an empty body unless scripted."""
    server = ScriptedHttpServer(default=(200, b""))
    yield server
    server.close()
