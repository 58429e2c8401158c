"""The shared engines of the registry, as the dispatcher and operators see them (pure + one deploy).

:func:`serve_config` turns the registry into the cluster's Serve config (one application per
model, see :mod:`llmbatch.ray_job.engines.serve_engine`); :func:`summarize` turns Serve's status into one row
per model for ``llmbatch engines list``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.ray_job.batch_runner.runner_config import RunnerPlace
from llmbatch.ray_job.batch_runner.runner_config import serve_application as runner_application
from llmbatch.ray_job.batch_runner.runner_http import APP_NAME, DEPLOYMENT
from llmbatch.ray_job.engines.serve_engine import serve_application
from llmbatch.ray_job.storage import node_secrets
from llmbatch.schemas.engines import DEPLOYMENT_NAME, EngineModel, EngineRegistry, Scaling, app_name


def serve_config(
    registry: EngineRegistry,
    env_vars: dict[str, str] | None = None,
    *,
    http_address: str,
    runner: dict[str, Any] | None = None,
    ssl_files: tuple[str, str] | None = None,
    tenant_weights: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The Serve multi-application config: one handle-only application per model, plus the batch
    runner (``runner``, from :func:`llmbatch.ray_job.batch_runner.runner_config.serve_application`) when
    given.

    Serve's HTTP proxy runs on the head node at ``http_address``'s port, runner or not: Serve takes
    its HTTP options from the deploy that started it and never changes them later, so every
    deploy of a cluster must name the same ones. ``ssl_files`` (certificate, key: paths on the head)
    make it speak TLS only, for an https:// ``http_address``."""
    apps = [
        serve_application(model, entry, env_vars, tenant_weights)
        for model, entry in sorted(registry.models.items())
    ]
    url = urlsplit(http_address)
    loopback = url.hostname in ("127.0.0.1", "localhost", "::1")
    https = url.scheme == "https"
    if https != (ssl_files is not None):
        raise ValueError(
            f"Serve's proxy at {http_address} needs a certificate and key exactly when it is https://"
        )
    http: dict[str, Any] = {
        "host": "127.0.0.1" if loopback else "0.0.0.0",  # noqa: S104
        "port": url.port or (443 if https else 80),
    }
    if ssl_files is not None:
        http.update(ssl_certfile=ssl_files[0], ssl_keyfile=ssl_files[1])
    return {
        "proxy_location": "HeadOnly",
        "http_options": http,
        "applications": [*apps, runner] if runner is not None else apps,
    }


def cluster_serve_config(
    settings: DispatcherSettings, registry: EngineRegistry | None = None
) -> dict[str, Any]:
    """What the dispatcher runs on Serve: ``registry`` (default: the settings') and, with the short
    path on, the batch runner."""
    opts = settings.dispatcher
    runner = None
    if opts.shared_engines and opts.short_path_max_lines > 0:
        env = runner_env_vars(settings)
        if opts.runner_s3_sessions:  # each batch brings S3 keys of its own: the node's stay out of reach
            env.update(node_secrets.withheld(node_secrets.S3_KEYS))
        place = RunnerPlace(
            # no password in it (the Serve config is no secret): the nodes' environment has it
            redis_url=settings.job_redis_url(),
            key_prefix=settings.redis.key_prefix,
            results_bucket=settings.s3.results_bucket,
        )
        runner = runner_application(
            max_runs=opts.short_path_max_runs, place=place, replicas=opts.short_path_replicas, env_vars=env
        )
    models = registry if registry is not None else settings.engines
    ray = settings.ray
    files = (
        (ray.serve_ssl_certfile, ray.serve_ssl_keyfile)
        if ray.serve_ssl_certfile is not None and ray.serve_ssl_keyfile is not None
        else None
    )
    return serve_config(
        models,
        engine_env_vars(settings),
        runner=runner,
        http_address=ray.serve_address,
        ssl_files=files,
        tenant_weights=settings.tenants.weights,
    )


def serve_controller(details: dict[str, Any]) -> str | None:
    """The actor id of the cluster's Serve controller (``details``: ``GET /api/serve/applications/``);
    ``None`` when Serve is not running. A new id means Serve started again (its head restarted)."""
    info = details.get("controller_info") or {}
    actor = info.get("actor_id") if isinstance(info, dict) else None
    return str(actor) if actor else None


def config_lost(config: dict[str, Any], details: dict[str, Any], deployed_on: str | None) -> bool:
    """Whether Serve lost ``config``'s applications: it holds none of them and is not the Serve
    instance they were deployed on (``deployed_on``, its controller's actor id): its head restarted
    without them. The same instance without them is an operator's doing (``llmbatch engines stop``,
    until the next deploy from settings), and stays so."""
    wanted = {str(app["name"]) for app in config.get("applications") or []}
    present = set(details.get("applications") or {})
    restarted = deployed_on is None or serve_controller(details) != deployed_on
    return bool(wanted) and not wanted & present and restarted


