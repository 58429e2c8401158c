"""Pods as real containers: a real kubelet (with containerd and runc) as a node of the tests' control
plane (tests/support/kube_node.py).

What it shows, each through the kubelet alone (nothing here starts a container or writes a pod's
status): a pod's container runs in a cgroup and PID namespace of its own with the service account
token the kubelet asked for (TokenRequest, bound to the pod, of the projected volume's audience) in
its own mount, which the API server accepts for that account and pod; a liveness probe that starts
failing gets the container killed and restarted, with the kubelet's events saying why; a deleted
pod's containers and cgroup go, and the kubelet then removes the pod from the API. On the pod network
(the reference CNI plugins, called by containerd): a pod reaches another by its pod IP; with a
NetworkPolicy that lets in only ``role=friend`` pods, enforced by the real kube-router on the node,
the friend gets through and a stranger does not (with an allow-all ingress rule instead, the test
fails); a pod reaches a ClusterIP Service by its name (CoreDNS answers, kube-proxy DNATs; without
kube-proxy the test fails). The kubelet's own identity (``system:node:<name>``, a client
certificate) reads a Secret only through a pod bound to its node, and creates no other Node.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.kube_control_plane import ControlPlane, KubeClient, start_control_plane
from tests.support.kube_node import KubeletNode, kubelet_node
from tests.support.kube_router import start_kube_router
from tests.support.node_images import IMAGE
from tests.support.pod_network import PREFIX

pytestmark = [pytest.mark.integration, pytest.mark.deploy]

NAMESPACE = "apps"
MACHINE_NETNS = Path("/var/run/netns")  # where `ip netns` (and a containerd left to itself) keeps them
AUDIENCE = "llmbatch-test"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = start_control_plane(
        tmp_path_factory.mktemp("plane"), crds=[], operator=False, controllers=("endpointslice",)
    )
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def node(plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeletNode]:
    machine_netns = _machine_netns()
    with kubelet_node(plane, tmp_path_factory.mktemp("node")) as node:
        yield node
    # the pods' network namespaces were kept under the node's folder and went with it
    left = _machine_netns() - machine_netns
    assert not left, left


def _machine_netns() -> set[Path]:
    """The machine's named network namespaces but the pod networks of other test processes
    (tests/support/pod_network.py names them after their PID), which tests on other xdist workers
    make and delete meanwhile; this process's own (the node's among them) count."""
    if not MACHINE_NETNS.exists():
        return set()
    mine = f"{PREFIX}{os.getpid()}-"
    return {
        path
        for path in MACHINE_NETNS.iterdir()
        if path.name.startswith(mine) or not path.name.startswith(PREFIX)
    }


@pytest.fixture(scope="module")
def kube(plane: ControlPlane, node: KubeletNode) -> Iterator[KubeClient]:
    client = plane.client()
    client.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    for account in ("default", "reader"):  # no controller makes `default` here
        client.apply(
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": account, "namespace": NAMESPACE},
            }
        )
    try:
        yield client
    finally:
        client.close()


def _pod(name: str, node: KubeletNode, script: str, **spec: Any) -> dict[str, Any]:
    """A hostNetwork pod bound to ``node`` running ``script`` in the node image's busybox sh."""
    container = {
        "name": "main",
        "image": IMAGE,
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", script],
        **spec.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "nodeName": node.name,
            "hostNetwork": True,
            "terminationGracePeriodSeconds": 1,
            "automountServiceAccountToken": False,
            "containers": [container],
            **spec,
        },
    }


def _wait_pod(
    plane: ControlPlane,
    kube: KubeClient,
    node: KubeletNode,
    name: str,
    what: str,
    check: Any,
    timeout: float = 120,
) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        assert node.running(), node.log()[-3000:]
        pod = kube.get("v1", "Pod", name, NAMESPACE)
        return pod if pod is not None and check(pod) else None

    try:
        found: dict[str, Any] = plane.wait_for(f"pod {name}: {what}", ready, timeout=timeout)
    except AssertionError:
        print(json.dumps(kube.get("v1", "Pod", name, NAMESPACE), indent=1)[-3000:])
        print(node.log()[-3000:])
        raise
    return found


