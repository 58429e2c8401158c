"""Webhook settings (``LLMBATCH_WEBHOOKS__*``), shared by the HTTP API (which manages endpoints and
shows their secrets) and the dispatcher (which delivers)."""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, Field, SecretStr, field_validator

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Standard Webhooks' suggested schedule: then the delivery is dead (about 27 hours in all)
DEFAULT_RETRY_S = (5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0)


class WebhookSettings(BaseModel):
    """Signed webhooks of batch events to the tenants' endpoints (off until ``signing_key`` is set)."""

    signing_key: SecretStr | None = Field(
        default=None,
        description="Key every endpoint's secret is derived from (at least 32 characters; e.g. "
        "`openssl rand -hex 32`), the same on the API and the dispatcher. Unset: no webhooks (the API "
        "answers 404 on /v1/webhook_endpoints and the dispatcher delivers nothing). Changing it changes "
        "every endpoint's secret.",
    )
    allow_networks: list[str] = Field(
        default_factory=list,
        description="Networks (CIDR, as JSON) endpoints may point at although they are loopback, "
        'private, link-local or otherwise not public, e.g. ["10.20.0.0/16"]. Empty: public addresses only.',
    )
    allow_http: bool = Field(default=False, description="Accept http:// endpoints (else https:// only).")
    retry_s: list[float] = Field(
        default_factory=lambda: list(DEFAULT_RETRY_S),
        description="Waits before each retry of a failed delivery, as JSON; after the last one the delivery "
        "is dead (kept for `llmbatch webhooks dead`, counted, logged).",
    )
    timeout_s: float = Field(
        default=15.0, gt=0, le=300, description="One delivery attempt, connect to answer."
    )
    max_endpoints: int = Field(default=16, ge=1, le=1000, description="Endpoints a tenant may have.")
    concurrency: int = Field(default=8, ge=1, le=256, description="Deliveries a dispatcher makes at once.")
    lease_s: float = Field(
        default=120.0,
        gt=0,
        description="How long a claimed delivery stays with its dispatcher before another may try it "
        "(a dispatcher that died mid-delivery).",
    )
    dead_ttl_s: int = Field(default=7 * 86400, ge=60, description="How long dead deliveries are kept.")

    @field_validator("signing_key")
    @classmethod
    def _long_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError(
                "the webhook signing key must be at least 32 characters (`openssl rand -hex 32`)"
            )
        return value

    @field_validator("allow_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for text in value:
            try:
                ipaddress.ip_network(text, strict=False)
            except ValueError as exc:
                raise ValueError(
                    f"allow_networks: {text!r} is not a network (e.g. 10.0.0.0/8): {exc}"
                ) from exc
        return value

    @field_validator("retry_s")
    @classmethod
    def _retries(cls, value: list[float]) -> list[float]:
        if len(value) > 50 or any(not 0 < v <= 7 * 86400 for v in value):
            raise ValueError("retry_s: at most 50 waits, each above 0 and at most 7 days (604800)")
        return value

    @property
    def enabled(self) -> bool:
        return self.signing_key is not None

    def networks(self) -> list[IpNetwork]:
        """``allow_networks`` parsed."""
        return [ipaddress.ip_network(text, strict=False) for text in self.allow_networks]

    def key_bytes(self) -> bytes:
        """The signing key (raises ValueError when webhooks are off)."""
        if self.signing_key is None:
            raise ValueError("LLMBATCH_WEBHOOKS__SIGNING_KEY is not set")
        return self.signing_key.get_secret_value().encode()
