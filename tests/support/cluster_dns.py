"""The cluster's DNS for the tests' kubelet node: CoreDNS (``deploy/tools/coredns``: its kubernetes
plugin and the few it needs, built from the Go module proxy and cached) answering ``cluster.local``
from the API server, as a cluster's kube-dns does. It listens on the node's address in the node's
network namespace, and the kubelet gives that address to every pod as its nameserver
(``clusterDNS``), so a pod resolves ``<service>.<namespace>.svc.cluster.local``: a headless
Service (the Ray head's) to its pods' IPs.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from llmbatch.stack.go_build import go_binaries
from llmbatch.stack.process import spawn, wait_until
from tests.support.kube_control_plane import TOOLS, KubeClient
from tests.support.pod_network import PodNetwork

CLUSTER_DOMAIN = "cluster.local"
CLUSTER_DNS_USER = "llmbatch-test:coredns"  # the user of CoreDNS's client certificate
# what CoreDNS's kubernetes plugin reads (the ClusterRole its own deployment manifests give it)
CLUSTER_DNS_RULES = [
    {"apiGroups": [""], "resources": ["services", "pods", "namespaces"], "verbs": ["list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
]
READY_PORT = 8181  # CoreDNS's ready plugin, on the node's loopback


def coredns_binary() -> Path:
    """Build (or find cached) the tests' CoreDNS."""
    return go_binaries(TOOLS / "coredns", ["."])["."]


def allow_cluster_dns(kube: KubeClient) -> None:
    """Let :data:`CLUSTER_DNS_USER` read what CoreDNS reads, and nothing else."""
    name = CLUSTER_DNS_USER
    kube.apply(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": CLUSTER_DNS_RULES,
        }
    )
    kube.apply(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": name}],
        }
    )


def corefile(node_ip: str, kubeconfig: Path) -> str:
    """CoreDNS's configuration: ``cluster.local`` (and reverse lookups of pod IPs) from the API
    server on ``node_ip``:53; no upstream (the test's pods need only the cluster's names)."""
    return f""".:53 {{
    bind {node_ip}
    ready 127.0.0.1:{READY_PORT}
    errors
    log
    cache 5
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa {{
        kubeconfig {kubeconfig} local
        pods verified
        ttl 5
    }}
}}
"""


def start_cluster_dns(net: PodNetwork, coredns: Path, folder: Path, kubeconfig: Path) -> int:
    """Start CoreDNS (binary ``coredns``) in ``net``'s node namespace and wait until it has read
    the API server (its ready plugin says so); its PID."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "Corefile"
    config.write_text(corefile(net.node_ip, kubeconfig))
    log = folder / "coredns.log"
    pid = spawn(net.command([str(coredns), "-conf", str(config)], net.node), log)

    url = f"http://127.0.0.1:{READY_PORT}/ready"  # on the node's loopback
    wait_until(
        lambda: net.on_node(lambda: httpx.get(url, timeout=2).status_code == 200),
        60,
        pid,
        "CoreDNS",
        log,
        interval=0.3,
    )
    return pid
