"""Enqueued-token quotas: how many tokens a batch is taken to hold while it is accepted and not ended
(estimated at intake, as OpenAI's batch queue limits are), and the refusal's wording. Pure.

The count per tenant lives in Redis (``<p>:quota:<tenant>:tokens``): ``intake.lua`` checks and adds a
batch's estimate in the script that accepts it (nothing half-accepted), ``mark_published.lua`` takes it
back once the batch's end is published.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import orjson

BYTES_PER_TOKEN = 4
"""The estimate: about 4 bytes of input a token (English text through a BPE tokenizer)."""


def estimate_inline(bodies: Iterable[Any]) -> int:
    """Tokens of an inline batch: its request bodies' JSON bytes / :data:`BYTES_PER_TOKEN`."""
    return sum(math.ceil(len(orjson.dumps(body)) / BYTES_PER_TOKEN) for body in bodies)


def estimate_file(size_bytes: int) -> int:
    """Tokens of a file batch: the input file's bytes / :data:`BYTES_PER_TOKEN`."""
    return math.ceil(max(0, size_bytes) / BYTES_PER_TOKEN)


def over_storage_message(tenant: str, used: int, limit: int) -> str:
    return (
        f"tenant {tenant!r} keeps {used} bytes (inputs and results, as last measured): over its limit of "
        f"{limit} (LLMBATCH_TENANTS__MAX_STORED_BYTES). Send the batch again once files were deleted or "
        "expired (their retention)"
    )


def over_limit_message(tenant: str, estimate: int, used: int, limit: int) -> str:
    return (
        f"tenant {tenant!r} has {used} tokens enqueued (estimated) and this batch adds about {estimate}: "
        f"over its limit of {limit} (LLMBATCH_TENANTS__MAX_ENQUEUED_TOKENS). Send it again once earlier "
        "batches have ended, or split it"
    )
