"""deploy/kubernetes against a real control plane: etcd, kube-apiserver 1.37 with the KubeRay v1.7.0
CRDs of ../shared/kuberay-crds and prometheus-operator's ServiceMonitor CRD (v0.85.0), and the real
KubeRay operator (v1.6.1, the newest the Go module proxy serves here). See
tests/support/kube_control_plane.py.

- every rendered overlay and component is accepted by the API server (strict field validation,
  server-side dry-run, admission);
- the operator turns our RayCluster, RayService and RayJob into the pods we mean: engine workers
  carry the `llmbatch_engine` resource, the GPU group starts from zero, credentials reach pods only
  as Secret references, the autoscaler sidecar is there;
- each rule scripts/validate_kuberay.py re-implements from KubeRay's validation.go is one the real
  operator (or the API server) enforces too.

No kubelet runs here: pods are created and stay Pending.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.kube_control_plane import ControlPlane, KubeApiError, KubeClient
from tests.support.kube_objects import (
    RAY,
    apply_all,
    cluster_pods,
    ensure_namespace,
    kuberay,
    object_events,
    ray_container,
    rayservice_cluster,
    start_command,
    vd,
    worker_groups,
)

pytestmark = [pytest.mark.integration, pytest.mark.deploy]


@pytest.fixture(scope="module")
def kube(plane: ControlPlane) -> Iterator[KubeClient]:
    client = plane.client()
    try:
        yield client
    finally:
        client.close()


def _rendered_once(render: Callable[[], list[dict[str, Any]]]) -> Callable[[], list[dict[str, Any]]]:
    """``render`` runs once; each call gets its own copy of the objects (tests change them)."""
    cached = functools.cache(render)
    return lambda: copy.deepcopy(cached())


def _renders() -> dict[str, Callable[[], list[dict[str, Any]]]]:
    out: dict[str, Callable[[], list[dict[str, Any]]]] = {
        name: _rendered_once(functools.partial(vd.render_overlay, name)) for name in vd.OVERLAYS
    }
    for component in vd.COMPONENTS:
        out[f"gpu-prod+{component}"] = _rendered_once(
            functools.partial(vd.render_with_components, "gpu-prod", [component])
        )
    return out


RENDERS = _renders()


def _secret_values(objects: list[dict[str, Any]]) -> set[str]:
    values = set()
    for obj in objects:
        if obj["kind"] != "Secret":
            continue
        values |= set((obj.get("stringData") or {}).values())
        values |= {base64.b64decode(v).decode() for v in (obj.get("data") or {}).values()}
    return {v for v in values if len(v) >= 8}


def _api_token_holders(pod: dict[str, Any]) -> set[str]:
    """Containers of a stored pod (after admission) that see a Kubernetes API token."""
    token_volumes = {
        v["name"]
        for v in pod["spec"].get("volumes") or []
        if any("serviceAccountToken" in source for source in (v.get("projected") or {}).get("sources", []))
    }
    return {
        c["name"]
        for c in [*pod["spec"]["containers"], *(pod["spec"].get("initContainers") or [])]
        if {m["name"] for m in c.get("volumeMounts") or []} & token_volumes
    }


def assert_only_the_autoscaler_holds_an_api_token(pods: list[dict[str, Any]]) -> None:
    """KubeRay's Role lets the head pod's account patch pods and the RayCluster itself. Job drivers
    run in the head's Ray container: with that token a batch could rewrite the worker template (an
    env from any Secret of the namespace, say). Only the autoscaler sidecar needs it."""
    holders = {p["metadata"]["name"]: _api_token_holders(p) for p in pods}
    wanted = {
        p["metadata"]["name"]: {"autoscaler"} & {c["name"] for c in p["spec"]["containers"]} for p in pods
    }
    assert holders == wanted


@pytest.mark.parametrize("render", sorted(RENDERS))
def test_the_api_server_accepts_every_rendered_object(kube: KubeClient, render: str) -> None:
    skipped = apply_all(kube, RENDERS[render](), dry_run=True)
    assert not skipped, f"kinds no API group serves: {skipped}"


def test_the_api_server_refuses_a_field_the_crd_does_not_have(kube: KubeClient) -> None:
    """The check above can fail: strict field validation names an unknown field."""
    cluster = copy.deepcopy(vd.one(RENDERS["cpu-dev"](), "RayCluster"))
    ensure_namespace(kube, cluster["metadata"]["namespace"])
    cluster["spec"]["headGroupSpec"]["rayStartParam"] = {"num-cpus": "0"}  # typo of rayStartParams
    with pytest.raises(KubeApiError, match="rayStartParam"):
        kube.apply(cluster, dry_run=True)


def test_a_namespaced_object_without_its_namespace_is_named(kube: KubeClient) -> None:
    """What the ray-https component's Service once was: the API server would only answer 404."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "no-namespace"},
        "spec": {"ports": [{"port": 8265}]},
    }
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "Service/no-namespace: Service 'no-namespace' is namespaced: give its metadata.namespace"
        ),
    ):
        apply_all(kube, [service], dry_run=True)