def runner_env_vars(settings: DispatcherSettings) -> dict[str, str]:
    """The batch runner's environment, as a job's: where S3 is, and ``job.env_vars``. No secret: the
    replicas take the S3 keys and the Redis password from the Ray workers' own environment. The endpoint
    goes in ``LLMBATCH_S3__ENDPOINT`` too, as a job's does: ray_job.storage.s3 reads that first, so one the
    Ray node inherited (a stale shell's, another stack's) would otherwise win. CA bundles of TLS servers
    (``LLMBATCH_S3__CA_FILE``, ``LLMBATCH_REDIS__SSL_CA_CERTS``) go as paths: the nodes hold the same
    files there (a mounted ConfigMap; on the local stack, the same machine)."""
    s3 = settings.s3
    env = {
        "LLMBATCH_S3__ENDPOINT": s3.endpoint,
        "AWS_ENDPOINT_URL_S3": s3.endpoint,
        "AWS_REGION": s3.region,
        # Ray starts its workers at nice 15: beside an engine that keeps every core busy (a batch alone
        # fills it) a runner replica at 15 gets a few percent of a core, and an urgent batch waited
        # seconds for its own runner (measured: 4.0 s of generation instead of 1.2 s). The runner is
        # on every short-path batch's way and needs little CPU: it runs at the engine's priority.
        "RAY_worker_niceness": "0",
    }
    if s3.ca_file is not None:
        env["LLMBATCH_S3__CA_FILE"] = str(s3.ca_file)
    if settings.redis.ssl_ca_certs is not None:
        env["LLMBATCH_REDIS__SSL_CA_CERTS"] = str(settings.redis.ssl_ca_certs)
    env.update(settings.job.env_vars)
    return env


def engine_env_vars(settings: DispatcherSettings) -> dict[str, str]:
    """The replicas' engine environment (vLLM caches, CPU tuning), as the jobs get it; no secrets."""
    job = settings.job
    if not job.engine_cache_dir:
        return {}
    from llmbatch.ray_job.engines.engine_env import engine_env

    return engine_env(
        job.engine_cache_dir,
        cpu=job.engine_cpu,
        omp_threads_bind=job.omp_threads_bind,
        kv_cache_gib=job.kv_cache_gib,
    )


def with_scaling(registry: EngineRegistry, model: str, **changes: Any) -> EngineRegistry:
    """The registry with ``model``'s scaling changed (``min_replicas=...``, ``max_replicas=...``)."""
    entry = registry.get(model)
    scaling = Scaling.model_validate({**entry.scaling.model_dump(), **changes})
    models = dict(registry.models)
    models[model] = EngineModel.model_validate({**entry.model_dump(), "scaling": scaling.model_dump()})
    return EngineRegistry(models=models)


def without(registry: EngineRegistry, model: str) -> EngineRegistry:
    """The registry without ``model`` (its application is removed at the next deploy)."""
    registry.get(model)
    return EngineRegistry(models={m: e for m, e in registry.models.items() if m != model})


@dataclass
class EngineStatus:
    """One model's engines, as Serve reports them."""

    model: str
    app: str
    status: str
    replicas: dict[str, int] = field(default_factory=dict)
    message: str = ""
    min_replicas: int = 0
    max_replicas: int = 0
    # from the engines' metrics (ray_job.engines.engine_stats), if known
    figures: dict[str, Any] | None = None

    @property
    def running(self) -> int:
        return self.replicas.get("RUNNING", 0)

    def figure_cells(self) -> list[str]:
        """queued, on the engine, idle, tokens/s, cold starts ("-" where unknown)."""
        f = self.figures
        if not f:
            return ["-"] * 5
        idle = f.get("idle_s")
        return [
            f"{f.get('queued', 0):.0f}",
            f"{f.get('active', 0):.0f}",
            "-" if idle is None else f"{idle:.0f} s",
            f"{f.get('tokens_per_s', 0):.1f}",
            f"{f.get('cold_starts', 0):.0f}",
        ]


def with_figures(rows: list[EngineStatus], figures: dict[str, dict[str, Any]]) -> list[EngineStatus]:
    """``rows`` with each model's figures (``GET /llmbatch-runner/engines``) attached."""
    for row in rows:
        row.figures = figures.get(row.model)
    return rows


def summarize(registry: EngineRegistry, details: dict[str, Any]) -> list[EngineStatus]:
    """One row per registry model from ``GET /api/serve/applications/`` (missing = NOT_DEPLOYED)."""
    apps = details.get("applications") or {}
    rows: list[EngineStatus] = []
    for model, entry in sorted(registry.models.items()):
        name = app_name(model)
        app = apps.get(name) or {}
        deployment = (app.get("deployments") or {}).get(DEPLOYMENT_NAME) or {}
        replicas: dict[str, int] = {}
        for replica in deployment.get("replicas") or []:
            state = str(replica.get("state", "UNKNOWN"))
            replicas[state] = replicas.get(state, 0) + 1
        message = str(deployment.get("message") or app.get("message") or "")
        rows.append(
            EngineStatus(
                model=model,
                app=name,
                status=str(app.get("status", "NOT_DEPLOYED")),
                replicas=replicas,
                message=message[:500],
                min_replicas=entry.scaling.min_replicas,
                max_replicas=entry.scaling.max_replicas,
            )
        )
    return rows


def runner_pids(details: dict[str, Any]) -> list[int]:
    """PIDs of the batch runner's running replicas (for operators and crash tests)."""
    app = (details.get("applications") or {}).get(APP_NAME) or {}
    replicas = ((app.get("deployments") or {}).get(DEPLOYMENT) or {}).get("replicas") or []
    return [int(r["pid"]) for r in replicas if r.get("state") == "RUNNING" and r.get("pid")]


def replica_pids(details: dict[str, Any], model: str) -> list[int]:
    """PIDs of ``model``'s running replicas (for operators and crash tests)."""
    app = (details.get("applications") or {}).get(app_name(model)) or {}
    deployment = (app.get("deployments") or {}).get(DEPLOYMENT_NAME) or {}
    return [
        int(r["pid"])
        for r in deployment.get("replicas") or []
        if r.get("state") == "RUNNING" and r.get("pid")
    ]
