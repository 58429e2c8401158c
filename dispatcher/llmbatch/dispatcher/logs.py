"""JSON logs: one object per line with ``batch_id``, ``attempt`` and ``trace_id`` when known.

Context travels in contextvars (:func:`bind`), so every log line written while handling a batch
carries its ids without threading them through every call.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import orjson

from llmbatch.dispatcher.log_limits import RepeatLimiter

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("llmbatch_log", default=None)
_RESERVED = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime", "taskName"}


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<trace>-<span>-<flags>``)."""
    if not traceparent:
        return None
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 else None


@contextlib.contextmanager
def bind(**fields: Any) -> Iterator[None]:
    """Add fields to every log record written inside the block (``None`` values are skipped)."""
    current = dict(_context.get() or {})
    current.update({k: v for k, v in fields.items() if v is not None})
    token = _context.set(current)
    try:
        yield
    finally:
        _context.reset(token)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_context.get() or {})
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_context.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def setup(level: str = "INFO", json_format: bool = True) -> None:
    """Configure the root logger once (idempotent)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_llmbatch", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._llmbatch = True  # type: ignore[attr-defined]
    handler.addFilter(RepeatLimiter())  # aiokafka's line per retry while a broker is down
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.addFilter(_ContextFilter())
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("aiokafka", "kafka", "urllib3", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
