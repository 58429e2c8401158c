"""One order for ``GET /v1/batches`` over the two places a tenant's batches are known.

The API's own batches are its records (ids that sort newest first, made from the millisecond they were
created); the batches the tenant's services sent to Kafka are the dispatcher's per-tenant index (batch
id -> the millisecond it was accepted). A page is both, merged: newest millisecond first; within one
millisecond the API's batches (in their ids' order), then the Kafka ones (ids descending). A cursor is
the last batch id of a page, whichever kind it is: the next page takes up both lists after it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from llmbatch.api.store.records import BATCH_PREFIX, made_ms


@dataclass(frozen=True, slots=True)
class Entry:
    """One batch of a page: its id, its millisecond, and which list it came from."""

    batch_id: str
    ms: int
    via_kafka: bool

    def order(self) -> tuple[int, bool]:
        return (-self.ms, self.via_kafka)


def merge(api_ids: Sequence[str], kafka: Sequence[tuple[str, int]]) -> list[Entry]:
    """The API's ids (newest first) and the Kafka batches ``(id, ms)`` (newest first, ids descending
    within a millisecond) as one list in the listing's order."""
    mine = [Entry(i, made_ms(i, BATCH_PREFIX), False) for i in api_ids]
    sent = [Entry(i, ms, True) for i, ms in kafka]
    return list(heapq.merge(mine, sent, key=Entry.order))
