"""The shared engines from the dispatcher's side: keep the registry deployed on Ray Serve (again after
a Ray head restart lost it) and export the engines' figures, both from the tracker leader.

The config itself is :func:`llmbatch.dispatcher.backends.engines.cluster_serve_config`; the HTTP calls are
:class:`llmbatch.dispatcher.backends.serve_api.ServeApi` and
:meth:`llmbatch.dispatcher.backends.runner_backend.RunnerClient.engines`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.settings import DispatcherSettings

if TYPE_CHECKING:
    from llmbatch.dispatcher.backends.runner_backend import RunnerClient
    from llmbatch.dispatcher.runs.tracker import Tracker

log = logging.getLogger(__name__)

ENGINE_POLL_S = 15.0  # how often the tracker leader refreshes llmbatch_engine_* (Ray exports every ~10 s)


class EngineKeeper:
    """The dispatcher's two engine loops (:meth:`watch`, :meth:`keep_deployed`) and the deploy at start;
    they end when ``stopping`` is set."""

    def __init__(
        self, settings: DispatcherSettings, tracker: Tracker, metrics: Metrics, stopping: asyncio.Event
    ) -> None:
        self.settings = settings
        self.tracker = tracker
        self.metrics = metrics
        self.stopping = stopping

    async def watch(self, runner: RunnerClient) -> None:
        """Export the shared engines' figures (``llmbatch_engine_*``) while this replica leads the
        tracker (one exporter, so sums over dispatcher pods stay right); clear them otherwise. The
        replicas per model also size the tracker's admission (unknown: the registry's minimum)."""
        while not self.stopping.is_set():
            figures: dict[str, dict[str, Any]] = {}
            if self.tracker.is_leader:
                try:
                    figures = await runner.engines()
                except DispatcherError as exc:  # the tracker reports Ray's outages; no line per poll
                    log.debug("engine figures unavailable: %s", exc)
            self.metrics.set_engines(figures)
            self.tracker.launcher.engine_replicas = {
                model: f["replicas"] for model, f in figures.items() if isinstance(f.get("replicas"), int)
            }
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), ENGINE_POLL_S)

    async def deploy_at_start(self) -> str | None:
        """Deploy the engines; returns the Serve instance they went to (its controller's id), ``None``
        if Ray does not answer. A config Serve refuses stops the start; Ray not answering does not:
        intake goes on, and :meth:`keep_deployed` deploys once Ray is back."""
        try:
            return await self.deploy()
        except DispatcherError as exc:
            if not exc.retriable:
                raise
            log.warning(
                "engines not deployed: Ray does not answer; deploying them once it does",
                extra={"error": str(exc)},
            )
            return None

    async def keep_deployed(self, deployed_on: str | None) -> None:
        """Deploy the engines once Ray answers, if the start could not (``deployed_on`` None); then,
        on the tracker leader, again whenever Serve has lost all of them: a Ray head restarted without
        GCS fault tolerance comes back with no applications (a new Serve instance), and the batches
        waiting for an engine would otherwise fail with engine_unavailable."""
        from llmbatch.dispatcher.backends.engines import config_lost
        from llmbatch.dispatcher.backends.serve_api import ServeApi

        api = ServeApi.of(self.settings.ray)
        refused, failing = "", False
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), ENGINE_POLL_S)
            if self.stopping.is_set() or (deployed_on is not None and not self.tracker.is_leader):
                continue
            try:
                if deployed_on is not None and config_lost(self.config(), await api.status(), deployed_on):
                    log.warning(
                        "Ray Serve has none of the engines (a Ray head restart?): deploying them again"
                    )
                    deployed_on = None
                if deployed_on is None:
                    deployed_on = await self.deploy()
                refused, failing = "", False
            except DispatcherError as exc:
                if exc.retriable and deployed_on is None and not failing:  # once per streak of failures
                    failing = True
                    log.warning(
                        "engines still not deployed; trying again every %.0f s",
                        ENGINE_POLL_S,
                        extra={"error": str(exc)},
                    )
                elif exc.retriable:  # the tracker reports Ray's outages; no line per poll
                    log.debug("engine deployment check failed: %s", exc)
                elif str(exc) != refused:  # said once per refusal
                    refused = str(exc)
                    log.error("Ray Serve refused the engines' config", extra={"error": refused})
            except Exception:  # a bug here must not end the loop: the engines would never be deployed
                log.exception("engine deployment check failed unexpectedly; the next poll tries again")

    def config(self) -> dict[str, Any]:
        from llmbatch.dispatcher.backends.engines import cluster_serve_config

        return cluster_serve_config(self.settings)

    async def deploy(self) -> str:
        """Apply the registry to the cluster's Serve config (idempotent: unchanged apps keep running);
        returns the Serve instance it went to (its controller's actor id, "" if Serve does not say)."""
        from llmbatch.dispatcher.backends.engines import serve_controller
        from llmbatch.dispatcher.backends.serve_api import ServeApi

        config = self.config()
        api = ServeApi.of(self.settings.ray)
        await api.deploy(config)
        log.info("engines deployed", extra={"applications": [a["name"] for a in config["applications"]]})
        return serve_controller(await api.status()) or ""
