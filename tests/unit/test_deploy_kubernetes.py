"""deploy/kubernetes: kustomize renders, KubeRay CRD schemas, kubernetes-validate, and the wiring
between the objects (names, keys, ports, labels, settings) that no schema checks.

Rendering uses deploy/tools/deploycheck (kustomize's own Go library, built once from the Go module
proxy and cached); see scripts/validate_deploy.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from typer.testing import CliRunner

from llmbatch.dispatcher.backends.engines import cluster_serve_config
from llmbatch.dispatcher.ops import engines_cli
from llmbatch.ray_job.storage import node_secrets
from tests.support.scripts import load_script

pytestmark = pytest.mark.unit


vd = load_script("validate_deploy")
kuberay = load_script("validate_kuberay")
grafana = load_script("validate_dashboard")

# Secrets gpu-prod expects to exist already (created by the operator, never committed)
EXTERNAL_SECRETS = {"llmbatch-credentials", "llmbatch-ray-auth", "llmbatch-api-keys"}
# and the ones a component adds (created by hand as its kustomization.yaml shows)
COMPONENT_SECRETS = {
    "kafka-sasl": {"llmbatch-kafka-users", "llmbatch-kafka-ca"},
    "ray-https": {"llmbatch-ray-tls"},
}
RAY_PORTS = {"gcs-server": 6379, "dashboard": 8265}


@pytest.fixture(scope="module")
def renders() -> dict[str, list[dict[str, Any]]]:
    out = {name: vd.render_overlay(name) for name in vd.OVERLAYS}
    for component in vd.COMPONENTS:
        out[f"gpu-prod+{component}"] = vd.render_with_components("gpu-prod", [component])
    return out


@pytest.fixture(scope="module")
def rayjob_templates() -> dict[str, dict[str, Any]]:
    folder = vd.KUSTOMIZE / "rayjob"
    found = {p.name: obj for p in sorted(folder.glob("*.yaml")) for obj in vd.load_yaml_objects(p)}
    assert set(found) == {"rayjob-per-batch.yaml", "rayjob-reuse-cluster.yaml"}
    return found


def _patch_files() -> set[Path]:
    """Files kustomizations use as patches (partial objects: not validated on their own)."""
    out = set()
    for kfile in vd.KUSTOMIZE.rglob("kustomization.yaml"):
        for patch in yaml.safe_load(kfile.read_text()).get("patches") or []:
            if "path" in patch:
                out.add((kfile.parent / patch["path"]).resolve())
    return out


def _config(objects: list[dict[str, Any]]) -> dict[str, str]:
    maps = [
        o for o in vd.by_kind(objects, "ConfigMap") if o["metadata"]["name"].startswith("llmbatch-config")
    ]
    assert len(maps) == 1, [m["metadata"]["name"] for m in maps]
    return dict(maps[0]["data"])


def _settings(objects: list[dict[str, Any]]) -> Any:
    env = _config(objects)
    env.update(
        {
            "LLMBATCH_S3__ACCESS_KEY": "k",
            "LLMBATCH_S3__SECRET_KEY": "s",
            "LLMBATCH_REDIS__PASSWORD": "p",
            "LLMBATCH_RAY__AUTH_TOKEN": "t",
        }
    )
    return vd.build_settings(env)


def _raycluster(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The overlay's Ray cluster: its RayCluster, or the cluster of its RayService (as a RayCluster)."""
    if vd.by_kind(objects, "RayService"):
        service = vd.one(objects, "RayService")
        assert vd.by_kind(objects, "RayCluster") == []
        return {
            "apiVersion": "ray.io/v1",
            "kind": "RayCluster",
            "metadata": service["metadata"],
            "spec": service["spec"]["rayClusterConfig"],
        }
    cluster: dict[str, Any] = vd.one(objects, "RayCluster")
    return cluster


# --- rendering and schemas ------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", vd.OVERLAYS)
def test_overlay_renders_the_whole_system(renders: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    kinds = {o["kind"] for o in renders[overlay]}
    assert len(kinds & {"RayCluster", "RayService"}) == 1
    assert {
        "Namespace",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Job",
        "ConfigMap",
        "ServiceAccount",
    } <= kinds
    namespaces = {o["metadata"].get("namespace") for o in renders[overlay] if o["kind"] != "Namespace"}
    assert namespaces == {vd.one(renders[overlay], "Namespace")["metadata"]["name"]}, namespaces
    names = [(o["kind"], o["metadata"]["name"]) for o in renders[overlay]]
    assert len(names) == len(set(names)), "duplicate objects"


@pytest.mark.parametrize("component", vd.COMPONENTS)
def test_what_a_component_adds_lands_in_the_overlays_namespace(
    renders: dict[str, list[dict[str, Any]]], component: str
) -> None:
    """Rendered as each component's header says (the overlay under resources:, the component under
    components:, no namespace of its own), every object is in the overlay's namespace; an object
    without one lands in whatever namespace kubectl's context names, apart from what it serves."""
    objects = renders[f"gpu-prod+{component}"]
    namespace = vd.one(objects, "Namespace")["metadata"]["name"]
    elsewhere = [
        (o["kind"], o["metadata"]["name"])
        for o in objects
        if o["kind"] != "Namespace" and o["metadata"].get("namespace") != namespace
    ]
    assert not elsewhere, f"not in namespace {namespace}: {elsewhere}"


def test_kuberay_objects_validate_against_the_real_crds(
    renders: dict[str, list[dict[str, Any]]], rayjob_templates: dict[str, dict[str, Any]]
) -> None:
    checked = 0
    objects = [o for objs in renders.values() for o in objs]
    objects += list(rayjob_templates.values())
    objects += vd.load_yaml_objects(vd.KUSTOMIZE / "base" / "ray" / "raycluster.yaml")
    for obj in objects:
        if obj["apiVersion"].startswith("ray.io/"):
            assert obj["apiVersion"] == "ray.io/v1"
            assert kuberay.validate_kuberay(obj) == [], obj["metadata"]["name"]
            assert kuberay.kuberay_semantic_errors(obj) == [], obj["metadata"]["name"]
            checked += 1
    assert checked == len(renders) + 2 + 1


def test_strict_crd_validation_catches_mistakes(renders: dict[str, list[dict[str, Any]]]) -> None:
    cluster = _raycluster(renders["gpu-prod"])
    typo = copy.deepcopy(cluster)
    typo["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert any("maxReplica" in e for e in kuberay.validate_kuberay(typo))
    wrong_type = copy.deepcopy(cluster)
    wrong_type["spec"]["workerGroupSpecs"][0]["minReplicas"] = "zero"
    assert kuberay.validate_kuberay(wrong_type)
    bad_enum = copy.deepcopy(cluster)
    bad_enum["spec"]["autoscalerOptions"]["upscalingMode"] = "Fast"
    assert kuberay.validate_kuberay(bad_enum)
    old_ray = copy.deepcopy(cluster)
    old_ray["spec"]["rayVersion"] = "2.40.0"
    assert any("token auth" in e for e in kuberay.kuberay_semantic_errors(old_ray))


def test_rayjob_semantic_rules_catch_mistakes(rayjob_templates: dict[str, dict[str, Any]]) -> None:
    reuse = copy.deepcopy(rayjob_templates["rayjob-reuse-cluster.yaml"])
    reuse["spec"]["ttlSecondsAfterFinished"] = 60
    assert any("ttlSecondsAfterFinished" in e for e in kuberay.kuberay_semantic_errors(reuse))
    neither = copy.deepcopy(reuse)
    del neither["spec"]["clusterSelector"]
    assert any("one of rayClusterSpec" in e for e in kuberay.kuberay_semantic_errors(neither))


def test_native_objects_validate_with_kubernetes_validate(renders: dict[str, list[dict[str, Any]]]) -> None:
    patches = _patch_files()
    objects = [o for objs in renders.values() for o in objs]
    objects += [o for path, objs in vd.raw_manifests().items() if path.resolve() not in patches for o in objs]
    native = [o for o in objects if vd.is_native(o)]
    assert len(native) > 40
    errors = [e for o in native for e in vd.validate_native(o)]
    assert errors == []
    others = {o["kind"] for o in objects if not vd.is_native(o)}
    assert others <= {"RayCluster", "RayJob", "RayService", "ServiceMonitor"}, others


def test_kubernetes_validate_is_strict() -> None:
    deployment = vd.load_yaml_objects(vd.KUSTOMIZE / "base" / "dispatcher" / "deployment.yaml")[0]
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/readyz"
    assert vd.validate_native(bad)


# --- wiring -----------------------------------------------------------------------------------------


def _references(objects: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    """(kind, name) -> keys referenced (empty set = the whole object)."""
    refs: dict[tuple[str, str], set[str]] = {}
    for obj in objects:
        for _, pod in vd.pod_specs(obj):
            if pod.get("serviceAccountName"):
                refs.setdefault(("ServiceAccount", pod["serviceAccountName"]), set())
            for volume in pod.get("volumes") or []:
                if "persistentVolumeClaim" in volume:
                    refs.setdefault(
                        ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]), set()
                    )
                if "secret" in volume:
                    refs.setdefault(("Secret", volume["secret"]["secretName"]), set())
                if "configMap" in volume:
                    refs.setdefault(("ConfigMap", volume["configMap"]["name"]), set())
            for container in vd.containers(pod):
                for source in container.get("envFrom") or []:
                    if "configMapRef" in source:
                        refs.setdefault(("ConfigMap", source["configMapRef"]["name"]), set())
                    if "secretRef" in source:
                        refs.setdefault(("Secret", source["secretRef"]["name"]), set())
                for env in container.get("env") or []:
                    value_from = env.get("valueFrom") or {}
                    for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                        if key in value_from and not value_from[key].get("optional"):  # absent is fine
                            ref = value_from[key]
                            refs.setdefault((kind, ref["name"]), set()).add(ref["key"])
        cluster = _cluster_spec(obj)
        if cluster is not None:
            for env in (cluster.get("autoscalerOptions") or {}).get("env") or []:
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    refs.setdefault(("Secret", ref["name"]), set()).add(ref["key"])
            auth_secret = (cluster.get("authOptions") or {}).get("secretName")
            if auth_secret:  # KubeRay reads the token from its key auth_token
                refs.setdefault(("Secret", auth_secret), set()).add("auth_token")
    return refs


def _cluster_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] == "RayCluster":
        return dict(obj["spec"])
    if obj["kind"] == "RayService":
        return dict(obj["spec"]["rayClusterConfig"])
    return None


