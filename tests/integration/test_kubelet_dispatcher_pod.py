"""cpu-dev's dispatcher Deployment run by a real kubelet (tests/support/kube_node.py), its brokers
out of reach: what its probes do in an outage.

The Deployment is cpu-dev's as rendered, with the one change every pod on the test node has (the
host-userland image, tests/support/real_ray_pods.py, started as the dispatcher image starts it) and
one replica. kube-controller-manager's Deployment and ReplicaSet controllers make the pod,
kube-scheduler binds it, the kubelet runs it with cpu-dev's securityContext (user 10001, read-only
root filesystem, no capabilities). Nothing answers at ``kafka:9092`` or ``redis:6379`` here.

What it shows: the startup and liveness probes (``/livez``) pass while Kafka and Redis cannot be
reached, so an outage does not restart the dispatcher; the readiness probe (``/readyz``) fails, so the
pod stays out of its Service's ready endpoints, and ``/readyz`` says which dependency is missing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.kube_control_plane import ControlPlane, KubeClient, start_control_plane
from tests.support.kube_node import KubeletNode, kubelet_node
from tests.support.kube_objects import apply_all, crds, ensure_namespace, vd
from tests.support.real_ray_pods import PRIVILEGED, dispatcher_on_host_userland

pytestmark = [pytest.mark.integration, pytest.mark.deploy]

DEPLOYMENT = "llmbatch-dispatcher"
# the liveness probe fails a container after 3 x 10 s: watched for longer than that
WATCH_S = 45


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = start_control_plane(
        tmp_path_factory.mktemp("plane"),
        crds(),
        operator=False,
        scheduler=True,
        controllers=("endpointslice", "nodelifecycle", "deployment", "replicaset"),
    )
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def node(plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeletNode]:
    with kubelet_node(plane, tmp_path_factory.mktemp("node")) as node:
        yield node


def _dispatcher_pods(kube: KubeClient, namespace: str) -> list[dict[str, Any]]:
    return kube.list("v1", "Pod", namespace, "app.kubernetes.io/name=llmbatch-dispatcher")


def _condition(pod: dict[str, Any], kind: str) -> bool:
    return any(
        c["type"] == kind and c["status"] == "True" for c in pod.get("status", {}).get("conditions") or []
    )


def test_the_dispatcher_pod_lives_through_a_broker_outage_and_stays_unready(
    plane: ControlPlane, node: KubeletNode
) -> None:
    kube = plane.client()
    objects = vd.render_overlay("cpu-dev")
    deployment = dispatcher_on_host_userland(
        next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == DEPLOYMENT)
    )
    deployment["spec"]["replicas"] = 1
    namespace = deployment["metadata"]["namespace"]
    ensure_namespace(kube, namespace, PRIVILEGED)  # hostPath volumes: see real_ray_pods
    apply_all(kube, [o for o in objects if o["kind"] not in ("Namespace", "RayCluster")], dry_run=False)

    def started() -> dict[str, Any] | None:
        assert node.running(), node.log()[-3000:]
        pods = _dispatcher_pods(kube, namespace)
        statuses = pods[0].get("status", {}).get("containerStatuses") or [] if pods else []
        return pods[0] if statuses and statuses[0].get("started") else None

    try:
        pod = plane.wait_for("the dispatcher's startup probe passed", started, timeout=240)
    except AssertionError:
        for log in sorted(node.pod_logs.rglob("*.log")):
            print(log, log.read_text()[-3000:])
        raise
    ip = pod["status"]["podIP"]

    def probe(path: str) -> httpx.Response:
        return node.net.on_node(lambda: httpx.get(f"http://{ip}:9464{path}", timeout=10))

    time.sleep(WATCH_S)  # several liveness periods of the outage
    pod = kube.get("v1", "Pod", pod["metadata"]["name"], namespace) or {}
    (status,) = pod["status"]["containerStatuses"]
    assert status["restartCount"] == 0 and "running" in status["state"], status
    assert not _condition(pod, "Ready")
    assert probe("/livez").status_code == 200
    ready = probe("/readyz")
    assert ready.status_code == 503, ready.text
    assert "kafka" in ready.text and "unavailable" in ready.text, ready.text
    # out of its Service (the metrics one): the EndpointSlice lists the pod, not ready
    (service,) = [
        o
        for o in objects
        if o["kind"] == "Service"
        and o["spec"].get("selector", {}).get("app.kubernetes.io/name") == DEPLOYMENT
    ]
    slices = kube.list(
        "discovery.k8s.io/v1",
        "EndpointSlice",
        namespace,
        f"kubernetes.io/service-name={service['metadata']['name']}",
    )
    endpoints = [e for s in slices for e in s.get("endpoints") or []]
    assert [e["addresses"] for e in endpoints] == [[ip]], slices
    assert endpoints[0]["conditions"]["ready"] is False
    kube.close()