def _log_lines(node: KubeletNode, pod: dict[str, Any], container: str) -> list[str]:
    """What the container wrote to stdout, from the log file the kubelet keeps (CRI log format:
    ``<time> <stream> <tag> <line>``)."""
    meta = pod["metadata"]
    (log,) = sorted(
        (node.pod_logs / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container).glob("*.log")
    )
    return [line.split(" ", 3)[3] for line in log.read_text().splitlines() if " stdout " in line]


def _jwt_claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    claims: dict[str, Any] = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return claims


def test_a_pod_runs_in_a_container_of_its_own_with_the_token_the_kubelet_mounted(
    plane: ControlPlane, kube: KubeClient, node: KubeletNode
) -> None:
    # `$$` is how a pod's command writes one `$` (the kubelet expands `$(VAR)`)
    script = (
        "cat /var/run/secrets/tokens/token; echo; echo pid=$$$$; /bin/busybox grep memory /proc/self/cgroup"
    )
    volume = {
        "name": "token",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "audience": AUDIENCE, "expirationSeconds": 3600}}
            ]
        },
    }
    kube.apply(
        _pod(
            "token-reader",
            node,
            script,
            restartPolicy="Never",
            serviceAccountName="reader",
            volumes=[volume],
            container={
                "volumeMounts": [{"name": "token", "mountPath": "/var/run/secrets/tokens", "readOnly": True}]
            },
        )
    )
    pod = _wait_pod(
        plane,
        kube,
        node,
        "token-reader",
        "Succeeded",
        lambda p: p.get("status", {}).get("phase") in ("Succeeded", "Failed"),
    )
    assert pod["status"]["phase"] == "Succeeded", pod["status"]
    token, pid_line, cgroup_line = _log_lines(node, pod, "main")

    uid = pod["metadata"]["uid"]
    claims = _jwt_claims(token)
    assert claims["sub"] == f"system:serviceaccount:{NAMESPACE}:reader"
    assert claims["aud"] == [AUDIENCE]
    assert claims["kubernetes.io"]["pod"] == {"name": "token-reader", "uid": uid}
    review = kube.review_token(token, [AUDIENCE])
    assert review["authenticated"] is True, review
    assert review["user"]["username"] == f"system:serviceaccount:{NAMESPACE}:reader"
    assert review["user"]["extra"]["authentication.kubernetes.io/pod-uid"] == [uid]

    assert pid_line == "pid=1"  # the container's own PID namespace: its command is PID 1
    # the pod's cgroup under the node's root, in its QoS class (no requests: BestEffort)
    assert f"{node.cgroup_root}/kubepods/besteffort/pod{uid}/" in cgroup_line, cgroup_line


def test_a_failing_liveness_probe_gets_the_container_restarted(
    plane: ControlPlane, kube: KubeClient, node: KubeletNode
) -> None:
    # healthy for 3 s, then the probe's file is gone; the kubelet restarts it, and so on
    script = "touch /tmp/healthy; sleep 3; rm /tmp/healthy; sleep 600"
    probe = {"exec": {"command": ["/bin/cat", "/tmp/healthy"]}, "periodSeconds": 1, "failureThreshold": 2}
    kube.apply(_pod("probed", node, script, container={"livenessProbe": probe}))

    def restarted(pod: dict[str, Any]) -> bool:
        statuses = pod.get("status", {}).get("containerStatuses") or [{}]
        return int(statuses[0].get("restartCount", 0)) >= 1 and "running" in statuses[0].get("state", {})

    pod = _wait_pod(plane, kube, node, "probed", "restarted once and running again", restarted)
    (status,) = pod["status"]["containerStatuses"]
    terminated = status["lastState"]["terminated"]
    assert terminated["exitCode"] == 137, terminated  # sh ignores SIGTERM as PID 1: killed after 1 s
    reasons = {
        (e["reason"], e["message"].split(":")[0])
        for e in kube.list("v1", "Event", NAMESPACE)
        if e["involvedObject"]["name"] == "probed"
    }
    assert ("Unhealthy", "Liveness probe failed") in reasons, reasons
    assert ("Killing", "Container main failed liveness probe, will be restarted") in reasons, reasons


