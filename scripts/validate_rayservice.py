"""KubeRay RayService checks and the Ray resources of worker groups, for scripts/validate_kuberay.py.

What no CRD schema says and the KubeRay operator / Ray autoscaler would only find out on a cluster:

- the RayService rules of ray-operator's ``ValidateRayServiceMetadata`` / ``ValidateRayServiceSpec``
  (the RayCluster rules of ``spec.rayClusterConfig`` are validate_kuberay's, passed in);
- ``serveConfigV2``: YAML, a Serve multi-application config, no credentials in its runtime_env, its
  HTTP port the head's ``serve`` port (KubeRay health-checks that one), and every deployment's
  ``ray_actor_options`` satisfiable by the head or a worker group that can scale up;
- a group's custom resources (``rayStartParams.resources``) in the quoting KubeRay expects, read the
  two ways they are read: by ``ray start`` through the shell, and by the autoscaler.

Node resources are the autoscaler's own reading of a group spec (Ray's KubeRay autoscaling config),
so what passes here is what the autoscaler will plan with.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shlex
from collections.abc import Callable, Iterator
from typing import Any

import yaml

MAX_RAYSERVICE_NAME = 47  # KubeRay: 53 (longest Service suffix) - 6 (the cluster's "-xxxxx")
UPGRADE_TYPES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}
PROXY_LOCATIONS = {"HeadOnly", "EveryNode", "Disabled"}
DEFAULT_SERVE_PORT = 8000
# environment variable names that carry credentials (same rule as `llmbatch engines render`)
SECRET_ENV_NAME = re.compile(
    r"(^|_)(PASSWORD|PASSWD|SECRET|TOKEN|CREDENTIALS?)(_|$)|ACCESS_KEY|PRIVATE_KEY", re.IGNORECASE
)

ClusterErrors = Callable[[dict[str, Any], str], list[str]]


def rayservice_errors(obj: dict[str, Any], cluster_errors: ClusterErrors) -> list[str]:
    """Everything the operator checks on a RayService, plus what its Serve config needs to run."""
    errors: list[str] = []
    name, spec = obj["metadata"]["name"], obj["spec"]
    if len(name) > MAX_RAYSERVICE_NAME:
        errors.append(f"RayService names are limited to {MAX_RAYSERVICE_NAME} characters")
    cluster = spec["rayClusterConfig"]
    errors += cluster_errors(cluster, "RayService.rayClusterConfig")
    head_service = cluster["headGroupSpec"].get("headService") or {}
    if (head_service.get("metadata") or {}).get("name"):
        errors.append("rayClusterConfig.headGroupSpec.headService.metadata.name must not be set")
    upgrade = spec.get("upgradeStrategy") or {}
    kind = upgrade.get("type")
    if kind is not None and kind not in UPGRADE_TYPES:
        errors.append(f"upgradeStrategy.type {kind!r} is not one of {sorted(UPGRADE_TYPES)}")
    if kind == "NewClusterWithIncrementalUpgrade":
        errors += _incremental_upgrade_errors(cluster, upgrade.get("clusterUpgradeOptions"))
    delay = spec.get("rayClusterDeletionDelaySeconds")
    if delay is not None and delay < 0:
        errors.append("rayClusterDeletionDelaySeconds must not be negative")
    text = spec.get("serveConfigV2")
    if not text:
        errors.append("serveConfigV2 is empty: no Serve application, the RayService never becomes ready")
    else:
        errors += serve_config_errors(text, cluster)
    return errors


def _incremental_upgrade_errors(cluster: dict[str, Any], options: dict[str, Any] | None) -> list[str]:
    if not cluster.get("enableInTreeAutoscaling"):
        return ["NewClusterWithIncrementalUpgrade needs the Ray autoscaler"]
    if not options:
        return ["NewClusterWithIncrementalUpgrade needs upgradeStrategy.clusterUpgradeOptions"]
    errors = []
    for key in ("maxSurgePercent", "stepSizePercent"):
        if not 0 <= options.get(key, 100) <= 100:
            errors.append(f"clusterUpgradeOptions.{key} must be between 0 and 100")
    if options.get("intervalSeconds", 0) <= 0:
        errors.append("clusterUpgradeOptions.intervalSeconds must be positive")
    if not options.get("gatewayClassName"):
        errors.append("clusterUpgradeOptions.gatewayClassName is required")
    return errors


# --- serveConfigV2 ---------------------------------------------------------------------------------


def serve_config_errors(text: str, cluster: dict[str, Any]) -> list[str]:
    """The Serve config a RayService deploys, checked against the cluster it runs on."""
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return [f"serveConfigV2 is not YAML: {exc}"]
    if not isinstance(config, dict):
        return ["serveConfigV2 must be a mapping (a Serve config with `applications`)"]
    apps = config.get("applications")
    if not isinstance(apps, list) or not apps:
        return ["serveConfigV2 has no applications"]
    errors: list[str] = []
    if config.get("proxy_location", "EveryNode") not in PROXY_LOCATIONS:
        errors.append(
            f"serveConfigV2 proxy_location {config['proxy_location']!r} is not one of "
            f"{sorted(PROXY_LOCATIONS)}"
        )
    port = (config.get("http_options") or {}).get("port", DEFAULT_SERVE_PORT)
    serve_port = head_serve_port(cluster)
    if port != serve_port:
        errors.append(
            f"serveConfigV2 http_options.port {port} is not the head's `serve` port {serve_port} "
            "(KubeRay health-checks the proxy there)"
        )
    nodes = node_resources(cluster)
    names: set[str] = set()
    prefixes: set[str] = set()
    for app in apps:
        errors += _app_errors(app, nodes, names, prefixes)
    return errors


def _app_errors(
    app: Any, nodes: dict[str, dict[str, float]], names: set[str], prefixes: set[str]
) -> list[str]:
    if not isinstance(app, dict) or not app.get("name") or not app.get("import_path"):
        return [f"serveConfigV2 application {app!r} needs a name and an import_path"]
    errors: list[str] = []
    name = app["name"]
    if name in names:
        errors.append(f"serveConfigV2 application {name!r} appears twice")
    names.add(name)
    prefix = app.get("route_prefix")
    if prefix is not None:
        if prefix in prefixes:
            errors.append(f"serveConfigV2 route_prefix {prefix!r} is used twice")
        prefixes.add(prefix)
    env = (app.get("runtime_env") or {}).get("env_vars") or {}
    for key, value in env.items():
        if value and SECRET_ENV_NAME.search(key):  # set empty: what a replica is started without
            errors.append(
                f"serveConfigV2 {name}: runtime_env carries {key}, a credential, in the manifest; "
                "give it to the Ray pods from a Secret (secretKeyRef) instead"
            )
    for deployment in app.get("deployments") or []:
        demand = actor_demand(deployment.get("ray_actor_options") or {})
        if not any(fits(demand, have) for have in nodes.values()):
            offered = "; ".join(f"{group} {have}" for group, have in nodes.items())
            errors.append(
                f"serveConfigV2 {name}/{deployment.get('name')} needs {demand}: no head or "
                f"worker group provides it (they have: {offered})"
            )
    return errors


def actor_demand(options: dict[str, Any]) -> dict[str, float]:
    """What one replica asks of a node, in the autoscaler's resource names (Serve's default: 1 CPU)."""
    demand: dict[str, float] = {"CPU": float(options.get("num_cpus", 1))}
    if options.get("num_gpus"):
        demand["GPU"] = float(options["num_gpus"])
    if options.get("memory"):
        demand["memory"] = float(options["memory"])
    demand.update({k: float(v) for k, v in (options.get("resources") or {}).items()})
    return {k: v for k, v in demand.items() if v > 0}


def fits(demand: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(key, 0) >= amount for key, amount in demand.items())


def node_resources(cluster: dict[str, Any]) -> dict[str, dict[str, float]]:
    """group -> what one of its nodes offers, as the autoscaler reads the group spec; the head, and the
    worker groups that may have a node at all (maxReplicas > 0). Groups whose custom resources the
    autoscaler cannot read are left out (group_resource_errors reports them)."""
    groups = [("head", cluster["headGroupSpec"], True)]
    groups += [
        (g["groupName"], g, False)
        for g in cluster.get("workerGroupSpecs") or []
        if g.get("maxReplicas", 0) > 0 and not g.get("suspend")
    ]
    out: dict[str, dict[str, float]] = {}
    with _autoscaler() as autoscaler:
        for name, group, is_head in groups:
            try:
                resources = autoscaler._get_ray_resources_from_group_spec(group, is_head)
            except Exception:  # noqa: S112 - reported by group_resource_errors
                continue
            out[name] = {k: float(v) for k, v in resources.items()}
    return out


@contextlib.contextmanager
def _autoscaler() -> Iterator[Any]:
    """Ray's KubeRay autoscaling config module, its logger quiet (it logs what it then raises)."""
    from ray.autoscaler._private.kuberay import autoscaling_config

    log = logging.getLogger(autoscaling_config.__name__)
    quiet, log.disabled = log.disabled, True
    try:
        yield autoscaling_config
    finally:
        log.disabled = quiet


