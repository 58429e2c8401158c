"""gpu-prod-rayservice's serveConfigV2, deployed by the real KubeRay operator on a running head, and
its engine scaled from zero onto a GPU worker the autoscaler adds, all on a pod network.

The pieces are real: the tests' control plane (kube-apiserver, kube-controller-manager's EndpointSlice
and garbage collector controllers, the KubeRay operator; see tests/support/kube_control_plane.py)
holding gpu-prod-rayservice as rendered, and Ray started as the pods the operator made say
(tests/support/pod_runner.py stands in for the kubelet: the head and the CPU worker, with their
``ray start`` options, ``RAY_*`` environment and the token of ``authOptions.secretName``; pods reported
Running). Every pod has a network namespace and a pod IP of its own on one node
(tests/support/pod_network.py), the operator too: it runs in a pod of that network, reaches the API
server through a relay on its own loopback (the ``kubernetes`` Service in a cluster) and the head's
dashboard by the head Service's name (``<cluster>-head-svc.<namespace>.svc.cluster.local:8265``), which
tests/support/cluster_hosts.py resolves as cluster DNS would: KubeRay's head Service is headless, so
the name is the head pod's IP, from the EndpointSlice kube-controller-manager publishes. kube-router's
firewall enforces the overlay's NetworkPolicies on the node, and the operator's pod carries the labels
and namespace of its Helm chart, which they name: every call of the operator to the head passes them
(the dashboard by the base policy, Serve's proxy by the overlay's networkpolicy-operator-serve.yaml).

What it shows:

- the operator submits our serveConfigV2 to that dashboard with the token of
  ``authOptions.secretName`` (Ray's token auth is on); Serve runs every application of it (the batch
  runner's replica on the CPU worker, the engine deployment at zero replicas) and the RayService
  reports them RUNNING;
- the operator's health check of Serve's proxy on the head pod (``GET <pod IP>:8000/-/healthz``, over
  the pod network) passes, the operator labels the head a serve endpoint, kube-controller-manager's
  EndpointSlice controller publishes it, and the RayService is Ready;
- an engine call from zero replicas makes Serve ask for a replica on an ``llmbatch_engine`` node; Ray's
  autoscaler, run in the head pod as its sidecar with its token volume, scales the GPU group 0 -> 1;
  the operator makes the pod, and the replica runs on that node;
- an upgrade (a changed head template): the operator brings up a second cluster while the first
  keeps serving, deploys the config there, switches the serve Service and its EndpointSlice to it
  once its applications run, and deletes the old cluster, whose pods kube-controller-manager's
  garbage collector deletes (the stand-in stops their Ray nodes).

Knobs that differ from gpu-prod-rayservice: the engine runs the fake backend (no model and no GPU here;
the GPU is Ray's logical one, from the pod's ``nvidia.com/gpu`` limit), and the old cluster is deleted
5 s after the switch (default 60).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas.engines import DEPLOYMENT_NAME
from llmbatch.stack.process import stop_tree
from tests.support.cluster_hosts import ClusterHosts
from tests.support.kube_control_plane import (
    ControlPlane,
    KubeClient,
    start_control_plane,
    start_operator,
)
from tests.support.kube_objects import (
    RAY,
    apply_all,
    cluster_pods,
    crds,
    create_operator_secrets,
    ensure_namespace,
    group_replicas,
    publish_root_ca,
    rayservice_cluster,
    vd,
)
from tests.support.kube_router import start_kube_router
from tests.support.pod_checks import JOBS_PORT, NODE, connects, run_plain_pod
from tests.support.pod_network import PodNetwork
from tests.support.pod_runner import LocalPods, register_node
from tests.support.private_ray import PrivateRay

pytestmark = [pytest.mark.integration, pytest.mark.deploy]

DASHBOARD_PORT = 8265  # the head Service's `dashboard` port (KubeRay's default, ours too)
OPERATOR_POD = "kuberay-operator"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    # the stand-in's node sends no heartbeats: no node lifecycle controller (it would taint the node)
    started = start_control_plane(
        tmp_path_factory.mktemp("kube"),
        crds(),
        controllers=("endpointslice", "garbagecollector"),
        operator=False,
    )  # the test starts it in a pod
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def net(plane: ControlPlane, tmp_path: Path) -> Iterator[PodNetwork]:
    """The pod network, with the KubeRay operator running in a pod of it (namespace kuberay-system,
    its Helm chart's labels, which the head's NetworkPolicy names) and kube-router enforcing the
    NetworkPolicies on the node."""
    with PodNetwork() as started:
        kube = plane.client()
        register_node(kube, NODE, started.node_ip)
        ensure_namespace(kube, "kuberay-system", {"kubernetes.io/metadata.name": "kuberay-system"})
        run_plain_pod(
            kube,
            started,
            {
                "spec": {
                    "template": {
                        "metadata": {
                            "labels": {
                                "app.kubernetes.io/name": "kuberay-operator",
                                "app.kubernetes.io/component": "kuberay-operator",
                            }
                        },
                        "spec": {"containers": [{"name": "kuberay-operator", "image": "kuberay"}]},
                    }
                }
            },
            OPERATOR_POD,
            "kuberay-system",
            NODE,
        )
        hosts = ClusterHosts(kube, started.pods[OPERATOR_POD].netns).start()
        relay = started.forward_into_pod(OPERATOR_POD, int(plane.server.rsplit(":", 1)[1]))
        router, pid = None, None
        try:
            router = start_kube_router(plane, started, NODE, tmp_path)
            pid = start_operator(
                plane,
                {},
                server=f"https://127.0.0.1:{relay}",
                wrap=hosts.command,
                call=lambda ready: started.in_pod(OPERATOR_POD, ready),
            )
            yield started
        finally:
            if pid is not None:
                stop_tree(pid)
                plane.pids.remove(pid)
            if router is not None:
                router.stop()
            hosts.stop()
            kube.close()


def _serve_applications(head: PrivateRay, token: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{head.address}/api/serve/applications/", headers={"Authorization": f"Bearer {token}"}
    )

    def fetch() -> dict[str, Any]:
        with urllib.request.urlopen(request, timeout=10) as resp:
            found: dict[str, Any] = json.loads(resp.read())["applications"]
            return found

    return head.call(fetch)


def _app_statuses(kube: KubeClient, namespace: str, name: str) -> dict[str, str]:
    apps = _service_status(kube, namespace, name, "activeServiceStatus").get("applicationStatuses") or {}
    return {app: info.get("status", "") for app, info in apps.items()}


def _ready(kube: KubeClient, namespace: str, name: str) -> bool:
    service = kube.get(RAY, "RayService", name, namespace) or {}
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (service.get("status") or {}).get("conditions", [])
    )


def _call_engine(head: PrivateRay, app: str, log: Path) -> subprocess.Popen[bytes]:
    """A driver in the head pod calling the engine's ``info`` through a Serve handle (waits for a
    replica)."""
    code = (
        "import sys, ray; from ray import serve; "
        "ray.init(address=sys.argv[1], log_to_driver=False); "
        "h = serve.get_deployment_handle(sys.argv[3], app_name=sys.argv[2]); "
        "print(h.info.remote().result(timeout_s=280)); ray.shutdown()"
    )
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": str(head.auth_token)}
    with log.open("wb") as out:
        assert head.place is not None
        argv = [sys.executable, "-c", code, head.gcs_address, app, DEPLOYMENT_NAME]
        return subprocess.Popen(head.place.command(argv), env=env, stdout=out, stderr=subprocess.STDOUT)


def test_the_operator_deploys_our_serve_config_and_an_engine_call_scales_the_gpu_group_from_zero(
    plane: ControlPlane, net: PodNetwork, tmp_path: Path
) -> None:
    kube = plane.client()
    objects = vd.render_overlay("gpu-prod-rayservice")
    service = vd.one(objects, "RayService")
    namespace, name = service["metadata"]["namespace"], service["metadata"]["name"]
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (engine_app,) = [app for app in config["applications"] if app["name"].startswith("llmbatch-engine-")]
    engine_app["args"]["entry"]["engine"]["backend"] = FAKE_BACKEND  # no model, no GPU here
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)
    wanted_apps = {app["name"]: app["import_path"] for app in config["applications"]}
    apply_all(kube, objects, dry_run=False)
    publish_root_ca(kube, namespace, plane.ca_cert)
    token = create_operator_secrets(kube, namespace)["llmbatch-ray-auth"]["auth_token"]
    assert service["spec"]["rayClusterConfig"]["authOptions"]["secretName"] == "llmbatch-ray-auth"

    cluster = plane.wait_for(
        f"the RayCluster of RayService {name}", lambda: rayservice_cluster(kube, namespace, name)
    )
    cluster_name = cluster["metadata"]["name"]
    pods, head_svc = _pods_and_head_service(plane, kube, cluster)
    assert DASHBOARD_PORT in {p["port"] for p in head_svc["spec"]["ports"] if p["name"] == "dashboard"}
    assert head_svc["spec"]["clusterIP"] == "None"  # headless: its name is the head pod's IP

    with LocalPods(kube, tmp_path, net, node=NODE) as local:
        head_pod = next(p for p in pods if p["metadata"]["labels"]["ray.io/node-type"] == "head")
        head = local.run_head(head_pod)
        head_ip = net.pods[head_pod["metadata"]["name"]].ip
        assert head.auth_token == token  # the pod's RAY_AUTH_TOKEN is the Secret's
        # the policies hold: a pod they do not name is refused by the head
        deployments = {d["metadata"]["name"]: d for d in objects if d["kind"] == "Deployment"}
        api = run_plain_pod(kube, net, deployments["llmbatch-api"], "llmbatch-api-test", namespace)
        plane.wait_for(
            "kube-router enforcing the head's policy",
            lambda: not connects(net, api, head_ip, JOBS_PORT),
            timeout=90,
        )
        for pod in pods:
            if pod is not head_pod:
                local.run_worker(pod)

        statuses = plane.wait_for(
            f"RayService {name} reporting every application RUNNING (operator log {plane.operator_log})",
            lambda: (
                found
                if set((found := _app_statuses(kube, namespace, name)).values()) == {"RUNNING"}
                and set(found) == set(wanted_apps)
                else None
            ),
            timeout=300,
        )
        assert set(statuses) == set(wanted_apps)
        # what the operator submitted through the head Service's name, with the token (auth is on)
        deployed = _serve_applications(head, token)
        assert {
            app: info["deployed_app_config"]["import_path"] for app, info in deployed.items()
        } == wanted_apps

        # the operator's health check of Serve's proxy on the head pod passes, so it labels the head
        # as a serve endpoint; with that endpoint published the RayService is Ready
        plane.wait_for(
            f"the head pod labelled ray.io/serve=true (operator log {plane.operator_log})",
            lambda: (
                (kube.get("v1", "Pod", head_pod["metadata"]["name"], namespace) or {})["metadata"][
                    "labels"
                ].get("ray.io/serve")
                == "true"
            ),
        )
        plane.wait_for(f"RayService {name} Ready", lambda: _ready(kube, namespace, name))
        serve_svc = _serve_service(kube, namespace)
        # kube-controller-manager's slice; KubeRay labels the workers serve endpoints too, though
        # with proxy_location HeadOnly no proxy runs there (the dispatcher uses the head Service)
        assert head_ip in _serve_endpoints(kube, serve_svc)

        # an engine call from zero replicas: Serve asks for a replica on an `llmbatch_engine` node,
        # Ray's autoscaler (the head pod's sidecar) scales the GPU group from 0, the operator makes
        # the pod, and the replica lands on it
        scaler = local.run_autoscaler(plane.server, head_pod)
        caller = _call_engine(head, engine_app["name"], tmp_path / "caller.log")
        gpu_pod = plane.wait_for(
            f"a gpu pod for the engine replica (autoscaler log {scaler.log})",
            lambda: next(
                (
                    p
                    for p in cluster_pods(kube, namespace, cluster_name)
                    if p["metadata"]["labels"]["ray.io/group"] == "gpu"
                ),
                None,
            ),
            timeout=240,
        )
        gpu_node = local.run_worker(gpu_pod)
        try:
            assert caller.wait(timeout=300) == 0, (tmp_path / "caller.log").read_text()[-3000:]
        finally:
            if caller.poll() is None:
                caller.kill()
                caller.wait()
        replicas = _serve_applications(head, token)[engine_app["name"]]["deployments"][DEPLOYMENT_NAME][
            "replicas"
        ]
        assert [(r["state"], r["node_id"]) for r in replicas] == [("RUNNING", gpu_node.node_id)]
        assert group_replicas(kube, namespace, cluster_name)["gpu"] == 1

        _upgrade_switches_clusters(
            plane, kube, net, service, config, cluster_name, local, tmp_path / "upgrade"
        )
    kube.close()


def _pods_and_head_service(
    plane: ControlPlane, kube: KubeClient, cluster: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Once the operator made them: every pod of ``cluster`` (head and the workers' replicas) and its
    head Service."""
    namespace, name = cluster["metadata"]["namespace"], cluster["metadata"]["name"]
    expected = 1 + sum(g.get("replicas", 0) for g in cluster["spec"]["workerGroupSpecs"])
    pods = plane.wait_for(
        f"the pods of {name}",
        lambda: found if len(found := cluster_pods(kube, namespace, name)) == expected else None,
    )
    head_svc = plane.wait_for(
        f"the head Service of {name}",
        lambda: next(
            (
                s
                for s in kube.list("v1", "Service", namespace, selector=f"ray.io/cluster={name}")
                if s["metadata"]["labels"].get("ray.io/node-type") == "head"
            ),
            None,
        ),
    )
    return pods, head_svc


