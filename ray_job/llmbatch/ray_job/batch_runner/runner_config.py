"""The batch runner's place in a deployment: where a batch's keys and output prefix come from
(:class:`RunnerPlace`, its Serve application's ``args``) and the runner's entry in a Serve config
(:func:`serve_application`; the replicas are :mod:`llmbatch.ray_job.batch_runner.runner`'s). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmbatch.ray_job.batch_runner.runner_http import APP_NAME, DEPLOYMENT, ROUTE_PREFIX
from llmbatch.ray_job.storage import job_keys
from llmbatch.schemas.job import JobSpec, output_prefix

IMPORT_PATH = "llmbatch.ray_job.batch_runner.runner:build_app"
DEFAULT_REPLICAS = 2


@dataclass(frozen=True)
class RunnerPlace:
    """What the runner derives a batch's keys and prefix from (its application's ``args``): the
    Redis of the progress hashes and runs (no password: the node's environment has it), the key
    prefix, and the bucket results go to. ``redis_url`` None: no progress, runs in memory only;
    ``results_bucket`` None: any output prefix (a runner deployed before these args)."""

    redis_url: str | None = None
    key_prefix: str = "llmbatch"
    results_bucket: str | None = None

    def spec_for(self, spec: JobSpec) -> JobSpec:
        """``spec`` with the Redis URL and progress key this runner derives (the caller's are dropped)."""
        if self.redis_url is None:
            return spec.model_copy(update={"redis_url": None, "progress_key": None})
        key = job_keys.progress_key(self.key_prefix, spec.tenant, spec.batch_id)
        return spec.model_copy(update={"redis_url": self.redis_url, "progress_key": key})

    def prefix_problem(self, spec: JobSpec) -> str | None:
        """Why ``spec``'s output prefix is not the one its identity gives, or None."""
        if self.results_bucket is None:
            return None
        expected = output_prefix(self.results_bucket, spec.tenant, spec.batch_id, spec.lifecycle)
        if spec.output_prefix == expected:
            return None
        return f"output_prefix: this runner writes a batch's results only under {expected}"


def serve_application(
    *,
    max_runs: int,
    place: RunnerPlace | None = None,
    replicas: int = DEFAULT_REPLICAS,
    env_vars: dict[str, str] | None = None,
    num_cpus: float = 0.2,
) -> dict[str, Any]:
    """The runner's entry in a Serve config (HTTP route :data:`ROUTE_PREFIX`, ``replicas`` replicas;
    one without a Redis for its runs, which then live in its memory). ``place``'s fields go in
    ``args``: none is secret (the Redis URL has no password)."""
    place = place or RunnerPlace()
    if place.redis_url is None:
        replicas = 1
    args: dict[str, Any] = {"max_runs": max_runs, "key_prefix": place.key_prefix}
    if place.redis_url is not None:
        args["redis_url"] = place.redis_url
    if place.results_bucket is not None:
        args["results_bucket"] = place.results_bucket
    app: dict[str, Any] = {
        "name": APP_NAME,
        "route_prefix": ROUTE_PREFIX,
        "import_path": IMPORT_PATH,
        "args": args,
        "deployments": [
            {
                "name": DEPLOYMENT,
                "num_replicas": replicas,
                "max_ongoing_requests": 256,
                "ray_actor_options": {"num_cpus": num_cpus},
            }
        ],
        # the dispatcher polls every run about once a second: no access-log line per poll
        "logging_config": {"enable_access_log": False},
    }
    if env_vars:
        app["runtime_env"] = {"env_vars": dict(env_vars)}
    return app
