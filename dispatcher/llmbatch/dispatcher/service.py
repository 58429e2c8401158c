"""Wiring: settings -> store, producer, consumer, tracker, health endpoint; graceful SIGTERM.

On SIGTERM/SIGINT the dispatcher stops fetching, finishes the segment in hand, commits its offsets,
leaves the consumer group (its partitions move to the other replicas), gives up the tracker lease
and exits. Running Ray jobs keep running; the next tracker leader watches them.
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
from llmbatch.dispatcher.backends.input_sizes import InputSizes
from llmbatch.dispatcher.errors import DispatcherError, InvalidSettings
from llmbatch.dispatcher.http import HealthServer
from llmbatch.dispatcher.intake.consumer import RequestConsumer
from llmbatch.dispatcher.intake.reconcile import Reconciler
from llmbatch.dispatcher.intake.record_retry import OUTAGE_LOG_EVERY_S
from llmbatch.dispatcher.kafka.publisher import EventProducer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.engine_keeper import EngineKeeper
from llmbatch.dispatcher.runs.results import ResultStore
from llmbatch.dispatcher.runs.stored_bytes import StoredBytes
from llmbatch.dispatcher.runs.tracker import Tracker
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.dispatcher.webhooks.runner import Webhooks

if TYPE_CHECKING:
    from llmbatch.dispatcher.backends.runner_backend import RunnerClient

log = logging.getLogger(__name__)


def _no_crash(point: str) -> None:
    """Crash points pass unnoticed in production."""


class Dispatcher:
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
            from llmbatch.dispatcher.backends.ray_backend import RayJobsBackend

            job_sessions = None
            if settings.job.s3_sessions:
                from llmbatch.dispatcher.backends.s3_sessions import JobSessions, SessionMinter

                job_sessions = JobSessions(
                    SessionMinter(
                        settings.s3, duration_s=settings.job.s3_session_s, role_arn=opts.runner_s3_role_arn
                    ),
                    self.store,
                )
            backend = RayJobsBackend(settings, upload_spec=self.results.upload_spec, sessions=job_sessions)
            if opts.shared_engines and opts.short_path_max_lines > 0:
                # imported here: the runner's module brings Ray, which the plain job path never needs
                from llmbatch.dispatcher.backends.runner_backend import RoutedBackend, RunnerClient
                from llmbatch.dispatcher.backends.s3_sessions import SessionMinter

                sessions = None
                if opts.runner_s3_sessions:
                    sessions = SessionMinter(
                        settings.s3, duration_s=opts.runner_s3_session_s, role_arn=opts.runner_s3_role_arn
                    )
                self.runner = RunnerClient.of(settings.ray, sessions=sessions)
                backend = RoutedBackend(
                    backend,
                    self.runner,
                    max_lines=opts.short_path_max_lines,
                    max_bytes=opts.short_path_max_bytes,
                    size_of=input_sizes,
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

    # -- health --------------------------------------------------------------------------------------
    def _live(self) -> bool:
        if any(t.done() for t in self._tasks):
            return False
        stalled = self.stalled_loops() if self._started else []
        if stalled != self._stalled:  # said once per change of state
            if stalled:
                log.error(
                    "loop stalled: /livez fails",
                    extra={"loops": stalled, "stall_timeout_s": self.settings.dispatcher.stall_timeout_s},
                )
            else:
                log.info("loops moving again", extra={"loops": self._stalled})
            self._stalled = stalled
        return not stalled

    def stalled_loops(self) -> list[str]:
        """The loops that have not moved for ``stall_timeout_s`` (a hang, not an outage)."""
        now, limit = time.monotonic(), self.settings.dispatcher.stall_timeout_s
        moved = {"consumer": self.consumer.last_progress, "tracker": self.tracker.last_tick}
        return [name for name, at in moved.items() if now - at > limit]

    async def _ready(self) -> tuple[bool, dict[str, str]]:
        detail: dict[str, str] = {}
        try:
            await self.store.ping()
            detail["redis"] = "ok"
        except DispatcherError as exc:
            detail["redis"] = f"unavailable ({exc.code})"
        detail["kafka"] = "ok" if await self.producer.ping() else "unavailable"
        detail["consumer"] = f"{len(self.consumer.assignment)} partition(s)"
        paused = self.consumer.retry.paused
        detail["intake"] = f"paused ({paused})" if paused else "ok"
        leases = self.tracker.leases
        detail["tracker"] = "leader" if leases.is_leader else "standby"  # the launching lease
        detail["tracker_shards"] = f"{len(leases.shards)} of {leases.shard_count}"
        ok = (
            self._started
            and detail["redis"] == "ok"
            and detail["kafka"] == "ok"
            and paused is None
            and self._live()
        )
        return ok, detail

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Raises :class:`InvalidSettings` when the settings cannot serve (no model configured)."""
        problem = self.settings.serving_problem()
        if problem is None and self.runner is not None and self.settings.ray.runner_token is None:
            problem = (
                "the short path is on (LLMBATCH_DISPATCHER__SHORT_PATH_MAX_LINES > 0) but "
                "LLMBATCH_RAY__RUNNER_TOKEN is not set: give the dispatcher and the Ray nodes the same "
                "token (on Kubernetes the llmbatch-credentials Secret's runner-token), or set "
                "LLMBATCH_DISPATCHER__SHORT_PATH_MAX_LINES=0"
            )
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
        if self.settings.replay.key is None:
            log.warning(
                "LLMBATCH_REPLAY__KEY is not set: replay headers are honoured from any producer "
                "that may write the requests topic (they reopen failed batches)"
            )
        if not self.settings.tenants.keys:
            log.warning(
                "LLMBATCH_TENANTS__KEYS is not set: the tenant a request or cancel names is trusted "
                "from any producer that may write the requests topic"
            )
        else:
            log.info(
                "requests and cancels must be signed by their tenant",
                extra={"tenants": sorted(self.settings.tenants.keys)},
            )
        if self.settings.tenants.pools:
            log.info(
                "these tenants' jobs run only on their own worker pools (Ray resource "
                "llmbatch_tenant_<tenant>), never on the shared batch runner",
                extra={"tenants": self.settings.tenants.pools},
            )
        if self.health is not None:
            await self.health.start()
        await self._until_ok("kafka producer", self.producer.start)
        await self._until_ok("kafka topics", self._ensure_topics)
        await self._until_ok("kafka consumer", self.consumer.start)
        await self._check_durability()
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

    async def _check_durability(self) -> None:
        """Say once when Redis may lose acknowledged intakes in a crash (see dispatcher.reconcile)."""
        with contextlib.suppress(DispatcherError):
            policy = await self.store.fsync_policy()
            if policy is not None and policy != "always":
                log.warning(
                    "Redis runs with appendfsync %s: a crash of its host may lose the last second of "
                    "accepted batches (the reconcile pass takes them in again from the requests topic); "
                    "run Redis with --appendfsync always for durable intake",
                    policy,
                )

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

    async def _ensure_topics(self) -> None:
        from llmbatch.adapters.topics import ensure_topics

        try:
            created = await ensure_topics(self.settings)
        except Exception as exc:
            from llmbatch.dispatcher.errors import KafkaUnavailable

            raise KafkaUnavailable(str(exc)) from exc
        if created:
            log.info("topics created", extra={"topics": created})
        await self._check_topic_sizes()

    async def _check_topic_sizes(self) -> None:
        """Warn once at start about existing topics that would refuse what the settings accept."""
        from llmbatch.adapters.topics import check_topic_sizes

        try:
            problems = await check_topic_sizes(self.settings)
        except Exception as exc:  # a broker that will not describe configs (ACLs) is not an outage
            log.info("topic sizes not checked", extra={"error": str(exc)[:300]})
            return
        for problem in problems:
            log.warning(problem)

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
