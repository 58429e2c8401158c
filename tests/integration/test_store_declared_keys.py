"""Every key the dispatcher's Lua scripts touch is declared in their KEYS (as BullMQ's are): what makes
them safe on Redis Cluster (with a hash tag in the key prefix) and lets a reader of a script's header
know all it writes.

Watched on a real Redis: MONITOR records each command a script runs; Redis itself says which of its
arguments are keys (``COMMAND GETKEYS``), and each must be among the keys of the EVALSHA that ran it.
The store runs every script, through each path that touches more than the batch's hash (a reopen, a
retry's delay and promotion, an end, its publication, a dead letter's marker).
"""

from __future__ import annotations

import asyncio
import codecs
import re
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from llmbatch.dispatcher.domain.batch_record import IntakeItem
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.retention import Expiring, file_member
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.state.retention import RetentionIndex
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.dispatcher.webhooks.store import Delivery, WebhookStore
from llmbatch.settings import RedisSettings
from tests.support.clock import Clock
from tests.support.scratch_store import scratch_store

pytestmark = pytest.mark.integration
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
_LINE = re.compile(r"^\+[0-9.]+ \[\d+ ([^\]]+)\] (.*)$")
NOW = 1_790_000_000.0


@dataclass
class Monitor:
    """The lines of a MONITOR connection, read on a thread of its own."""

    sock: socket.socket
    lines: list[str] = field(default_factory=list)

    def read(self) -> None:
        with self.sock.makefile("rb") as stream:
            for raw in stream:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\r\n"))


@contextmanager
def monitoring(settings: RedisSettings) -> Iterator[Monitor]:
    url = urlsplit(settings.url)
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379), timeout=30)
    password = settings.effective_password()
    if password:
        sock.sendall(f"AUTH {password}\r\n".encode())
        assert sock.recv(64).startswith(b"+OK")
    sock.sendall(b"MONITOR\r\n")
    assert sock.recv(64).startswith(b"+OK")
    monitor = Monitor(sock)
    reader = threading.Thread(target=monitor.read, daemon=True)
    reader.start()
    try:
        yield monitor
    finally:
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        reader.join(10)


def _args(text: str) -> list[str]:
    """MONITOR's quoted arguments, unescaped (it writes ``\\xNN``, ``\\"`` and the like)."""
    return [
        codecs.decode(a.encode("latin-1", "backslashreplace"), "unicode_escape") for a in _ARG.findall(text)
    ]


@pytest.fixture
async def store(redis_settings: RedisSettings) -> AsyncIterator[StateStore]:
    async with scratch_store(redis_settings.url, finished_ttl_s=3600, dedupe_ttl_s=3600) as s:
        s.clock = Clock()
        yield s


def _item(key: str, event: str, *, initial: State = State.QUEUED, replay: str | None = None) -> IntakeItem:
    fields = {
        "model": "m",
        "attempt": "0",
        "request": "{}",
        "source": "src",
        "event_id": event,
        "retention_s": "3600",
    }
    return IntakeItem(
        key=BatchKey(key),
        fields=fields,
        marker=("src", event),
        initial=initial,
        ready_score=1.0,
        deadline=NOW + 600,
        replay_id=replay,
    )


