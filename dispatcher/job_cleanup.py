"""Deleting the Ray jobs of finished batches, durably.

Once a batch's terminal event is out its Ray jobs (one per attempt) are deleted from the head, so the
head's job records and logs stay bounded. A delete that fails for a reason that may pass (the head
is down or slow, its agent timed out, or the head does not count the job as ended yet) is not
dropped: the submission id goes to a Redis zset and the tracker leader tries again later
(:meth:`JobCleanup.retry_due`), so a zombie attempt is deleted once it ends. A job Ray calls unknown
(already deleted, or a batch that ran on the batch runner) is settled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dispatcher.backend import JobBackend
from dispatcher.errors import DispatcherError
from dispatcher.store import BatchRecord, StateStore
from schemas.job import submission_id

log = logging.getLogger(__name__)

RETRY_AFTER_S = 60.0


@dataclass
class JobCleanup:
    """Deletes finished batches' Ray jobs now, or later when the head cannot answer now."""

    store: StateStore
    backend: JobBackend
    retry_after_s: float = RETRY_AFTER_S
    clock: Callable[[], float] = time.time
    deferred: int = field(default=0, init=False)  # how many deletes were put off (for logs and tests)

    async def forget(self, record: BatchRecord) -> None:
        """Delete the jobs of every attempt of ``record`` (called once its terminal event is out)."""
        lifecycle = record.get("lifecycle") or None
        sids = [submission_id(record.batch_id, n, lifecycle) for n in range(1, record.attempt + 1)]
        await self._delete(sids)

    async def retry_due(self, limit: int = 50) -> int:
        """Try again the deletes whose time has come; returns how many were settled."""
        due = await self.store.due_job_deletes(self.clock(), limit)
        if not due:
            return 0
        settled = await self._delete(due)
        await self.store.drop_job_deletes(due[:settled])
        return settled

    async def _delete(self, sids: list[str]) -> int:
        """Delete ``sids`` in order; at the first failure that may pass, put that one and the rest
        off. Returns how many were settled (deleted, unknown or still running)."""
        for done, sid in enumerate(sids):
            try:
                deleted = await self.backend.delete(sid)
                log.debug("finished Ray job deleted" if deleted else "finished Ray job unknown to Ray",
                          extra={"submission_id": sid})
            except Exception as exc:
                retriable = not isinstance(exc, DispatcherError) or exc.retriable
                if not retriable:
                    extra = {"submission_id": sid, "error": str(exc)[:300]}
                    log.warning("finished Ray job not deleted", extra=extra)
                    continue
                await self.store.defer_job_deletes(sids[done:], self.clock() + self.retry_after_s)
                self.deferred += len(sids) - done
                log.info(
                    "deleting finished Ray jobs put off",
                    extra={"submission_id": sid, "pending": len(sids) - done, "error": str(exc)[:300]},
                )
                return done
        return len(sids)
