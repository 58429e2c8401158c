"""The state store's upkeep, beside the batches' state machine: index entries of expired batches,
Ray jobs waiting to be deleted, leases between replicas, the S3 sessions handed to Ray job drivers,
and health. Mixed into :class:`llmbatch.dispatcher.state.store.StateStore`, whose client, keys, clock and
error
translation (``_call``) it uses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmbatch.dispatcher.domain import states
from llmbatch.dispatcher.errors import StateStoreUnavailable
from llmbatch.dispatcher.state.store_host import StoreHost
from llmbatch.dispatcher.state.store_indexes import reply_text
from llmbatch.schemas.common import MAX_COMPLETION_WINDOW

MAX_JOB_DELETES = 100_000  # Ray jobs waiting for another delete, at most
LISTED_SLACK_S = 86_400.0  # a listed batch is kept this much longer than its record could be


class StoreUpkeep(StoreHost):
    """Upkeep operations of the Redis state store (see the module docstring)."""

    async def sweep_finished(self, limit: int = 1000) -> int:
        """Drop index entries of finished batches whose hash has expired (older than the TTL), and the
        tenants' listed batches accepted before any batch still kept could have been (a batch ends by
        its deadline, at most :data:`MAX_COMPLETION_WINDOW` after it was accepted)."""
        now = self.clock()
        cutoff = now - self.finished_ttl_s
        listed_cutoff = cutoff - MAX_COMPLETION_WINDOW.total_seconds() - LISTED_SLACK_S

        async def run() -> int:
            removed = 0
            for state in states.TERMINAL:
                key = self.keys.state_index(state)
                removed += int(await self.client.zremrangebyscore(key, "-inf", cutoff))
            async for tenant in self.client.sscan_iter(self.keys.tenants, count=100):
                key = self.keys.tenant_batches(reply_text(tenant))
                removed += int(await self.client.zremrangebyscore(key, "-inf", int(listed_cutoff * 1000)))
            return removed

        return await self._call(run)

    # -- Ray jobs to delete (see dispatcher.job_cleanup) -------------------------------------------
    async def defer_job_deletes(self, submission_ids: Sequence[str], due: float) -> None:
        """Remember Ray jobs to delete at ``due``; the oldest go first beyond ``MAX_JOB_DELETES``
        (a head down for weeks must not grow Redis without bound)."""
        if not submission_ids:
            return
        key = self.keys.job_deletes

        async def run() -> None:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.zadd(key, {sid: due for sid in submission_ids})
                pipe.zremrangebyrank(key, 0, -MAX_JOB_DELETES - 1)
                await pipe.execute()

        await self._call(run)

    async def due_job_deletes(self, now: float, limit: int = 50) -> list[str]:
        key = self.keys.job_deletes
        raw = await self._call(lambda: self.client.zrangebyscore(key, "-inf", now, start=0, num=limit))
        return [str(x) for x in raw]

    async def drop_job_deletes(self, submission_ids: Sequence[str]) -> None:
        if submission_ids:
            key = self.keys.job_deletes
            await self._call(lambda: self.client.zrem(key, *submission_ids))

    # -- leases -----------------------------------------------------------------------------------
    async def acquire_lease(self, name: str, token: str, ttl_s: float) -> bool:
        keys, args = [self.keys.lease(name)], [token, str(int(ttl_s * 1000))]
        return int(await self._call(lambda: self._scripts.lease_acquire(keys=keys, args=args))) == 1

    async def release_lease(self, name: str, token: str) -> bool:
        keys, args = [self.keys.lease(name)], [token]
        return int(await self._call(lambda: self._scripts.lease_release(keys=keys, args=args))) == 1

    async def hold_leases(self, wanted: Mapping[str, bool], token: str, ttl_s: float) -> set[str]:
        """Take or extend the leases named ``True`` in ``wanted``, give back those named ``False`` if
        ``token`` holds them (one script, one round trip); return the names ``token`` holds now."""
        names = list(wanted)
        if not names:
            return set()
        keys = [self.keys.lease(n) for n in names]
        args = [token, str(int(ttl_s * 1000)), *("1" if wanted[n] else "0" for n in names)]
        held = await self._call(lambda: self._scripts.leases_hold(keys=keys, args=args))
        return {n for n, h in zip(names, held, strict=True) if int(h) == 1}

    async def live_members(self, name: str, token: str, ttl_s: float, *, leaving: bool = False) -> list[str]:
        """Say ``token`` takes part in ``name``'s shards for ``ttl_s`` more (``leaving``: no more) and
        return the live members' tokens, expiry judged on Redis' clock."""
        keys = [self.keys.lease_members(name)]
        args = [token, str(int(ttl_s * 1000)), "1" if leaving else "0"]
        members = await self._call(lambda: self._scripts.members(keys=keys, args=args))
        return [str(m) for m in members]

    async def put_s3_session(self, nonce: str, payload: bytes, ttl_s: int) -> None:
        """Keep a Ray job attempt's S3 session for its driver to take (``SET NX``: never over another)."""
        key = self.keys.s3_session(nonce)

        async def run() -> None:
            if not await self.client.set(key, payload, ex=ttl_s, nx=True):
                raise StateStoreUnavailable(f"the S3 session key {key} exists already")

        await self._call(run)

    async def drop_s3_session(self, key: str) -> None:
        """Forget a session no driver will take (its submit created no job)."""
        if not key.startswith(self.keys.s3_session_prefix):
            raise ValueError(f"not an S3 session key of this store: {key[:80]!r}")
        await self._call(lambda: self.client.delete(key))

    # -- what tenants keep (see dispatcher.runs.stored_bytes) ------------------------------------------
    async def set_stored_bytes(self, sizes: Mapping[str, int], ttl_s: int) -> None:
        """Tenant -> the bytes it keeps, as just measured; each figure expires after ``ttl_s`` (a leader
        that stopped measuring leaves none behind)."""
        if not sizes:
            return

        async def run() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                for tenant, size in sizes.items():
                    pipe.set(self.keys.stored_bytes(tenant), str(int(size)), ex=ttl_s)
                await pipe.execute()

        await self._call(run)

    async def stored_bytes_many(self, tenants: Sequence[str]) -> list[int | None]:
        """The bytes each tenant keeps as last measured (None: no measure)."""
        if not tenants:
            return []
        keys = [self.keys.stored_bytes(t) for t in tenants]
        raw = await self._call(lambda: self.client.mget(keys))
        return [int(v) if v is not None and reply_text(v).isdigit() else None for v in raw]

    async def ping(self) -> bool:
        return bool(await self._call(lambda: self.client.ping()))

    async def fsync_policy(self) -> str | None:
        """Redis' ``appendfsync`` (``None`` with AOF off or when ``CONFIG`` is not allowed)."""
        try:
            config = await self.client.config_get("append*")  # appendonly and appendfsync in one call
        except Exception:  # managed Redis often disables CONFIG: nothing to tell then
            return None
        if config.get("appendonly") != "yes":
            return None
        return str(config.get("appendfsync") or "") or None
