"""kube-proxy for the tests' kubelet node (tests/support/kube_node.py): the real one (built with the
kubelet from ``deploy/tools/kubelet``), iptables mode, in the node's network namespace, so a pod
reaches a Service by its ClusterIP as in a cluster.

The ``kubernetes`` Service is the one thing set up by hand: the API server listens on this machine's
loopback, which no pod can reach, so its endpoint (the API server's endpoint reconciler is off in
the tests) is published as a relay on the node's address (:meth:`PodNetwork.forward_from_node`).
kube-proxy then routes ``10.96.0.1:443`` there like any Service.

Only tunables of the node's own network namespace change: conntrack's global sizes and timeouts are
left alone (``maxPerCore: 0``, zero timeouts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from llmbatch.stack.process import spawn, wait_until
from tests.support.kube_control_plane import KubeClient
from tests.support.pod_network import PodNetwork

KUBERNETES_SERVICE = ("10.96.0.1", 443)  # the `kubernetes` Service: first IP of the service range
HEALTHZ_PORT = 10256  # on the node's loopback


def proxy_config(node_name: str, net: PodNetwork, kubeconfig: Path) -> dict[str, Any]:
    """kube-proxy's KubeProxyConfiguration for node ``node_name`` of ``net``."""
    return {
        "kind": "KubeProxyConfiguration",
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "hostnameOverride": node_name,
        "bindAddress": net.node_ip,
        "clusterCIDR": f"{net.subnet}.0/24",
        "healthzBindAddress": f"127.0.0.1:{HEALTHZ_PORT}",
        "metricsBindAddress": "127.0.0.1:10249",
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
            "udpTimeout": "0s",
            "udpStreamTimeout": "0s",
        },
        "iptables": {"syncPeriod": "5s", "minSyncPeriod": "0s"},
    }


def publish_api_server(kube: KubeClient, address: str, port: int) -> None:
    """The ``kubernetes`` Service's endpoint: ``address:port`` (the relay on the node)."""
    kube.apply(
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "kubernetes",
                "namespace": "default",
                "labels": {"kubernetes.io/service-name": "kubernetes"},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        }
    )


def start_kube_proxy(binary: Path, node_name: str, net: PodNetwork, folder: Path, kubeconfig: Path) -> int:
    """Start kube-proxy in ``net``'s node namespace and wait until it has programmed the node's
    Services (its healthz answers 200); its PID."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.json"
    config.write_text(json.dumps(proxy_config(node_name, net, kubeconfig)))
    log = folder / "kube-proxy.log"
    pid = spawn(net.command([str(binary), f"--config={config}", "--v=2"], net.node), log)

    url = f"http://127.0.0.1:{HEALTHZ_PORT}/healthz"  # on the node's loopback
    wait_until(
        lambda: net.on_node(lambda: httpx.get(url, timeout=2).status_code == 200),
        90,
        pid,
        "kube-proxy",
        log,
        interval=0.3,
    )
    return pid