def test_a_deleted_pod_loses_its_containers_and_cgroup_and_then_its_object(
    plane: ControlPlane, kube: KubeClient, node: KubeletNode
) -> None:
    kube.apply(_pod("doomed", node, "sleep 600"))
    pod = _wait_pod(
        plane, kube, node, "doomed", "Running", lambda p: p.get("status", {}).get("phase") == "Running"
    )
    uid = pod["metadata"]["uid"]
    cgroups = list(Path("/sys/fs/cgroup/memory").glob(f"{node.cgroup_root.strip('/')}/kubepods/*/pod{uid}"))
    assert len(cgroups) == 1, cgroups
    pids = {int(pid) for procs in cgroups[0].glob("*/cgroup.procs") for pid in procs.read_text().split()}
    assert pids, "the running pod has processes in its cgroup"

    kube.delete("v1", "Pod", "doomed", NAMESPACE)
    plane.wait_for(
        "the kubelet removed the deleted pod",
        lambda: kube.get("v1", "Pod", "doomed", NAMESPACE) is None,
        timeout=120,
    )
    plane.wait_for("the pod's cgroup removed", lambda: not cgroups[0].exists(), timeout=120)
    assert not pids & node.container_pids()
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)


def _client_pod(name: str, node: KubeletNode, ip: str, labels: dict[str, str]) -> dict[str, Any]:
    """A pod on the pod network that fetches ``/index.html`` from ``ip``:8080 (tries for 20 s) and
    exits 0 once it could. With ``nc``: the static busybox's ``wget`` looks the ``http`` service up
    through glibc's NSS, which a static binary cannot load in this image (it crashes)."""
    request = "printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n'"
    script = (
        f"for i in $$(seq 20); do {request} | nc -w 1 {ip} 8080 | grep hello && exit 0; "
        "sleep 1; done; echo never reached; exit 1"
    )
    pod = _pod(name, node, script, restartPolicy="Never", hostNetwork=False)
    pod["metadata"]["labels"] = labels
    return pod


def test_a_pod_reaches_a_service_by_its_name_through_cluster_dns_and_kube_proxy(
    plane: ControlPlane, kube: KubeClient, node: KubeletNode
) -> None:
    web = _pod(
        "svc-web",
        node,
        "mkdir -p /www; echo hello-from-web > /www/index.html; exec httpd -f -p 8080 -h /www",
        hostNetwork=False,
    )
    web["metadata"]["labels"] = {"app": "svc-web"}
    kube.apply(web)
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": NAMESPACE},
            "spec": {
                "selector": {"app": "svc-web"},
                "ports": [{"name": "http", "port": 80, "targetPort": 8080}],
            },
        }
    )
    service = kube.get("v1", "Service", "web", NAMESPACE)
    assert service is not None
    cluster_ip = service["spec"]["clusterIP"]
    # busybox's nslookup asks the pod's nameserver (the kubelet's clusterDNS: CoreDNS); port 80 of
    # the ClusterIP is kube-proxy's DNAT to the web pod's 8080
    request = "printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n'"
    script = (
        f"for i in $$(seq 30); do ip=$$(nslookup web.{NAMESPACE}.svc.cluster.local | "
        "sed -n 's/^Address: *\\([0-9.]*\\)$$/\\1/p' | tail -1); "
        f'[ -n "$$ip" ] && {request} | nc -w 1 $$ip 80 | grep hello && echo via $$ip && exit 0; '
        "sleep 1; done; echo never reached; exit 1"
    )
    kube.apply(_pod("svc-client", node, script, restartPolicy="Never", hostNetwork=False))
    done = _wait_pod(
        plane,
        kube,
        node,
        "svc-client",
        "done",
        lambda p: p.get("status", {}).get("phase") in ("Succeeded", "Failed"),
    )
    assert _log_lines(node, done, "main") == ["hello-from-web", f"via {cluster_ip}"]
    assert done["status"]["phase"] == "Succeeded"