def test_the_operator_builds_the_dev_cluster_we_mean(plane: ControlPlane, kube: KubeClient) -> None:
    objects = RENDERS["cpu-dev"]()
    apply_all(kube, objects, dry_run=False)
    cluster = vd.one(objects, "RayCluster")
    namespace, name = cluster["metadata"]["namespace"], cluster["metadata"]["name"]
    groups = worker_groups(cluster["spec"])
    expected_workers = sum(g.get("replicas", g.get("minReplicas", 0)) for g in groups.values())

    pods = plane.wait_for(
        f"head and {expected_workers} worker pods of {name}",
        lambda: found if len(found := cluster_pods(kube, namespace, name)) == 1 + expected_workers else None,
    )
    assert not [e for e in object_events(kube, namespace, name) if e["reason"] == "InvalidRayClusterSpec"]
    # the API server admitted every pod, the containers KubeRay adds included, under restricted
    live = kube.get("v1", "Namespace", namespace)
    assert live is not None
    assert live["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    by_group = {p["metadata"]["labels"]["ray.io/group"]: p for p in pods}
    head = by_group["headgroup"]
    assert "autoscaler" in {c["name"] for c in head["spec"]["containers"]}  # KubeRay's sidecar
    for group_name in groups:  # and its init container, each admitted as restricted
        assert "wait-gcs-ready" in {c["name"] for c in by_group[group_name]["spec"]["initContainers"]}
    assert "ray start --head" in start_command(head)
    assert (
        ray_container(head)["image"]
        == cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    )
    for group_name, group in groups.items():
        pod = by_group[group_name]
        resources = (group.get("rayStartParams") or {}).get("resources")
        if resources:  # the engine placement: `ray start --resources=...` carries it unchanged
            assert f"--resources={resources}" in start_command(pod), start_command(pod)

    assert_only_the_autoscaler_holds_an_api_token(pods)
    text = json.dumps(pods)
    leaked = [v for v in _secret_values(objects) - {namespace} if v in text]
    assert not leaked, "a Secret's value is written into a pod the operator built"
    for pod in pods:
        env = {e["name"]: e for e in ray_container(pod).get("env", [])}
        assert "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"], env["RAY_AUTH_TOKEN"]
        assert not {
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "LLMBATCH_S3__ACCESS_KEY",
            "LLMBATCH_S3__SECRET_KEY",
        } & set(env)


def test_restricted_pod_security_refuses_a_head_without_its_security_context(
    plane: ControlPlane, kube: KubeClient
) -> None:
    """The admission above is real: the same cluster without the head's securityContext gets no pod."""
    objects = RENDERS["cpu-dev"]()
    apply_all(kube, [o for o in objects if o["kind"] == "Namespace"], dry_run=False)
    cluster = copy.deepcopy(vd.one(objects, "RayCluster"))
    namespace, name = cluster["metadata"]["namespace"], "psa-probe"
    cluster["metadata"] = {"name": name, "namespace": namespace}
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    head.pop("securityContext")
    head["containers"][0].pop("securityContext")
    kube.apply(cluster)
    refusals = plane.wait_for(
        f"FailedToCreateHeadPod for {name}",
        lambda: [e for e in object_events(kube, namespace, name) if e["reason"] == "FailedToCreateHeadPod"],
    )
    assert 'violates PodSecurity "restricted:latest"' in refusals[0]["message"]
    groups = {p["metadata"]["labels"]["ray.io/group"] for p in cluster_pods(kube, namespace, name)}
    assert "headgroup" not in groups
    kube.delete(RAY, "RayCluster", name, namespace)


def test_the_operator_turns_the_rayservice_into_a_cluster_scaling_engines_from_zero(
    plane: ControlPlane, kube: KubeClient
) -> None:
    objects = RENDERS["gpu-prod-rayservice"]()
    service = vd.one(objects, "RayService")
    namespace, name = service["metadata"]["namespace"], service["metadata"]["name"]
    apply_all(kube, objects, dry_run=False)

    cluster = plane.wait_for(
        f"the RayCluster of RayService {name}", lambda: rayservice_cluster(kube, namespace, name)
    )
    wanted = service["spec"]["rayClusterConfig"]
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    assert cluster["spec"]["authOptions"] == wanted["authOptions"]
    gpu = worker_groups(cluster["spec"])["gpu"]
    assert (gpu["minReplicas"], gpu.get("replicas", 0)) == (0, 0)
    assert "llmbatch_engine" in gpu["rayStartParams"]["resources"]

    cluster_name = cluster["metadata"]["name"]
    expected = 1 + sum(g.get("replicas", 0) for g in worker_groups(cluster["spec"]).values())
    pods = plane.wait_for(
        f"the pods of {cluster_name}",
        lambda: found if len(found := cluster_pods(kube, namespace, cluster_name)) == expected else None,
    )
    groups = {p["metadata"]["labels"]["ray.io/group"] for p in pods}
    assert "gpu" not in groups  # no GPU worker until a replica asks for one
    head = next(p for p in pods if p["metadata"]["labels"]["ray.io/group"] == "headgroup")
    assert "autoscaler" in {c["name"] for c in head["spec"]["containers"]}
    assert_only_the_autoscaler_holds_an_api_token(pods)
    auth = {e["name"]: e for e in ray_container(head).get("env", [])}["RAY_AUTH_TOKEN"]
    assert auth["valueFrom"]["secretKeyRef"]["name"] == wanted["authOptions"]["secretName"]
    for kind, obj in (("RayService", name), ("RayCluster", cluster_name)):
        bad = [e for e in object_events(kube, namespace, obj) if e["reason"].startswith("Invalid")]
        assert not bad, f"{kind} {obj}: {bad}"


