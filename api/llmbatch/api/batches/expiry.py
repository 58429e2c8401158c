"""When the API's files and a batch's result files expire, and the 404 an expired one answers.

The dates live in the retention index (:mod:`llmbatch.dispatcher.state.retention`, behind the
:class:`ExpiryIndex` port): an upload is dated as it is stored (``expires_after``, else the tenant's
retention), a batch's lifecycle by the dispatcher as its end is published. A read past the date
answers 404 ``expired`` at once, before the collector (:mod:`llmbatch.api.retention.collector`) has removed
anything; once it has, its tombstone keeps that answer for ``forget_after_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Literal, Protocol

from llmbatch.api.errors import NotFound
from llmbatch.dispatcher.domain.retention import batch_member, file_member, gone_name, retention_s
from llmbatch.schemas.common import ExpiresAfter
from llmbatch.settings.retention import RetentionSettings


class ExpiryIndex(Protocol):
    """What the API does with the retention index
    (:class:`llmbatch.dispatcher.state.retention.RetentionIndex`)."""

    async def schedule(self, member: str, due: float) -> None: ...

    async def due_of(self, members: Sequence[str]) -> list[float | None]: ...

    async def gone_at(self, name: str) -> float | None: ...


def expired(what: str, record_id: str, at: float, param: str) -> NotFound:
    """The 404 of something past its expiry (``code: expired``)."""
    when = datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return NotFound(
        f"{what} {record_id} expired at {when} and was (or is being) deleted: its retention ended "
        "(expires_after / output_expires_after, else LLMBATCH_RETENTION__*)",
        param=param,
        code="expired",
    )


class Expiry:
    """Dates and expiry checks over an optional index (without one nothing expires)."""

    def __init__(
        self,
        index: ExpiryIndex | None,
        settings: RetentionSettings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.settings = settings
        self.clock = clock

    def file_expires_at(self, tenant: str, asked: ExpiresAfter | None, created_at: float) -> float | None:
        """When an upload of ``tenant`` made at ``created_at`` expires (``None``: kept until deleted)."""
        if self.index is None:
            return None
        keep = retention_s(self.settings, tenant, asked)
        return created_at + keep if keep else None

    async def date_file(self, tenant: str, file_id: str, expires_at: float | None) -> None:
        """Put the upload in the index (before its bytes are written: the collector may then find
        nothing to delete, but never bytes it does not know of)."""
        if self.index is not None and expires_at is not None:
            await self.index.schedule(file_member(tenant, file_id), expires_at)

    def is_past(self, expires_at: float | None) -> bool:
        return expires_at is not None and self.clock() >= expires_at

    async def results_expire_at(self, tenant: str, batch_id: str, lifecycles: Sequence[str]) -> float | None:
        """When a batch's result files expire: the earliest date of the lifecycles they are in."""
        if self.index is None or not lifecycles:
            return None
        dates = await self.index.due_of([batch_member(tenant, batch_id, lc) for lc in lifecycles])
        known = [d for d in dates if d is not None]
        return min(known) if known else None

    async def gone(
        self, kind: Literal["batch", "file"], tenant: str, record_id: str, param: str
    ) -> NotFound | None:
        """The ``expired`` 404 of a file or batch the collector removed, ``None`` when it did not."""
        if self.index is None:
            return None
        at = await self.index.gone_at(gone_name(kind, tenant, record_id))
        if at is None:
            return None
        return expired("File" if kind == "file" else "Batch", record_id, at, param)

    async def gone_or(
        self, missing: NotFound, kind: Literal["batch", "file"], tenant: str, record_id: str, param: str
    ) -> NotFound:
        """The ``expired`` 404 of what the collector removed, else ``missing``. The tombstone is a
        courtesy: Redis being away must not turn a 404 into a 503."""
        try:
            return await self.gone(kind, tenant, record_id, param) or missing
        except Exception:
            return missing
