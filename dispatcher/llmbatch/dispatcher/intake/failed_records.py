"""The records the requests-topic consumer gave up on: each is dead-lettered (``processing_failed``,
:meth:`~llmbatch.dispatcher.intake.record_retry.RecordRetry.give_up`) and, when it names a batch and is
no cancel, answered ``rejected`` on the results topic
(:func:`~llmbatch.dispatcher.intake.answers.failure_answer`), so one record never stops the consumer and
its producer still hears of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from llmbatch.dispatcher import logs
from llmbatch.dispatcher.intake.answers import failure_answer
from llmbatch.dispatcher.intake.commands import Accept, Cancel, Command, IntakeRules
from llmbatch.dispatcher.intake.record_retry import Abandoned, GaveUp, RecordRetry, describe
from llmbatch.dispatcher.kafka.publisher import EventProducer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.settings import DispatcherSettings

log = logging.getLogger(__name__)


class FailedRecords:
    """Dead-letters and answers the records the consumer gave up on (see the module docstring)."""

    def __init__(
        self,
        settings: DispatcherSettings,
        retry: RecordRetry,
        producer: EventProducer,
        metrics: Metrics,
        rules: IntakeRules,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.opts = settings.dispatcher
        self.retry = retry
        self.producer = producer
        self.metrics = metrics
        self.rules = rules
        self.clock = clock

    async def give_up(self, command: Command, failed: GaveUp, epoch: int) -> None:
        """Dead-letter a record the consumer gave up on and answer it. Never raises but
        :class:`Abandoned`: a record that cannot even be dead-lettered is logged by its coordinates."""
        batch_id = batch_id_of(command)
        with logs.bind(batch_id=batch_id):
            try:
                await self._dead_letter_and_answer(command, batch_id, failed, epoch)
            except Abandoned:
                raise
            except Exception:  # a bug here must not end the consumer: the record is passed, loudly
                self.metrics.failed_records.inc()
                log.exception(
                    "giving up on a record failed",
                    extra={
                        "topic": command.origin.topic,
                        "partition": command.origin.partition,
                        "offset": command.origin.offset,
                    },
                )

    async def _dead_letter_and_answer(
        self, command: Command, batch_id: str | None, failed: GaveUp, epoch: int
    ) -> None:
        written = await self.retry.give_up(
            self.producer,
            command.origin,
            failed,
            epoch,
            dlt_topic=self.rules.dlt_topic,
            group_id=self.rules.group_id,
            max_attempts=self.opts.record_max_attempts,
        )
        if batch_id is None or isinstance(command, Cancel):
            return
        answer = failure_answer(command, batch_id, failed, written, source=self.opts.source, now=self.clock())
        if answer is None:
            return
        try:
            await self.retry.run(
                "answer",
                lambda: self.producer.publish(self.settings.kafka.topics.results, answer),
                epoch,
                max_attempts=self.opts.record_max_attempts,
            )
        except GaveUp as lost:
            log.error("the rejected request could not be answered", extra={"error": describe(lost.error)})


def batch_id_of(command: Command) -> str | None:
    """The batch id a command names (None: a rejected record that names none)."""
    if isinstance(command, Accept):
        return command.request.batch_id
    if isinstance(command, Cancel):
        return command.batch_id
    return command.batch_id if command.item is not None else None
