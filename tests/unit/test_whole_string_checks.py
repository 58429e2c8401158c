"""Strings are checked whole: no ``re.match`` / ``re.search`` nor ``<pattern>.match(...)`` in the
product's code. With ``$`` those let a trailing newline through (``re.match(r"^a$", "a\\n")`` matches),
and pydantic's stricter check of the same pattern then refuses the value later, where nothing expects
a failure (that ended the consumer on a record whose key ended in ``\\n``). Use ``fullmatch``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "llmbatch", "dispatcher", "producer", "ray_job", "api")


def _partial_matches(source: str) -> list[int]:
    """Lines of ``re.match(...)`` and of ``.match(...)`` called on a module constant (a compiled
    pattern by this code base's naming: ``NAME`` or ``_NAME``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "match":
            owner = node.func.value
            if isinstance(owner, ast.Name) and (owner.id == "re" or owner.id.lstrip("_").isupper()):
                lines.append(node.lineno)
    return lines


def test_the_check_finds_what_it_looks_for() -> None:
    assert re.match(r"^a$", "a\n")  # the trap itself
    source = "import re\n_RE = re.compile('x')\nok = _RE.match(s)\nre.match('^x$', s)\n"
    assert _partial_matches(source) == [3, 4]
    assert _partial_matches("_RE.fullmatch(s)\nmatch = m.match\n") == []


def test_no_partial_match_in_the_product() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line in _partial_matches(path.read_text())
    ]
    assert not found, f"check whole strings with fullmatch: {found}"
