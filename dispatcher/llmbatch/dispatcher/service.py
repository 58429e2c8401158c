"""Wiring: settings -> store, producer, consumer, tracker, health endpoint; graceful SIGTERM.

On SIGTERM/SIGINT the dispatcher stops fetching, finishes the segment in hand, commits its offsets,
leaves the consumer group (its partitions move to the other replicas), gives up the tracker lease
and exits. Running Ray jobs keep running; the next tracker leader watches them.

The job backend is built by :mod:`llmbatch.dispatcher.backends.build`, the checks made once at start
are :mod:`llmbatch.dispatcher.start_checks`', what the health endpoint answers
:mod:`llmbatch.dispatcher.probes`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmbatch.dispatcher import logs
from llmbatch.dispatcher.backends.backend import JobBackend
from llmbatch.dispatcher.backends.build import build_backend
from llmbatch.dispatcher.backends.input_sizes import InputSizes
from llmbatch.dispatcher.errors import DispatcherError, InvalidSettings
from llmbatch.dispatcher.http import HealthServer
from llmbatch.dispatcher.intake.consumer import RequestConsumer
from llmbatch.dispatcher.intake.reconcile import Reconciler
from llmbatch.dispatcher.intake.record_retry import OUTAGE_LOG_EVERY_S
from llmbatch.dispatcher.kafka.publisher import EventProducer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.probes import Probes
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.engine_keeper import EngineKeeper
from llmbatch.dispatcher.runs.results import ResultStore
from llmbatch.dispatcher.runs.stored_bytes import StoredBytes
from llmbatch.dispatcher.runs.tracker import Tracker
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.start_checks import check_durability, prepare_topics, say_trust, start_problem
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.dispatcher.webhooks.runner import Webhooks

if TYPE_CHECKING:
    from llmbatch.dispatcher.backends.runner_backend import RunnerClient

log = logging.getLogger(__name__)


def _no_crash(point: str) -> None:
    """Crash points pass unnoticed in production."""


class Dispatcher(Probes):
    def __init__(
        self,
        settings: DispatcherSettings,
        *,
        backend: JobBackend | None = None,
        metrics: Metrics | None = None,
        crash: Callable[[str], None] | None = None,
    ) -> None:
        """``crash``: a test seam, called with the name of each crash point the dispatcher passes
        (``after_accept``, ``after_submit``, ``after_job_end``, ``after_publish``, ``after_dlt``); the
        crash tests plug in one that kills the process there (tests/support/crashing_dispatcher.py)."""
        self.settings = settings
        opts = settings.dispatcher
        self.metrics = metrics or Metrics()
        self.crash: Callable[[str], None] = crash or _no_crash
        self.store = StateStore.from_settings(
            settings.redis, finished_ttl_s=opts.finished_ttl_s, dedupe_ttl_s=opts.event_dedupe_ttl_s
        )
        self.results = ResultStore(settings.s3)
        # one cache for the tracker's admission and the runner backend's route: one S3 HEAD per batch
        input_sizes = InputSizes(self.results.object_size)
        self.runner: RunnerClient | None = None
        if backend is None:
            backend, self.runner = build_backend(
                settings, self.store, upload_spec=self.results.upload_spec, input_sizes=input_sizes
            )
        self.backend = backend
        self.producer = EventProducer(settings.kafka, self.metrics)
        self.consumer = RequestConsumer(
            settings, self.store, self.producer, self.metrics, crash=self.crash, size_of=input_sizes
        )
        self.tracker = Tracker(
            RunContext(
                settings,
                self.store,
                self.backend,
                self.results,
                self.producer,
                self.metrics,
                crash=self.crash,
            ),
            input_sizes=input_sizes,
        )
        self.consumer.on_accepted = self.tracker.accepted
        self.reconciler = Reconciler(
            settings,
            self.store,
            self.consumer.rules,
            self.metrics,
            reader=self.tracker.launcher.bodies.reader,
        )
        self._stop = asyncio.Event()
        self.engines = EngineKeeper(settings, self.tracker, self.metrics, self._stop)
        self.webhooks: Webhooks | None = None
        if settings.webhooks.enabled:
            self.webhooks = Webhooks(
                settings.webhooks,
                settings.kafka,
                redis=self.store.client,
                keys=self.store.keys,
                group_id=opts.group_id,
                metrics=self.metrics,
            )
        self.health: HealthServer | None = None
        if opts.metrics_port is not None:
            self.health = HealthServer(
                self.metrics,
                live=self._live,
                ready=self._ready,
                host=opts.metrics_host,
                port=opts.metrics_port,
            )
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._stalled: list[str] = []

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Raises :class:`InvalidSettings` when the settings cannot serve (no model configured)."""
        problem = start_problem(self.settings, short_path=self.runner is not None)
        if problem is not None:
            raise InvalidSettings(problem)
        opts = self.settings.dispatcher
        log.info(
            "dispatcher starting",
            extra={
                "instance": opts.instance_id,
                "group_id": opts.group_id,
                "max_in_flight": opts.launch_limit,
                "models": sorted(self.settings.served_models),
            },
        )
        say_trust(self.settings)
        if self.health is not None:
            await self.health.start()
        await self._until_ok("kafka producer", self.producer.start)
        await self._until_ok("kafka topics", lambda: prepare_topics(self.settings))
        await self._until_ok("kafka consumer", self.consumer.start)
        await check_durability(self.store)
        deployed_on: str | None = None
        if opts.shared_engines and opts.deploy_engines:
            deployed_on = await self.engines.deploy_at_start()
        self._tasks = [
            asyncio.create_task(self.consumer.run(), name="consumer"),
            asyncio.create_task(self.tracker.run(), name="tracker"),
        ]
        if self.runner is not None:
            self._tasks.append(asyncio.create_task(self.engines.watch(self.runner), name="engine-metrics"))
        if opts.shared_engines and opts.deploy_engines:
            keep = self.engines.keep_deployed(deployed_on)
            self._tasks.append(asyncio.create_task(keep, name="engine-deploy"))
        if opts.reconcile_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._reconcile(), name="reconcile"))
        if opts.stored_bytes_every_s > 0:
            stored = StoredBytes(
                self.settings.s3,
                self.metrics,
                self.tracker,
                self.settings.tenants.known(),
                self._stop,
                every_s=opts.stored_bytes_every_s,
                figures=self.store,
            )
            self._tasks.append(asyncio.create_task(stored.run(), name="stored-bytes"))
        if self.webhooks is not None:
            webhooks = self.webhooks
            await self._until_ok("webhook consumer", webhooks.start)
            self._tasks += webhooks.tasks()
        self._started = True
        log.info("dispatcher started")

    async def _reconcile(self) -> None:
        """Run the reconcile pass on the tracker leader: when it becomes leader, then every
        ``reconcile_interval_s``. A pass that fails (Kafka or Redis down) is tried again at the next."""
        interval = self.settings.dispatcher.reconcile_interval_s
        next_at = 0.0
        was_leader = False
        while not self._stop.is_set():
            leader = self.tracker.is_leader
            if leader and (not was_leader or time.monotonic() >= next_at):
                next_at = time.monotonic() + interval
                try:
                    await self.reconciler.run_once()
                except DispatcherError as exc:
                    log.warning("reconcile pass failed; the next one tries again", extra={"error": str(exc)})
                except Exception:  # a bug here must not stop the service (its task ending fails /livez)
                    log.exception("reconcile pass failed unexpectedly; the next one tries again")
            was_leader = leader
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 5.0)

    async def _until_ok(self, what: str, fn: Callable[[], object]) -> None:
        """``fn()`` until it succeeds (a start step); a dependency that is not ready is logged once per
        change of state: when it first fails, every ``OUTAGE_LOG_EVERY_S`` while it does, and when it
        is ready, not on every retry."""
        failures = 0
        since = said = 0.0
        while True:
            try:
                result = fn()
                if asyncio.iscoroutine(result):
                    await result
                if failures:
                    log.info(
                        f"{what} ready",
                        extra={"down_s": round(time.monotonic() - since, 1), "tries": failures + 1},
                    )
                return
            except DispatcherError as exc:
                if not exc.retriable or self._stop.is_set():
                    raise
                failures += 1
                delay = self.settings.dispatcher.io_backoff.delay(failures)
                now = time.monotonic()
                if failures == 1:
                    since = said = now
                    log.warning(
                        f"{what} not ready, retrying (repeats are not logged)",
                        extra={"error": str(exc), "retry_in_s": round(delay, 1)},
                    )
                elif now - said >= OUTAGE_LOG_EVERY_S:
                    said = now
                    log.warning(
                        f"{what} still not ready",
                        extra={"error": str(exc), "down_s": round(now - since, 1), "tries": failures},
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                if self._stop.is_set():
                    raise

    def request_stop(self) -> None:
        self._stop.set()
        self.consumer.request_stop()
        self.tracker.request_stop()

    async def wait(self) -> None:
        """Until a stop is requested or a loop dies."""
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait([stop, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.error("a dispatcher loop died", exc_info=task.exception())

    async def stop(self) -> None:
        self.request_stop()
        deadline = time.monotonic() + self.settings.dispatcher.shutdown_timeout_s
        for task in self._tasks:
            try:
                await asyncio.wait_for(asyncio.shield(task), max(0.1, deadline - time.monotonic()))
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
            except Exception:
                log.exception("loop ended with an error")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.consumer.stop(), max(1.0, deadline - time.monotonic()))
        if self.webhooks is not None:
            await self.webhooks.stop()
        await self.producer.stop()
        with contextlib.suppress(Exception):
            await self.tracker.launcher.bodies.reader.close()
        await self.backend.close()
        with contextlib.suppress(Exception):
            await self.store.close()
        if self.health is not None:
            await self.health.stop()
        log.info("dispatcher stopped")


def dump_tasks() -> None:
    """SIGUSR1: log every asyncio task's stack and every thread's (diagnosing a stuck loop)."""
    import faulthandler
    import io
    import sys

    for task in asyncio.all_tasks():
        buf = io.StringIO()
        task.print_stack(file=buf)
        log.warning("task stack", extra={"task": task.get_name(), "stack": buf.getvalue()[-4000:]})
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


async def serve(settings: DispatcherSettings, *, crash: Callable[[str], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code. ``crash``: see :class:`Dispatcher`."""
    logs.setup(settings.dispatcher.log_level, settings.dispatcher.log_json)
    dispatcher = Dispatcher(settings, crash=crash)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, dispatcher.request_stop)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    code = 0
    try:
        await dispatcher.start()
        await dispatcher.wait()
        if not dispatcher._stop.is_set():
            code = 1
    except DispatcherError as exc:
        log.error("dispatcher could not start", extra={"error": str(exc)})
        code = 1
    finally:
        await dispatcher.stop()
    return code
