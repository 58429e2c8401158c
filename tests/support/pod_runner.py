"""The tests' stand-in for a kubelet, used by the autoscaler, RayService and policy tests (a real
kubelet node is :mod:`tests.support.kube_node`): run a Ray pod the KubeRay operator made as local
Ray processes started the way the pod's container would start them, and report the pod Running and
Ready through the API server.

A head pod becomes a :class:`PrivateRay` and a worker pod a :class:`PrivateRayWorker` of it: the
CPUs, custom resources and ``--no-monitor`` of the pod's ``ray start``, its GPU limit as Ray's GPU
count, its ``RAY_*`` environment (the token from its Secret, the pod's name as the node's cloud
instance id). Addresses and ports are this machine's, not the pod's, unless a
:class:`~tests.support.pod_network.PodNetwork` is given: then each pod runs in a network namespace of
its own, on its pod IP and the ports of its pod spec. A pod is reported Running and Ready once its
readiness probe, run as the kubelet runs it (no credentials), passes. The head pod's ``autoscaler``
container runs as Ray's own KubeRay autoscaler with the files of its token volume. Given a node name,
:class:`LocalPods` registers that node, binds its pods to it and finishes their deletion.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmbatch.stack.ports import free_port
from llmbatch.stack.process import spawn, stop_tree
from tests.support.kube_control_plane import ROOT, KubeClient
from tests.support.kube_objects import container, container_env, project_volume, ray_container, start_command
from tests.support.pod_network import PodNetwork
from tests.support.private_ray import PodPlace, PrivateRay, PrivateRayWorker

# `ray start` options of a pod that hold on this machine too (the rest name its ports and addresses)
KEPT_FLAGS = {"--no-monitor"}
DEFAULT_AGENT_PORT = "52365"  # Ray's, when a pod's `ray start` names none
DEFAULT_DASHBOARD_PORT = "8265"


def ray_start_options(pod: dict[str, Any]) -> tuple[dict[str, str], set[str]]:
    """The ``--name=value`` options and the bare flags of the pod's ``ray start``."""
    argv = shlex.split(start_command(pod).split(";")[-1])
    options = dict(a.removeprefix("--").split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    return options, {a for a in argv if a.startswith("--") and "=" not in a}


def ray_env(kube: KubeClient, pod: dict[str, Any]) -> dict[str, str]:
    """The ``RAY_*`` variables of the pod's Ray container, as the kubelet resolves them."""
    env = container_env(kube, pod, ray_container(pod)["name"])
    return {k: v for k, v in env.items() if k.startswith("RAY_") and k != "RAY_ADDRESS"}


def _place(net: PodNetwork | None, pod: dict[str, Any], pod_ip: str) -> tuple[PodPlace | None, str, str]:
    """Where ``pod`` runs: on this machine (``pod_ip``, node 127.0.0.1), or in a new pod of ``net``
    (its pod IP, the net's node address); returns the place and the pod's and node's addresses."""
    if net is None:
        return None, pod_ip, "127.0.0.1"
    place = PodPlace(net, net.add_pod(pod["metadata"]["name"]))
    return place, place.pod.ip, net.node_ip


def run_head_pod(
    kube: KubeClient,
    pod: dict[str, Any],
    run_dir: Path,
    pod_ip: str = "127.0.0.1",
    net: PodNetwork | None = None,
) -> PrivateRay:
    """Start the head pod's Ray head here; report the pod Running with ``pod_ip``. With ``net``, the
    head runs in a pod of that network instead, on the pod's IP and ports (its metrics port too)."""
    options, flags = ray_start_options(pod)
    env = ray_env(kube, pod)
    place, pod_ip, host_ip = _place(net, pod, pod_ip)
    kept = sorted(flags & KEPT_FLAGS)
    if place is not None and "metrics-export-port" in options:
        kept.append(f"--metrics-export-port={options['metrics-export-port']}")
    head = PrivateRay(
        run_dir,
        num_cpus=int(options.get("num-cpus", "1")),
        auth_token=env.pop("RAY_AUTH_TOKEN", None),
        start_args=kept,
        env=env,
        place=place,
    )
    if place is not None:  # the pod has its IP once its sandbox is up, long before it is Ready
        report_running(kube, pod, pod_ip, host_ip, ready=False)
    head.start()
    try:
        wait_ready(
            pod,
            {
                int(options.get("dashboard-agent-listen-port", DEFAULT_AGENT_PORT)): head.agent,
                int(options.get("dashboard-port", DEFAULT_DASHBOARD_PORT)): head.dashboard,
            },
            place=place,
        )
        report_running(kube, pod, pod_ip, host_ip)
    except BaseException:
        head.stop()
        head.remove_temp()
        raise
    return head


def run_worker_pod(
    kube: KubeClient,
    head: PrivateRay,
    pod: dict[str, Any],
    run_dir: Path,
    pod_ip: str = "127.0.0.1",
    net: PodNetwork | None = None,
) -> PrivateRayWorker:
    """Start the worker pod's Ray node here, joined to ``head``; report the pod Running with
    ``pod_ip``. With ``net``, the node runs in a pod of that network, joined to the head by its pod
    IP (what the head Service's name resolves to: KubeRay makes it headless)."""
    options, flags = ray_start_options(pod)
    place, pod_ip, host_ip = _place(net, pod, pod_ip)
    gpus = ray_container(pod).get("resources", {}).get("limits", {}).get("nvidia.com/gpu", "0")
    env = ray_env(kube, pod)
    env.pop("RAY_AUTH_TOKEN", None)  # the head's, which the node is given anyway
    node = PrivateRayWorker(
        head,
        run_dir,
        num_cpus=int(options.get("num-cpus", "1")),
        resources=json.loads(options.get("resources", "{}")),
        name=pod["metadata"]["name"],
        start_args=[f"--num-gpus={gpus}", *sorted(flags & KEPT_FLAGS)],
        env=env,
        place=place,
    )
    if place is not None:  # the pod has its IP once its sandbox is up, long before it is Ready
        report_running(kube, pod, pod_ip, host_ip, ready=False)
    node.start()
    try:
        assert node.agent_port is not None
        wait_ready(
            pod,
            {int(options.get("dashboard-agent-listen-port", DEFAULT_AGENT_PORT)): node.agent_port},
            place=place,
        )
        report_running(kube, pod, pod_ip, host_ip)
    except BaseException:
        node.stop()
        raise
    return node


def wait_ready(
    pod: dict[str, Any], ports: dict[int, int], timeout: float = 120.0, place: PodPlace | None = None
) -> str:
    """Run the Ray container's readiness probe as the kubelet does, against the node started here
    (``ports`` maps the pod's ports to this machine's), until it passes; return what it printed or
    answered. An ``httpGet`` probe is a GET with no credentials (2xx/3xx passes); an ``exec`` probe
    runs its command here with ``localhost:<pod port>`` pointed at the mapped port (exit 0 passes).
    With ``place`` (a pod of a pod network) the GET goes from the node to the pod IP and the command
    runs in the pod. AssertionError naming the last failure if it never passes within ``timeout``."""
    probe = ray_container(pod).get("readinessProbe")
    if probe is None:
        return ""
    if "httpGet" in probe:
        attempt = _http_probe(probe["httpGet"], ports, place)
    else:
        attempt = _exec_probe(probe["exec"], ports, place)
    deadline = time.monotonic() + timeout
    while True:
        passed, said = attempt(float(probe.get("timeoutSeconds", 1)))
        if passed:
            return said
        if time.monotonic() > deadline:
            raise AssertionError(f"the readiness probe of {pod['metadata']['name']} never passed: {said}")
        time.sleep(1.0)


def _mapped(ports: dict[int, int], port: int) -> int:
    assert port in ports, f"the probe names port {port}, none of the pod's {sorted(ports)}"
    return ports[port]


def _http_probe(
    get: dict[str, Any], ports: dict[int, int], place: PodPlace | None
) -> Callable[[float], tuple[bool, str]]:
    host = "127.0.0.1" if place is None else place.pod.ip
    url = f"http://{host}:{_mapped(ports, int(get['port']))}{get.get('path', '/')}"

    def fetch(timeout: float) -> str:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return str(resp.read().decode(errors="replace"))

    def attempt(timeout: float) -> tuple[bool, str]:
        try:
            return True, (fetch(timeout) if place is None else place.call(lambda: fetch(timeout)))
        except urllib.error.HTTPError as exc:  # 4xx/5xx: the probe fails
            return False, f"GET {url}: HTTP {exc.code} {exc.read()[:300]!r}"
        except OSError as exc:
            return False, f"GET {url}: {exc}"

    return attempt


def _exec_probe(
    exec_: dict[str, Any], ports: dict[int, int], place: PodPlace | None
) -> Callable[[float], tuple[bool, str]]:
    command = [
        re.sub(r"\blocalhost:(\d+)", lambda m: f"127.0.0.1:{_mapped(ports, int(m[1]))}", arg)
        for arg in exec_["command"]
    ]
    if place is not None:  # in the container: its own localhost
        command = place.command(command)

    def attempt(timeout: float) -> tuple[bool, str]:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 5, check=False)
        except subprocess.TimeoutExpired:
            return False, f"{command}: timed out"
        said = (done.stdout + done.stderr).strip()
        if done.returncode != 0:
            return False, f"{command}: exit {done.returncode} {said}"
        return True, said

    return attempt


