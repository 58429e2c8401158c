"""The deploy tier runs as root and is skipped, saying why, otherwise (tests/conftest.py)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests import conftest

pytestmark = pytest.mark.unit


class Item:
    """What the collection hook reads of a collected test."""

    def __init__(self, nodeid: str, deploy: bool) -> None:
        self.nodeid = nodeid
        self.deploy = deploy
        self.added: list[Any] = []

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name == "deploy" and self.deploy else None

    def add_marker(self, marker: Any) -> None:
        self.added.append(marker)


@pytest.mark.parametrize(("uid", "skipped"), [(0, False), (1000, True)])
def test_deploy_tests_are_skipped_with_the_reason_only_when_not_root(
    monkeypatch: pytest.MonkeyPatch, uid: int, skipped: bool
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    node, other = (
        Item("tests/integration/test_kubelet_node.py::t", True),
        Item("tests/unit/test_x.py::t", False),
    )
    conftest.pytest_collection_modifyitems(None, [node, other])  # type: ignore[arg-type,list-item]
    assert other.added == []
    if not skipped:
        assert node.added == []
        return
    [mark] = node.added
    assert (
        mark.name == "skip"
        and "root" in mark.kwargs["reason"]
        and "make test-deploy" in mark.kwargs["reason"]
    )
