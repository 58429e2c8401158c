"""Retention settings (``LLMBATCH_RETENTION__*``), shared by the dispatcher (which dates a batch's
results as it ends) and the HTTP API (which dates uploads and runs the collector)."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from llmbatch.schemas.common import MIN_EXPIRES_AFTER_S, check_tenant

MAX_RETENTION_S = 10 * 365 * 86400
DEFAULT_RETENTION_S = 30 * 86400


def _check_retention(name: str, value: int) -> int:
    if value != 0 and not MIN_EXPIRES_AFTER_S <= value <= MAX_RETENTION_S:
        raise ValueError(
            f"{name} must be 0 (keep until deleted) or {MIN_EXPIRES_AFTER_S}-{MAX_RETENTION_S} seconds "
            f"(got {value})"
        )
    return value


class RetentionSettings(BaseModel):
    """How long uploaded files and a batch's results are kept, and the collector that removes them."""

    default_s: int = Field(
        default=DEFAULT_RETENTION_S,
        description="Seconds an uploaded batch file (from its upload) and a batch's result files and state "
        "(from its end) are kept when neither the request nor LLMBATCH_RETENTION__BY_TENANT says otherwise "
        "(OpenAI keeps batch files 30 days). 0: kept until deleted.",
    )
    by_tenant: dict[str, int] = Field(
        default_factory=dict,
        description='Tenant -> its retention in seconds, as JSON (e.g. {"acme": 604800}); 0 keeps that '
        "tenant's files until deleted. A request's own output_expires_after (HTTP or Kafka) or an upload's "
        "expires_after wins over both.",
    )
    collect_every_s: float = Field(
        default=300.0,
        ge=0,
        le=86_400,
        description="How often each HTTP API replica runs the collector, which deletes expired files, "
        "results, manifests and state (replicas share the work safely). 0: never (then run "
        "`llmbatch retention collect` from a cron job).",
    )
    forget_after_s: int = Field(
        default=30 * 86400,
        ge=3600,
        le=MAX_RETENTION_S,
        description="How long, after the collector removed an expired file or batch, reading its id still "
        "answers 404 with code 'expired' (then: 'not found').",
    )

    @field_validator("default_s")
    @classmethod
    def _valid_default(cls, value: int) -> int:
        return _check_retention("default_s", value)

    @field_validator("by_tenant")
    @classmethod
    def _valid_by_tenant(cls, value: dict[str, int]) -> dict[str, int]:
        for tenant, seconds in value.items():
            check_tenant(tenant)
            _check_retention(f"the retention of tenant {tenant!r}", seconds)
        return value

    def for_tenant(self, tenant: str) -> int:
        """Seconds ``tenant``'s files are kept when nothing more specific is asked (0: until deleted)."""
        return self.by_tenant.get(tenant, self.default_s)
