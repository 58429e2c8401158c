"""Warm engines shared by every batch: one Ray Serve application per model of the registry.

Each replica of an application holds one engine (:func:`llmbatch.ray_job.engines.backends.make_backend`:
vLLM, or the fake for tests, the same code on CPU and GPU) behind an
:class:`~llmbatch.ray_job.engines.engine_runner.EngineRunner`,
so the requests of many batches run on it at once (continuous batching across batches). Serve
routes each call to the least loaded replica, scales the replicas between ``min_replicas`` and
``max_replicas`` on the calls in flight per replica, removes idle ones after ``idle_s`` (down to
zero) and replaces a replica whose engine died (``check_health``).

The application is deployed from a Serve config
(``import_path: llmbatch.ray_job.engines.serve_engine:build_app``, ``args: {model, entry}``), by the
dispatcher through the dashboard's REST API or by a KubeRay RayService; :func:`serve_application` builds
that config. Batches reach it through :class:`~llmbatch.ray_job.engines.serve_client.ServeEngine`, a
client with the interface of a local engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Annotated, Any, cast

from pydantic import Field, TypeAdapter

from llmbatch.ray_job.engines import engine_scaling
from llmbatch.ray_job.engines.backends import make_backend
from llmbatch.ray_job.engines.engine_metrics import EngineMetrics
from llmbatch.ray_job.engines.engine_runner import EngineRunner
from llmbatch.ray_job.lines.records import Generation, GenRequest
from llmbatch.ray_job.storage import node_secrets
from llmbatch.schemas.batch import DEFAULT_PRIORITY
from llmbatch.schemas.engines import DEPLOYMENT_NAME, EngineModel, app_name

log = logging.getLogger(__name__)

IMPORT_PATH = "llmbatch.ray_job.engines.serve_engine:build_app"
METRICS_INTERVAL_S = 5.0
# the tenants' weights as the builder takes them from the Serve config (the dispatcher's settings)
_WEIGHTS: TypeAdapter[dict[str, Annotated[float, Field(gt=0, le=1000)]]] = TypeAdapter(
    dict[str, Annotated[float, Field(gt=0, le=1000)]]
)


class EngineServer:
    """The body of one engine replica (a Serve deployment class; see :func:`build_app`)."""

    def __init__(
        self, model: str, entry: dict[str, Any], tenant_weights: dict[str, float] | None = None
    ) -> None:
        spec = EngineModel.model_validate(entry)
        self.model = model
        started = time.perf_counter()
        backend = make_backend(spec.path, spec.engine)
        self.engine_start_s = time.perf_counter() - started
        self.ready_at = time.time()
        self._max_active = spec.max_active_requests
        self._runner = EngineRunner(
            backend,
            max_active=spec.max_active_requests,
            tenant_weights=_WEIGHTS.validate_python(tenant_weights or {}),
        )
        # runner.generate blocks until its requests finish: one thread per call in flight
        self._pool = ThreadPoolExecutor(
            max_workers=spec.scaling.max_ongoing_requests, thread_name_prefix="engine-call"
        )
        self._lock = threading.Lock()
        self._requests = 0
        self._completion_tokens = 0
        self._calls = 0
        self._in_flight = 0
        self._last_busy = time.time()
        self._metrics = EngineMetrics(model)
        self._metrics.started(self.engine_start_s)
        if self._metrics.enabled:
            threading.Thread(target=self._sample_metrics, name="engine-metrics", daemon=True).start()
        log.info("engine for %s ready in %.1f s", model, self.engine_start_s)

    def idle_s(self) -> float:
        """Seconds since the replica last had a call in flight (0 while it has one)."""
        with self._lock:
            return 0.0 if self._in_flight else time.time() - self._last_busy

    def _sample_metrics(self) -> None:
        while True:
            self._metrics.sample(self._runner.stats(), self.idle_s())
            time.sleep(METRICS_INTERVAL_S)

    def info(self) -> dict[str, Any]:
        """What a client needs before sending requests (context size, defaults) and engine stats."""
        backend = self._runner.backend
        with self._lock:
            requests, tokens = self._requests, self._completion_tokens
        stats = self._runner.stats()
        return {
            "model": self.model,
            "max_model_len": backend.max_model_len,
            "default_max_tokens": backend.default_max_tokens,
            "max_active": self._max_active,
            "engine_start_s": self.engine_start_s,
            "ready_at": self.ready_at,
            "requests": requests,
            "completion_tokens": tokens,
            "idle_s": self.idle_s(),
            "queued": stats.queued,
            "active": stats.active,
            "preempted": stats.preempted,
            "finished": stats.finished,
            "abandoned": stats.abandoned,
        }

    async def generate(
        self,
        requests: list[GenRequest],
        group: str = "",
        priority: int = DEFAULT_PRIORITY,
        due: float | None = None,
    ) -> list[Generation]:
        """Run ``requests`` (keys unique within the call) of batch ``group`` on this replica's engine
        (see :class:`~llmbatch.ray_job.engines.engine_runner.EngineRunner` for how batches share it and what
        ``due`` does).

        Calls of different batches run at once and their keys (input line numbers) repeat: each
        call's keys are made unique on the engine and given back in the answers."""
        with self._lock:
            self._calls += 1
            self._in_flight += 1
            call = self._calls
        on_engine = [replace(r, key=f"{call}:{r.key}") for r in requests]
        loop = asyncio.get_running_loop()
        try:
            out: list[Generation] = await loop.run_in_executor(
                self._pool,
                lambda: self._runner.generate(on_engine, group=group, priority=priority, due=due),
            )
        except asyncio.CancelledError:  # the caller cancelled the call (its batch stopped): free the engine
            self._runner.abandon([r.key for r in on_engine])
            raise
        finally:
            with self._lock:
                self._in_flight -= 1
                self._last_busy = time.time()
        answers = [replace(g, key=r.key) for g, r in zip(out, requests, strict=True)]
        tokens = sum(g.completion_tokens for g in answers)
        with self._lock:
            self._requests += len(answers)
            self._completion_tokens += tokens
        self._metrics.answered(len(answers), tokens)
        return answers

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric of this replica (see
        :mod:`llmbatch.ray_job.engines.engine_scaling`)."""
        return {engine_scaling.AT_RISK_WAITING: float(self._runner.stats().at_risk_queued)}

    def check_health(self) -> None:
        """Serve calls this periodically; raising makes it replace the replica."""
        fatal = self._runner.fatal
        if fatal is not None:
            raise RuntimeError(f"the engine stopped: {fatal!r}")


def deployment_options(entry: EngineModel) -> dict[str, Any]:
    """Serve deployment options of one model (autoscaling, per-replica limits, resources)."""
    scaling, res = entry.scaling, entry.resources
    autoscaling: dict[str, Any] = {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "target_ongoing_requests": scaling.target_ongoing_requests,
        "downscale_delay_s": scaling.idle_s,
        "upscale_delay_s": 0.0,
        # Serve's own rule, and more replicas while requests of batches at risk of their deadline wait
        "policy": {
            "policy_function": engine_scaling.POLICY_PATH,
            "policy_kwargs": {"slots_per_replica": entry.max_active_requests},
        },
    }
    if scaling.initial_replicas is not None:
        autoscaling["initial_replicas"] = scaling.initial_replicas
    actor: dict[str, Any] = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus}
    if res.resources:
        actor["resources"] = dict(res.resources)
    if res.memory:
        actor["memory"] = res.memory
    return {
        "name": DEPLOYMENT_NAME,
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": scaling.max_ongoing_requests,
        "max_queued_requests": scaling.max_queued_requests,
        "ray_actor_options": actor,
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 60.0,
    }


def serve_application(
    model: str,
    entry: EngineModel,
    env_vars: dict[str, str] | None = None,
    tenant_weights: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """One entry of a Serve config's ``applications`` (REST ``PUT /api/serve/applications/`` or a
    RayService's ``serveConfigV2``): handle-only (no HTTP route), options as in the builder;
    ``tenant_weights``: the tenants' shares of its replicas
    (:class:`~llmbatch.ray_job.engines.fair_queue.FairQueue`)."""
    deployment = deployment_options(entry)
    # started without the node's secrets (ray_job.storage.node_secrets), whatever the entry or dispatcher set
    blanks = node_secrets.withheld(node_secrets.engine_withheld(entry.path))
    env = {**entry.env_vars, **(env_vars or {}), **blanks}
    if entry.resources.omp_threads is not None:  # else Ray sets it to the actor's num_cpus
        env["OMP_NUM_THREADS"] = str(entry.resources.omp_threads)
    app: dict[str, Any] = {
        "name": app_name(model),
        "route_prefix": None,
        "import_path": IMPORT_PATH,
        "args": {"model": model, "entry": entry.model_dump(mode="json")},
        "deployments": [deployment],
    }
    if tenant_weights:  # only then: an unchanged config leaves running engines alone
        app["args"]["tenant_weights"] = dict(sorted(tenant_weights.items()))
    if env:
        app["runtime_env"] = {"env_vars": env}
    return app


def build_app(args: dict[str, Any]) -> Any:
    """Serve application builder (``import_path``): ``args = {"model": ..., "entry": {...}}``."""
    from ray import serve

    model = str(args["model"])
    entry = EngineModel.model_validate(args["entry"])
    weights = _WEIGHTS.validate_python(args.get("tenant_weights") or {})
    deployment = cast(Any, serve.deployment)(EngineServer).options(**deployment_options(entry))
    return deployment.bind(model, entry.model_dump(mode="json"), weights)
