"""Libraries' own chatter during an outage, said once per change and then every so often.

While a Kafka broker is down, aiokafka logs an error for every reconnect and metadata retry (three
replicas printed 6,000 lines in 25 s of outage). The dispatcher says the outage itself, once per
change of state (:mod:`llmbatch.dispatcher.intake.record_retry`); from a library, :class:`RepeatLimiter` lets
the
first line of each kind through, then one line per ``every_s`` carrying how many like it it held
back (``suppressed``). A kind is the logger plus the message template (``record.msg`` before its
arguments), so "Unable connect to node with id 1" and the same for node 2 are one kind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

LIBRARY_LOGGERS = ("aiokafka", "kafka")
"""Loggers (and their children) whose repeats are limited."""
EVERY_S = 30.0
MAX_KINDS = 256  # bounded memory: the oldest kind is forgotten first


@dataclass(slots=True)
class _Kind:
    last_said: float
    held: int = 0


class RepeatLimiter(logging.Filter):
    """A handler filter: repeats of a library's warnings and errors at most once per ``every_s``."""

    def __init__(
        self,
        loggers: tuple[str, ...] = LIBRARY_LOGGERS,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._prefixes = tuple(loggers)
        self._every = every_s
        self._clock = clock
        self._kinds: dict[tuple[str, str], _Kind] = {}

    def _limited(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self._prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not self._limited(record.name):
            return True
        key = (record.name, str(record.msg))
        now = self._clock()
        kind = self._kinds.get(key)
        if kind is None:
            if len(self._kinds) >= MAX_KINDS:
                self._kinds.pop(next(iter(self._kinds)))
            self._kinds[key] = _Kind(now)
            return True
        if now - kind.last_said < self._every:
            kind.held += 1
            return False
        if kind.held:
            record.suppressed = kind.held  # the JSON line's "suppressed" field
            record.msg = f"{record.msg} [{kind.held} more like this in the last {now - kind.last_said:.0f} s]"
        kind.last_said, kind.held = now, 0
        return True
