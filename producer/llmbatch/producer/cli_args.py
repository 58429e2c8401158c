"""What the producer commands' options parse into, with one ``error:`` line naming the option and
the fix when a value is wrong (:class:`CliFailure`)."""

from __future__ import annotations

from datetime import datetime

from llmbatch.schemas import Endpoint, parse_duration, utcnow
from llmbatch.schemas.compat import parse_iso_time
from llmbatch.schemas.errors import LLMBatchError

EXIT_ERROR = 1
ENDPOINT_ALIASES = {
    "chat": Endpoint.CHAT_COMPLETIONS,
    "chat/completions": Endpoint.CHAT_COMPLETIONS,
    "completions": Endpoint.COMPLETIONS,
    "embeddings": Endpoint.EMBEDDINGS,
    **{e.value: e for e in Endpoint},
}


class CliFailure(LLMBatchError):
    """A user-facing failure: printed as one line, exit code attached."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def parse_endpoint(value: str) -> Endpoint:
    key = value.strip()
    endpoint = ENDPOINT_ALIASES.get(key) or ENDPOINT_ALIASES.get(key.lower())
    if endpoint is None:
        raise CliFailure(
            f"unknown endpoint {value!r}: use chat (/v1/chat/completions) or completions (/v1/completions)"
        )
    return endpoint


def parse_metadata(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliFailure(f"--metadata {pair!r}: use key=value")
        out[key] = value
    return out


def _time(option: str, value: str, *, past: bool, how: str) -> datetime:
    """A duration (``past``: that long ago, else from now) or an RFC 3339 time with its offset."""
    try:
        span = parse_duration(value)
    except ValueError:
        pass
    else:
        return utcnow() - span if past else utcnow() + span
    try:
        parsed = parse_iso_time(value)
    except ValueError:
        raise CliFailure(f"{option} {value!r}: {how}") from None
    if parsed.tzinfo is None:
        raise CliFailure(f"{option} {value!r}: add a UTC offset, e.g. {value}Z")
    return parsed


def parse_since(value: str | None) -> datetime | None:
    """``--since``: 30m, 2h, 1d ago, or a time."""
    if value is None:
        return None
    return _time("--since", value, past=True, how="use a duration such as 30m, 2h, 1d or an RFC 3339 time")


def parse_deadline(value: str | None) -> datetime | None:
    """``--deadline``: a time, or a duration from now."""
    if value is None:
        return None
    return _time(
        "--deadline", value, past=False, how="use an RFC 3339 time with offset or a duration like 2h"
    )