def _serve_service(kube: KubeClient, namespace: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        s
        for s in kube.list("v1", "Service", namespace)
        if (s["spec"].get("selector") or {}).get("ray.io/serve") == "true"
    )
    return found


def _serve_endpoints(kube: KubeClient, service: dict[str, Any]) -> list[str]:
    """The ready addresses of ``service``'s EndpointSlices made by kube-controller-manager."""
    meta = service["metadata"]
    slices = kube.list(
        "discovery.k8s.io/v1",
        "EndpointSlice",
        meta["namespace"],
        selector=f"kubernetes.io/service-name={meta['name']}",
    )
    return sorted(
        address
        for s in slices
        if s["metadata"]["labels"].get("endpointslice.kubernetes.io/managed-by")
        == "endpointslice-controller.k8s.io"
        for e in s.get("endpoints") or []
        if (e.get("conditions") or {}).get("ready")
        for address in e["addresses"]
    )


def _service_status(kube: KubeClient, namespace: str, name: str, which: str) -> dict[str, Any]:
    service = kube.get(RAY, "RayService", name, namespace) or {}
    found: dict[str, Any] = (service.get("status") or {}).get(which) or {}
    return found


def _upgrade_switches_clusters(
    plane: ControlPlane,
    kube: KubeClient,
    net: PodNetwork,
    service: dict[str, Any],
    config: dict[str, Any],
    old_cluster: str,
    old_pods: LocalPods,
    run_dir: Path,
) -> None:
    """A new release of the RayService's cluster (a changed head template): the operator brings up a
    second cluster beside the serving one, deploys the config there, points the serve Service at it
    once its applications run, and deletes the old cluster (its pods go with it, by
    kube-controller-manager's garbage collector). The new pods are pods of the same network."""
    namespace, name = service["metadata"]["namespace"], service["metadata"]["name"]
    head_container = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head_container["env"] = [*head_container.get("env", []), {"name": "LLMBATCH_RELEASE", "value": "2"}]
    service["spec"]["rayClusterDeletionDelaySeconds"] = 5  # default 60
    kube.apply(service)
    new_cluster = plane.wait_for(
        f"a pending cluster of RayService {name}",
        lambda: _service_status(kube, namespace, name, "pendingServiceStatus").get("rayClusterName"),
    )
    assert new_cluster != old_cluster
    assert old_pods.head is not None
    old_head_ip = old_pods.head.host
    # while the new cluster comes up, the old one serves
    assert _service_status(kube, namespace, name, "activeServiceStatus")["rayClusterName"] == old_cluster
    assert _serve_service(kube, namespace)["spec"]["selector"]["ray.io/cluster"] == old_cluster
    assert old_head_ip in _serve_endpoints(kube, _serve_service(kube, namespace))

    cluster = plane.wait_for(
        f"RayCluster {new_cluster}", lambda: kube.get(RAY, "RayCluster", new_cluster, namespace)
    )
    pods, _ = _pods_and_head_service(plane, kube, cluster)
    head_pod = next(p for p in pods if p["metadata"]["labels"]["ray.io/node-type"] == "head")
    with LocalPods(kube, run_dir, net, node=NODE) as local:
        head = local.run_head(head_pod)
        head_ip = head.host
        for pod in pods:
            if pod is not head_pod:
                local.run_worker(pod)

        plane.wait_for(
            f"RayService {name} switched to {new_cluster} (operator log {plane.operator_log})",
            lambda: (
                _service_status(kube, namespace, name, "activeServiceStatus").get("rayClusterName")
                == new_cluster
            ),
            timeout=300,
        )
        assert _app_statuses(kube, namespace, name) == {
            app["name"]: "RUNNING" for app in config["applications"]
        }
        assert not _service_status(kube, namespace, name, "pendingServiceStatus").get("rayClusterName")
        assert _serve_service(kube, namespace)["spec"]["selector"]["ray.io/cluster"] == new_cluster
        plane.wait_for(
            "the serve Service's endpoints on the new cluster only",
            lambda: (
                head_ip in (found := _serve_endpoints(kube, _serve_service(kube, namespace)))
                and old_head_ip not in found
            ),
        )
        assert set(_serve_applications(head, str(head.auth_token))) == {
            app["name"] for app in config["applications"]
        }
        # its pods are deleted by the garbage collector, and their nodes stopped by the kubelet
        plane.wait_for(
            f"the old cluster {old_cluster} deleted, with its pods",
            lambda: (
                kube.get(RAY, "RayCluster", old_cluster, namespace) is None
                and (old_pods.reap() or True)
                and not cluster_pods(kube, namespace, old_cluster)
            ),
            timeout=120,
        )
        assert old_pods.head.pid is None  # stopped
        plane.wait_for(f"RayService {name} Ready on {new_cluster}", lambda: _ready(kube, namespace, name))
