"""The replay ledger on a real Redis stays bounded by the replays of its retention: before, its hash
kept every entry for as long as replays went on (each write renewed the whole hash's expiry)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from llmbatch.dispatcher.ops.replay import LedgerEntry
from llmbatch.dispatcher.ops.replay_publish import LEDGER_TTL_S, ReplayLedger
from llmbatch.settings import RedisSettings
from tests.support.scratch_store import scratch_store

pytestmark = pytest.mark.integration
T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def test_entries_older_than_the_retention_are_pruned_at_the_next_write(
    redis_settings: RedisSettings,
) -> None:
    async with scratch_store(redis_settings.url) as store:
        ledger = ReplayLedger(store, "req.dlt")
        entry = LedgerEntry(replay_id="r", round=1, at=T0, by="op", to_topic="req")
        for i in range(10_000):
            await ledger.record(f"0:{i}", entry.model_copy(update={"at": T0 + timedelta(seconds=i)}))
        assert await store.client.hlen(ledger.key) == 10_000
        later = T0 + timedelta(seconds=LEDGER_TTL_S + 5_000)  # the first 5,000 have passed the retention
        await ledger.record("1:0", entry.model_copy(update={"at": later}))
        assert await store.client.hlen(ledger.key) == 5_001
        assert await store.client.zcard(ledger.times) == 5_001
        kept = await ledger.entries(["0:4999", "0:5000", "1:0"])
        assert set(kept) == {"0:5000", "1:0"}
