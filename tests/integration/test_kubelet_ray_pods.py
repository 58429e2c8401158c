"""cpu-dev's Ray pods as real containers, run by a real kubelet (tests/support/kube_node.py).

The KubeRay operator builds the pods from cpu-dev's RayCluster as rendered; the only changes are the
image (tests/support/real_ray_pods.py: this machine's /usr and the checkout's venv mounted
read-only, for want of a Ray image) and the worker group (one small worker, from zero, without the
init container that fetches the model). The kubelet runs the pods: containerd and runc make their
containers, with cpu-dev's securityContext (user 1000, no capabilities, the runtime's default
seccomp profile), the environment the kubelet resolves from Secrets, the autoscaler's service
account token in its projected volume, and the cluster's DNS (CoreDNS) as their nameserver.

What it shows: the head pod turns Ready by the kubelet's own probes (KubeRay's exec probes of the
raylet and the GCS); Ray's processes run as user 1000 with no capabilities under seccomp; Ray's
token reaches them from the Secret (the pod object holds only the reference), and the Jobs API on
the pod IP answers 401 without it and 200 with it; the autoscaler container, with nothing but the
token the kubelet mounted, scales the worker group from 0 to 1 when a driver asks for a CPU; the
worker pod the operator then makes (with KubeRay's ``wait-gcs-ready`` init container) resolves the
head's headless Service to the head pod's IP and joins it over the pod network.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.support.cluster_dns import CLUSTER_DOMAIN
from tests.support.kube_control_plane import ROOT, ControlPlane, KubeClient, start_control_plane
from tests.support.kube_node import KubeletNode, kubelet_node
from tests.support.kube_objects import (
    apply_all,
    cluster_pods,
    crds,
    ensure_namespace,
    group_replicas,
    publish_root_ca,
    vd,
)
from tests.support.real_ray_pods import PRIVILEGED, on_host_userland

pytestmark = [pytest.mark.integration, pytest.mark.deploy]

RESOLVE = "import socket; print(*sorted({{a[4][0] for a in socket.getaddrinfo({!r}, 6379)}}))"
LIVE_NODES = (
    "import ray; ray.init(address='auto', log_to_driver=False); "
    "print(*(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))"
)
WITHDRAW = (
    "import ray; from ray.autoscaler.sdk import request_resources; "
    "ray.init(address='auto', log_to_driver=False); request_resources(bundles=[])"
)
REQUEST_A_CPU = (
    "import ray; from ray.autoscaler.sdk import request_resources; "
    "ray.init(address='auto', log_to_driver=False); request_resources(num_cpus=1)"
)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    # kube-scheduler binds the pods to the node once the node lifecycle controller has lifted its
    # not-ready taint; the EndpointSlice controller publishes the head Service's pod IP, which CoreDNS
    # answers from
    plane = start_control_plane(
        tmp_path_factory.mktemp("plane"),
        crds(),
        controllers=("endpointslice", "nodelifecycle"),
        scheduler=True,
    )
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def node(plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeletNode]:
    with kubelet_node(plane, tmp_path_factory.mktemp("node")) as node:
        yield node


def _small_worker_group(cluster: dict[str, Any]) -> None:
    """One CPU worker group from 0 replicas, sized for this 2-core node (cpu-dev asks 4 CPUs), without
    the init container that fetches the model (it asks a CPU of its own, and no engine runs here);
    idle workers go after 5 s."""
    (group,) = cluster["spec"]["workerGroupSpecs"]
    group.update(replicas=0, minReplicas=0, maxReplicas=1)
    cluster["spec"]["autoscalerOptions"]["idleTimeoutSeconds"] = 5  # cpu-dev: 600
    spec = group["template"]["spec"]
    spec["initContainers"] = [c for c in spec.get("initContainers", []) if c["name"] != "prepare-model"]
    (ray,) = group["template"]["spec"]["containers"]
    ray["resources"] = {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}}


def _pod_ready(pod: dict[str, Any] | None) -> bool:
    conditions = (pod or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _wait_ready(
    plane: ControlPlane, kube: KubeClient, node: KubeletNode, namespace: str, cluster: str, node_type: str
) -> dict[str, Any]:
    """The cluster's first pod of ``node_type`` (head, worker) once the kubelet reports it Ready;
    on a timeout, the pods' statuses and container logs are printed."""

    def ready() -> dict[str, Any] | None:
        assert node.running(), node.log()[-3000:]
        pods = [
            p
            for p in cluster_pods(kube, namespace, cluster)
            if p["metadata"]["labels"]["ray.io/node-type"] == node_type
        ]
        return pods[0] if pods and _pod_ready(pods[0]) else None

    try:
        found: dict[str, Any] = plane.wait_for(f"the {node_type} pod Ready", ready, timeout=300)
    except AssertionError:
        for pod in cluster_pods(kube, namespace, cluster):
            print(json.dumps(pod.get("status"), indent=1)[-2500:])
        for log in sorted(node.pod_logs.rglob("*.log")):
            print(log, log.read_text()[-2500:])
        raise
    return found


