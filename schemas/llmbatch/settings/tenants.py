"""Tenant settings (``LLMBATCH_TENANTS__*``): who may act for which tenant, where its jobs run, its
share of the engines and its quota of enqueued tokens."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, Field, SecretStr, field_validator

from llmbatch.schemas.common import check_tenant


def limit_of(limits: Mapping[str, int], tenant: str) -> int | None:
    """A per-tenant limit of a setting like ``{"*": n, "acme": m}``: the tenant's own, else ``*``'s;
    None: no limit."""
    return limits.get(tenant, limits.get("*"))


class TenantSettings(BaseModel):
    """Who may act for which tenant (``LLMBATCH_TENANTS__KEYS``) and where its jobs run
    (``LLMBATCH_TENANTS__POOLS``)."""

    keys: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Tenant name -> its signing key (at least 32 characters), as JSON. A producer or the "
        "HTTP API signs the requests and cancels of those tenants with them (HMAC-SHA256, header "
        "llmbatch-tenant-sig); give each producer only the keys of the tenants it acts for. A dispatcher "
        "that has keys refuses (dead letter invalid_event and a rejected answer) every request or cancel "
        "not signed with the key of the tenant it names. Empty on the dispatcher: tenant claims are "
        "trusted (it says so as it starts).",
    )

    @field_validator("keys")
    @classmethod
    def _valid_keys(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for tenant, key in value.items():
            check_tenant(tenant)
            if len(key.get_secret_value()) < 32:
                raise ValueError(
                    f"the key of tenant {tenant!r} must be at least 32 characters "
                    "(e.g. `openssl rand -hex 32`)"
                )
        return value

    pools: list[str] = Field(
        default_factory=list,
        description="Tenants whose batches run only on their own Ray worker pool, as JSON (e.g. "
        '["acme"]): nodes started with --num-cpus=0 and --resources=\'{"llmbatch_tenant_<tenant>": <CPUs>}\' '
        "(without job S3 sessions, their environment holds that tenant's S3 keys, limited by a MinIO policy "
        "to its prefixes: `llmbatch dispatcher minio-tenant`; with them, no keys are needed there). Their "
        "jobs ask that resource where others ask CPUs, so each "
        "runs only on its own pool and nothing else runs there. They always run as Ray jobs (never on the "
        "shared batch runner, which reads every tenant's files) and wait while the pool has no node.",
    )

    @field_validator("pools")
    @classmethod
    def _valid_pools(cls, value: list[str]) -> list[str]:
        return sorted({check_tenant(tenant) for tenant in value})

    weights: dict[str, float] = Field(
        default_factory=dict,
        description='Tenant name -> its weight on the shared engines, as JSON (e.g. {"acme": 2}): within a '
        "priority, tenants take turns at an engine replica in proportion to their weights (1 for a tenant "
        "not named), then their batches take turns, so a tenant's many batches take one tenant's share. "
        "Sent to the engines with their Serve config (changing it redeploys them).",
    )

    @field_validator("weights")
    @classmethod
    def _valid_weights(cls, value: dict[str, float]) -> dict[str, float]:
        for tenant, weight in value.items():
            check_tenant(tenant)
            if not 0 < weight <= 1000:
                raise ValueError(
                    f"the weight of tenant {tenant!r} must be above 0 and at most 1000 (got {weight})"
                )
        return value

    def key_bytes(self) -> dict[str, bytes]:
        """Tenant -> key bytes (empty when no tenant has a key)."""
        return {tenant: key.get_secret_value().encode() for tenant, key in self.keys.items()}

    def pool_of(self, tenant: str) -> str | None:
        """The Ray resource of ``tenant``'s own worker pool, or ``None`` when it has none."""
        from llmbatch.schemas.job import tenant_pool_resource

        return tenant_pool_resource(tenant) if tenant in self.pools else None

    max_enqueued_tokens: dict[str, int] = Field(
        default_factory=dict,
        description="Tenant -> the tokens its batches may have enqueued at once (accepted, not ended), "
        'as JSON; "*" applies to every tenant not named (e.g. {"*": 5000000, "acme": 20000000}). Tokens are '
        "estimated at intake from the input, about 4 bytes a token (an inline batch's request bodies, a "
        "file batch's size). A batch that would pass the limit is refused whole (HTTP 429 / a rejected "
        "event, code token_limit_exceeded, and a dead letter to replay later); its tokens are released "
        "when the batch's end is published. Empty: no limit.",
    )

    @field_validator("max_enqueued_tokens")
    @classmethod
    def _valid_token_limits(cls, value: dict[str, int]) -> dict[str, int]:
        for tenant, limit in value.items():
            if tenant != "*":
                check_tenant(tenant)
            if not isinstance(limit, int) or limit < 1:
                raise ValueError(f"max_enqueued_tokens of {tenant!r} must be a positive number of tokens")
        return value

    max_stored_bytes: dict[str, int] = Field(
        default_factory=dict,
        description='Tenant -> the bytes it may keep, its inputs and results together, as JSON; "*" applies '
        'to every tenant not named (e.g. {"*": 50000000000}). An upload through the HTTP API that would go '
        "over is refused (429 storage_quota_exceeded, counted from a listing), and so is a batch of a "
        "tenant already over it, by the API (429) and on Kafka (a rejected event and a dead letter, "
        "storage_quota_exceeded), judged by the tracker leader's last measure "
        "(LLMBATCH_DISPATCHER__STORED_BYTES_EVERY_S). Deleting files, or their retention, makes room. "
        "Empty: no limit.",
    )

    @field_validator("max_stored_bytes")
    @classmethod
    def _valid_storage_limits(cls, value: dict[str, int]) -> dict[str, int]:
        for tenant, limit in value.items():
            if tenant != "*":
                check_tenant(tenant)
            if not isinstance(limit, int) or limit < 1:
                raise ValueError(f"max_stored_bytes of {tenant!r} must be a positive number of bytes")
        return value

    def token_limit(self, tenant: str) -> int | None:
        """The enqueued-token limit of ``tenant`` (its own, else ``*``), None when it has none."""
        return limit_of(self.max_enqueued_tokens, tenant)

    def known(self) -> frozenset[str]:
        """The configured tenants (keys, pools, weights) and ``default``: the tenants that metrics
        label by name (any other is ``other``, so labels stay bounded)."""
        return frozenset({"default", *self.keys, *self.pools, *self.weights})
