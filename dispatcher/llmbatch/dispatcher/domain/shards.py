"""The tracker's shards (pure): which part of the batch space each dispatcher replica tracks.

The batches in flight are split into ``tracker_shards`` shards by a hash of their key
(:func:`shard_of`); each shard has its own lease in Redis, and the replica holding it checks those
batches' jobs, ends them and publishes their terminal events. Which replica should hold which shard
follows from the live replicas alone (:func:`shards_for`): every replica reads the same member list
and computes the same split, each takes the leases of its own shards and gives back the others. A
replica that dies loses its shards when their leases expire; the members left share them again.

The split is balanced (shares differ by one at most) and moves few shards when the members change:
a shard goes to the replica that ranks it highest among those with room (rendezvous hashing), so a
replica joining moves about its share, not every shard (16 shards, a third replica joining two: 6.1
moved on average, 5.3 at least). A moved shard waits for its old holder to give its lease back.

Two replicas acting on one batch during a hand-over is harmless, as with the single leader before:
every state change is a compare-and-set on the batch's version, submissions are idempotent, and a
terminal event republished carries the same event id.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable

MAX_SHARDS = 1024


def shard_of(key: str, shards: int) -> int:
    """The shard of batch ``key`` among ``shards`` (stable across processes and versions: CRC-32)."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be 1..{MAX_SHARDS}, got {shards}")
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % shards


def _rank(member: str, shard: int) -> bytes:
    return hashlib.blake2b(f"{shard}\x00{member}".encode("utf-8", "surrogatepass"), digest_size=8).digest()


def split(members: Iterable[str], shards: int) -> dict[str, frozenset[int]]:
    """Every live member's shards: each member gets ``shards // n`` or one more (``n`` members), and
    a shard goes to the member that ranks it highest (rendezvous hashing) among those with room.
    Deterministic: the same members and count give the same split on every replica."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be 1..{MAX_SHARDS}, got {shards}")
    live = sorted(set(members))
    if not live:
        return {}
    base, extra = divmod(shards, len(live))
    # the members that take one more than the base: the first ``extra`` by a rank of their own
    by_rank = sorted(live, key=lambda m: _rank(m, -1))
    room = {m: base + (1 if i < extra else 0) for i, m in enumerate(by_rank)}
    owned: dict[str, set[int]] = {m: set() for m in live}
    for shard in range(shards):
        for member in sorted(live, key=lambda m: _rank(m, shard), reverse=True):
            if room[member] > 0:
                room[member] -= 1
                owned[member].add(shard)
                break
    return {m: frozenset(s) for m, s in owned.items()}


def shards_for(member: str, members: Iterable[str], shards: int) -> frozenset[int]:
    """The shards ``member`` should hold when ``members`` are live (``member`` counts as live)."""
    return split({member, *members}, shards)[member]