async def _every_script(store: StateStore) -> None:
    clock = store.clock
    assert isinstance(clock, Clock)
    await store.intake_many([_item("a", "e1"), _item("a", "e1"), _item("acme/b", "e2")])
    await store.intake(_item("bad", "e3", initial=State.DEAD_LETTERED))  # a rejected request's marker
    await store.intake(_item("bad", "e3", initial=State.DEAD_LETTERED))  # ... seen again
    # a retry: back to queued with a backoff (delayed), then promoted once it is due
    await store.transition_or_raise(BatchKey("a"), State.SUBMITTED, fields={"attempt": "1"})
    await store.transition_or_raise(BatchKey("a"), State.QUEUED, not_before=NOW + 30)
    clock.now = NOW + 31
    assert await store.promote_due() == 1
    for to in (State.SUBMITTED, State.RUNNING, State.FAILED):
        await store.transition_or_raise(BatchKey("a"), to, fields={"terminal_event_id": "t1"})
    assert await store.mark_dlt_written(BatchKey("a"), "t1")
    assert await store.mark_published(BatchKey("a"), "t1", ended_at=NOW)  # its usage recorded too
    # a replay reopens the failed batch: it leaves every index it was in
    (reopened,) = await store.intake_many([_item("a", "e4", replay="r1")])
    assert reopened.outcome == "reopened"
    # an orphan entry (its batch hash gone) found in an index is removed
    await store.client.zadd(store.keys.ready, {"ghost": 1.0})
    assert await store.drop_orphans("ready", [BatchKey("ghost"), BatchKey("acme/b")]) == 1
    assert await store.acquire_lease("tracker", "me", 10.0)
    assert await store.release_lease("tracker", "me")
    # the tracker's shards: members (one leaving), leases held, given back
    assert await store.live_members("tracker", "me", 10.0) == ["me"]
    assert await store.hold_leases({"tracker:shard:0": True, "tracker:shard:1": True}, "me", 10.0) == {
        "tracker:shard:0",
        "tracker:shard:1",
    }
    assert await store.hold_leases({"tracker:shard:0": True, "tracker:shard:1": False}, "me", 10.0) == {
        "tracker:shard:0"
    }
    assert await store.live_members("tracker", "me", 10.0, leaving=True) == []
    # the webhooks' queue: queued, claimed, retried, claimed again, delivered; another one ends dead
    hooks = WebhookStore(store.client, store.keys)
    one, two = (Delivery("acme", "whep_" + "a" * 24, f"evt-{n}", "batch.completed", 1, "b") for n in (1, 2))
    assert await hooks.enqueue([one, two], 1_000) == 2
    (_, did, token), _ = await hooks.claim(1_000, 60_000, 10)
    assert await hooks.settle(did, token, "retry", now_ms=1_001, next_ms=1_002)
    ((_, did, token),) = await hooks.claim(1_002, 60_000, 10)
    assert await hooks.settle(did, token, "delivered", now_ms=1_003)
    ((_, did, token),) = await hooks.claim(61_000, 60_000, 10)
    assert await hooks.settle(did, token, "dead", now_ms=61_001)
    # retention: a file dated, claimed, put off, claimed again and removed; the ended batch "a" (kept
    # an hour: its end was published above) retired, then done
    index = RetentionIndex(store.client, store.keys)
    await index.schedule(file_member("acme", "file-" + "1" * 29), NOW)
    later = NOW + 7200
    claims = await index.claim(later, lease_s=60, limit=10)
    assert sorted(c.member for c in claims) == ["b|default|a|", "f|acme|file-" + "1" * 29]
    batch, file = sorted(claims, key=lambda c: c.member)
    assert await index.defer(file, later + 1)
    (file,) = await index.claim(later + 2, lease_s=60, limit=10)
    assert await index.gone(file, Expiring("file", "acme", "file-" + "1" * 29), NOW, 3600)
    assert await index.retire_batch(batch, Expiring("batch", "default", "a"), NOW + 3600, 3600) == "running"
    await index.schedule("b|acme|gone|", NOW)  # a batch whose record expired: retired, then done
    (gone,) = await index.claim(later + 3, lease_s=60, limit=10)
    assert await index.retire_batch(gone, Expiring("batch", "acme", "gone"), NOW, 3600) == "retired"
    assert await index.done(gone)


async def _keys_of(client: aioredis.Redis, command: list[str]) -> set[str]:
    try:
        return {str(k) for k in await client.command_getkeys(*command)}
    except ResponseError:  # a command without key arguments
        return set()


async def test_every_key_a_script_touches_is_declared(
    store: StateStore, redis_settings: RedisSettings
) -> None:
    with monitoring(redis_settings) as monitor:
        await _every_script(store)
        await asyncio.sleep(0.5)  # the last lines reach the monitor
    declared: set[str] | None = None
    scripts: set[str] = set()
    checked = 0
    undeclared: list[tuple[str, str]] = []
    for line in monitor.lines:
        match = _LINE.match(line)
        if match is None:
            continue
        client, args = match.group(1), _args(match.group(2))
        if client != "lua":
            is_script = args and args[0].lower() in ("evalsha", "eval")
            declared = set(args[3 : 3 + int(args[2])]) if is_script else None
            mine = declared is not None and any(k.startswith(store.keys.prefix + ":") for k in declared)
            if mine:
                scripts.add(args[1])
            else:
                declared = None
            continue
        if declared is None:
            continue
        for key in await _keys_of(store.client, args):
            checked += 1
            if key not in declared:
                undeclared.append((" ".join(args[:2]), key))
    assert len(scripts) == 16, f"every script should have run once at least; saw {len(scripts)}"
    assert checked > 50  # the scripts' own commands were seen (the monitor did watch)
    assert undeclared == []