def test_pods_on_the_pod_network_reach_each_other_as_their_network_policy_says(
    plane: ControlPlane, kube: KubeClient, node: KubeletNode, tmp_path: Path
) -> None:
    web = _pod(
        "web",
        node,
        "mkdir -p /www; echo hello-from-web > /www/index.html; exec httpd -f -p 8080 -h /www",
        hostNetwork=False,
    )
    web["metadata"]["labels"] = {"app": "web"}
    kube.apply(web)
    pod = _wait_pod(
        plane,
        kube,
        node,
        "web",
        "Running with a pod IP",
        lambda p: p.get("status", {}).get("phase") == "Running" and p["status"].get("podIP"),
    )
    web_ip = pod["status"]["podIP"]
    assert web_ip != node.net.node_ip and web_ip.startswith(node.net.subnet + "."), web_ip
    assert pod["status"]["hostIP"] == node.net.node_ip

    # no policy: a pod reaches another by its pod IP, through the node's bridge
    kube.apply(_client_pod("open-client", node, web_ip, {"role": "any"}))
    done = _wait_pod(
        plane,
        kube,
        node,
        "open-client",
        "done",
        lambda p: p.get("status", {}).get("phase") in ("Succeeded", "Failed"),
    )
    assert done["status"]["phase"] == "Succeeded", _log_lines(node, done, "main")
    assert _log_lines(node, done, "main") == ["hello-from-web"]

    # web's ingress only from role=friend, enforced by kube-router on the node
    router = start_kube_router(plane, node.net, node.name, tmp_path)
    try:
        kube.apply(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"name": "web-friends-only", "namespace": NAMESPACE},
                "spec": {
                    "podSelector": {"matchLabels": {"app": "web"}},
                    "policyTypes": ["Ingress"],
                    "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "friend"}}}]}],
                },
            }
        )
        kube.apply(_client_pod("stranger", node, web_ip, {"role": "stranger"}))
        kube.apply(_client_pod("friend", node, web_ip, {"role": "friend"}))
        finished = {
            name: _wait_pod(
                plane,
                kube,
                node,
                name,
                "done",
                lambda p: p.get("status", {}).get("phase") in ("Succeeded", "Failed"),
            )
            for name in ("friend", "stranger")
        }
        assert finished["friend"]["status"]["phase"] == "Succeeded", router.rules(node.net)
        assert finished["stranger"]["status"]["phase"] == "Failed", router.rules(node.net)
        assert _log_lines(node, finished["stranger"], "main") == ["never reached"]
    finally:
        router.stop()


def test_the_kubelet_reads_only_the_secrets_of_its_own_pods(
    plane: ControlPlane, kube: KubeClient, node: KubeletNode
) -> None:
    for name in ("used-by-a-pod", "used-by-none"):
        kube.apply(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "stringData": {"value": name},
            }
        )
    env = [{"name": "VALUE", "valueFrom": {"secretKeyRef": {"name": "used-by-a-pod", "key": "value"}}}]
    kube.apply(_pod("secret-user", node, "echo $(VALUE); exec sleep 600", container={"env": env}))
    pod = _wait_pod(
        plane, kube, node, "secret-user", "Running", lambda p: p.get("status", {}).get("phase") == "Running"
    )
    assert _log_lines(node, pod, "main") == ["used-by-a-pod"]  # the kubelet read it for the pod

    # the kubelet's own credentials (user system:node:<name>): the Node authorizer lets it read a
    # Secret only through a pod bound to its node
    identity = node.kubelet_identity
    tls = ssl.create_default_context(cafile=str(plane.ca_cert))
    tls.load_cert_chain(identity.cert, identity.key)
    with httpx.Client(base_url=plane.server, verify=tls, timeout=10) as as_node:

        def secret(name: str) -> int:
            return as_node.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/{name}").status_code

        assert as_node.get(f"/api/v1/nodes/{node.name}").status_code == 200
        assert secret("used-by-a-pod") == 200
        assert secret("used-by-none") == 403
        # and NodeRestriction lets it write only its own Node
        another = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "another-node"}}
        assert as_node.post("/api/v1/nodes", json=another).status_code == 403
    kube.delete("v1", "Pod", "secret-user", NAMESPACE)