def report_running(
    kube: KubeClient,
    pod: dict[str, Any],
    pod_ip: str = "127.0.0.1",
    host_ip: str = "127.0.0.1",
    *,
    ready: bool = True,
) -> None:
    """What a kubelet reports once the pod's containers run and pass their probes (``ready``), or
    once they run, before their probes passed (not ``ready``: the pod has its IP already, so a
    network policy enforcer counts it as the pod it is). ``pod_ip``: a pod's address in a
    :class:`PodNetwork`, or 127.0.0.1; ``host_ip``: its node's address."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    statuses = [
        {
            "name": c["name"],
            "ready": ready,
            "started": True,
            "restartCount": 0,
            "image": c["image"],
            "imageID": "",
            "state": {"running": {"startedAt": now}},
        }
        for c in pod["spec"]["containers"]
    ]
    kube.patch_status(
        "v1",
        "Pod",
        pod["metadata"]["name"],
        pod["metadata"]["namespace"],
        {
            "phase": "Running",
            "podIP": pod_ip,
            "podIPs": [{"ip": pod_ip}],
            "hostIP": host_ip,
            "startTime": now,
            "conditions": [
                {
                    "type": t,
                    "status": "True" if ready or t in ("PodScheduled", "Initialized") else "False",
                    "lastTransitionTime": now,
                }
                for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
            ],
            "containerStatuses": statuses,
        },
    )


@dataclass
class AutoscalerContainer:
    """The head pod's ``autoscaler`` container run here (see :func:`run_autoscaler_container`)."""

    pid: int
    log: Path
    volume: Path  # the files of its token volume: ``token``, ``ca.crt``, ``namespace``

    def stop(self) -> None:
        stop_tree(self.pid)


