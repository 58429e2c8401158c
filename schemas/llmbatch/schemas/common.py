"""Constrained scalar types shared by every contract: ids, names, URIs, endpoints, statuses.

Each type is an ``Annotated`` alias, so pydantic validates it and the exported JSON Schema carries
its pattern and limits. Validators raise ``ValueError`` with a message naming the fix.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, PlainSerializer

from llmbatch.schemas.compat import UTC, StrEnum

BATCH_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
TENANT_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$"
MODEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}$"
S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/\S.*$"
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_IPV4_RE = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")
_DURATION_RE = re.compile(r"^([1-9][0-9]{0,5})([smhd])$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_COMPLETION_WINDOW = timedelta(days=7)
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 2_592_000  # 30 days: OpenAI's bounds of an expiration policy
API_BATCH_PREFIX = "batch_"
"""Batch ids the HTTP API makes start with this (its namespace: it never reads such an id from Kafka)."""


class Endpoint(StrEnum):
    """The OpenAI endpoints a batch may target."""

    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"

    @property
    def pooling(self) -> bool:
        """True for the endpoints an embedding (pooling) model serves, False for text generation."""
        return self is Endpoint.EMBEDDINGS


class BatchStatus(StrEnum):
    """Lifecycle states (OpenAI's names where they exist, plus ``dead_lettered``)."""

    ACCEPTED = "accepted"
    QUEUED = "queued"
    SUBMITTED = "submitted"
    RUNNING = "running"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    DEAD_LETTERED = "dead_lettered"

    @property
    def is_terminal(self) -> bool:
        """True for states a batch never leaves (except by an explicit operator replay)."""
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {
        BatchStatus.COMPLETED,
        BatchStatus.FAILED,
        BatchStatus.CANCELLED,
        BatchStatus.EXPIRED,
        BatchStatus.DEAD_LETTERED,
    }
)


def _check_s3_uri(value: str) -> str:
    if not value.startswith("s3://"):
        raise ValueError(f"must be an s3://bucket/key URI, got {value[:80]!r}")
    bucket, sep, key = value[5:].partition("/")
    if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket or _IPV4_RE.fullmatch(bucket):
        raise ValueError(
            f"bucket {bucket[:80]!r} is not a valid S3 bucket name "
            "(3-63 chars: lowercase letters, digits, '.', '-')"
        )
    if not sep or not key:
        raise ValueError(f"{value[:80]!r} has no object key: use s3://{bucket}/path/to/object")
    if key.startswith("/"):
        raise ValueError(f"object key of {value[:80]!r} must not start with '/'")
    if len(key) > 256 and len(key.encode("utf-8")) > 1024:  # <= 256 chars are <= 1024 bytes
        raise ValueError("object key is longer than S3's 1024-byte limit")
    if _CONTROL_RE.search(key):
        raise ValueError("object key contains control characters")
    return value


def _check_prefix(value: str) -> str:
    _check_s3_uri(value)
    if not value.endswith("/"):
        raise ValueError(f"prefix {value[:80]!r} must end with '/'")
    return value


def _check_duration(value: str) -> str:
    parse_duration(value)
    return value


def check_tenant(value: str) -> str:
    """``value`` when it is a tenant name (all of it matches :data:`TENANT_PATTERN`), else
    :class:`ValueError` naming it and saying what one looks like."""
    if not re.fullmatch(TENANT_PATTERN, value):
        raise ValueError(
            f"tenant {value[:80]!r}: use 1-64 lowercase letters, digits or '-', "
            "not starting or ending with '-'"
        )
    return value


def whole_match(regex: str, what: str) -> Any:
    """A pydantic validator: the value when all of it matches ``regex``, else :class:`ValueError`
    saying ``what`` one looks like."""
    compiled = re.compile(regex)

    def check(value: str) -> str:
        if not compiled.fullmatch(value):
            raise ValueError(f"{value[:80]!r} is not a valid {what}")
        return value

    return AfterValidator(check)


