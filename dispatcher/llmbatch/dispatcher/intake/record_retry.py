"""Retrying the processing of consumed records: outages without limit, everything else a few times.

A dependency that is down (Redis or Kafka unreachable: a retriable :class:`DispatcherError`) is not
the record's fault: :meth:`RecordRetry.run` backs off and tries again for as long as it takes, and the
consumer commits nothing meanwhile. Nor is a dependency that refuses this service for how it is set
up (:class:`~llmbatch.dispatcher.errors.Misconfiguration`: Redis ``NOPERM``, ``OOM`` or a refused
login, a Kafka ACL): intake *pauses* on it the same way, and says so (:attr:`RecordRetry.paused`,
read by readiness; the ``llmbatch_dispatcher_intake_paused{cause}`` gauge; one line when it pauses and
one when it resumes), so valid requests are never dead-lettered or rejected for it. Any other failure,
a permanent error (a record the broker refuses) or an unexpected exception, is tried
``max_attempts`` times in all; then :class:`GaveUp` tells the consumer to dead-letter the record
(:func:`failure_letter`, reason ``processing_failed``) and move past it, instead of dying on it and
reading it again after every restart (a crash loop that blocks the partition).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from llmbatch.dispatcher.domain.dlt import DeadLetter, OriginalRecord, build_dead_letter, exception_fqcn
from llmbatch.dispatcher.domain.retry import Backoff
from llmbatch.dispatcher.errors import DeadLetterRefused, DispatcherError, Misconfiguration
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.schemas.dlt import DltReason
from llmbatch.schemas.events import RecordRef

if TYPE_CHECKING:
    from llmbatch.dispatcher.kafka.publisher import EventProducer

log = logging.getLogger(__name__)
T = TypeVar("T")


class Abandoned(Exception):
    """Processing stopped: shutdown, or the partition was revoked meanwhile."""


class GaveUp(Exception):
    """``what`` failed ``attempts`` times with a non-transient error; ``error`` is the last one."""

    def __init__(self, what: str, error: BaseException, attempts: int) -> None:
        super().__init__(f"{what} failed {attempts} time{'s' if attempts > 1 else ''}: {describe(error)}")
        self.what = what
        self.error = error
        self.attempts = attempts


def describe(error: BaseException) -> str:
    """One line for a log or a dead letter (translated errors already name the library's class)."""
    text = str(error) if isinstance(error, DispatcherError) else f"{type(error).__name__}: {error}"
    return text[:2000]


def failure_letter(origin: OriginalRecord, failed: GaveUp, *, dlt_topic: str, group_id: str) -> DeadLetter:
    """The dead letter of a record the consumer gave up on (pure). ``kafka_dlt-exception-fqcn`` names
    the library's exception when the error was translated from one (e.g. redis' OutOfMemoryError)."""
    cause = failed.error.__cause__ if isinstance(failed.error, DispatcherError) else None
    return build_dead_letter(
        origin,
        dlt_topic=dlt_topic,
        reason=DltReason.PROCESSING_FAILED,
        group_id=group_id,
        fqcn=exception_fqcn(cause or failed.error),
        message=str(failed),
    )


OUTAGE_LOG_EVERY_S = 30.0  # an outage is logged when it starts, then at most this often, and when it ends


@dataclass
class RecordRetry:
    """Runs one step of a record's processing under the consumer's retry rules."""

    backoff: Backoff
    metrics: Metrics
    stopping: asyncio.Event
    epoch: Callable[[], int]
    """The consumer's current rebalance epoch: a step started in another epoch is abandoned."""
    beat: Callable[[], None] = lambda: None
    """Called on every try: a consumer retrying through an outage is alive, not stalled (/livez)."""
    clock: Callable[[], float] = time.monotonic
    paused: str | None = field(default=None, init=False)
    """The misconfiguration intake waits on (an error code), or None."""
    _outage_since: float | None = field(default=None, init=False)
    _outage_logged_at: float = field(default=0.0, init=False)
    _outage_tries: int = field(default=0, init=False)

    def _outage(self, what: str, exc: DispatcherError, delay: float) -> None:
        """Log an outage once per change of state (down, still down every so often), not per try."""
        now = self.clock()
        self._outage_tries += 1
        if self._outage_since is None:
            self._outage_since = self._outage_logged_at = now
            log.warning(
                "dependency unavailable; retrying until it is back (repeats are not logged)",
                extra={"what": what, "error": str(exc), "retry_in_s": round(delay, 2)},
            )
        elif now - self._outage_logged_at >= OUTAGE_LOG_EVERY_S:
            self._outage_logged_at = now
            log.warning(
                "dependency still unavailable",
                extra={
                    "what": what,
                    "error": str(exc),
                    "down_s": round(now - self._outage_since, 1),
                    "tries": self._outage_tries,
                },
            )

    def _pause(self, what: str, exc: Misconfiguration) -> None:
        """Pause intake on ``exc``: said once per cause (a line, the gauge, readiness)."""
        if self.paused == exc.code:
            return
        if self.paused is not None:
            self.metrics.intake_paused.labels(cause=self.paused).set(0)
        self.paused = exc.code
        self.metrics.intake_paused.labels(cause=exc.code).set(1)
        log.error(
            "intake paused: a dependency refuses this service's configuration; nothing is dead-lettered "
            "or answered until it is fixed",
            extra={"what": what, "cause": exc.code, "error": str(exc)},
        )

    def _recovered(self) -> None:
        if self.paused is not None:
            self.metrics.intake_paused.labels(cause=self.paused).set(0)
            log.info("intake resumed", extra={"cause": self.paused})
            self.paused = None
        if self._outage_since is not None:
            log.info(
                "dependency back",
                extra={"down_s": round(self.clock() - self._outage_since, 1), "tries": self._outage_tries},
            )
            self._outage_since, self._outage_tries = None, 0

    async def run(self, what: str, fn: Callable[[], Awaitable[T]], epoch: int, *, max_attempts: int) -> T:
        """``fn()`` until it succeeds. Transient errors back off without limit; other errors and
        unexpected exceptions raise :class:`GaveUp` on the ``max_attempts``-th failure. Raises
        :class:`Abandoned` when the consumer stops or the partitions were revoked meanwhile."""
        outages = attempts = 0
        while True:
            self.beat()
            if self.stopping.is_set() or epoch != self.epoch():
                raise Abandoned(what)
            try:
                result = await fn()
            except Misconfiguration as exc:
                outages += 1
                self._pause(what, exc)
                await self.sleep(self.backoff.delay(outages))
                continue
            except DispatcherError as exc:
                if exc.retriable:
                    outages += 1
                    component = "redis" if exc.code == "redis_unavailable" else "kafka"
                    self.metrics.transient_errors.labels(component=component).inc()
                    delay = self.backoff.delay(outages)
                    self._outage(what, exc, delay)
                    await self.sleep(delay)
                    continue
                error: BaseException = exc
            except Exception as exc:  # a bug or an untranslated library error: not the consumer's end
                error = exc
            else:
                self._recovered()
                return result
            attempts += 1
            if attempts >= max_attempts:
                raise GaveUp(what, error, attempts) from error
            delay = self.backoff.delay(attempts)
            log.warning(
                "processing failed, retrying",
                extra={
                    "what": what,
                    "error": describe(error),
                    "attempt": attempts,
                    "max_attempts": max_attempts,
                    "retry_in_s": round(delay, 2),
                },
                exc_info=not isinstance(error, DispatcherError),
            )
            await self.sleep(delay)

    async def give_up(
        self,
        producer: EventProducer,
        origin: OriginalRecord,
        failed: GaveUp,
        epoch: int,
        *,
        dlt_topic: str,
        group_id: str,
        max_attempts: int,
    ) -> RecordRef:
        """Dead-letter a record whose processing failed on every allowed attempt, so its offset can
        move past it; count it and say so in one error line. A dead letter the topic refuses for good
        is sent again in its reduced form; if that is refused too, intake pauses on the record
        (:class:`~llmbatch.dispatcher.errors.DeadLetterRefused`: readiness, the gauge, one line) and
        tries again until it is taken, for a record is never passed without a trace. Returns where the
        dead letter was written. Raises :class:`Abandoned` when the consumer stops meanwhile."""
        reduced = build_dead_letter(
            origin,
            dlt_topic=dlt_topic,
            reason=DltReason.PROCESSING_FAILED,
            group_id=group_id,
            fqcn=exception_fqcn(failed.error),
            message=f"{failed.what} failed {failed.attempts} times",
        )
        try:
            letter = failure_letter(origin, failed, dlt_topic=dlt_topic, group_id=group_id)
        except Exception:  # the error's text is hostile input too: say less
            letter = reduced
        refusals = 0
        while True:
            try:
                send = functools.partial(producer.dead_letter, letter)
                meta = await self.run("dead letter", send, epoch, max_attempts=max_attempts)
                break
            except GaveUp as exc:
                self.metrics.dead_letters_failed.labels(stage="intake").inc()
                if letter is not reduced:
                    letter = reduced
                    continue
                refusals += 1
                self._pause(
                    "dead letter", DeadLetterRefused(f"the dead letter was refused: {describe(exc.error)}")
                )
                await self.sleep(self.backoff.delay(refusals))
                if self.stopping.is_set() or epoch != self.epoch():
                    raise Abandoned("dead letter") from None
        written = RecordRef(topic=letter.topic, partition=meta.partition, offset=meta.offset)
        self.metrics.failed_records.inc()
        self.metrics.processed.labels(outcome="failed").inc()
        log.error(
            "record dead-lettered after failed attempts, moving on",
            extra={
                "reason": letter.reason,
                "what": failed.what,
                "attempts": failed.attempts,
                "error": describe(failed.error),
                "topic": origin.topic,
                "partition": origin.partition,
                "offset": origin.offset,
            },
        )
        return written

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or less when the consumer stops."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)