def run_autoscaler_container(
    kube: KubeClient, server: str, head_pod: dict[str, Any], head: PrivateRay, run_dir: Path
) -> AutoscalerContainer:
    """Run the head pod's ``autoscaler`` container here: Ray's ``ray kuberay-autoscaler`` (through
    tests/support/kuberay_autoscaler.py) with the container's environment, the API server at
    ``server`` as ``KUBERNETES_SERVICE_HOST``/``_PORT_HTTPS`` say in a pod, and the files the kubelet
    would put in its service account token volume (asked for as the kubelet asks). When the head runs
    in a pod of a pod network, so does the container: in the head pod's network namespace, the API
    server relayed onto that pod's loopback."""
    env = container_env(kube, head_pod, "autoscaler")
    token_volumes = {
        v["name"]
        for v in head_pod["spec"]["volumes"]
        if any("serviceAccountToken" in source for source in (v.get("projected") or {}).get("sources", []))
    }
    (mount,) = [
        m for m in container(head_pod, "autoscaler").get("volumeMounts") or [] if m["name"] in token_volumes
    ]
    volume = run_dir / mount["name"]
    project_volume(kube, head_pod, mount["name"], volume)
    host, port = server.removeprefix("https://").rsplit(":", 1)
    argv = [
        sys.executable,
        "-m",
        "tests.support.kuberay_autoscaler",
        "--cluster-name",
        env["RAY_CLUSTER_NAME"],
        "--cluster-namespace",
        env["RAY_CLUSTER_NAMESPACE"],
        "--gcs-address",
        head.gcs_address,
        "--mount-path",
        mount["mountPath"],
        "--volume-dir",
        str(volume),
    ]
    if head.place is not None:  # a container of the head pod: in its network namespace, where the
        # API server (the `kubernetes` Service in a cluster) is relayed onto the pod's loopback
        port = str(head.place.net.forward_into_pod(head.place.pod.name, int(port)))
        host = "127.0.0.1"
        argv = head.place.command(argv)
    log = run_dir / "autoscaler.log"
    pid = spawn(
        argv,
        log,
        env={
            **env,
            "KUBERNETES_SERVICE_HOST": host,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "RAY_USAGE_STATS_ENABLED": "0",
            "AUTOSCALER_METRIC_PORT": str(free_port()),
        },
        cwd=ROOT,
    )
    return AutoscalerContainer(pid, log, volume)


