"""A create checked against its tenant's quotas before its event goes out: enqueued tokens
(``LLMBATCH_TENANTS__MAX_ENQUEUED_TOKENS``) and stored bytes (``LLMBATCH_TENANTS__MAX_STORED_BYTES``).
Both answer 429 in OpenAI's shape. The dispatcher checks again as it takes the batch in, which is the
check that holds when creates race (:mod:`llmbatch.dispatcher.domain.quota`)."""

from __future__ import annotations

from collections.abc import Mapping

from llmbatch.api.errors import QuotaExceeded, from_exception
from llmbatch.api.store.state import StateReader
from llmbatch.dispatcher.domain.quota import estimate_file, over_limit_message, over_storage_message
from llmbatch.settings.tenants import limit_of


async def check_tokens(state: StateReader, limits: Mapping[str, int], tenant: str, size: int) -> None:
    """429 ``token_limit_exceeded`` when a file of ``size`` bytes (its tokens estimated) and the tokens
    the tenant's batches hold would pass its limit."""
    limit = limit_of(limits, tenant)
    if limit is None:
        return
    estimate = estimate_file(size)
    try:
        used = await state.enqueued_tokens(tenant)
    except Exception as exc:
        raise from_exception(exc) from exc
    if used + estimate > limit:
        raise QuotaExceeded(
            over_limit_message(tenant, estimate, used, limit),
            param="input_file_id",
            code="token_limit_exceeded",
        )


async def check_storage(state: StateReader, limits: Mapping[str, int], tenant: str) -> None:
    """429 ``storage_quota_exceeded`` when the tenant keeps its limit or more, as the dispatchers last
    measured: the dispatcher would refuse the batch."""
    limit = limit_of(limits, tenant)
    if limit is None:
        return
    try:
        used = await state.stored_bytes(tenant)
    except Exception as exc:
        raise from_exception(exc) from exc
    if used is not None and used >= limit:
        raise QuotaExceeded(
            over_storage_message(tenant, used, limit), param="input_file_id", code="storage_quota_exceeded"
        )
