"""gpu-prod-rayservice's serveConfigV2, deployed by the real KubeRay operator on a running head.

The pieces are real: the tests' control plane (kube-apiserver, the KubeRay operator; see
tests/support/kube_control_plane.py) holding gpu-prod-rayservice as rendered, and Ray on this machine
started as the pods the operator made say (tests/support/pod_runner.py stands in for the kubelet:
the head and the CPU worker, with their ``ray start`` options, ``RAY_*`` environment and the token of
``authOptions.secretName``; pods reported Running). The operator reaches the head's dashboard by its
Service name (``<cluster>-head-svc.<namespace>.svc.cluster.local:8265``) through
tests/support/service_routes.py, which stands in for cluster DNS and kube-proxy.

What it shows: the operator submits our serveConfigV2 to that dashboard with the token of
``authOptions.secretName`` (Ray's token auth is on), Serve runs every application of it (the batch
runner's replica on the CPU worker, the engine deployment at zero replicas until asked), and the
RayService reports them RUNNING. One knob differs from gpu-prod-rayservice: Serve's HTTP proxy binds
127.0.0.1 on a free port instead of 0.0.0.0:8000.

Not shown: the RayService's Ready condition. It counts the serve Service's endpoints, which need
EndpointSlices (kube-controller-manager's, not run here) and the operator's proxy health check on
each pod's ``serve`` port.
"""

from __future__ import annotations

import json
import secrets
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmbatch.stack.process import free_port
from tests.support.kube_control_plane import ControlPlane, KubeClient, start_control_plane
from tests.support.kube_objects import RAY, apply_all, cluster_pods, crds, vd
from tests.support.pod_runner import run_head_pod, run_worker_pod
from tests.support.private_ray import PrivateRay, PrivateRayWorker
from tests.support.service_routes import ServiceRoutes

pytestmark = pytest.mark.integration

DASHBOARD_PORT = 8265  # the head Service's `dashboard` port (KubeRay's default, ours too)


@pytest.fixture(scope="module")
def routes() -> Iterator[ServiceRoutes]:
    started = ServiceRoutes().start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, routes: ServiceRoutes) -> Iterator[ControlPlane]:
    started = start_control_plane(tmp_path_factory.mktemp("kube"), crds(),
                                  operator_env={"HTTP_PROXY": routes.url, "NO_PROXY": "127.0.0.1,localhost"})
    try:
        yield started
    finally:
        started.stop()


def _operators_secrets(kube: KubeClient, namespace: str) -> str:
    """The Secrets gpu-prod's kustomization.yaml has the operator create; returns the Ray token."""
    token = secrets.token_hex(32)
    for name, data in (("llmbatch-credentials", {k: secrets.token_hex(16) for k in (
                           "s3-access-key", "s3-secret-key", "redis-password", "replay-key")}),
                       ("llmbatch-ray-auth", {"auth_token": token})):
        kube.apply({"apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": name, "namespace": namespace}, "stringData": data})
    return token


def _owned_cluster(kube: KubeClient, namespace: str, service: str) -> dict[str, Any] | None:
    for cluster in kube.list(RAY, "RayCluster", namespace):
        if any(ref["kind"] == "RayService" and ref["name"] == service
               for ref in cluster["metadata"].get("ownerReferences", [])):
            return cluster
    return None


def _serve_applications(head: PrivateRay, token: str) -> dict[str, Any]:
    request = urllib.request.Request(f"{head.address}/api/serve/applications/",
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        found: dict[str, Any] = json.loads(resp.read())["applications"]
        return found


def _app_statuses(kube: KubeClient, namespace: str, name: str) -> dict[str, str]:
    service = kube.get(RAY, "RayService", name, namespace) or {}
    apps = ((service.get("status") or {}).get("activeServiceStatus") or {}).get("applicationStatuses") or {}
    return {app: info.get("status", "") for app, info in apps.items()}


def test_the_operator_deploys_our_serve_config_with_the_token_of_auth_options(
        plane: ControlPlane, routes: ServiceRoutes, tmp_path: Path) -> None:
    kube = plane.client()
    objects = vd.render_overlay("gpu-prod-rayservice")
    service = vd.one(objects, "RayService")
    namespace, name = service["metadata"]["namespace"], service["metadata"]["name"]
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    config["http_options"] = {**config["http_options"], "host": "127.0.0.1", "port": free_port()}
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)
    wanted_apps = {app["name"]: app["import_path"] for app in config["applications"]}
    apply_all(kube, objects, dry_run=False)
    token = _operators_secrets(kube, namespace)
    assert service["spec"]["rayClusterConfig"]["authOptions"]["secretName"] == "llmbatch-ray-auth"

    cluster = plane.wait_for(f"the RayCluster of RayService {name}",
                             lambda: _owned_cluster(kube, namespace, name))
    cluster_name = cluster["metadata"]["name"]
    expected = 1 + sum(g.get("replicas", 0) for g in cluster["spec"]["workerGroupSpecs"])
    pods = plane.wait_for(f"the pods of {cluster_name}", lambda: (
        found if len(found := cluster_pods(kube, namespace, cluster_name)) == expected else None))
    head_svc = plane.wait_for(f"the head Service of {cluster_name}", lambda: next(
        (s for s in kube.list("v1", "Service", namespace, selector=f"ray.io/cluster={cluster_name}")
         if s["metadata"]["labels"].get("ray.io/node-type") == "head"), None))
    assert DASHBOARD_PORT in {p["port"] for p in head_svc["spec"]["ports"] if p["name"] == "dashboard"}

    head: PrivateRay | None = None
    nodes: list[PrivateRayWorker] = []
    try:
        head_pod = next(p for p in pods if p["metadata"]["labels"]["ray.io/node-type"] == "head")
        head = run_head_pod(kube, head_pod, tmp_path / "ray")
        assert head.auth_token == token  # the pod's RAY_AUTH_TOKEN is the Secret's
        service_host = f"{head_svc['metadata']['name']}.{namespace}.svc.cluster.local"
        routes.route(service_host, DASHBOARD_PORT, head.dashboard)
        for pod in pods:
            if pod is not head_pod:
                nodes.append(run_worker_pod(kube, head, pod, tmp_path / "nodes"))

        statuses = plane.wait_for(
            f"RayService {name} reporting every application RUNNING (proxy saw {routes.seen[-5:]})",
            lambda: (found if set((found := _app_statuses(kube, namespace, name)).values()) == {"RUNNING"}
                     and set(found) == set(wanted_apps) else None), timeout=300)
        assert set(statuses) == set(wanted_apps)
        deployed = _serve_applications(head, token)
        assert {app: info["deployed_app_config"]["import_path"]
                for app, info in deployed.items()} == wanted_apps
        # the operator's submissions, through the head Service's name (a 502 is one sent before the
        # route was there; the operator retries)
        submitted = [status for method, url, status in routes.seen if method == "PUT"
                     and url == f"http://{service_host}:{DASHBOARD_PORT}/api/serve/applications/"]
        assert 200 in submitted and not {401, 403} & set(submitted), routes.seen
    finally:
        for node in nodes:
            node.stop()
        if head is not None:
            head.stop()
            head.remove_temp()
        kube.close()