def _ray_processes(node: KubeletNode, name: str) -> list[psutil.Process]:
    found = []
    for pid in node.container_pids():
        try:
            proc = psutil.Process(pid)
            if proc.name() == name:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _status_fields(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, v in (line.split(":", 1) for line in lines)}


def test_cpu_dev_head_pod_runs_for_real_and_its_autoscaler_scales_with_the_mounted_token(
    plane: ControlPlane, node: KubeletNode
) -> None:
    kube: KubeClient = plane.client()
    objects = vd.render_overlay("cpu-dev")
    cluster = on_host_userland(vd.one(objects, "RayCluster"))
    _small_worker_group(cluster)
    namespace, name = cluster["metadata"]["namespace"], cluster["metadata"]["name"]
    ensure_namespace(kube, namespace, PRIVILEGED)  # hostPath volumes: see real_ray_pods
    publish_root_ca(kube, namespace, plane.ca_cert)
    apply_all(kube, [o for o in objects if o["kind"] != "Namespace"], dry_run=False)
    auth = next(
        o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].startswith("llmbatch-ray-auth")
    )
    token = (auth.get("stringData") or {}).get("auth_token") or base64.b64decode(
        auth["data"]["auth_token"]
    ).decode()

    head = _wait_ready(plane, kube, node, namespace, name, "head")
    statuses = {s["name"]: s for s in head["status"]["containerStatuses"]}
    assert set(statuses) == {"ray-head", "autoscaler"}
    assert all(s["restartCount"] == 0 and "running" in s["state"] for s in statuses.values()), statuses

    # Ray as cpu-dev's securityContext says: user 1000, no capability, seccomp filter (mode 2)
    (gcs,) = _ray_processes(node, "gcs_server")
    fields = _status_fields(gcs.pid)
    assert fields["Uid"].split()[0] == "1000" and fields["Gid"].split()[0] == "100", fields
    assert int(fields["CapEff"], 16) == 0 and fields["Seccomp"] == "2", fields
    # the token from the Secret, resolved by the kubelet; the pod object has only the reference
    assert gcs.environ().get("RAY_AUTH_TOKEN") == token
    assert token not in json.dumps(head)

    ip = head["status"]["podIP"]
    assert ip.startswith(node.net.subnet + ".") and ip != node.net.node_ip

    def jobs(auth_token: str | None) -> int:
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        return httpx.get(f"http://{ip}:8265/api/jobs/", headers=headers, timeout=10).status_code

    assert node.net.on_node(lambda: jobs(None)) == 401
    assert node.net.on_node(lambda: jobs(token)) == 200

    # a driver in the head asks for a CPU; only the autoscaler, with its mounted token, can scale
    python = str(ROOT / ".venv" / "bin" / "python")
    node.exec_in(head, "ray-head", [python, "-c", REQUEST_A_CPU])
    plane.wait_for(
        "the autoscaler scaled the worker group to 1",
        lambda: group_replicas(kube, namespace, name).get("cpu") == 1,
        timeout=180,
    )

    # the worker pod the operator makes finds the head by its Service's name (the cluster's DNS) and
    # joins it over the pod network: Ray then has two live nodes
    worker = _wait_ready(plane, kube, node, namespace, name, "worker")
    (service,) = kube.list("v1", "Service", namespace, f"ray.io/cluster={name},ray.io/node-type=head")
    fqdn = f"{service['metadata']['name']}.{namespace}.svc.{CLUSTER_DOMAIN}"
    resolved = node.exec_in(worker, "ray-worker", [python, "-c", RESOLVE.format(fqdn)]).split()
    assert resolved == [ip], (fqdn, resolved)
    alive = node.exec_in(head, "ray-head", [python, "-c", LIVE_NODES]).split()
    assert sorted(alive) == sorted([ip, worker["status"]["podIP"]]), alive
    worker_ip = worker["status"]["podIP"]
    (worker_raylet,) = [
        p for p in _ray_processes(node, "raylet") if f"--node_ip_address={worker_ip}" in p.cmdline()
    ]

    # demand withdrawn: the idle worker is drained, the group goes back to 0, the operator deletes the
    # pod and the kubelet stops its containers and removes it
    node.exec_in(head, "ray-head", [python, "-c", WITHDRAW])
    plane.wait_for(
        "the worker pod deleted after the scale-down",
        lambda: (
            group_replicas(kube, namespace, name).get("cpu") == 0
            and kube.get("v1", "Pod", worker["metadata"]["name"], namespace) is None
        ),
        timeout=240,
    )
    assert not worker_raylet.is_running()
    assert node.exec_in(head, "ray-head", [python, "-c", LIVE_NODES]).split() == [ip]
    kube.close()
