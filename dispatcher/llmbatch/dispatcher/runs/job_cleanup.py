"""Deleting the Ray jobs of finished batches, durably.

Once a batch's terminal event is out its Ray jobs (one per attempt) are deleted from the head, so the
head's job records and logs stay bounded. Every delete goes through a Redis zset that the tracker
leader works through (:meth:`JobCleanup.retry_due`):

- The first delete waits ``settle_s`` after the terminal event. Ray's job monitor keeps pinging a
  job's supervisor actor until it has exited, a moment after the job's status turned terminal; when
  the job's record was deleted in that moment, the monitor takes the record's absence for a crash
  and writes it back (status FAILED, "Job supervisor actor died", entrypoint "Entrypoint not
  found."), a record nobody deletes any more. Seen in CI and locally: the e2e happy path's job came
  back after its delete.
- A job that was deleted is asked for again ``retry_after_s`` later (a member ``check:<sid>``) and
  deleted again if it came back.
- A delete that fails for a reason that may pass (the head is down or slow, its agent timed out, or
  the head does not count the job as ended yet) is tried again ``retry_after_s`` later, so a zombie
  attempt is deleted once it ends. A job Ray calls unknown (already deleted, or a batch that ran on
  the batch runner) is settled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.job import submission_id

log = logging.getLogger(__name__)

CHECK = "check:"  # never in a submission id (batch ids are [A-Za-z0-9._-])


class JobDeleter(Protocol):
    """What the cleanup needs of a backend (a JobBackend has it): deleting a job."""

    async def delete(self, submission_id: str) -> bool: ...


@dataclass
class JobCleanup:
    """Deletes finished batches' Ray jobs now, or later when the head cannot answer now."""

    store: StateStore
    backend: JobDeleter
    retry_after_s: float  # LLMBATCH_DISPATCHER__JOB_DELETE_RECHECK_S
    settle_s: float  # LLMBATCH_DISPATCHER__JOB_DELETE_SETTLE_S
    clock: Callable[[], float] = time.time
    deferred: int = field(default=0, init=False)  # how many deletes were put off (for logs and tests)
    came_back: int = field(default=0, init=False)  # deleted jobs Ray wrote back (deleted again)

    async def forget(self, record: BatchRecord) -> None:
        """Delete the jobs of every attempt of ``record`` once they settled (called once its terminal
        event is out; the deletes run in :meth:`retry_due`)."""
        lifecycle = record.get("lifecycle") or None
        sids = [submission_id(record.batch_id, n, lifecycle) for n in range(1, record.attempt + 1)]
        await self.store.defer_job_deletes(sids, self.clock() + self.settle_s)

    async def retry_due(self, limit: int = 50) -> int:
        """Try again the deletes whose time has come; returns how many were settled."""
        due = await self.store.due_job_deletes(self.clock(), limit)
        if not due:
            return 0
        settled = await self._delete(due)
        await self.store.drop_job_deletes(due[:settled])
        return settled

    async def _delete(self, entries: list[str]) -> int:
        """Delete the jobs of ``entries`` (submission ids, or ``check:<sid>``) in order; at the first
        failure that may pass, put that one and the rest off. A deleted job gets a check later.
        Returns how many entries were settled (deleted, unknown, or refused for good)."""
        later = self.clock() + self.retry_after_s
        checks: list[str] = []
        try:
            for done, entry in enumerate(entries):
                sid = entry.removeprefix(CHECK)
                try:
                    deleted = await self.backend.delete(sid)
                except Exception as exc:
                    retriable = not isinstance(exc, DispatcherError) or exc.retriable
                    if not retriable:
                        extra = {"submission_id": sid, "error": str(exc)[:300]}
                        log.warning("finished Ray job not deleted", extra=extra)
                        continue
                    await self.store.defer_job_deletes(entries[done:], later)
                    self.deferred += len(entries) - done
                    log.info(
                        "deleting finished Ray jobs put off",
                        extra={"submission_id": sid, "pending": len(entries) - done, "error": str(exc)[:300]},
                    )
                    return done
                if deleted and entry.startswith(CHECK):
                    self.came_back += 1
                    log.info(
                        "a deleted Ray job came back (Ray's job monitor wrote it again); deleted again",
                        extra={"submission_id": sid},
                    )
                elif deleted:
                    checks.append(CHECK + sid)
                    log.debug("finished Ray job deleted", extra={"submission_id": sid})
            return len(entries)
        finally:
            await self.store.defer_job_deletes(checks, later)
