"""Reads of the state store's per-batch hashes: a batch's record (one or many, whole or a few fields),
its progress hash, and the markers of the command events already applied. Mixed into
:class:`llmbatch.dispatcher.state.store.StateStore`, whose client, keys and error translation (``_call``)
it uses."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.state.store_host import StoreHost
from llmbatch.dispatcher.state.store_indexes import reply_text

log = logging.getLogger(__name__)

UNREADABLE_SAID_MAX = 10_000  # the batches whose unreadable record was logged (bounded: then said again)


def str_hash(raw: Mapping[Any, Any]) -> dict[str, str]:
    """A hash reply as str -> str (the client decodes already; this only narrows the type)."""
    return {reply_text(k): reply_text(v) for k, v in raw.items()}


class StoreRecords(StoreHost):
    """Per-batch reads of the Redis state store (see the module docstring)."""

    def _record(self, key: BatchKey, data: Mapping[str, str]) -> BatchRecord | None:
        """The record of a batch's hash; ``None`` (as for no batch: every index drops it as an orphan)
        when its state or version is unreadable. Redis is not trusted: one garbled hash read with others
        must not stop every step that reads them. Logged once per batch."""
        try:
            return BatchRecord.from_hash(key, data)
        except (KeyError, ValueError) as exc:
            if key not in self._unreadable_said:
                if len(self._unreadable_said) >= UNREADABLE_SAID_MAX:
                    self._unreadable_said.clear()
                self._unreadable_said.add(key)
                log.error(
                    "batch record unreadable: left out of every step (fix or delete its hash)",
                    extra={"batch_key": key[:200], "error": repr(exc)[:200]},
                )
            return None

    async def get(self, key: BatchKey) -> BatchRecord | None:
        data = str_hash(await self._call(lambda: self.client.hgetall(self.keys.batch(key))))
        return self._record(key, data) if data else None

    async def get_many(self, batch_keys: Sequence[BatchKey]) -> list[BatchRecord | None]:
        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in batch_keys:
                    pipe.hgetall(self.keys.batch(key))
                return list(await pipe.execute())

        raw = await self._call(run) if batch_keys else []
        return [self._record(k, d) if d else None for k, d in zip(batch_keys, raw, strict=True)]

    async def get_fields_many(
        self, batch_keys: Sequence[BatchKey], fields: Sequence[str]
    ) -> list[BatchRecord | None]:
        """Each batch's record with only ``fields`` (and its state and version), in one round trip
        (``None``: no such batch): for the steps that judge many batches by a few fields each, without
        reading their request bodies."""
        names = ("state", "version", *fields)

        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in batch_keys:
                    pipe.hmget(self.keys.batch(key), names)
                return list(await pipe.execute())

        raw = await self._call(run) if batch_keys else []
        return [
            self._record(k, {n: v for n, v in zip(names, values, strict=True) if v is not None})
            if values and values[0]
            else None
            for k, values in zip(batch_keys, raw, strict=True)
        ]

    async def states_many(self, batch_keys: Sequence[BatchKey]) -> list[State | None]:
        """The state of each batch (``None``: no such batch, or its record is unreadable, as for
        :meth:`get`), in one round trip."""
        return [r.state if r is not None else None for r in await self.get_fields_many(batch_keys, ())]

    async def markers_exist(self, markers: Sequence[tuple[str, str]]) -> list[bool]:
        """Whether each command event (source, id) was already applied."""
        if not markers:
            return []

        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for source, event_id in markers:
                    pipe.exists(self.keys.event(source, event_id))
                return list(await pipe.execute())

        return [bool(int(x)) for x in await self._call(run)]

    async def set_marker(self, marker: tuple[str, str]) -> None:
        await self.set_markers([marker])

    async def set_markers(self, markers: Sequence[tuple[str, str]]) -> None:
        async def run() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                for marker in markers:
                    pipe.set(self.keys.event(*marker), "1", ex=self.dedupe_ttl_s)
                await pipe.execute()

        if markers:
            await self._call(run)

    async def read_progress(self, key: BatchKey) -> dict[str, str]:
        return str_hash(await self._call(lambda: self.client.hgetall(self.keys.progress(key))))

    async def read_progress_many(self, batch_keys: Sequence[BatchKey]) -> list[dict[str, str]]:
        """The progress hashes of ``batch_keys`` (one round trip; empty for a batch without one)."""
        if not batch_keys:
            return []

        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in batch_keys:
                    pipe.hgetall(self.keys.progress(key))
                return list(await pipe.execute())

        return [str_hash(h) for h in await self._call(run)]
