"""Who is calling: API keys (held only as SHA-256 hashes) -> tenants, and each tenant's request quota.

A key is sent as OpenAI's SDKs send it, ``Authorization: Bearer <key>``. The server hashes it and
looks the hash up in ``LLMBATCH_API__KEYS``; the key itself is never stored or logged. Every object a
tenant creates lives under its prefix and every read looks only there, so another tenant's ids simply
do not exist for it (404, never 403: existence is not revealed).

:class:`RateLimiter` is a token bucket per tenant (``rate_per_s``, ``rate_burst``), kept in the
process: with N replicas a tenant gets up to N times the rate.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmbatch.api.errors import InvalidApiKey, RateLimited


def hash_api_key(key: str) -> str:
    """The SHA-256 hex digest under which ``key`` is configured."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class Authenticator:
    """``Authorization`` header -> tenant."""

    def __init__(self, hashed_keys: Mapping[str, str]) -> None:
        self._tenants = {digest.lower(): tenant for digest, tenant in hashed_keys.items()}

    def tenant_of(self, authorization: str | None) -> str:
        """The tenant of the bearer key in ``authorization``; :class:`InvalidApiKey` otherwise."""
        if not authorization:
            raise InvalidApiKey(
                "You didn't provide an API key: send it as 'Authorization: Bearer <key>'",
                code="missing_api_key",
            )
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise InvalidApiKey("send the API key as 'Authorization: Bearer <key>'")
        tenant = self._tenants.get(hash_api_key(key.strip()))
        if tenant is None:
            raise InvalidApiKey("Incorrect API key provided; ask the operator for a valid key")
        return tenant


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """A token bucket per tenant: ``burst`` requests at once, refilled at ``rate_per_s``."""

    def __init__(self, rate_per_s: float, burst: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate_per_s
        self.burst = burst
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def check(self, tenant: str) -> None:
        """Take one token of ``tenant``'s bucket; :class:`RateLimited` (with ``Retry-After``) when empty."""
        if self.rate <= 0:
            return
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return
        wait = math.ceil((1.0 - bucket.tokens) / self.rate)
        raise RateLimited(
            f"Rate limit reached for tenant {tenant!r}: {self.rate:g} requests/s with bursts of "
            f"{self.burst}; retry in {wait} s",
            headers={"Retry-After": str(wait)},
        )
