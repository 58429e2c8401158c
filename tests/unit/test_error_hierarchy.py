"""One error hierarchy: every exception class llmbatch defines derives from
:class:`llmbatch.schemas.errors.LLMBatchError` (so it has ``retriable``), and no two of them share a name
in different modules (an ``except BrokerUnavailable`` must not catch the wrong one). The control-flow
signals below are not errors and are exempt."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from collections import defaultdict

import pytest

from llmbatch.schemas.errors import LLMBatchError

pytestmark = pytest.mark.unit

UNITS = (
    "schemas",
    "settings",
    "adapters",
    "producer",
    "ray_job",
    "dispatcher",
    "api",
    "stack",
    "chaos",
    "cli",
    "demo",
    "docs",
)
SIGNALS = {
    "llmbatch.dispatcher.intake.record_retry.Abandoned",  # processing stopped: shutdown or revoked
    "llmbatch.dispatcher.intake.record_retry.GaveUp",  # carries the last error to the dead letter
    "llmbatch.ray_job.job.main.StopRequested",  # a BaseException: SIGTERM unwinds the driver
}


def _exception_classes() -> dict[str, type[BaseException]]:
    names = []
    for unit in UNITS:
        package = importlib.import_module(f"llmbatch.{unit}")
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
                names.append(info.name)
    return {
        f"{cls.__module__}.{cls.__qualname__}": cls
        for name in names
        for cls in vars(sys.modules[name]).values()
        if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == name
    }


def test_every_error_is_an_llmbatch_error_with_retriable() -> None:
    classes = _exception_classes()
    assert len(classes) > 40  # the walk found them
    outside = sorted(path for path, cls in classes.items() if not issubclass(cls, LLMBatchError))
    assert sorted(set(outside) - SIGNALS) == [], "derive these from LLMBatchError"
    assert all(isinstance(cls.retriable, bool) for cls in classes.values() if issubclass(cls, LLMBatchError))


def test_no_two_error_classes_share_a_name() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path, cls in _exception_classes().items():
        by_name[cls.__name__].append(path)
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
