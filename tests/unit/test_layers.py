"""The pure domain loads no transport, read from the code's own imports. (The layers themselves, and
that no package has an import cycle, are import-linter's contracts in pyproject.toml, run by `make
lint`.)

Only imports that run when a module is loaded count (module level, outside ``if TYPE_CHECKING``): a
function that imports redis to translate its errors (:func:`llmbatch.dispatcher.errors.classify`) runs
only when transport code calls it.
"""

from __future__ import annotations

import ast
from collections import deque
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
UNITS = [ROOT, *(ROOT / unit for unit in ("schemas", "adapters", "producer", "ray_job", "dispatcher", "api"))]
"""Each unit's folder holds its part of the llmbatch namespace (the top layer's is the root's)."""
TRANSPORT_LIBS = {
    "redis",
    "aiokafka",
    "ray",
    "httpx",
    "minio",
    "vllm",
    "fastapi",
    "uvicorn",
    "pyarrow",
    "urllib3",
    "boto3",
    "s3fs",
}
TRANSPORT_MODULES = {
    f"llmbatch.dispatcher.{m}"
    for m in (
        "state.store",
        "intake.consumer",
        "kafka.publisher",
        "backends.ray_backend",
        "runs.results",
        "backends.runner_backend",
        "kafka.record_reader",
        "service",
        "http",
        "intake.intake_apply",
        "runs.engine_keeper",
    )
}
PURE_DOMAIN = [
    f"llmbatch.dispatcher.{m}"
    for m in (
        "domain.states",
        "domain.retry",
        "domain.scheduler",
        "domain.dlt",
        "domain.events",
        "domain.batch_record",
        "domain.keys",
        "domain.coalesce",
        "intake.commands",
        "intake.intake_checks",
        "intake.answers",
        "runs.jobspec",
        "kafka.request_body",
    )
]


def _name(unit: Path, path: Path) -> str:
    parts = list(path.relative_to(unit).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_name(unit, p): p for unit in UNITS for p in (unit / "llmbatch").rglob("*.py")}


def _loaded_at_import(tree: ast.Module) -> list[ast.stmt]:
    """Statements that run when the module loads: the top level, and the bodies of top-level ``try``
    and ``if`` (not ``if TYPE_CHECKING``); not function or class bodies' imports inside functions."""
    out: list[ast.stmt] = []
    todo: deque[ast.stmt] = deque(tree.body)
    while todo:
        node = todo.popleft()
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            todo.extend([*node.body, *node.orelse])
        elif isinstance(node, ast.Try):
            handlers = [s for h in node.handlers for s in h.body]
            todo.extend([*node.body, *node.orelse, *node.finalbody, *handlers])
    return out


@cache
def imports(module: str) -> frozenset[str]:
    """What ``module`` imports when it loads: dotted names as written (a name ``from a import b`` gives
    ``a``, and ``a.b`` when that is a first-party module)."""
    names: set[str] = set()
    for node in _loaded_at_import(ast.parse(modules()[module].read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules()}
    return frozenset(names)


def _first_party(name: str) -> str | None:
    """The first-party module a dotted import name loads (its nearest enclosing module), or None."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def load_path(start: str, bad: set[str]) -> list[str] | None:
    """The chain of imports by which loading ``start`` loads a module in ``bad`` (a first-party module
    or a top-level library name), or None."""
    came_from: dict[str, str | None] = {start: None}
    todo = deque([start])
    while todo:
        current = todo.popleft()
        for name in sorted(imports(current)):
            if name in bad or name.split(".")[0] in bad:
                path: list[str] = [name]
                step: str | None = current
                while step is not None:
                    path.append(step)
                    step = came_from[step]
                return path[::-1]
            target = _first_party(name)
            if target is not None and target not in came_from:
                came_from[target] = current
                todo.append(target)
    return None


@pytest.mark.parametrize("module", PURE_DOMAIN)
def test_the_pure_domain_loads_no_transport(module: str) -> None:
    path = load_path(module, TRANSPORT_LIBS | TRANSPORT_MODULES)
    assert path is None, " -> ".join(path or [])


def test_the_walk_finds_a_library_behind_first_party_hops_and_skips_lazy_imports() -> None:
    start = "llmbatch.dispatcher.runs.in_flight"
    path = load_path(start, {"redis"})
    assert path is not None and path[0] == start and path[-1].startswith("redis")
    assert len(path) > 2  # through the store, not imported by in_flight itself
    assert "redis" not in {n.split(".")[0] for n in imports("llmbatch.dispatcher.runs.in_flight")}
    # llmbatch.dispatcher.errors imports redis and aiokafka inside classify() only
    assert load_path("llmbatch.dispatcher.errors", TRANSPORT_LIBS) is None
    # request_body names the Kafka reader for type checkers only
    reader = "llmbatch.dispatcher.kafka.record_reader"
    assert load_path("llmbatch.dispatcher.kafka.request_body", {reader}) is None
