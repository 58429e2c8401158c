"""What every operator command shares: settings, connections, one-line errors, times, JSON output.

Exit codes (all ops commands): 0 done; 1 error (one ``error: ...`` line on stderr, never a traceback
unless ``LLMBATCH_DEBUG=1``); 2 usage error; 3 done, but some selected items were refused or
skipped (see the summary); 4 ``--wait`` ran out of time (as ``llmbatch submit --wait``); 130 interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn, TypeVar, overload
from urllib.parse import urlsplit, urlunsplit

import orjson
import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console

from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.errors import LLMBatchError
from llmbatch.settings import LLMBatchSettings

T = TypeVar("T")
S = TypeVar("S", bound=LLMBatchSettings)

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
EXIT_TIMEOUT = 4
EXIT_INTERRUPTED = 130
CONNECT_TIMEOUT_S = 5.0

# tables go to stdout: a terminal's width when interactive, wide enough not to fold when piped
out = Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 240)
err = Console(stderr=True, highlight=False, soft_wrap=True)

_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d|w)$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class OpsError(LLMBatchError):
    """A user-facing failure: printed as one line with ``code`` as the exit status."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def one_line(message: str) -> str:
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    err.print(f"[red]error:[/red] {one_line(message)}", markup=True)
    raise typer.Exit(code)


def safe_url(url: str) -> str:
    """``url`` without its password (for messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


@overload
def load_settings(ctx: typer.Context | None) -> LLMBatchSettings: ...


@overload
def load_settings(ctx: typer.Context | None, kind: type[S]) -> S: ...


def load_settings(
    ctx: typer.Context | None, kind: type[LLMBatchSettings] = LLMBatchSettings
) -> LLMBatchSettings:
    """Settings handed in by a caller (``ctx.obj``, tests) or read from the ``LLMBATCH_*`` env as ``kind``."""
    obj = ctx.obj if ctx is not None else None
    if isinstance(obj, dict):
        obj = obj.get("settings")
    if isinstance(obj, kind):
        return obj
    try:
        return kind()
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise OpsError(
            f"invalid setting {where}: {first['msg']} (check the LLMBATCH_* environment)"
        ) from None


def quiet_libraries() -> None:
    """Client libraries log connection retries; the one error line says it all."""
    if os.environ.get("LLMBATCH_DEBUG"):
        return
    for name in ("aiokafka", "kafka", "urllib3", "redis"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def run(body: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run an async command body; every failure becomes one line and an exit code."""
    quiet_libraries()
    try:
        return asyncio.run(body())
    except typer.Exit:
        raise
    except OpsError as exc:
        fail(str(exc), exc.code)
    except DispatcherError as exc:
        fail(f"{exc.code}: {exc}")
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        fail(f"invalid value {where}: {first['msg']}")
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as exc:
        if os.environ.get("LLMBATCH_DEBUG"):
            raise
        fail(f"unexpected {type(exc).__name__}: {exc} (set LLMBATCH_DEBUG=1 for a traceback)")


# --- connections -------------------------------------------------------------------------------------


async def open_store(settings: LLMBatchSettings) -> StateStore:
    """A state store on the configured Redis, checked with a ping (fails fast, one clear line)."""
    store = StateStore.from_settings(settings.redis, socket_timeout=CONNECT_TIMEOUT_S)
    try:
        await asyncio.wait_for(store.ping(), CONNECT_TIMEOUT_S + 1)
    except (DispatcherError, TimeoutError) as exc:
        await _close_quietly(store)
        detail = str(exc).split(":", 1)[0] if isinstance(exc, DispatcherError) else "timeout"
        raise OpsError(
            f"Redis at {safe_url(settings.redis.url)} did not answer ({detail}); check LLMBATCH_REDIS__URL"
        ) from None
    return store


async def _close_quietly(store: StateStore) -> None:
    with contextlib.suppress(Exception):  # closing a broken connection; the real error is reported
        await store.close()


def kafka_unreachable(settings: LLMBatchSettings, exc: BaseException | None = None) -> OpsError:
    detail = f" ({type(exc).__name__})" if exc is not None else ""
    return OpsError(
        f"Kafka at {settings.kafka.bootstrap_servers} did not answer{detail}; "
        "check LLMBATCH_KAFKA__BOOTSTRAP_SERVERS"
    )


# --- times -------------------------------------------------------------------------------------------


def parse_when(value: str | None, option: str, *, now: datetime | None = None) -> datetime | None:
    """``--since``/``--until``: a duration ago (``90s``, ``30m``, ``2h``, ``1d``, ``1w``) or an RFC 3339
    time with an offset (``2026-01-31T12:00:00Z``)."""
    if value is None:
        return None
    text = value.strip()
    match = _DURATION_RE.fullmatch(text)
    if match:
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
        return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        parsed = datetime.fromisoformat(text.replace("z", "Z").replace("Z", "+00:00"))
    except ValueError:
        raise OpsError(
            f"{option} {value!r}: use a duration such as 30m, 2h, 1d or an RFC 3339 time like "
            "2026-01-31T12:00:00Z",
            EXIT_USAGE,
        ) from None
    if parsed.tzinfo is None:
        raise OpsError(f"{option} {value!r}: add a UTC offset, e.g. {value}Z", EXIT_USAGE)
    return parsed.astimezone(UTC)


def from_ts(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, UTC) if value is not None else None


def show_time(value: datetime | None) -> str:
    """``2026-01-31 12:00:03Z`` (seconds) for tables."""
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def ago(value: datetime | None, now: datetime | None = None) -> str:
    if value is None:
        return "-"
    seconds = max(0.0, ((now or datetime.now(UTC)) - value).total_seconds())
    if seconds < 90:
        return f"{seconds:.0f}s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f}h ago"
    return f"{seconds / 86400:.1f}d ago"


# --- output ------------------------------------------------------------------------------------------


def _default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def emit_json(payload: Any) -> None:
    """Pretty JSON on stdout (scripts read it; messages go to stderr)."""
    data = orjson.dumps(
        payload, default=_default, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS | orjson.OPT_UTC_Z
    )
    sys.stdout.buffer.write(data + b"\n")
    sys.stdout.flush()
