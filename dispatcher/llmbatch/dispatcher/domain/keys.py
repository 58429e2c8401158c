"""Every Redis key the dispatcher reads or writes, in one place.

All keys start with ``RedisSettings.key_prefix`` (default ``llmbatch``) so several deployments can
share one Redis. The layout:

``<p>:batch:<key>``               hash: the batch's state, version and bookkeeping fields
``<p>:state:<state>``             zset: batch keys in that state, score = time of entry (unix s)
``<p>:ready``                     zset: queued batches that may launch now, score = priority then deadline
``<p>:delayed``                   zset: queued batches waiting for a retry backoff, score = not_before
``<p>:deadlines``                 zset: non-terminal batches, score = deadline (unix s)
``<p>:unpublished``               zset: terminal batches whose terminal event is not yet published
``<p>:progress:<key>``            hash: counters written by the running job (see ray_job)
``<p>:runner:*``                  the batch runner's runs (:mod:`llmbatch.ray_job.storage.job_keys`)
``<p>:jobs:delete``               zset: Ray jobs of finished batches to delete again, score = when
``<p>:event:<source>:<id>``       string: dedupe marker of an already-applied command event
``<p>:lease:<name>``              string: owner token of a lease (the tracker loop's leader, a shard's holder)
``<p>:lease:<name>:members``      zset: the replicas taking part in ``<name>``'s shards, score = expiry (ms)
``<p>:tracker:wake``              Pub/Sub channel: "tick now" to every replica's tracker (not a key)
``<p>:dlq:replayed:<dlt topic>``  hash: dead letters replayed by ``llmbatch dlq replay`` (dispatcher.ops)
``<p>:dlq:replayed-at:<topic>``   zset: the same dead letters, score = when replayed (prunes the hash)
``<p>:s3session:<random>``        string: a Ray job attempt's S3 session until its driver takes it
                                  (``GETDEL``; see dispatcher.s3_sessions)
``<p>:usage:<tenant>:<yyyymmdd>`` hash: a tenant's usage of one UTC day (dispatcher.domain.usage)
``<p>:usage:tenants``             set: the tenants that have usage hashes
``<p>:quota:<tenant>:tokens``     string: the tokens a tenant's accepted, not yet ended batches hold
``<p>:webhook:endpoints:<tenant>`` hash: a tenant's webhook endpoints, id -> JSON (dispatcher.webhooks)
``<p>:webhook:due``               zset: webhook deliveries to attempt, score = when (unix ms)
``<p>:webhook:delivery:<id>``     hash: one delivery (its event, endpoint, attempts, last error)
``<p>:webhook:done:<id>``         string: a delivered delivery (a replayed event is not sent again)
``<p>:webhook:dead``              zset: deliveries that ran out of retries, score = when (unix ms)
``<p>:stored:<tenant>``           string: the bytes a tenant keeps (inputs and results), as the tracker
                                  leader last measured them, with a TTL
``<p>:retention:due``             zset: things to delete when they expire (dispatcher.domain.retention),
                                  score = when (unix s): what reads show as ``expires_at``
``<p>:retention:queue``           zset: the same members, score = when the collector may take them next
``<p>:retention:gone:<name>``     string: a removed file or batch (reads answer ``expired``), with a TTL

Batch ids are scoped by tenant: a batch is stored under its :data:`BatchKey`, ``<batch_id>`` for
the ``default`` tenant and ``<tenant>/<batch_id>`` for any other (a tenant has no ``/`` and a
batch id has none either, so the two never meet). Two tenants may use the same batch id; each
has its own batch. The zsets hold keys, and every key the dispatcher builds comes from one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

from llmbatch.dispatcher.domain.states import State
from llmbatch.ray_job.storage import job_keys

BatchKey = NewType("BatchKey", str)
"""What the dispatcher's state names a batch by (see the module's docstring): build it with
:func:`batch_key`, never from a bare batch id (``mypy`` refuses a ``str`` where one is expected)."""

DEFAULT_TENANT = job_keys.DEFAULT_TENANT


def batch_key(tenant: str | None, batch_id: str) -> BatchKey:
    """The store's name of ``tenant``'s batch ``batch_id`` (``None``: the default tenant)."""
    return BatchKey(job_keys.batch_key(tenant or DEFAULT_TENANT, batch_id))


def split_batch_key(key: str) -> tuple[str, str]:
    """``(tenant, batch_id)`` of a key :func:`batch_key` made."""
    tenant, sep, batch_id = key.partition("/")
    return (tenant, batch_id) if sep else (DEFAULT_TENANT, key)


@dataclass(frozen=True)
class Keys:
    """Key names for one prefix. Cheap to build; pure."""

    prefix: str = "llmbatch"

    def batch(self, key: BatchKey) -> str:
        return f"{self.prefix}:batch:{key}"

    def state_index(self, state: State | str) -> str:
        return f"{self.prefix}:state:{State(state).value}"

    @property
    def ready(self) -> str:
        return f"{self.prefix}:ready"

    @property
    def delayed(self) -> str:
        return f"{self.prefix}:delayed"

    @property
    def deadlines(self) -> str:
        return f"{self.prefix}:deadlines"

    @property
    def unpublished(self) -> str:
        return f"{self.prefix}:unpublished"

    @property
    def job_deletes(self) -> str:
        return f"{self.prefix}:jobs:delete"

    def progress(self, key: BatchKey) -> str:
        """The batch's progress hash, as the job side derives it
        (:mod:`llmbatch.ray_job.storage.job_keys`)."""
        return job_keys.progress_key(self.prefix, *split_batch_key(key))

    def event(self, source: str, event_id: str) -> str:
        return f"{self.prefix}:event:{source}:{event_id}"

    def tenant_batches(self, tenant: str) -> str:
        """Zset batch id -> when it was accepted (unix ms) of ``tenant``'s batches from Kafka: what
        ``GET /v1/batches`` lists beside the API's own (:mod:`llmbatch.dispatcher.state.store_upkeep`
        prunes it)."""
        return f"{self.prefix}:tenant:{tenant}:batches"

    @property
    def tenants(self) -> str:
        """Set of the tenants that have a :meth:`tenant_batches` zset."""
        return f"{self.prefix}:tenants"

    def lease(self, name: str) -> str:
        return f"{self.prefix}:lease:{name}"

    @property
    def tracker_wake(self) -> str:
        """The Pub/Sub channel that wakes the replicas' trackers (:mod:`llmbatch.dispatcher.runs.wakeups`)."""
        return f"{self.prefix}:tracker:wake"

    def lease_members(self, name: str) -> str:
        """Zset of the live replicas sharing ``name``'s shards (:mod:`llmbatch.dispatcher.domain.shards`)."""
        return f"{self.prefix}:lease:{name}:members"

    def replay_ledger(self, dlt_topic: str) -> str:
        """Hash ``<partition>:<offset>`` -> JSON of the replay (see :mod:`llmbatch.dispatcher.ops.replay`)."""
        return f"{self.prefix}:dlq:replayed:{dlt_topic}"

    def replay_ledger_times(self, dlt_topic: str) -> str:
        """Zset ``<partition>:<offset>`` -> when it was replayed: what prunes :meth:`replay_ledger`."""
        return f"{self.prefix}:dlq:replayed-at:{dlt_topic}"

    def s3_session(self, nonce: str) -> str:
        """A Ray job attempt's S3 session under a random ``nonce``
        (:mod:`llmbatch.dispatcher.backends.s3_sessions`)."""
        return f"{self.prefix}:s3session:{nonce}"

    def usage(self, tenant: str, day: str) -> str:
        """Hash ``<model>|<state>|<counter>`` -> amount of ``tenant``'s batches that ended on ``day``."""
        return f"{self.prefix}:usage:{tenant}:{day}"

    @property
    def usage_tenants(self) -> str:
        return f"{self.prefix}:usage:tenants"

    def quota_tokens(self, tenant: str) -> str:
        """The estimated tokens ``tenant``'s accepted batches hold until their end is published
        (:mod:`llmbatch.dispatcher.domain.quota`)."""
        return f"{self.prefix}:quota:{tenant}:tokens"

    def webhook_endpoints(self, tenant: str) -> str:
        """Hash endpoint id -> JSON of :class:`~llmbatch.schemas.webhooks.WebhookEndpoint`."""
        return f"{self.prefix}:webhook:endpoints:{tenant}"

    @property
    def webhook_due(self) -> str:
        return f"{self.prefix}:webhook:due"

    def webhook_delivery(self, delivery_id: str) -> str:
        return f"{self.prefix}:webhook:delivery:{delivery_id}"

    def webhook_done(self, delivery_id: str) -> str:
        return f"{self.prefix}:webhook:done:{delivery_id}"

    @property
    def webhook_dead(self) -> str:
        return f"{self.prefix}:webhook:dead"

    def stored_bytes(self, tenant: str) -> str:
        """The bytes ``tenant`` keeps as last measured (:mod:`llmbatch.dispatcher.runs.stored_bytes`)."""
        return f"{self.prefix}:stored:{tenant}"

    @property
    def retention_due(self) -> str:
        return f"{self.prefix}:retention:due"

    @property
    def retention_queue(self) -> str:
        return f"{self.prefix}:retention:queue"

    def retention_gone(self, name: str) -> str:
        """The tombstone of a removed file or batch (``name``: see
        :func:`llmbatch.dispatcher.domain.retention.gone_name`)."""
        return f"{self.prefix}:retention:gone:{name}"

    @property
    def s3_session_prefix(self) -> str:
        return f"{self.prefix}:s3session:"
