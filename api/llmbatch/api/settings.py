"""Settings of the HTTP front door (``llmbatch api``): the shared connection settings plus ``api``.

Everything comes from the environment like the rest of llmbatch (prefix ``LLMBATCH_``, ``__`` for
nesting): ``LLMBATCH_API__PORT=8080``, ``LLMBATCH_API__KEYS='{"<sha256 hex of the key>": "search"}'``.

API keys are never configured in clear: the server holds only their SHA-256 hashes, each mapped to
the tenant the key acts for (``llmbatch api --hash-key`` prints the hash of a key read from stdin).
Kafka, Redis and S3 credentials are the shared ``SecretStr`` settings and are never logged.
"""

from __future__ import annotations

import re
import socket

from pydantic import BaseModel, Field, field_validator

from llmbatch.schemas.common import Duration, Tenant
from llmbatch.settings import LLMBatchSettings

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def default_source() -> str:
    """``ce_source`` of the events the API publishes: ``urn:llmbatch:api:<hostname>``."""
    return f"urn:llmbatch:api:{socket.gethostname() or 'unknown'}"


class ApiOptions(BaseModel):
    """``LLMBATCH_API__*``: where the API listens, who may call it, and its limits."""

    host: str = Field(default="127.0.0.1", description="Address to bind (loopback unless set).")
    port: int = Field(default=8080, ge=0, le=65535, description="TCP port (0 = any free).")
    keys: dict[str, Tenant] = Field(
        default_factory=dict,
        description="SHA-256 hex of each API key -> the tenant it acts for (JSON object). Keys are "
        "never stored in clear: `llmbatch api --hash-key` prints the hash of a key.",
    )
    max_upload_bytes: int = Field(
        default=200 << 20, ge=1024, le=8 << 30, description="Largest batch input file accepted (bytes)."
    )
    max_file_requests: int = Field(
        default=1_000_000, ge=1, description="Most request lines in one uploaded batch file."
    )
    max_active_batches: int = Field(
        default=0,
        ge=0,
        description="Batches each tenant may have under way at once through the API (0 = no limit); a "
        "create over it is 429 active_batch_quota_exceeded (create it once one has ended).",
    )
    max_json_bytes: int = Field(
        default=1 << 20, ge=1024, le=64 << 20, description="Largest JSON request body (bytes)."
    )
    default_completion_window: Duration = Field(
        default="24h", description="Completion window of a batch created without one."
    )
    priority: int = Field(default=5, ge=0, le=9, description="Priority of the batches the API publishes.")
    rate_per_s: float = Field(
        default=20.0, ge=0, description="Requests per second each tenant may make (0 = no limit)."
    )
    rate_burst: int = Field(default=40, ge=1, description="Requests a tenant may make at once.")
    state_fallback_after_s: float = Field(
        default=600.0,
        ge=0,
        description="A batch Redis does not know (yet, or any more) that is older than this is looked "
        "up in the results bucket (its manifest) instead of being reported as validating.",
    )
    republish_after_s: float = Field(
        default=120.0,
        ge=1,
        description="A batch the dispatcher does not know this long after its create (the API stopped "
        "between writing its record and publishing its event) is published again when read, with the "
        "same event id (the dispatcher drops a copy it already has), at most once per this interval.",
    )
    source: str = Field(default_factory=default_source, min_length=1, description="ce_source of events.")
    publish_timeout_s: float = Field(default=30.0, gt=0, description="Waiting for Kafka's acks=all.")
    connect_timeout_s: float = Field(default=10.0, gt=0, description="Connecting to Kafka/Redis/MinIO.")

    @field_validator("keys")
    @classmethod
    def _hashed_keys(cls, value: dict[str, str]) -> dict[str, str]:
        normalised: dict[str, str] = {}
        for digest, tenant in value.items():
            lowered = digest.strip().lower()
            if not _SHA256_HEX.fullmatch(lowered):
                raise ValueError(
                    "LLMBATCH_API__KEYS maps SHA-256 hashes (64 hex digits) of API keys to tenants, got "
                    f"an entry for tenant {tenant!r} that is not one: store `llmbatch api --hash-key`'s "
                    "output, never the key itself"
                )
            normalised[lowered] = tenant
        return normalised


class ApiSettings(LLMBatchSettings):
    """``ApiSettings()`` reads the environment (``LLMBATCH_`` prefix, ``__`` nesting)."""

    api: ApiOptions = ApiOptions()