def head_serve_port(cluster: dict[str, Any]) -> int:
    """The head container's port named `serve` (what KubeRay probes), else Serve's default 8000."""
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    for port in head.get("ports") or []:
        if port.get("name") == "serve":
            return int(port["containerPort"])
    return DEFAULT_SERVE_PORT


# --- custom resources of a group --------------------------------------------------------------------


def group_resource_errors(where: str, group: dict[str, Any]) -> list[str]:
    """``rayStartParams.resources`` must read the same for ``ray start`` (KubeRay passes
    ``--resources=<value>`` through bash) and for the autoscaler (which drops the outer quotes and
    every backslash): KubeRay's form is ``'"{\\"name\\": 1}"'`` in YAML, with integer amounts."""
    value = (group.get("rayStartParams") or {}).get("resources")
    if value is None:
        return []
    expected = 'write it as \'"{\\"name\\": 1}"\' (KubeRay\'s form)'
    try:
        words = shlex.split(f"--resources={value}")
        started = json.loads(words[0].partition("=")[2]) if len(words) == 1 else None
    except ValueError:
        started = None
    if not isinstance(started, dict):
        return [
            f"{where}: rayStartParams.resources {value!r} reaches `ray start` as something other "
            f"than one JSON object; {expected}"
        ]
    with _autoscaler() as autoscaler:
        try:
            planned = autoscaler._get_custom_resources({}, group["rayStartParams"], where)
        except Exception as exc:
            return [
                f"{where}: the autoscaler cannot read rayStartParams.resources {value!r} "
                f"({type(exc).__name__}: {exc}); {expected}, amounts as integers"
            ]
    if planned != started:
        return [
            f"{where}: rayStartParams.resources gives `ray start` {started} but the autoscaler "
            f"{planned}; {expected}"
        ]
    return []