@pytest.mark.parametrize("overlay", [*vd.OVERLAYS, *(f"gpu-prod+{c}" for c in vd.COMPONENTS)])
def test_every_reference_resolves(renders: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = renders[overlay]
    present = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    missing = []
    for (kind, name), keys in _references(objects).items():
        if (kind, name) not in present:
            missing.append((kind, name))
            continue
        data = {
            **(present[(kind, name)].get("data") or {}),
            **(present[(kind, name)].get("stringData") or {}),
        }
        assert keys <= set(data), f"{kind}/{name} lacks keys {keys - set(data)}"
    expected_missing = {("Secret", s) for s in EXTERNAL_SECRETS} if overlay.startswith("gpu-prod") else set()
    expected_missing |= {("Secret", s) for s in COMPONENT_SECRETS.get(overlay.partition("+")[2], ())}
    assert set(missing) == expected_missing


def test_external_secrets_are_documented_with_every_key(renders: dict[str, list[dict[str, Any]]]) -> None:
    """gpu-prod's Secrets are created by hand: the guide's commands must create every key used."""
    refs = _references(renders["gpu-prod"])
    texts = {
        "deploy/README.md": (vd.DEPLOY / "README.md").read_text(),
        "overlays/gpu-prod/kustomization.yaml": (
            vd.KUSTOMIZE / "overlays/gpu-prod/kustomization.yaml"
        ).read_text(),
    }
    # shell line continuations (also inside YAML comments)
    texts = {k: re.sub(r"\\\n[#\s]*", " ", v) for k, v in texts.items()}
    for where, text in texts.items():
        for name in EXTERNAL_SECRETS:
            commands = [c for c in re.findall(r"create secret generic (\S+)([^\n]*)", text) if c[0] == name]
            assert commands, f"{where} shows no `kubectl create secret generic {name}`"
            for key in refs[("Secret", name)]:
                assert any(f"--from-literal={key}=" in c[1] for c in commands), f"{where}: {name} lacks {key}"


def test_every_llmbatch_variable_is_a_setting(renders: dict[str, list[dict[str, Any]]]) -> None:
    from llmbatch.api.settings import ApiSettings

    names = vd.settings_env_names() | vd.settings_env_names(ApiSettings)  # the dispatcher's and the API's
    used: set[str] = set()
    for objects in renders.values():
        used |= set(_config(objects))
        for obj in objects:
            for _, pod in vd.pod_specs(obj):
                for container in vd.containers(pod):
                    used |= {e["name"] for e in container.get("env") or []}
    for objs in vd.raw_manifests().values():
        for obj in objs:
            for _, pod in vd.pod_specs(obj):
                for container in vd.containers(pod):
                    used |= {e["name"] for e in container.get("env") or []}
    for env_file in vd.KUSTOMIZE.rglob("*.env"):
        used |= set(vd.parse_env_file(env_file))
    llmbatch = {n for n in used if n.startswith("LLMBATCH_")}
    assert len(llmbatch) > 20
    assert llmbatch - names == set(), "not settings names (typo? renamed setting?)"


def test_settings_name_check_catches_a_typo() -> None:
    names = vd.settings_env_names()
    assert "LLMBATCH_KAFKA__BOOTSTRAP_SERVERS" in names
    assert "LLMBATCH_ENGINES__MODELS" in names
    assert "LLMBATCH_JOB__MODEL_PATH" not in names  # replaced by the registry
    assert "LLMBATCH_JOB__ENGINE__NUM_GPUS_PER_REPLICA" not in names
    assert "LLMBATCH_KAFKA__TOPICS__PARTITIONS" in names
    assert "LLMBATCH_KAFKA__BOOTSTRAP_SERVER" not in names
    assert "LLMBATCH_DISPATCHER__METRICS_PORTS" not in names


@pytest.mark.parametrize("overlay", vd.OVERLAYS)
def test_config_builds_valid_settings(renders: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = renders[overlay]
    settings = _settings(objects)
    cluster = _raycluster(objects)
    # the dispatcher reaches the RayCluster's head service (KubeRay: <name>-head-svc) on the dashboard port
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    dashboard = {p["name"]: p["containerPort"] for p in head["ports"]}["dashboard"]
    assert settings.ray.address == f"http://{cluster['metadata']['name']}-head-svc:{dashboard}"
    # S3 keys never go through the Jobs API, and no Ray pod holds any: every job attempt and runner
    # batch gets a session of its own, and no model is read from S3 by a Ray process
    assert settings.job.pass_s3_credentials is False
    assert settings.job.s3_sessions is True
    assert settings.dispatcher.runner_s3_sessions is True
    assert not any(m.path.startswith("s3://") for m in settings.engines.models.values())
    for where, pod in vd.pod_specs(cluster):
        env = {e["name"] for e in pod["containers"][0].get("env") or []}
        assert {
            "LLMBATCH_S3__ENDPOINT",
            "RAY_AUTH_TOKEN",
            "LLMBATCH_REDIS__PASSWORD",  # the jobs' and the batch runner's (a Serve config carries none)
        } <= env, where
    # (that no Ray pod holds S3 keys is checked for every rendering below)


S3_KEY_VARIABLES = {*node_secrets.S3_KEYS, "LLMBATCH_S3__ACCESS_KEY", "LLMBATCH_S3__SECRET_KEY"}


def _s3_key_holders(objects: list[dict[str, Any]]) -> list[str]:
    """Every container of a Ray pod with an S3 key in its env, except model copies from S3 (their own
    init containers, which end before Ray starts)."""
    found = []
    for where, pod in vd.pod_specs(_raycluster(objects)):
        for container in vd.containers(pod):
            keys = {e["name"] for e in container.get("env") or []} & S3_KEY_VARIABLES
            copies_model = "--from-s3" in (container.get("command") or [])
            if keys and not (copies_model and container in (pod.get("initContainers") or [])):
                found.append(f"{where} {container['name']}: {sorted(keys)}")
    return found


def test_every_rendering_keeps_s3_keys_off_the_ray_pods(renders: dict[str, list[dict[str, Any]]]) -> None:
    for name, objects in renders.items():
        assert _s3_key_holders(objects) == [], name
    # and the check sees keys where they are
    objects = copy.deepcopy(renders["gpu-prod"])
    cluster = _raycluster(objects)
    env = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    env.append({"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "x", "key": "y"}}})
    assert _s3_key_holders(objects) == ["RayCluster/llmbatch-ray/gpu ray-worker: ['AWS_SECRET_ACCESS_KEY']"]


def test_dispatcher_deployment(renders: dict[str, list[dict[str, Any]]]) -> None:
    for overlay in vd.OVERLAYS:
        objects = renders[overlay]
        settings = _settings(objects)
        deployment = vd.one(objects, "Deployment", "llmbatch-dispatcher")
        spec = deployment["spec"]
        assert spec["replicas"] == 2
        assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == settings.dispatcher.metrics_port
        assert settings.dispatcher.metrics_host == "0.0.0.0"
        probes = {k: container[k]["httpGet"] for k in ("livenessProbe", "readinessProbe", "startupProbe")}
        assert probes["livenessProbe"]["path"] == "/livez"
        assert probes["startupProbe"]["path"] == "/livez"
        assert probes["readinessProbe"]["path"] == "/readyz"
        assert {p["port"] for p in probes.values()} == {"metrics"}
        assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
        # SIGTERM handling must finish inside the grace period
        assert pod["terminationGracePeriodSeconds"] > settings.dispatcher.shutdown_timeout_s + 5
        instance = [e for e in container["env"] if e["name"] == "LLMBATCH_DISPATCHER__INSTANCE_ID"]
        assert instance and instance[0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        labels = vd.pod_template_labels(deployment)
        assert vd.selector_matches(spec["selector"], labels)
        pdb = vd.one(objects, "PodDisruptionBudget", "llmbatch-dispatcher")
        assert vd.selector_matches(pdb["spec"]["selector"], labels)
        assert 1 <= pdb["spec"]["minAvailable"] < spec["replicas"]
        service = vd.one(objects, "Service", "llmbatch-dispatcher-metrics")
        assert vd.selector_matches({"matchLabels": service["spec"]["selector"]}, labels)
        assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}["metrics"] == "metrics"


@pytest.mark.parametrize("overlay", vd.OVERLAYS)
def test_dispatchers_refuse_to_start_without_the_tenant_and_replay_keys(
    renders: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """Every overlay, cpu-dev included, runs only requests signed by the tenant they name: a dispatcher
    without the tenant and replay keys exits at start instead of trusting tenant claims."""
    objects = renders[overlay]
    deployment = vd.one(objects, "Deployment", "llmbatch-dispatcher")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    from_secrets = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert from_secrets["LLMBATCH_TENANTS__KEYS"].startswith("llmbatch-tenants")  # cpu-dev: a generated name
    assert from_secrets["LLMBATCH_REPLAY__KEY"].startswith("llmbatch-credentials")
    settings = _settings(objects)  # the ConfigMap and the credentials, no tenant or replay key
    assert settings.dispatcher.require_signed_events is True
    problem = settings.serving_problem()
    assert problem is not None and "LLMBATCH_TENANTS__KEYS and LLMBATCH_REPLAY__KEY" in problem
    keys = {"LLMBATCH_TENANTS__KEYS": json.dumps({"acme": "t" * 32}), "LLMBATCH_REPLAY__KEY": "r" * 32}
    assert vd.build_settings({**_config(objects), **keys}).serving_problem() is None


def test_cpu_dev_generates_the_keys_its_dispatchers_and_api_need(
    renders: dict[str, list[dict[str, Any]]],
) -> None:
    """cpu-dev's own (well-known, dev-only) Secrets make its dispatchers serve: the default tenant's
    signing key, which the HTTP API signs its requests with, and the replay key."""
    import base64

    objects = renders["cpu-dev"]

    def secret(prefix: str, key: str) -> str:
        [found] = [o for o in vd.by_kind(objects, "Secret") if o["metadata"]["name"].startswith(prefix)]
        data = found.get("data") or {}
        return base64.b64decode(data[key]).decode() if key in data else str(found["stringData"][key])

    tenants = secret("llmbatch-tenants", "keys")
    assert set(json.loads(tenants)) == {"default"}
    replay = secret("llmbatch-credentials", "replay-key")
    keys = {"LLMBATCH_TENANTS__KEYS": tenants, "LLMBATCH_REPLAY__KEY": replay}
    assert vd.build_settings({**_config(objects), **keys}).serving_problem() is None
    api = vd.one(objects, "Deployment", "llmbatch-api")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in api["env"]}
    assert env["LLMBATCH_TENANTS__KEYS"]["valueFrom"]["secretKeyRef"]["name"].startswith("llmbatch-tenants")


def test_api_deployment(renders: dict[str, list[dict[str, Any]]]) -> None:
    """The HTTP API: the dispatcher image's `llmbatch api` on all interfaces, probed on /livez, with the
    dispatcher's addresses (llmbatch-config) and its own keys; a Service and a PDB select its pods."""
    from llmbatch.api.settings import ApiSettings

    for overlay in vd.OVERLAYS:
        objects = renders[overlay]
        deployment = vd.one(objects, "Deployment", "llmbatch-api")
        dispatcher = vd.one(objects, "Deployment", "llmbatch-dispatcher")
        spec = deployment["spec"]
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        (image,) = {c["image"] for c in dispatcher["spec"]["template"]["spec"]["containers"]}
        assert container["image"] == image and container["args"][0] == "api"
        port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
        assert container["args"][container["args"].index("--port") + 1] == str(port)
        assert container["args"][container["args"].index("--host") + 1] == "0.0.0.0"
        probes = ("livenessProbe", "readinessProbe", "startupProbe")
        assert {container[k]["httpGet"]["path"] for k in probes} == {"/livez"}
        env = {e["name"]: e for e in container["env"]}
        # (cpu-dev generates the Secret: its name gets kustomize's content hash)
        assert env["LLMBATCH_API__KEYS"]["valueFrom"]["secretKeyRef"]["name"].startswith("llmbatch-api-keys")
        (config_map,) = [
            o["metadata"]["name"]
            for o in vd.by_kind(objects, "ConfigMap")
            if o["metadata"]["name"].startswith("llmbatch-config")
        ]
        assert {"configMapRef": {"name": config_map}} in container["envFrom"]
        labels = vd.pod_template_labels(deployment)
        service = vd.one(objects, "Service", "llmbatch-api")
        assert vd.selector_matches({"matchLabels": service["spec"]["selector"]}, labels)
        assert not vd.selector_matches(
            {"matchLabels": service["spec"]["selector"]}, vd.pod_template_labels(dispatcher)
        )
        pdb = vd.one(objects, "PodDisruptionBudget", "llmbatch-api")
        assert vd.selector_matches(pdb["spec"]["selector"], labels)
        # the config it reads builds valid API settings: the dispatcher's addresses and topics
        keys = '{"%s": "default"}' % ("a" * 64)
        with pytest.MonkeyPatch.context() as env_vars:
            for name, value in {**_config(objects), "LLMBATCH_API__KEYS": keys}.items():
                env_vars.setenv(name, value)
            settings = ApiSettings(_env_file=None)
        dispatcher_settings = _settings(objects)
        assert settings.kafka == dispatcher_settings.kafka
        assert settings.s3.endpoint == dispatcher_settings.s3.endpoint


def test_servicemonitor_scrapes_the_dispatcher(renders: dict[str, list[dict[str, Any]]]) -> None:
    objects = renders["gpu-prod"]
    monitor = vd.one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    services = [
        s
        for s in vd.by_kind(objects, "Service")
        if vd.selector_matches(monitor["spec"]["selector"], s["metadata"].get("labels") or {})
    ]
    assert [s["metadata"]["name"] for s in services] == ["llmbatch-dispatcher-metrics"]
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
    # dev clusters have no Prometheus operator: no ServiceMonitor there
    assert vd.by_kind(renders["cpu-dev"], "ServiceMonitor") == []


def test_grafana_dashboard_configmap(renders: dict[str, list[dict[str, Any]]]) -> None:
    for overlay in vd.OVERLAYS:
        dashboards = [
            c
            for c in vd.by_kind(renders[overlay], "ConfigMap")
            if (c["metadata"].get("labels") or {}).get("grafana_dashboard") == "1"
        ]
        assert len(dashboards) == 1
        assert dashboards[0]["data"]["llmbatch-dashboard.json"] == grafana.DASHBOARD.read_text()


# --- Ray ---------------------------------------------------------------------------------------------


def test_gpu_prod_raycluster(renders: dict[str, list[dict[str, Any]]]) -> None:
    objects = renders["gpu-prod"]
    settings = _settings(objects)
    cluster = _raycluster(objects)
    spec = cluster["spec"]
    assert spec["rayVersion"] == "2.60.0"
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    group, cpu = spec["workerGroupSpecs"]
    assert group["minReplicas"] == 0
    # the shared engines' always-on batch runner and the jobs' CPU stages go to a CPU group, so
    # nothing keeps a GPU worker up: the GPU group scales back to zero
    assert settings.dispatcher.shared_engines is True
    assert cpu["groupName"] == "cpu" and cpu["minReplicas"] >= 1 and cpu["rayStartParams"] == {}
    cpu_pod = cpu["template"]["spec"]
    assert "tolerations" not in cpu_pod and "nodeSelector" not in cpu_pod
    for container in vd.containers(cpu_pod):
        for part in ("requests", "limits"):
            assert "nvidia.com/gpu" not in (container.get("resources") or {}).get(part, {})
    assert ENGINE_RESOURCE not in _node(spec, "cpu")
    _assert_model_reachable(settings, cpu_pod)  # the runner tokenizes
    engine = _served(settings, "Qwen/Qwen2.5-0.5B-Instruct").engine
    gpus_per_job = engine.replicas * engine.num_gpus_per_replica
    assert gpus_per_job >= 1
    # enough GPU workers for every batch the dispatcher lets run at once
    assert group["maxReplicas"] >= settings.dispatcher.launch_limit * gpus_per_job
    pod = group["template"]["spec"]
    worker = pod["containers"][0]
    for part in ("requests", "limits"):
        assert worker["resources"][part]["nvidia.com/gpu"] == "1"
        assert worker["resources"][part]["cpu"] and worker["resources"][part]["memory"]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert settings.job.engine_cpu is False
    _assert_model_reachable(settings, pod)
    assert worker["image"].endswith("-gpu")
    # engine replicas land on these workers only, one per worker
    entry = _served(settings, "Qwen/Qwen2.5-0.5B-Instruct")
    assert entry.resources.resources == {ENGINE_RESOURCE: 1}
    assert _node(spec, "gpu")[ENGINE_RESOURCE] == 1
    assert ENGINE_RESOURCE not in _node(spec, "head")


def test_cpu_dev_raycluster(renders: dict[str, list[dict[str, Any]]]) -> None:
    objects = renders["cpu-dev"]
    settings = _settings(objects)
    (group,) = _raycluster(objects)["spec"]["workerGroupSpecs"]
    pod = group["template"]["spec"]
    for container in vd.containers(pod):
        for part in ("requests", "limits"):
            assert "nvidia.com/gpu" not in (container.get("resources") or {}).get(part, {})
        assert container["image"].endswith("-cpu")
    assert settings.job.engine_cpu is True
    entry = _served(settings, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert entry.engine.num_gpus_per_replica == 0 and entry.resources.num_gpus == 0
    assert entry.engine.enforce_eager is True
    assert entry.path == "/models/SmolLM2-135M-Instruct"
    _assert_model_reachable(settings, pod)
    # the same placement as gpu-prod: one engine replica per CPU worker
    assert entry.resources.resources == {ENGINE_RESOURCE: 1}
    assert _node(_raycluster(objects)["spec"], "cpu")[ENGINE_RESOURCE] == 1


ENGINE_RESOURCE = "llmbatch_engine"


def _node(cluster_spec: dict[str, Any], group: str) -> dict[str, float]:
    """What one node of ``group`` offers, as the Ray autoscaler reads the spec."""
    return dict(kuberay.rayservice_checks().node_resources(cluster_spec)[group])


@pytest.mark.parametrize("overlay", vd.OVERLAYS)
def test_the_registry_fits_the_cluster(renders: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """What the dispatcher (or the RayService) deploys on Serve can be placed: every deployment fits
    the head or a worker group; engines only on groups with the engine resource, and what needs no
    GPU on a group without GPUs when there is one (so it never keeps a GPU worker up)."""
    objects = renders[overlay]
    settings = _settings(objects)
    spec = _raycluster(objects)["spec"]
    config = engines_cli.manifest_serve_config(settings)
    assert rs_checks().serve_config_errors(engines_cli.serve_config_yaml(config), spec) == []
    nodes = rs_checks().node_resources(spec)
    gpu_free = [name for name, have in nodes.items() if not have.get("GPU") and have.get("CPU")]
    for app in config["applications"]:
        for deployment in app["deployments"]:
            demand = rs_checks().actor_demand(deployment["ray_actor_options"])
            fitting = {name for name, have in nodes.items() if rs_checks().fits(demand, have)}
            if ENGINE_RESOURCE in demand:
                assert fitting == {
                    g["groupName"]
                    for g in spec["workerGroupSpecs"]
                    if ENGINE_RESOURCE in nodes.get(g["groupName"], {})
                }, app["name"]
            elif "GPU" not in demand and gpu_free:
                assert fitting & set(gpu_free), app["name"]

    def engine_units(deployment: dict[str, Any]) -> float:
        return float(rs_checks().actor_demand(deployment["ray_actor_options"]).get(ENGINE_RESOURCE, 0.0))

    # at their most, the engines fit too (the autoscaler never has to refuse a replica Serve wants)
    need = sum(
        deployment["autoscaling_config"]["max_replicas"] * engine_units(deployment)
        for app in config["applications"]
        for deployment in app["deployments"]
        if "autoscaling_config" in deployment
    )
    have = sum(
        g["maxReplicas"] * nodes.get(g["groupName"], {}).get(ENGINE_RESOURCE, 0)
        for g in spec["workerGroupSpecs"]
    )
    assert 0 < need <= have


def rs_checks() -> Any:
    return kuberay.rayservice_checks()


# --- the engines as a RayService (overlays/gpu-prod-rayservice) --------------------------------------

RAYSERVICE = "gpu-prod-rayservice"
RAYSERVICE_ENV_FILES = [
    vd.KUSTOMIZE / "base" / "dispatcher" / "settings.env",
    vd.KUSTOMIZE / "overlays" / "gpu-prod" / "settings.env",
    vd.KUSTOMIZE / "overlays" / RAYSERVICE / "settings.env",
]


def test_rayservice_serve_config_is_the_generators(renders: dict[str, list[dict[str, Any]]]) -> None:
    """serveConfigV2 is exactly what `llmbatch engines render` makes of the overlay's settings, and the
    checked-in patch is its output for the overlay's env files (regenerate it: deploy/README.md)."""
    objects = renders[RAYSERVICE]
    text = vd.one(objects, "RayService")["spec"]["serveConfigV2"]
    settings = _settings(objects)  # as the dispatcher pods have them, secrets included
    assert text == engines_cli.render_text(settings, engines_cli.RenderFormat.serve_config)
    public = vd.build_settings(_config(objects))  # the ConfigMap alone
    assert yaml.safe_load(text) == cluster_serve_config(public)
    assert engines_cli.settings_from_env_files(RAYSERVICE_ENV_FILES).model_dump() == public.model_dump()
    args = ["render", "--format", "rayservice"]
    for path in RAYSERVICE_ENV_FILES:
        args += ["--env-file", str(path)]
    result = CliRunner().invoke(engines_cli.app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == (vd.KUSTOMIZE / "overlays" / RAYSERVICE / "serve-config.yaml").read_text(), (
        "serve-config.yaml is stale: regenerate it with `llmbatch engines render` (deploy/README.md)"
    )


def test_rayservice_owns_the_serve_config_and_carries_no_secret(
    renders: dict[str, list[dict[str, Any]]],
) -> None:
    objects = renders[RAYSERVICE]
    settings = _settings(objects)
    assert settings.dispatcher.shared_engines is True
    assert settings.dispatcher.deploy_engines is False, "KubeRay deploys it; the dispatcher must not"
    assert settings.dispatcher.short_path_max_lines > 0  # the batch runner is part of it
    assert settings.job.pass_s3_credentials is False
    for overlay in vd.OVERLAYS:
        if overlay != RAYSERVICE:
            assert _settings(renders[overlay]).dispatcher.deploy_engines is True
    # with every secret of a dispatcher pod set, none reaches the manifest
    secrets = {
        "LLMBATCH_S3__ACCESS_KEY": "dummy-access-key-4f1e",
        "LLMBATCH_S3__SECRET_KEY": "dummy-secret-key-9a2c",
        "LLMBATCH_REDIS__PASSWORD": "dummy-redis-password-77",
        "LLMBATCH_RAY__AUTH_TOKEN": "dummy-ray-token-0d3b",
    }
    text = engines_cli.render_text(
        vd.build_settings({**_config(objects), **secrets}), engines_cli.RenderFormat.rayservice
    )
    assert not [name for name, value in secrets.items() if value in text]
    config = yaml.safe_load(yaml.safe_load(text)["spec"]["serveConfigV2"])
    envs = {app["name"]: (app.get("runtime_env") or {}).get("env_vars", {}) for app in config["applications"]}
    secret_name = rs_checks().SECRET_ENV_NAME
    named = {(app, k): v for app, env in envs.items() for k, v in env.items() if secret_name.search(k)}
    assert named and not [v for v in named.values() if v]  # credentials' names only to blank them
    # the engines are started without the pod's keys and password, the runner without its S3 keys (its
    # batches bring their own); it takes the Redis password from its pod (test_config_builds_valid_settings)
    assert {k for app, k in named if app != "llmbatch-runner"} == set(node_secrets.ALL)
    assert {k for app, k in named if app == "llmbatch-runner"} == set(node_secrets.S3_KEYS)


def _normalized(value: Any) -> Any:
    """``value`` with the hash suffix of generated ConfigMap names removed (overlays differ there)."""
    return json.loads(re.sub(r"llmbatch-config-[a-z0-9]+", "llmbatch-config", json.dumps(value)))


def test_rayservice_cluster_is_gpu_prods(renders: dict[str, list[dict[str, Any]]]) -> None:
    """The RayService runs gpu-prod's cluster: the same head and GPU group (placement, autoscaling from
    zero), plus what a RayService needs (operator token auth, worker readiness without a proxy) and a
    CPU group for the always-on batch runner."""
    service = vd.one(renders[RAYSERVICE], "RayService")
    spec = copy.deepcopy(service["spec"]["rayClusterConfig"])
    prod = _normalized(vd.one(renders["gpu-prod"], "RayCluster")["spec"])
    assert spec.pop("authOptions") == {"mode": "token", "secretName": "llmbatch-ray-auth"}
    gpu, cpu = spec.pop("workerGroupSpecs")
    prod_gpu, prod_cpu = prod.pop("workerGroupSpecs")
    assert _normalized(spec) == prod
    for group, in_prod in ((gpu, prod_gpu), (cpu, prod_cpu)):
        probe = group["template"]["spec"]["containers"][0].pop("readinessProbe")
        assert "52365/api/local_raylet_healthz" in probe["exec"]["command"][-1]
        assert ":8000" not in probe["exec"]["command"][-1]
        assert _normalized(group) == in_prod
    assert gpu["minReplicas"] == 0 and spec["enableInTreeAutoscaling"] is True
    assert service["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    assert cpu["groupName"] == "cpu" and cpu["minReplicas"] >= 1
    _assert_model_reachable(_settings(renders[RAYSERVICE]), cpu["template"]["spec"])  # the runner tokenizes


def _rayservice(renders: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return copy.deepcopy(vd.one(renders[RAYSERVICE], "RayService"))


def _with_serve(obj: dict[str, Any], change: Any) -> dict[str, Any]:
    config = yaml.safe_load(obj["spec"]["serveConfigV2"])
    change(config)
    obj["spec"]["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)
    return obj


def _engine_options(config: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = config["applications"][0]["deployments"][0]["ray_actor_options"]
    return options


def _set_path(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    node: Any = obj
    *parents, last = path.split("/")
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is _DELETE:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return obj


_DELETE = object()
GPU_GROUP = "spec/rayClusterConfig/workerGroupSpecs/0"
GPU_LIMITS = f"{GPU_GROUP}/template/spec/containers/0/resources"

Mutation = Callable[[dict[str, Any]], dict[str, Any]]
RAYSERVICE_MISTAKES: dict[str, tuple[Mutation, str]] = {
    "name too long": (lambda o: _set_path(o, "metadata/name", "x" * 48), "47 characters"),
    "old Ray with token auth": (
        lambda o: _set_path(o, "spec/rayClusterConfig/rayVersion", "2.40.0"),
        "token auth",
    ),
    "cluster rule": (
        lambda o: _set_path(o, f"{GPU_GROUP}/minReplicas", 9),
        "RayService.rayClusterConfig gpu: minReplicas > maxReplicas",
    ),
    "upgrade type": (lambda o: _set_path(o, "spec/upgradeStrategy/type", "Rolling"), "upgradeStrategy.type"),
    "head service name": (
        lambda o: _set_path(
            o, "spec/rayClusterConfig/headGroupSpec/headService", {"metadata": {"name": "mine"}}
        ),
        "headService",
    ),
    "serve config not YAML": (lambda o: _set_path(o, "spec/serveConfigV2", "applications: [\n"), "not YAML"),
    "serve config a list": (lambda o: _set_path(o, "spec/serveConfigV2", "- a\n- b\n"), "must be a mapping"),
    "no applications": (
        lambda o: _set_path(o, "spec/serveConfigV2", "applications: []\n"),
        "no applications",
    ),
    "two engines per worker": (
        lambda o: _with_serve(o, lambda c: _engine_options(c)["resources"].update({ENGINE_RESOURCE: 2})),
        "no head or worker group provides it",
    ),
    "unknown resource": (
        lambda o: _with_serve(o, lambda c: _engine_options(c).update({"resources": {"llmbatch_gpu": 1}})),
        "no head or worker group provides it",
    ),
    "two GPUs": (
        lambda o: _with_serve(o, lambda c: _engine_options(c).update({"num_gpus": 2})),
        "no head or worker group provides it",
    ),
    "group lost its resource": (
        lambda o: _set_path(o, f"{GPU_GROUP}/rayStartParams", {}),
        "no head or worker group provides it",
    ),
    "group without GPUs": (
        lambda o: _set_path(o, GPU_LIMITS, {"limits": {"cpu": "8", "memory": "32Gi"}}),
        "no head or worker group provides it",
    ),
    "group never scales up": (
        lambda o: _set_path(o, f"{GPU_GROUP}/maxReplicas", 0),
        "no head or worker group provides it",
    ),
    "unquoted resources": (
        lambda o: _set_path(o, f"{GPU_GROUP}/rayStartParams/resources", '{"llmbatch_engine": 1}'),
        "gpu: rayStartParams.resources",
    ),
    "fractional resource": (
        lambda o: _set_path(o, f"{GPU_GROUP}/rayStartParams/resources", '"{\\"llmbatch_engine\\": 1.5}"'),
        "autoscaler cannot read",
    ),
    "not JSON for ray start": (
        lambda o: _set_path(o, f"{GPU_GROUP}/rayStartParams/resources", '"{llmbatch_engine: 1}"'),
        "reaches `ray start`",
    ),
    "credential in the manifest": (
        lambda o: _with_serve(
            o,
            lambda c: c["applications"][-1].update(
                {"runtime_env": {"env_vars": {"AWS_SECRET_ACCESS_KEY": "x"}}}
            ),
        ),
        "AWS_SECRET_ACCESS_KEY, a credential",
    ),
    "proxy on another port": (
        lambda o: _with_serve(o, lambda c: c["http_options"].update({"port": 8001})),
        "serve` port 8000",
    ),
    "same app twice": (
        lambda o: _with_serve(o, lambda c: c["applications"].append(c["applications"][0])),
        "appears twice",
    ),
}


@pytest.mark.parametrize("mistake", sorted(RAYSERVICE_MISTAKES))
def test_rayservice_semantic_rules_catch_mistakes(
    renders: dict[str, list[dict[str, Any]]], mistake: str
) -> None:
    assert kuberay.kuberay_semantic_errors(_rayservice(renders)) == []
    mutate, expected = RAYSERVICE_MISTAKES[mistake]
    errors = kuberay.kuberay_semantic_errors(mutate(_rayservice(renders)))
    assert any(expected in e for e in errors), errors


def test_rayservice_crd_validation_is_strict(renders: dict[str, list[dict[str, Any]]]) -> None:
    assert kuberay.validate_kuberay(_rayservice(renders)) == []
    typo = _rayservice(renders)
    typo["spec"]["serveConfigv2"] = typo["spec"].pop("serveConfigV2")
    assert any("serveConfigv2" in e for e in kuberay.validate_kuberay(typo))
    nested = _set_path(_rayservice(renders), f"{GPU_GROUP}/maxReplica", 3)
    assert any("maxReplica" in e for e in kuberay.validate_kuberay(nested))
    wrong_type = _set_path(_rayservice(renders), "spec/rayClusterDeletionDelaySeconds", "60")
    assert kuberay.validate_kuberay(wrong_type)
    bad_auth = _set_path(_rayservice(renders), "spec/rayClusterConfig/authOptions/mode", "password")
    assert kuberay.validate_kuberay(bad_auth)
    missing = _rayservice(renders)
    del missing["spec"]["rayClusterConfig"]
    assert any("rayClusterConfig" in e for e in kuberay.validate_kuberay(missing))


def test_group_resource_quoting_is_checked_on_rayclusters_too(
    renders: dict[str, list[dict[str, Any]]],
) -> None:
    cluster = copy.deepcopy(vd.one(renders["gpu-prod"], "RayCluster"))
    assert kuberay.kuberay_semantic_errors(cluster) == []
    cluster["spec"]["workerGroupSpecs"][0]["rayStartParams"]["resources"] = "llmbatch_engine=1"
    errors = kuberay.kuberay_semantic_errors(cluster)
    assert any("RayCluster gpu: rayStartParams.resources" in e for e in errors)


def _served(settings: Any, name: str) -> Any:
    """The overlay serves exactly ``name`` (one registry entry); its entry."""
    assert list(settings.engines.models) == [name]
    return settings.engines.get(name)


def _assert_model_reachable(settings: Any, pod: dict[str, Any]) -> None:
    """The model folder the jobs load is on a volume of the worker, and the init container that
    fills/waits for it names the same folder."""
    (entry,) = settings.engines.models.values()
    model = entry.path
    worker = pod["containers"][0]
    mounts = [m for m in worker["volumeMounts"] if model.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{model} is on no volume of the worker"
    init = pod["initContainers"][0]
    args = vd_fetch_model_args(init["command"])
    assert args.dest == Path(model)
    assert any(m["name"] == mounts[0]["name"] for m in init["volumeMounts"])


def vd_fetch_model_args(command: list[str]) -> Any:
    assert command[:2] == ["python", "/home/ray/llmbatch/fetch_model.py"], command
    return _fetch_model().build_parser().parse_args(command[2:])


def _fetch_model() -> Any:
    if "fetch_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fetch_model", vd.DEPLOY / "docker" / "fetch_model.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules["fetch_model"] = module
        spec.loader.exec_module(module)
    return sys.modules["fetch_model"]


def test_every_fetch_model_command_parses(renders: dict[str, list[dict[str, Any]]]) -> None:
    seen = 0
    for objects in renders.values():
        for obj in objects:
            for _, pod in vd.pod_specs(obj):
                for container in vd.containers(pod):
                    command = container.get("command") or []
                    if any("fetch_model.py" in c for c in command):
                        vd_fetch_model_args(command)
                        seen += 1
    assert seen >= 4
    with pytest.raises(SystemExit):
        vd_fetch_model_args(
            ["python", "/home/ray/llmbatch/fetch_model.py", "--from-s3", "s3://b/m/"]
        )  # no --dest


def test_ray_start_params_are_ray_start_options(renders: dict[str, list[dict[str, Any]]]) -> None:
    from ray.scripts.scripts import start

    options = {opt.lstrip("-") for param in start.params for opt in param.opts}
    for objects in renders.values():
        spec = _raycluster(objects)["spec"]
        for params in [
            spec["headGroupSpec"]["rayStartParams"],
            *(g["rayStartParams"] for g in spec["workerGroupSpecs"]),
        ]:
            assert set(params) <= options, set(params) - options


# the KubeRay operator as deploy/README.md installs it (Helm, namespace kuberay-system)
OPERATOR_NAMESPACE = "kuberay-system"
OPERATOR_LABELS = {
    "app.kubernetes.io/component": "kuberay-operator",
    "app.kubernetes.io/name": "kuberay-operator",
}


def _admitted(policy: dict[str, Any], labels: dict[str, str], port: int, namespace: str) -> bool:
    """Does ``policy`` admit a pod with ``labels`` in ``namespace`` on ``port`` (NetworkPolicy peer
    semantics: a podSelector alone means the policy's namespace)?"""
    own = policy["metadata"]["namespace"]
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports") or []}
        if ports and port not in ports:
            continue
        for peer in rule.get("from") or [{}]:
            ns_selector = peer.get("namespaceSelector")
            if ns_selector is None:
                ns_ok = namespace == own
            else:
                ns_ok = vd.selector_matches(ns_selector, {"kubernetes.io/metadata.name": namespace})
            if ns_ok and vd.selector_matches(peer.get("podSelector") or {}, labels):
                return True
    return False


@pytest.mark.parametrize("overlay", ["gpu-prod", "gpu-prod-rayservice"])
def test_network_policy_guards_the_jobs_api(
    renders: dict[str, list[dict[str, Any]]], rayjob_templates: dict[str, dict[str, Any]], overlay: str
) -> None:
    objects = renders[overlay]
    cluster = _raycluster(objects)
    namespace = vd.one(objects, "Namespace")["metadata"]["name"]
    rayservice = overlay.endswith("rayservice")
    # the labels KubeRay puts on the pods (a RayService names its clusters <name>-<random suffix>)
    # next to those of our templates, which KubeRay keeps
    cluster_name = cluster["metadata"]["name"] + ("-x7k2p" if rayservice else "")
    head_labels = {
        "ray.io/cluster": cluster_name,
        "ray.io/node-type": "head",
        **vd.pod_template_labels({"spec": cluster["spec"]["headGroupSpec"]}),
    }
    worker_labels = [
        {"ray.io/cluster": cluster_name, "ray.io/node-type": "worker", **vd.pod_template_labels({"spec": g})}
        for g in cluster["spec"]["workerGroupSpecs"]
    ]
    policies = vd.by_kind(objects, "NetworkPolicy")
    head_policies = [p for p in policies if vd.selector_matches(p["spec"]["podSelector"], head_labels)]
    assert len(head_policies) == 1
    for labels in worker_labels:
        (worker_policy,) = [p for p in policies if vd.selector_matches(p["spec"]["podSelector"], labels)]
        assert worker_policy is not head_policies[0]
        dispatcher = {"app.kubernetes.io/name": "llmbatch-dispatcher"}
        assert not _admitted(worker_policy, dispatcher, 8000, namespace)
    policy = head_policies[0]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    dispatcher_labels = vd.pod_template_labels(vd.one(objects, "Deployment", "llmbatch-dispatcher"))
    submitter_labels = [
        t["spec"]["submitterPodTemplate"]["metadata"]["labels"] for t in rayjob_templates.values()
    ]
    jobs_api, serve = RAY_PORTS["dashboard"], 8000

    def admitted(labels: dict[str, str], port: int, ns: str = namespace) -> bool:
        return _admitted(policy, labels, port, ns)

    assert admitted(dispatcher_labels, jobs_api) and admitted(dispatcher_labels, serve)
    assert all(admitted(labels, jobs_api) and not admitted(labels, serve) for labels in submitter_labels)
    assert all(admitted(labels, RAY_PORTS["gcs-server"]) for labels in worker_labels)
    assert not admitted({"app": "anything-else"}, jobs_api)
    assert not admitted({"app": "anything-else"}, serve)
    # the KubeRay operator: the dashboard (RayJob status, Serve config) and, for a RayService, the
    # head's Serve proxy health check; from its own namespace only
    assert admitted(OPERATOR_LABELS, jobs_api, OPERATOR_NAMESPACE)
    assert admitted(OPERATOR_LABELS, serve, OPERATOR_NAMESPACE) is rayservice
    assert not admitted(OPERATOR_LABELS, jobs_api)  # the same labels in the app's namespace
    assert not admitted({"app": "anything-else"}, jobs_api, OPERATOR_NAMESPACE)
    assert admitted({"app": "prometheus"}, 8080, "monitoring")
    assert not admitted({"app": "prometheus"}, jobs_api, "monitoring")
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "an ingress rule without `from` admits everyone"
        for peer in rule["from"]:
            if "namespaceSelector" in peer:
                ports = {p["port"] for p in rule["ports"]}
                operator = peer["namespaceSelector"]["matchLabels"] == {
                    "kubernetes.io/metadata.name": OPERATOR_NAMESPACE
                }
                allowed = {jobs_api, serve} if operator else {8080}
                assert ports <= allowed, "other namespaces get metrics only"
                assert not operator or peer.get("podSelector"), "the operator's pods, not its namespace"


def test_topics_job_uses_the_settings_names(renders: dict[str, list[dict[str, Any]]]) -> None:
    for overlay in vd.OVERLAYS:
        objects = renders[overlay]
        config = _config(objects)
        job = vd.one(objects, "Job", "llmbatch-kafka-topics")
        (container,) = job["spec"]["template"]["spec"]["containers"]
        script = container["command"][-1]
        used = set(re.findall(r"\$\{?(LLMBATCH_[A-Z0-9_]+)", script))
        assert used >= {
            "LLMBATCH_KAFKA__BOOTSTRAP_SERVERS",
            "LLMBATCH_KAFKA__TOPICS__REQUESTS",
            "LLMBATCH_KAFKA__TOPICS__RESULTS",
            "LLMBATCH_KAFKA__TOPICS__DEAD_LETTER",
            "LLMBATCH_KAFKA__TOPICS__PARTITIONS",
            "LLMBATCH_KAFKA__TOPICS__REPLICATION_FACTOR",
        }
        sasl_only = {"LLMBATCH_KAFKA__SASL_MECHANISM"}  # read on a SASL listener only (components/kafka-sasl)
        assert used - sasl_only <= set(config), used - set(config)
        assert "--if-not-exists" in script
        assert container["image"] == "apache/kafka:4.2.0"


def test_images_are_pinned(
    renders: dict[str, list[dict[str, Any]]], rayjob_templates: dict[str, dict[str, Any]]
) -> None:
    objects = [o for objs in renders.values() for o in objs] + list(rayjob_templates.values())
    images = {c["image"] for o in objects for _, pod in vd.pod_specs(o) for c in vd.containers(pod)}
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag and tag != "latest", image
        assert re.search(r"\d", tag), image


def test_restricted_pod_security(
    renders: dict[str, list[dict[str, Any]]], rayjob_templates: dict[str, dict[str, Any]]
) -> None:
    """Every namespace is labelled for the `restricted` Pod Security Standard: every pod must pass it."""
    problems = []
    for name, objects in renders.items():
        namespace = vd.one(objects, "Namespace")
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted", name
    pods = [(w, p) for objects in renders.values() for o in objects for w, p in vd.pod_specs(o)]
    pods += [(w, p) for t in rayjob_templates.values() for w, p in vd.pod_specs(t)]
    for where, pod in pods:
        security = pod.get("securityContext") or {}
        if security.get("runAsNonRoot") is not True or security.get("runAsUser") == 0:
            problems.append(f"{where}: runAsNonRoot")
        if (security.get("seccompProfile") or {}).get("type") not in {"RuntimeDefault", "Localhost"}:
            problems.append(f"{where}: seccompProfile")
        if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
            problems.append(f"{where}: host namespaces")
        if any("hostPath" in v for v in pod.get("volumes") or []):
            problems.append(f"{where}: hostPath")
        for container in vd.containers(pod):
            csec = container.get("securityContext") or {}
            if csec.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}/{container['name']}: allowPrivilegeEscalation")
            if (csec.get("capabilities") or {}).get("drop") != ["ALL"]:
                problems.append(f"{where}/{container['name']}: capabilities.drop ALL")
            if csec.get("privileged") or csec.get("runAsUser") == 0:
                problems.append(f"{where}/{container['name']}: root/privileged")
    assert problems == []


def test_rayjob_templates(
    rayjob_templates: dict[str, dict[str, Any]], renders: dict[str, list[dict[str, Any]]]
) -> None:
    from llmbatch.ray_job.job.spec import parser

    per_batch = rayjob_templates["rayjob-per-batch.yaml"]["spec"]
    assert per_batch["submissionMode"] == "K8sJobMode"
    assert per_batch["shutdownAfterJobFinishes"] is True
    assert per_batch["ttlSecondsAfterFinished"] > 0
    assert per_batch["activeDeadlineSeconds"] > 0
    assert per_batch["backoffLimit"] == 0, "the dispatcher owns retries"
    assert "clusterSelector" not in per_batch
    (group,) = per_batch["rayClusterSpec"]["workerGroupSpecs"]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    reuse = rayjob_templates["rayjob-reuse-cluster.yaml"]["spec"]
    assert reuse["clusterSelector"] == {
        "ray.io/cluster": _raycluster(renders["gpu-prod"])["metadata"]["name"]
    }
    assert reuse["shutdownAfterJobFinishes"] is False
    assert reuse["activeDeadlineSeconds"] > 0
    for template in rayjob_templates.values():
        spec = template["spec"]
        assert spec["jobId"] == template["metadata"]["name"]
        words = shlex.split(spec["entrypoint"])
        assert words[:4] == ["python", "-P", "-m", "llmbatch.ray_job"]
        args = parser().parse_args(words[4:])
        # a cluster of the overlays holds no S3 keys: an attempt there brings its session (a cluster of
        # its own carries its own keys)
        assert (args.s3_session_key is not None) == ("clusterSelector" in spec), template["metadata"]
        if args.s3_session_redis is not None:
            assert urlsplit(args.s3_session_redis).password is None
        assert spec["entrypointNumCpus"] == 0
        assert isinstance(yaml.safe_load(spec["runtimeEnvYAML"]), dict)


def test_deploycheck_reports_kustomize_errors(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    with pytest.raises(vd.DeployCheckError, match=r"missing\.yaml"):
        vd.render_kustomize(tmp_path)


def test_crds_are_the_kuberay_release() -> None:
    for kind in ("RayCluster", "RayJob", "RayService"):
        crd = kuberay.crd_document(kind)
        assert crd["spec"]["group"] == "ray.io" and crd["spec"]["names"]["kind"] == kind
        assert [v["name"] for v in crd["spec"]["versions"] if v.get("storage")] == ["v1"]
    assert os.path.basename(kuberay.kuberay_crd_dir()) == "kuberay-crds"


def test_every_ray_container_cleans_up_a_crashed_workers_processes(
    renders: dict[str, list[dict[str, Any]]],
) -> None:
    """A SIGKILLed engine replica must take its vLLM EngineCore with it (Ray's process-group cleanup,
    set explicitly so a cluster default cannot turn it off: test_serve_engine_vllm_faults shows the
    orphans without it)."""
    for overlay in ("cpu-dev", "gpu-prod"):
        spec = _raycluster(renders[overlay])["spec"]
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        for group in groups:
            for container in group["template"]["spec"]["containers"]:
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                assert env.get("RAY_process_group_cleanup_enabled") == "1", (overlay, container["name"])


def test_cpu_dev_ray_pods_run_serve_as_quietly_as_the_local_stack(
    renders: dict[str, list[dict[str, Any]]],
) -> None:
    """On CPU the engine computes on every core of its pod, so the Ray containers of cpu-dev carry the
    local stack's Serve intervals (one source: ``QUIET_SERVE_ENV``); gpu-prod keeps Ray's defaults."""
    from llmbatch.stack.ray_head import QUIET_SERVE_ENV

    spec = _raycluster(renders["cpu-dev"])["spec"]
    for group in (spec["headGroupSpec"], *spec["workerGroupSpecs"]):
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert {k: env.get(k) for k in QUIET_SERVE_ENV} == QUIET_SERVE_ENV, container["name"]
    gpu = _raycluster(renders["gpu-prod"])["spec"]
    for group in (gpu["headGroupSpec"], *gpu["workerGroupSpecs"]):
        for container in group["template"]["spec"]["containers"]:
            assert not {e["name"] for e in container.get("env", [])} & QUIET_SERVE_ENV.keys()


# --- components/kafka-sasl: SASL_SSL logins and the ACL Job ---------------------------------------


def _env_value(container: dict[str, Any], name: str) -> Any:
    [entry] = [e for e in container.get("env") or [] if e["name"] == name]
    return entry.get("value", entry.get("valueFrom"))


def test_kafka_sasl_gives_each_workload_its_own_login_and_the_acl_job_binds_those_users(
    renders: dict[str, list[dict[str, Any]]],
) -> None:
    objects = renders["gpu-prod+kafka-sasl"]
    config = _config(objects)
    assert (config["LLMBATCH_KAFKA__SECURITY_PROTOCOL"], config["LLMBATCH_KAFKA__SASL_MECHANISM"]) == (
        "SASL_SSL",
        "SCRAM-SHA-512",
    )
    ca_dir = str(Path(config["LLMBATCH_KAFKA__SSL_CAFILE"]).parent)
    logins: dict[str, str] = {}
    for kind, name in (
        ("Deployment", "llmbatch-dispatcher"),
        ("Deployment", "llmbatch-api"),
        ("Job", "llmbatch-kafka-acls"),
    ):
        pod = vd.one(objects, kind, name)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        logins[name] = _env_value(container, "LLMBATCH_KAFKA__SASL_USERNAME")
        secret = _env_value(container, "LLMBATCH_KAFKA__SASL_PASSWORD")["secretKeyRef"]
        assert secret == {"name": "llmbatch-kafka-users", "key": f"{logins[name]}-password"}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert mounts["kafka-ca"] == ca_dir
        assert volumes["kafka-ca"]["secret"]["secretName"] == "llmbatch-kafka-ca"
    assert len(set(logins.values())) == 3  # no two workloads share a login
    job = vd.one(objects, "Job", "llmbatch-kafka-acls")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[:3] == ["dispatcher", "kafka-acl", "--apply"]
    users = dict(a.split("=", 1) for a in args[4::2])
    assert args[3::2] == ["--user"] * len(users)
    # the ACL plan grants each role to the user its workload logs in as
    assert users["dispatcher"] == logins["llmbatch-dispatcher"]
    assert users["producer"] == logins["llmbatch-api"]
    assert logins["llmbatch-kafka-acls"] not in users.values()  # the admin is a super user, not a role
    # the Job's command runs with the rendered settings (without --apply: it prints the plan)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMBATCH_")}
    env.update(config)
    env.update(
        {
            "LLMBATCH_KAFKA__SASL_USERNAME": logins["llmbatch-kafka-acls"],
            "LLMBATCH_KAFKA__SASL_PASSWORD": "not-used",
        }
    )
    plan = [a for a in args if a != "--apply"]
    proc = subprocess.run(
        [sys.executable, "-m", "llmbatch", *plan],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for role, user in users.items():
        assert f"{role} (User:{user})" in proc.stdout


def test_the_topics_job_logs_in_as_the_admin_on_a_sasl_listener(
    renders: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Runs the topics Job's real script with a stand-in kafka-topics.sh that records its arguments."""
    calls = tmp_path / "calls"
    stub = tmp_path / "kafka-topics.sh"
    stub.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    stub.chmod(0o755)

    def run(objects: list[dict[str, Any]]) -> list[str]:
        job = vd.one(objects, "Job", "llmbatch-kafka-topics")
        (container,) = job["spec"]["template"]["spec"]["containers"]
        script = container["command"][-1].replace("/opt/kafka/bin/kafka-topics.sh", str(stub))
        env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path), **_config(objects)}
        for entry in container.get("env") or []:
            env[entry["name"]] = entry.get("value", "admin-secret")  # a secretKeyRef: a stand-in
        calls.unlink(missing_ok=True)
        subprocess.run(["bash", "-ec", script], env=env, check=True, timeout=30)
        return calls.read_text().splitlines()

    plain = run(renders["gpu-prod"])
    assert len(plain) == 4 and not any("--command-config" in c for c in plain)
    sasl = run(renders["gpu-prod+kafka-sasl"])
    props = tmp_path / "client.properties"
    assert len(sasl) == 4 and all(f"--command-config {props}" in c for c in sasl)
    text = props.read_text()
    assert "security.protocol=SASL_SSL" in text and "sasl.mechanism=SCRAM-SHA-512" in text
    assert 'username="admin" password="admin-secret";' in text
    assert "ssl.truststore.location=/etc/llmbatch/kafka-ca/ca.crt" in text
    assert props.stat().st_mode & 0o077 == 0  # the admin's password: readable by its owner only


def _assert_secret_documented(objects: list[dict[str, Any]], component: str, secret: str) -> str:
    """The component's comment creates ``secret`` with every key the rendered objects read; its text."""
    refs = _references(objects)
    comment = (vd.KUSTOMIZE / f"components/{component}/kustomization.yaml").read_text()
    text = re.sub(r"\\\n[#\s]*", " ", comment)
    [command] = [c for c in re.findall(r"create secret generic (\S+)([^\n]*)", text) if c[0] == secret]
    for key in refs[("Secret", secret)]:
        assert f"--from-literal={key}=" in command[1], key
    return text


def test_kafka_sasl_secrets_are_documented_with_every_key(renders: dict[str, list[dict[str, Any]]]) -> None:
    text = _assert_secret_documented(renders["gpu-prod+kafka-sasl"], "kafka-sasl", "llmbatch-kafka-users")
    assert "create secret generic llmbatch-kafka-ca --from-file=ca.crt=" in text


# --- components/tenant-pool: one tenant's worker group ------------------------------------------


def test_tenant_pool_gives_the_tenant_a_group_of_its_own_with_no_keys_and_no_cpu_for_others(
    renders: dict[str, list[dict[str, Any]]],
) -> None:
    from llmbatch.schemas.job import tenant_pool_resource
    from llmbatch.settings import TenantSettings

    objects = renders["gpu-prod+tenant-pool"]
    groups = {g["groupName"]: g for g in _raycluster(objects)["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"gpu", "cpu", "tenant-acme"}
    pool = groups["tenant-acme"]
    params = pool["rayStartParams"]
    assert params["num-cpus"] == "0"  # nothing that asks CPUs (every other tenant's work) lands here
    assert json.loads(json.loads(params["resources"])) == {tenant_pool_resource("acme"): 4}
    assert pool["minReplicas"] == 0 and pool["replicas"] == 0
    cpus = pool["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]
    assert int(cpus) == 4, "the resource should count the container's CPUs"

    # the pool's pods hold what gpu-prod's CPU workers hold, and so no S3 keys (acme's jobs get sessions;
    # test_every_rendering_keeps_s3_keys_off_the_ray_pods covers this rendering too)
    def worker_env(group: dict[str, Any]) -> Any:
        return group["template"]["spec"]["containers"][0]["env"]

    assert worker_env(pool) == worker_env(groups["cpu"])
    # the dispatcher sends acme's jobs there
    deployments = vd.by_kind(objects, "Deployment")
    [dispatcher] = [o for o in deployments if o["metadata"]["name"] == "llmbatch-dispatcher"]
    env = {e["name"]: e.get("value") for e in dispatcher["spec"]["template"]["spec"]["containers"][0]["env"]}
    pools = TenantSettings(pools=json.loads(env["LLMBATCH_TENANTS__POOLS"]))
    assert pools.pool_of("acme") == "llmbatch_tenant_acme"


# --- components/ray-https: the dispatchers' HTTP hops to Ray over TLS ------------------------------


def _named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [o for o in vd.by_kind(objects, kind) if o["metadata"]["name"] == name]
    assert isinstance(found, dict)
    return found


def _mounted(container: dict[str, Any], pod: dict[str, Any], path: str) -> str:
    """The Secret whose volume holds ``path`` in ``container`` (and, if it lists items, that file)."""
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    for mount in container.get("volumeMounts") or []:
        folder = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(folder):
            secret = volumes[mount["name"]]["secret"]
            items = {i["path"]: i["key"] for i in secret.get("items") or []}
            name = path.removeprefix(folder)
            assert not items or name in items, (path, items)
            return str(secret["secretName"])
    raise AssertionError(f"{path} is not in any volume of {container['name']}")


def test_ray_https_puts_a_tls_front_before_the_dashboard_and_tls_on_serves_proxy(
    renders: dict[str, list[dict[str, Any]]],
) -> None:
    from llmbatch.dispatcher.backends.engines import cluster_serve_config
    from llmbatch.stack import tls_front

    objects = renders["gpu-prod+ray-https"]
    head = _raycluster(objects)["spec"]["headGroupSpec"]["template"]["spec"]
    ray_head, front = head["containers"]
    assert (ray_head["name"], front["name"]) == ("ray-head", "dashboard-tls")
    assert front["image"] == ray_head["image"]  # the head's image, as the overlay made it
    # the sidecar runs the tested front: TLS on 8443 of the pod, relayed to the dashboard's port
    command = front["command"]
    assert command[:3] == ["python", "-m", "llmbatch.stack.tls_front"]
    args = tls_front.parse_args(command[3:])
    dashboard = {p["name"]: p["containerPort"] for p in ray_head["ports"]}["dashboard"]
    assert (args.listen_host, args.listen_port, args.target_port) == ("0.0.0.0", 8443, dashboard)
    assert {p["name"]: p["containerPort"] for p in front["ports"]} == {"dashboard-tls": 8443}
    assert _mounted(front, head, args.cert) == _mounted(front, head, args.key) == "llmbatch-ray-tls"
    # the Service the dispatchers call reaches that port on the head pod
    service = _named(objects, "Service", "llmbatch-ray-dashboard-tls")
    assert service["spec"]["selector"] == {
        "app.kubernetes.io/name": "llmbatch-ray",
        "ray.io/node-type": "head",
    }
    assert service["spec"]["ports"][0]["targetPort"] == "dashboard-tls"
    # the dispatchers' settings: https to both, the CA mounted, Serve's certificate where the head has it
    dispatcher = _named(objects, "Deployment", "llmbatch-dispatcher")
    pod = dispatcher["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = _config(objects)
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    env.update(
        {
            "LLMBATCH_S3__ACCESS_KEY": "k",
            "LLMBATCH_S3__SECRET_KEY": "s",
            "LLMBATCH_REDIS__PASSWORD": "p",
            "LLMBATCH_RAY__AUTH_TOKEN": "t",
        }
    )
    settings = vd.build_settings(env)
    ray = settings.ray
    assert ray.address == f"https://{service['metadata']['name']}:8443"
    assert ray.serve_address.startswith("https://llmbatch-ray-head-svc:")
    assert _mounted(container, pod, str(ray.ca_file)) == "llmbatch-ray-tls"  # its ca.crt only
    http = cluster_serve_config(settings)["http_options"]
    assert (
        _mounted(ray_head, head, http["ssl_certfile"])
        == _mounted(ray_head, head, http["ssl_keyfile"])
        == "llmbatch-ray-tls"
    )
    # the dispatchers reach the front and Serve's proxy, no longer the dashboard's plain port
    policy = _named(objects, "NetworkPolicy", "llmbatch-ray-head")
    ports_of: dict[str, set[int]] = {}
    for rule in policy["spec"]["ingress"]:
        for peer in rule.get("from") or []:
            name = (peer.get("podSelector") or {}).get("matchLabels", {}).get("app.kubernetes.io/name")
            for port in rule.get("ports") or []:
                ports_of.setdefault(str(name), set()).add(port["port"])
    assert ports_of["llmbatch-dispatcher"] == {8443, 8000}
    assert 8265 in ports_of["None"]  # the operator (namespace selector) and the RayJob submitters keep it
    text = (vd.KUSTOMIZE / "components/ray-https/kustomization.yaml").read_text()
    assert re.search(
        r"create secret generic llmbatch-ray-tls \\\n#\s+--from-file=tls.crt=\S+ "
        r"--from-file=tls.key=\S+ --from-file=ca.crt=",
        text,
    )


# --- components/ray-grpc-tls: Ray's gRPC over KubeRay's mTLS -----------------------------------------


def test_ray_grpc_tls_turns_on_kuberays_mtls_and_changes_nothing_else(
    renders: dict[str, list[dict[str, Any]]],
) -> None:
    tls = _raycluster(renders["gpu-prod+ray-grpc-tls"])["spec"]
    assert tls.pop("tlsOptions") == {"enabled": True}
    assert tls == _raycluster(renders["gpu-prod"])["spec"]
    comment = (vd.KUSTOMIZE / "components/ray-grpc-tls/kustomization.yaml").read_text()
    assert "{name: RayClusterMTLS, enabled: true}" in comment and "cert-manager" in comment