BatchId = Annotated[
    str,
    whole_match(
        BATCH_ID_PATTERN,
        "batch_id: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
    ),
    Field(
        json_schema_extra={"pattern": BATCH_ID_PATTERN},
        description="Client-chosen idempotency key: 1-128 chars of letters, digits, '.', '_', '-', "
        "starting with a letter or digit (it becomes an S3 path segment and a Ray submission id).",
        examples=["batch-2024-06-01-nightly-eval"],
    ),
]
Tenant = Annotated[
    str,
    whole_match(TENANT_PATTERN, "tenant: use 1-64 lowercase letters, digits or '-', not starting with '-'"),
    Field(
        json_schema_extra={"pattern": TENANT_PATTERN},
        description="Tenant slug (lowercase letters, digits, '-'; 1-64 chars); results go under it.",
        examples=["default"],
    ),
]
ModelName = Annotated[
    str,
    whole_match(MODEL_PATTERN, "model name: use an id such as 'Qwen/Qwen2.5-0.5B-Instruct' (<= 256 chars)"),
    Field(
        json_schema_extra={"pattern": MODEL_PATTERN},
        description="Model name as served, e.g. an HF repo id such as Qwen/Qwen2.5-0.5B-Instruct.",
        examples=["HuggingFaceTB/SmolLM2-135M-Instruct"],
    ),
]
S3Uri = Annotated[
    str,
    AfterValidator(_check_s3_uri),
    Field(
        json_schema_extra={"pattern": S3_URI_PATTERN},
        description="s3://bucket/key",
        examples=["s3://llmbatch-input/default/inputs/3f2a.jsonl"],
    ),
]
S3Prefix = Annotated[
    str,
    AfterValidator(_check_prefix),
    Field(
        json_schema_extra={"pattern": S3_URI_PATTERN},
        description="s3://bucket/prefix/ (ends with '/')",
        examples=["s3://llmbatch-results/default/batch-1/"],
    ),
]
Duration = Annotated[
    str,
    AfterValidator(_check_duration),
    Field(
        json_schema_extra={"pattern": r"^[1-9][0-9]{0,5}[smhd]$"},
        description="A duration such as '24h', '90m', '2d' (1m to 7d).",
        examples=["24h"],
    ),
]
Metadata = Annotated[
    dict[
        Annotated[str, Field(min_length=1, max_length=64)],
        Annotated[str, Field(max_length=512)],
    ],
    Field(
        max_length=16,
        description="Up to 16 string pairs (keys <= 64 chars, values <= 512), echoed in every event.",
    ),
]


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


def _rfc3339(value: datetime) -> str:
    return format_time(value)


#: An aware datetime normalised to UTC and serialised as RFC 3339 with a ``Z`` suffix.
UtcDatetime = Annotated[
    AwareDatetime,
    AfterValidator(_utc),
    PlainSerializer(_rfc3339, return_type=str, when_used="json"),
]


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC with a ``Z`` suffix (microseconds kept when non-zero)."""
    text = value.astimezone(UTC).isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def utcnow() -> datetime:
    """The current time, timezone-aware, in UTC."""
    return datetime.now(UTC)


def parse_duration(value: str) -> timedelta:
    """``"24h"`` -> ``timedelta(hours=24)``; raises ``ValueError`` naming the accepted forms."""
    match = _DURATION_RE.fullmatch(value)
    if not match:
        raise ValueError(f"{value[:40]!r} is not a duration: use a number and a unit s/m/h/d, e.g. '24h'")
    delta = timedelta(seconds=int(match.group(1)) * _DURATION_UNITS[match.group(2)])
    if delta > MAX_COMPLETION_WINDOW:
        raise ValueError(f"{value!r} is longer than the 7d maximum")
    if delta < timedelta(minutes=1):
        raise ValueError(f"{value!r} is shorter than the 1m minimum")
    return delta


def json_schema_extra_examples(*examples: dict[str, Any]) -> dict[str, Any]:
    """A ``json_schema_extra`` dict carrying examples (exported to JSON Schema and AsyncAPI)."""
    return {"examples": list(examples)}


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy of a file: gone ``seconds`` (1 hour to 30 days) after its
    ``anchor``, ``created_at``: an uploaded file's upload, or a batch's result files' creation (the
    batch's end)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    anchor: Literal["created_at"] = Field(description="Only 'created_at'.")
    seconds: int = Field(
        ge=MIN_EXPIRES_AFTER_S,
        le=MAX_EXPIRES_AFTER_S,
        strict=True,
        description=f"{MIN_EXPIRES_AFTER_S} (1 hour) to {MAX_EXPIRES_AFTER_S} (30 days).",
    )
