"""Where the batch runner keeps its runs: in Redis (:class:`RedisRuns`), so every replica answers for
every run, a replica restart loses none and a finished run stays answerable for days (a dispatcher
that was away for hours still learns how its batch ended); or in one replica's memory
(:class:`MemoryRuns`: a runner given no Redis, as before).

A run's view is the Jobs API's (``status``, ``driver_exit_code``, ``message``, ``start_time``,
``end_time``) plus ``owner``, the replica that runs it. A replica beats (:meth:`RunStore.beat`) while it
lives; a run not ended whose owner stopped beating is reported unknown (``None``), which the dispatcher
takes for a lost attempt and retries, as it does after a lost Ray job. A stop asked of any replica
reaches the owner through :meth:`RunStore.stops_asked`, which it polls.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import orjson

from llmbatch.ray_job.storage import job_keys

ENDED = ("SUCCEEDED", "FAILED", "STOPPED")
REPLICA_TTL_S = 20  # a replica not heard of for this long is gone; it beats every BEAT_S
BEAT_S = 2.0
KEEP_S = 7 * 86400  # how long a run stays answerable after its last change


class RunStore(Protocol):
    """The runs of one runner deployment, whichever replica started them."""

    def claim(self, submission_id: str, view: dict[str, Any]) -> bool:
        """Record a new run; False when that submission id is known already (nothing changed)."""

    def save(self, submission_id: str, view: dict[str, Any]) -> None:
        """Record the run's new state."""

    def views(self, submission_ids: Sequence[str]) -> dict[str, dict[str, Any] | None]:
        """The runs' views; ``None`` for an unknown run and for one whose owner is gone."""

    def ask_stop(self, submission_id: str) -> bool | None:
        """Ask the run's owner to stop it: True asked, False it has ended, ``None`` unknown."""

    def stops_asked(self, submission_ids: Iterable[str]) -> set[str]:
        """Which of these (the caller's own running) runs were asked to stop."""

    def beat(self) -> None:
        """Say this replica lives (its runs are not lost)."""

    def forget(self, submission_id: str) -> None:
        """Drop what only the owner needs once the run has ended and is saved."""


class MemoryRuns:
    """Runs in this replica's memory: forgotten at a restart and ``keep_s`` after they end."""

    def __init__(self, keep_s: float = 3600.0) -> None:
        self.keep_s = keep_s
        self._views: dict[str, dict[str, Any]] = {}
        self._stops: set[str] = set()

    def claim(self, submission_id: str, view: dict[str, Any]) -> bool:
        self._prune()
        if submission_id in self._views:
            return False
        self._views[submission_id] = dict(view)
        return True

    def save(self, submission_id: str, view: dict[str, Any]) -> None:
        self._views[submission_id] = dict(view)

    def views(self, submission_ids: Sequence[str]) -> dict[str, dict[str, Any] | None]:
        return {sid: dict(v) if (v := self._views.get(sid)) is not None else None for sid in submission_ids}

    def ask_stop(self, submission_id: str) -> bool | None:
        view = self._views.get(submission_id)
        if view is None:
            return None
        if view.get("status") in ENDED:
            return False
        self._stops.add(submission_id)
        return True

    def stops_asked(self, submission_ids: Iterable[str]) -> set[str]:
        return self._stops.intersection(submission_ids)

    def beat(self) -> None:
        return None

    def forget(self, submission_id: str) -> None:
        self._stops.discard(submission_id)

    def _prune(self) -> None:
        horizon = time.time() - self.keep_s
        ended = {s: v.get("end_time") for s, v in self._views.items()}
        for sid in [s for s, end in ended.items() if end is not None and end < horizon]:
            del self._views[sid]
            self._stops.discard(sid)


class RedisRuns:
    """Runs in Redis under :mod:`llmbatch.ray_job.storage.job_keys`' runner keys (``client``: a sync
    ``redis.Redis``). Every call may raise the client's errors: the caller answers 503 then."""

    def __init__(self, client: Any, prefix: str, replica: str, *, keep_s: int = KEEP_S) -> None:
        self.client = client
        self.prefix = prefix
        self.replica = replica
        self.keep_s = keep_s

    def claim(self, submission_id: str, view: dict[str, Any]) -> bool:
        key = job_keys.run_key(self.prefix, submission_id)
        return bool(self.client.set(key, orjson.dumps(view), nx=True, ex=self.keep_s))

    def save(self, submission_id: str, view: dict[str, Any]) -> None:
        self.client.set(job_keys.run_key(self.prefix, submission_id), orjson.dumps(view), ex=self.keep_s)

    def views(self, submission_ids: Sequence[str]) -> dict[str, dict[str, Any] | None]:
        if not submission_ids:
            return {}
        raw = self.client.mget([job_keys.run_key(self.prefix, sid) for sid in submission_ids])
        found = {sid: _view(value) for sid, value in zip(submission_ids, raw, strict=True)}
        owners = sorted({str(v.get("owner")) for v in found.values() if v is not None and _open(v)})
        alive = dict(
            zip(
                owners,
                self.client.mget([job_keys.replica_key(self.prefix, o) for o in owners]) if owners else [],
                strict=True,
            )
        )
        return {
            sid: None if v is None or (_open(v) and alive.get(str(v.get("owner"))) is None) else v
            for sid, v in found.items()
        }

    def ask_stop(self, submission_id: str) -> bool | None:
        view = self.views([submission_id])[submission_id]
        if view is None:
            return None
        if not _open(view):
            return False
        self.client.set(job_keys.stop_key(self.prefix, submission_id), b"1", ex=self.keep_s)
        return True

    def stops_asked(self, submission_ids: Iterable[str]) -> set[str]:
        ids = list(submission_ids)
        if not ids:
            return set()
        raw = self.client.mget([job_keys.stop_key(self.prefix, sid) for sid in ids])
        return {sid for sid, value in zip(ids, raw, strict=True) if value is not None}

    def beat(self) -> None:
        self.client.set(job_keys.replica_key(self.prefix, self.replica), b"1", ex=REPLICA_TTL_S)

    def forget(self, submission_id: str) -> None:
        self.client.delete(job_keys.stop_key(self.prefix, submission_id))


def _view(raw: Any) -> dict[str, Any] | None:
    """A stored view; ``None`` for what is not one (Redis is not trusted to hold only ours)."""
    if raw is None:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("status"), str) else None


def _open(view: dict[str, Any]) -> bool:
    return view.get("status") not in ENDED