def test_the_operator_starts_the_per_batch_rayjobs_cluster(plane: ControlPlane, kube: KubeClient) -> None:
    job = vd.load_yaml_objects(vd.KUSTOMIZE / "rayjob" / "rayjob-per-batch.yaml")[0]
    job["metadata"]["namespace"] = "llmbatch-jobs"
    ensure_namespace(kube, "llmbatch-jobs")
    kube.apply(job)
    name = job["metadata"]["name"]

    def cluster() -> dict[str, Any] | None:
        found = kube.get(RAY, "RayJob", name, "llmbatch-jobs")
        cluster_name = ((found or {}).get("status") or {}).get("rayClusterName")
        return kube.get(RAY, "RayCluster", cluster_name, "llmbatch-jobs") if cluster_name else None

    created = plane.wait_for(f"the RayCluster of RayJob {name}", cluster)
    assert created["spec"]["rayVersion"] == job["spec"]["rayClusterSpec"]["rayVersion"]
    cluster_name = created["metadata"]["name"]
    expected = 1 + sum(g.get("replicas", 0) for g in worker_groups(created["spec"]).values())
    pods = plane.wait_for(
        f"the pods of {cluster_name}",
        lambda: (
            found if len(found := cluster_pods(kube, "llmbatch-jobs", cluster_name)) == expected else None
        ),
    )
    assert_only_the_autoscaler_holds_an_api_token(pods)
    assert not [e for e in object_events(kube, "llmbatch-jobs", name) if e["reason"] == "InvalidRayJobSpec"]


def _break_min_over_max(spec: dict[str, Any]) -> None:
    group = spec["workerGroupSpecs"][0]
    group["minReplicas"], group["maxReplicas"], group["replicas"] = 3, 1, 1


def _break_suspend_with_autoscaler(spec: dict[str, Any]) -> None:
    spec["enableInTreeAutoscaling"] = True
    spec["workerGroupSpecs"][0]["suspend"] = True


def _break_restart_policy_v2(spec: dict[str, Any]) -> None:
    spec["enableInTreeAutoscaling"] = True
    spec["autoscalerOptions"] = {**(spec.get("autoscalerOptions") or {}), "version": "v2"}
    spec["workerGroupSpecs"][0]["template"]["spec"]["restartPolicy"] = "Always"


def _break_resources_twice(spec: dict[str, Any]) -> None:
    group = next(g for g in spec["workerGroupSpecs"] if (g.get("rayStartParams") or {}).get("resources"))
    group["resources"] = {"llmbatch_engine": "1"}


def _break_token_on_old_ray(spec: dict[str, Any]) -> None:
    spec["authOptions"] = {"mode": "token"}
    spec["rayVersion"] = "2.40.0"


@pytest.mark.parametrize(
    "breaker",
    [
        _break_min_over_max,
        _break_suspend_with_autoscaler,
        _break_restart_policy_v2,
        _break_resources_twice,
        _break_token_on_old_ray,
    ],
    ids=lambda f: f.__name__.removeprefix("_break_"),
)
def test_a_rule_validate_kuberay_enforces_is_enforced_by_the_real_operator(
    plane: ControlPlane, kube: KubeClient, breaker: Callable[[dict[str, Any]], None]
) -> None:
    cluster = copy.deepcopy(vd.one(RENDERS["cpu-dev"](), "RayCluster"))
    namespace = "llmbatch-rules"
    ensure_namespace(kube, namespace)
    name = f"rule-{breaker.__name__.removeprefix('_break_').replace('_', '-')}"
    cluster["metadata"] = {"name": name, "namespace": namespace}
    breaker(cluster["spec"])
    assert kuberay.kuberay_semantic_errors(cluster), "validate_kuberay lets it through"
    kube.apply(cluster)  # the CRD schema lets it through: only the operator knows the rule
    plane.wait_for(
        f"an InvalidRayClusterSpec event for {name}",
        lambda: [e for e in object_events(kube, namespace, name) if e["reason"] == "InvalidRayClusterSpec"],
    )
    assert not cluster_pods(kube, namespace, name)
