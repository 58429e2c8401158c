"""The engine runner: one engine stepped by one thread, shared by concurrent callers.

Every caller (a Ray Data batch thread of :mod:`llmbatch.ray_job.job.engine`, or a Serve request of
:mod:`llmbatch.ray_job.engines.serve_engine`) passes its requests to one :class:`EngineRunner`, whose single
stepping thread adds them to the engine between steps and hands each finished request back to
the call that owns it. The engine therefore keeps running new requests while earlier calls drain
(continuous batching across calls), the way plain vLLM does with one big list.

Isolation: a request the engine refuses when it is added becomes a failed generation for that
request only. An engine that dies fails every waiting call with
:class:`~llmbatch.ray_job.errors.EngineDeadError`. A call whose caller stops waiting (its batch was
cancelled, reached its deadline or was superseded) is abandoned: its requests leave the queue and the
engine at once, so the engine's slots go to the batches still running instead of to answers nobody
will read.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from llmbatch.ray_job.engines.fair_queue import FairQueue
from llmbatch.ray_job.errors import CallAbandonedError, EngineDeadError, RequestFailure
from llmbatch.ray_job.lines.records import Generation, GenRequest
from llmbatch.schemas.batch import DEFAULT_PRIORITY


class Backend(Protocol):
    """An engine driven one step at a time (vLLM, or a plug-in: :mod:`llmbatch.ray_job.engines.backends`)."""

    max_model_len: int
    default_max_tokens: int | None

    def add(self, request: GenRequest) -> None:
        """Queue one request; raise to refuse it (:class:`EngineDeadError` = the engine is gone)."""

    def abort(self, keys: list[str]) -> None:
        """Drop unfinished requests (no answer will come for them); unknown keys are ignored."""

    def has_unfinished(self) -> bool:
        """True while added requests have not finished."""

    def step(self) -> list[Generation]:
        """Run one engine step; return the requests that finished in it."""


class _Waiter:
    """The results one call is waiting for."""

    def __init__(self, keys: list[str]) -> None:
        self.pending = set(keys)
        self.results: dict[str, Generation] = {}
        self.error: BaseException | None = None
        self.done = threading.Event()
        if not self.pending:
            self.done.set()

    def deliver(self, gen: Generation) -> None:
        self.results[gen.key] = gen
        self.pending.discard(gen.key)
        if not self.pending:
            self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()


@dataclass(slots=True)
class _Pending:
    """One request on its way through the runner: waiting, or on the engine."""

    request: GenRequest
    waiter: _Waiter
    group: str
    priority: int
    due: float | None = None


@dataclass(frozen=True, slots=True)
class _Abandon:
    """Word to the stepping thread that nobody waits for these requests any more."""

    keys: frozenset[str]


# how often a call given a stop event looks at it
STOP_POLL_S = 0.25


@dataclass
class RunnerStats:
    """What the runner holds and has done (for ``engines list`` and metrics)."""

    queued: int = 0
    active: int = 0
    preempted: int = 0
    finished: int = 0
    abandoned: int = 0  # requests dropped unanswered because their caller stopped waiting
    at_risk_queued: int = 0  # of ``queued``: requests of batches at risk of their deadline


class EngineRunner:
    """Serialises all engine access in one thread; :meth:`generate` may be called from many.

    Requests wait in a :class:`~llmbatch.ray_job.engines.fair_queue.FairQueue` and at most ``max_active`` of
    them are on the engine at once (None: no limit, everything goes to the engine at once). Priorities
    are strict: lower-priority requests are not started while higher-priority ones wait or run,
    and when higher-priority requests arrive the lower-priority ones on the engine are taken back
    (aborted, and queued again first of their batch: their work so far is redone, as vLLM's own
    preemption by recomputation does). Batches of the same priority take turns.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        max_active: int | None = None,
        tenant_weights: Mapping[str, float] | None = None,
    ) -> None:
        self.backend = backend
        self._max_active = max_active
        self._inbox: queue.SimpleQueue[list[_Pending] | _Abandon] = queue.SimpleQueue()
        self._queue: FairQueue[_Pending] = FairQueue(tenant_weights)
        self._active: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._calls = 0
        self._preempted = 0
        self._finished = 0
        self._abandoned = 0
        self._thread = threading.Thread(target=self._loop, name="engine-stepper", daemon=True)
        self._thread.start()

    @property
    def fatal(self) -> BaseException | None:
        """Why the engine stopped, once it has (every later call raises :class:`EngineDeadError`)."""
        return self._fatal

    def stats(self) -> RunnerStats:
        """A snapshot (read without stopping the engine thread: counts may be a step old)."""
        return RunnerStats(
            queued=len(self._queue),
            at_risk_queued=self._queue.at_risk_waiting(),
            active=len(self._active),
            preempted=self._preempted,
            finished=self._finished,
            abandoned=self._abandoned,
        )

    def generate(
        self,
        requests: list[GenRequest],
        *,
        group: str = "",
        priority: int = DEFAULT_PRIORITY,
        due: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[Generation]:
        """Run ``requests`` (keys unique across calls in flight); results in the same order.

        ``group`` names the batch the requests belong to (batches share the engine fairly; by
        default each call is a batch of its own); ``priority`` 0-9, higher first; ``due`` (unix
        seconds): the batch's deadline, given while it is urgent (near it or behind it), puts its requests
        before the other batches of its priority (:class:`~llmbatch.ray_job.engines.fair_queue.FairQueue`).
        ``stop``: once set, the call is abandoned (:meth:`abandon`) and raises
        :class:`~llmbatch.ray_job.errors.CallAbandonedError`."""
        waiter = _Waiter([r.key for r in requests])
        if not requests:
            return []
        with self._lock:
            if self._fatal is not None:
                raise EngineDeadError(f"the engine stopped: {self._fatal!r}") from self._fatal
            self._calls += 1
            name = group or f"call-{self._calls}"
            self._inbox.put([_Pending(r, waiter, name, priority, due) for r in requests])
        if stop is None:
            waiter.done.wait()
        else:
            while not waiter.done.wait(STOP_POLL_S):
                if stop.is_set():
                    self.abandon([r.key for r in requests])
                    waiter.done.wait()
        if isinstance(waiter.error, CallAbandonedError):
            raise CallAbandonedError(str(waiter.error))
        if waiter.error is not None:
            raise EngineDeadError(f"the engine stopped: {waiter.error!r}") from waiter.error
        return [waiter.results[r.key] for r in requests]

    def abandon(self, keys: list[str]) -> None:
        """Nobody waits for the requests ``keys`` any more (their call was given up): the waiting ones
        leave the queue, the ones on the engine are aborted, and their call raises
        :class:`~llmbatch.ray_job.errors.CallAbandonedError`. Keys already answered or unknown are
        ignored. Returns at once; the stepping thread drops them before it adds anything more."""
        if keys:
            self._inbox.put(_Abandon(frozenset(keys)))

    def _loop(self) -> None:
        try:
            while True:
                self._admit(block=not self.backend.has_unfinished())
                if self.backend.has_unfinished():
                    for gen in self.backend.step():
                        owner = self._active.pop(gen.key, None)
                        if owner is not None:
                            self._finished += 1
                            owner.waiter.deliver(gen)
        except BaseException as exc:
            with self._lock:
                self._fatal = exc
                waiters = {p.waiter for p in self._active.values()}
                waiters |= {p.waiter for p in self._queue.drain()}
                while True:
                    try:
                        message = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not isinstance(message, _Abandon):
                        waiters |= {p.waiter for p in message}
            for waiter in waiters:
                waiter.fail(exc)

    def _admit(self, *, block: bool) -> None:
        calls = [self._inbox.get()] if block and not self._queue else []
        while True:
            try:
                calls.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for call in calls:  # in the order they came: an abandon follows the call it gives up
            if isinstance(call, _Abandon):
                self._drop(call.keys)
                continue
            for pending in call:
                self._queue.push(
                    pending.group, pending.priority, pending, pending.request.prompt_token_ids, pending.due
                )
        self._preempt()
        running = max((p.priority for p in self._active.values()), default=None)
        while self._max_active is None or len(self._active) < self._max_active:
            top = self._queue.top_priority()
            if top is None or (running is not None and top < running):
                break  # strict priority: nothing lower starts while something higher runs
            taken = self._queue.pop()
            assert taken is not None
            pending = taken[2]
            running = top if running is None else max(running, top)
            request = pending.request
            try:
                self.backend.add(request)
            except EngineDeadError:
                self._queue.push_front(pending.group, pending.priority, pending)
                raise
            except Exception as exc:
                failure = RequestFailure.from_engine_exception(exc)
                pending.waiter.deliver(Generation(request.key, failure=failure))
            else:
                self._active[request.key] = pending

    def _drop(self, keys: frozenset[str]) -> None:
        """Take the requests ``keys`` off the engine and out of the queue; fail their calls."""
        on_engine = [key for key in keys if key in self._active]
        if on_engine:
            self.backend.abort(on_engine)
        dropped = [self._active.pop(key) for key in on_engine]
        dropped += self._queue.remove(lambda p: p.request.key in keys)
        self._abandoned += len(dropped)
        for waiter in {p.waiter for p in dropped}:
            waiter.fail(CallAbandonedError(f"{len(waiter.pending)} requests abandoned by their caller"))

    def _preempt(self) -> None:
        """Take back the requests on the engine whose priority is below the highest waiting."""
        top = self._queue.top_priority()
        if top is None:
            return
        lower = [p for p in self._active.values() if p.priority < top]
        if not lower:
            return
        self.backend.abort([p.request.key for p in lower])
        for pending in lower:  # in the order they started: each batch's earliest is first again
            del self._active[pending.request.key]
            self._queue.push_front(pending.group, pending.priority, pending)
        self._preempted += len(lower)
