"""The state store's Lua scripts, loaded once per store (each script is a file of ``lua/`` with its
KEYS/ARGV header): what :class:`~llmbatch.dispatcher.state.store.StateStore` and its upkeep call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript


@dataclass
class Scripts:
    intake: AsyncScript
    transition: AsyncScript
    mark_published: AsyncScript
    mark_dlt: AsyncScript
    promote: AsyncScript
    lease_acquire: AsyncScript
    lease_release: AsyncScript
    leases_hold: AsyncScript
    members: AsyncScript
    drop_orphans: AsyncScript
