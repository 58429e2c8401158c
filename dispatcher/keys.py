"""Every Redis key the dispatcher reads or writes, in one place.

All keys start with ``RedisSettings.key_prefix`` (default ``llmbatch``) so several deployments can
share one Redis. The layout:

``<p>:batch:<batch_id>``          hash: the batch's state, version and bookkeeping fields
``<p>:state:<state>``             zset: batch ids in that state, score = time of entry (unix s)
``<p>:ready``                     zset: queued batches that may launch now, score = priority then age
``<p>:delayed``                   zset: queued batches waiting for a retry backoff, score = not_before
``<p>:deadlines``                 zset: non-terminal batches, score = deadline (unix s)
``<p>:unpublished``               zset: terminal batches whose terminal event is not yet published
``<p>:progress:<batch_id>``       hash: counters written by the running job (see ray_job)
``<p>:jobs:delete``               zset: Ray jobs of finished batches to delete again, score = when
``<p>:event:<source>:<id>``       string: dedupe marker of an already-applied command event
``<p>:lease:<name>``              string: owner token of a lease (the tracker loop's leader)
``<p>:dlq:replayed:<dlt topic>``  hash: dead letters replayed by ``llmbatch dlq replay`` (dispatcher.ops)
"""

from __future__ import annotations

from dataclasses import dataclass

from dispatcher.states import State


@dataclass(frozen=True)
class Keys:
    """Key names for one prefix. Cheap to build; pure."""

    prefix: str = "llmbatch"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    @property
    def batch_prefix(self) -> str:
        return f"{self.prefix}:batch:"

    def state_index(self, state: State | str) -> str:
        return f"{self.prefix}:state:{State(state).value}"

    def all_state_indexes(self) -> list[str]:
        """One index per state, in :data:`State` declaration order (the Lua scripts rely on it)."""
        return [self.state_index(s) for s in State]

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

    def progress(self, batch_id: str) -> str:
        return f"{self.prefix}:progress:{batch_id}"

    def event(self, source: str, event_id: str) -> str:
        return f"{self.prefix}:event:{source}:{event_id}"

    def lease(self, name: str) -> str:
        return f"{self.prefix}:lease:{name}"

    def replay_ledger(self, dlt_topic: str) -> str:
        """Hash ``<partition>:<offset>`` -> JSON of the replay (see :mod:`dispatcher.ops.replay`)."""
        return f"{self.prefix}:dlq:replayed:{dlt_topic}"
