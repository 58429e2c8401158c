"""What the network policy tests do on a :class:`~tests.support.pod_network.PodNetwork`: run a pod
that only stands for its labels, and connect from inside a pod (so the packets carry its pod IP)."""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.kube_control_plane import ControlPlane, KubeClient
from tests.support.kube_objects import apply_all, cluster_pods, vd
from tests.support.pod_network import PodNetwork
from tests.support.pod_runner import report_running

NODE = "node-a"  # the node the kubelet stand-in registers
JOBS_PORT = 8265  # the Ray head's dashboard and Jobs API, as in the pod spec


def connects(net: PodNetwork, pod: str, ip: str, port: int) -> bool:
    def attempt() -> bool:
        try:
            with socket.create_connection((ip, port), timeout=3):
                return True
        except OSError:  # refused (kube-router rejects), or timed out
            return False

    return net.in_pod(pod, attempt)


def jobs_api(
    net: PodNetwork, pod: str, ip: str, token: str | None, *, port: int = JOBS_PORT, ca: Path | None = None
) -> int:
    """The status of ``GET /api/jobs/`` on the head at ``ip`` from pod ``pod`` (over TLS, checked
    against ``ca``, when given)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{'https' if ca else 'http'}://{ip}:{port}/api/jobs/"
    verify = ssl.create_default_context(cafile=str(ca)) if ca else True
    return net.in_pod(pod, lambda: httpx.get(url, headers=headers, timeout=10, verify=verify).status_code)


def run_plain_pod(
    kube: KubeClient,
    net: PodNetwork,
    template_of: dict[str, Any],
    name: str,
    namespace: str,
    node: str = NODE,
) -> str:
    """A pod made from a Deployment's template (its labels are what the policies select), bound to
    ``node``, given a pod IP on ``net`` (that node's network) and reported Running; nothing runs in
    it but the test's own connections."""
    template = template_of["spec"]["template"]
    pod = kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }
    )
    kube.bind(namespace, name, node)
    report_running(kube, pod, net.add_pod(name).ip, net.node_ip)
    return name


@dataclass(frozen=True)
class AppliedCluster:
    """A rendered overlay applied for real, once the operator made its RayCluster's pods."""

    namespace: str
    deployments: dict[str, dict[str, Any]]  # the overlay's Deployments by name
    head: dict[str, Any]  # the head pod
    worker: dict[str, Any]  # the one worker pod


def apply_one_worker_cluster(
    plane: ControlPlane, kube: KubeClient, objects: list[dict[str, Any]]
) -> AppliedCluster:
    """Apply ``objects`` (cpu-dev's render: a RayCluster with one worker) and wait for the operator's
    head and worker pods."""
    cluster = vd.one(objects, "RayCluster")
    namespace, name = cluster["metadata"]["namespace"], cluster["metadata"]["name"]
    apply_all(kube, objects, dry_run=False)
    pods = plane.wait_for(
        f"the head and worker pods of {name}",
        lambda: found if len(found := cluster_pods(kube, namespace, name)) == 2 else None,
    )

    def of_type(node_type: str) -> dict[str, Any]:
        found: dict[str, Any] = next(
            p for p in pods if p["metadata"]["labels"]["ray.io/node-type"] == node_type
        )
        return found

    return AppliedCluster(
        namespace,
        {d["metadata"]["name"]: d for d in objects if d["kind"] == "Deployment"},
        of_type("head"),
        of_type("worker"),
    )
