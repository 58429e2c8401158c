"""What Python 3.10 lacks that the contracts and the SDK use: the producer SDK (with the contracts and
the adapters under it) runs on Python 3.10 to 3.13, the services on 3.11. On 3.11 and later each name
here is the standard library's own."""

from __future__ import annotations

import asyncio
import sys
from datetime import datetime, timezone
from enum import Enum
from typing import Any, TypeVar

if sys.version_info < (3, 11):
    from collections.abc import Coroutine

T = TypeVar("T")

UTC = timezone.utc
"""``datetime.UTC`` (3.11)."""

TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError)
"""What ``asyncio.wait_for`` raises on a timeout: ``asyncio.TimeoutError``, the builtin ``TimeoutError``
itself from 3.11 on only."""

if sys.version_info >= (3, 11):
    from asyncio import Runner
    from enum import StrEnum

    def parse_iso_time(text: str) -> datetime:
        """``datetime.fromisoformat`` (RFC 3339 with ``Z`` from 3.11 on)."""
        return datetime.fromisoformat(text)
else:  # pragma: no cover - the SDK's 3.10 venv runs this (tests/integration/test_sdk_install.py)

    class StrEnum(str, Enum):
        """``enum.StrEnum`` (3.11): members are their values as strings."""

        def __str__(self) -> str:
            return str(self.value)

    def parse_iso_time(text: str) -> datetime:
        """``datetime.fromisoformat`` of 3.11 for the times llmbatch writes: a ``Z`` offset is UTC."""
        return datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)

    class Runner:
        """``asyncio.Runner`` (3.11), as the SDK's blocking client uses it: one private event loop."""

        def __init__(self) -> None:
            self._loop = asyncio.new_event_loop()

        def run(self, coro: Coroutine[Any, Any, T]) -> T:
            return self._loop.run_until_complete(coro)

        def close(self) -> None:
            try:
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()


__all__ = ["TIMEOUT_ERRORS", "UTC", "Runner", "StrEnum", "parse_iso_time"]
