"""How the live dispatcher replicas split the tracker's shards (pure)."""

from __future__ import annotations

import zlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.dispatcher.domain.shards import MAX_SHARDS, shard_of, shards_for, split

pytestmark = pytest.mark.unit

tokens = st.text(min_size=1, max_size=40)
members_of = st.lists(tokens, min_size=1, max_size=12, unique=True)
counts = st.integers(min_value=1, max_value=200)


def test_a_batch_s_shard_is_the_crc32_of_its_key() -> None:
    """Stable across processes, versions and machines (not Python's salted ``hash``)."""
    assert shard_of("default/b-1", 16) == zlib.crc32(b"default/b-1") % 16
    assert {shard_of(f"t/b-{i}", 16) for i in range(1000)} == set(range(16))


@pytest.mark.parametrize("count", [0, -1, MAX_SHARDS + 1])
def test_a_shard_count_out_of_range_is_refused(count: int) -> None:
    with pytest.raises(ValueError, match="shards must be"):
        shard_of("k", count)
    with pytest.raises(ValueError, match="shards must be"):
        split(["a"], count)


@given(members_of, counts)
def test_every_shard_has_exactly_one_member_and_shares_differ_by_one_at_most(
    members: list[str], count: int
) -> None:
    owned = split(members, count)
    assert set(owned) == set(members)
    every = [s for shards in owned.values() for s in shards]
    assert sorted(every) == list(range(count))  # each shard once
    sizes = [len(s) for s in owned.values()]
    assert max(sizes) - min(sizes) <= 1


@given(members_of, counts, st.randoms(use_true_random=False))
def test_every_replica_computes_the_same_split_whatever_order_it_read_the_members_in(
    members: list[str], count: int, rnd: object
) -> None:
    shuffled = list(members)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert split(shuffled, count) == split(members, count)
    for member in members:
        assert shards_for(member, shuffled, count) == split(members, count)[member]


@given(members_of, tokens)
def test_a_replica_not_yet_in_the_member_list_counts_itself(members: list[str], me: str) -> None:
    assert shards_for(me, members, 16) == split({*members, me}, 16)[me]


def test_a_replica_joining_moves_about_its_share_not_every_shard() -> None:
    """Rendezvous ranks keep most shards where they were (a modulo split would move nearly all)."""
    moved = []
    for n in range(1, 8):
        before = split([f"replica-{i}" for i in range(n)], 64)
        after = split([f"replica-{i}" for i in range(n + 1)], 64)
        moved.append(sum(len(before[m] - after[m]) for m in before))
    shares = [64 / (n + 1) for n in range(1, 8)]
    # each at most twice the newcomer's share (a modulo split moves n / (n + 1) of all: 32 .. 56 here)
    assert all(m <= 2 * share for m, share in zip(moved, shares, strict=True)), (moved, shares)


def test_a_replica_holding_some_shards_knows_it_is_not_alone_before_it_counts_the_others() -> None:
    """Its member count is from its last step: one that first saw only itself, then found half the shards
    held, skipped waking the others (the shards' holders checked its launches a poll interval late)."""
    from llmbatch.dispatcher.metrics import Metrics
    from llmbatch.dispatcher.runs.leases import TrackerLeases

    store: Any = None  # nothing here reaches Redis
    leases = TrackerLeases(store, Metrics(), token="a", ttl_s=15.0, shard_count=16)
    leases.members = 1
    leases._set(True, frozenset(range(16)))
    assert leases.alone
    leases._set(True, frozenset(range(8)))
    assert not leases.alone
    leases._set(True, frozenset(range(16)))
    leases.members = 2
    assert not leases.alone
