"""Retention: what expires when, named the way the retention index holds it (pure).

The index (``<p>:retention:due``, :mod:`llmbatch.dispatcher.state.retention`) holds one member per
thing to delete, scored by when it expires:

``b|<tenant>|<batch_id>|<lifecycle>``  one lifecycle of a batch: its result folder and its state, due
                                       ``retention_s`` after it ended (``mark_published.lua`` adds it)
``f|<tenant>|<file_id>``               a file uploaded through the HTTP API, due at its ``expires_at``

Neither a tenant, a batch id, a file id nor a lifecycle holds ``|``, so a member names one thing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from llmbatch.schemas.common import BATCH_ID_PATTERN, TENANT_PATTERN, ExpiresAfter
from llmbatch.settings.retention import RetentionSettings

_TENANT = TENANT_PATTERN.strip("^$")
_BATCH = BATCH_ID_PATTERN.strip("^$")
_BATCH_MEMBER = re.compile(rf"b\|({_TENANT})\|({_BATCH})\|([0-9a-f]{{10}})?")
_FILE_MEMBER = re.compile(rf"f\|({_TENANT})\|(file-[0-9]{{13}}[0-9a-f]{{16}})")


@dataclass(frozen=True, slots=True)
class Expiring:
    """One member of the retention index, read back (see the module docstring)."""

    kind: Literal["batch", "file"]
    tenant: str
    id: str
    lifecycle: str = ""

    @property
    def member(self) -> str:
        if self.kind == "file":
            return file_member(self.tenant, self.id)
        return batch_member(self.tenant, self.id, self.lifecycle)

    @property
    def gone_name(self) -> str:
        """What the tombstone of a removed thing is named by (without the lifecycle: reads know an id)."""
        return gone_name(self.kind, self.tenant, self.id)


def batch_member(tenant: str, batch_id: str, lifecycle: str) -> str:
    return f"b|{tenant}|{batch_id}|{lifecycle}"


def file_member(tenant: str, file_id: str) -> str:
    return f"f|{tenant}|{file_id}"


def gone_name(kind: Literal["batch", "file"], tenant: str, record_id: str) -> str:
    return f"{kind[0]}|{tenant}|{record_id}"


def parse_member(member: str) -> Expiring | None:
    """The member read back, ``None`` when it is not one this module makes (hostile or corrupt)."""
    if m := _BATCH_MEMBER.fullmatch(member):
        return Expiring("batch", m[1], m[2], m[3] or "")
    if m := _FILE_MEMBER.fullmatch(member):
        return Expiring("file", m[1], m[2])
    return None


def retention_s(settings: RetentionSettings, tenant: str, asked: ExpiresAfter | None) -> int:
    """Seconds a thing of ``tenant`` is kept after its anchor: what its request asked, else the
    tenant's setting, else the default; 0: until deleted."""
    return asked.seconds if asked is not None else settings.for_tenant(tenant)