def register_node(kube: KubeClient, name: str, address: str) -> None:
    """The Node object a kubelet registers, Ready, with ``address`` as its InternalIP."""
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        }
    )
    kube.patch_status(
        "v1",
        "Node",
        name,
        None,
        {
            "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "the tests' node"}
            ],
        },
    )


class LocalPods:
    """The pods of one cluster this stand-in runs, stopped together by :meth:`close` (the autoscaler,
    then the workers, then the head) or at the end of a ``with`` block.

    With ``node``, it is that node's kubelet: it registers the Node (its address the pod network's
    node address, or 127.0.0.1), binds each pod to it before running it (kube-scheduler's job; none
    runs here), and :meth:`reap` finishes the deletion of its pods, as a kubelet must for a pod bound
    to its node. Without, pods stay unscheduled (enough for the KubeRay operator; not for
    kube-controller-manager's EndpointSlices, which need the pod's node)."""

    def __init__(
        self, kube: KubeClient, run_dir: Path, net: PodNetwork | None = None, node: str | None = None
    ) -> None:
        self.kube = kube
        self.run_dir = run_dir
        self.net = net  # run each pod in a pod of this network; None: on this machine's network
        self.node = node
        self.head: PrivateRay | None = None
        self.nodes: list[PrivateRayWorker] = []
        self.autoscaler: AutoscalerContainer | None = None
        self._running: dict[str, tuple[str, PrivateRay | PrivateRayWorker]] = {}  # pod -> (ns, node)
        self._nets: dict[str | None, PodNetwork | None] = {node: net}  # each node's pod network
        if node is not None:
            register_node(kube, node, "127.0.0.1" if net is None else net.node_ip)

    def add_node(self, node: str, net: PodNetwork) -> None:
        """Be the kubelet of one more node, ``node``, whose pods run in ``net`` (another node's network
        of the same cluster, see :class:`~tests.support.pod_network.NodeLan`); :meth:`run_worker`
        places a pod there when told."""
        assert self.node is not None and self.net is not None, "multi-node needs a first node and network"
        register_node(self.kube, node, net.node_ip)
        self._nets[node] = net

    def _bind(self, pod: dict[str, Any], node: str | None) -> None:
        if node is not None and not pod["spec"].get("nodeName"):
            self.kube.bind(pod["metadata"]["namespace"], pod["metadata"]["name"], node)

    def reap(self) -> list[str]:
        """Stop the Ray node of each pod of ours being deleted (workers before the head, the head's
        autoscaler with it) and remove the pod (grace 0, as the kubelet does once its containers are
        gone); return their names."""
        reaped = []
        ordered = sorted(self._running.items(), key=lambda item: item[1][1] is self.head)
        for name, (namespace, ray_node) in ordered:
            found = self.kube.get("v1", "Pod", name, namespace)
            if found is not None and "deletionTimestamp" not in found["metadata"]:
                continue
            if ray_node is self.head and self.autoscaler is not None:
                self.autoscaler.stop()
            ray_node.stop()
            self.kube.delete("v1", "Pod", name, namespace, grace_period_seconds=0)
            del self._running[name]
            reaped.append(name)
        return reaped

    def __enter__(self) -> LocalPods:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_head(self, pod: dict[str, Any], pod_ip: str = "127.0.0.1") -> PrivateRay:
        self._bind(pod, self.node)
        self.head = run_head_pod(self.kube, pod, self.run_dir / "ray", pod_ip, self.net)
        self._running[pod["metadata"]["name"]] = (pod["metadata"]["namespace"], self.head)
        return self.head

    def run_worker(
        self, pod: dict[str, Any], pod_ip: str = "127.0.0.1", node: str | None = None
    ) -> PrivateRayWorker:
        """Run a worker pod on the head's node, or on ``node`` (one of :meth:`add_node`)."""
        assert self.head is not None, "run the head pod first"
        node = node or self.node
        self._bind(pod, node)
        worker = run_worker_pod(self.kube, self.head, pod, self.run_dir / "nodes", pod_ip, self._nets[node])
        self.nodes.append(worker)
        self._running[pod["metadata"]["name"]] = (pod["metadata"]["namespace"], worker)
        return worker

    def run_autoscaler(self, server: str, head_pod: dict[str, Any]) -> AutoscalerContainer:
        assert self.head is not None, "run the head pod first"
        self.autoscaler = run_autoscaler_container(self.kube, server, head_pod, self.head, self.run_dir)
        return self.autoscaler

    def close(self) -> None:
        if self.autoscaler is not None:
            self.autoscaler.stop()
        for node in self.nodes:
            node.stop()
        if self.head is not None:
            self.head.stop()
            self.head.remove_temp()
