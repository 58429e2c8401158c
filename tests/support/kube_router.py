"""kube-router's network policy controller, the real one, enforcing NetworkPolicies on the node of
a :class:`~tests.support.pod_network.PodNetwork`.

kube-router (github.com/cloudnativelabs/kube-router, built from deploy/tools/kube-router) runs as
on a Kubernetes node with only its firewall (``--run-firewall``; no routing, no service proxy, no
CNI): it watches pods, namespaces and NetworkPolicies through the API server and turns them into
the node's iptables rules and ipsets. Here it runs inside the node's network namespace, so its
rules are the node's and nothing of this machine's own network changes. It needs iptables and
ipset (Debian packages, scripts/bootstrap.sh).

A pod is local to the node (and has its ingress enforced) when its ``status.hostIP`` is the node's
InternalIP (:func:`tests.support.pod_runner.register_node`).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

from llmbatch.stack.go_build import go_binaries
from llmbatch.stack.ports import free_port
from llmbatch.stack.process import spawn, stop_tree, wait_until
from tests.support.kube_control_plane import KUBE_ROUTER, TOOLS, ControlPlane, write_kubeconfig
from tests.support.pod_network import PodNetwork


def binary() -> Path:
    """kube-router, built once from deploy/tools/kube-router's go.sum (cached)."""
    return go_binaries(TOOLS / "kube-router", [KUBE_ROUTER])[KUBE_ROUTER]


@dataclass
class KubeRouter:
    """A running kube-router; :meth:`stop` stops it by PID."""

    pid: int
    log: Path
    health: int  # its health port on the node's loopback

    def stop(self) -> None:
        stop_tree(self.pid)

    def rules(self, net: PodNetwork) -> str:
        """The node's iptables rules (``iptables-save``), for assertion messages."""
        done = subprocess.run(
            net.command(["iptables-save"], net.node), capture_output=True, text=True, check=False, timeout=30
        )
        return done.stdout


def start_kube_router(plane: ControlPlane, net: PodNetwork, node: str, workdir: Path) -> KubeRouter:
    """Start kube-router's firewall on ``net``'s node (Node object ``node``), talking to the API
    server through a relay onto the node's loopback (the server's certificate names 127.0.0.1)."""
    port = net.forward_from_node(int(plane.server.rsplit(":", 1)[1]))
    kubeconfig = workdir / f"kube-router-{node}.kubeconfig"
    write_kubeconfig(kubeconfig, f"https://127.0.0.1:{port}", plane.token, plane.ca_cert)
    health = free_port()  # on the node's own loopback: any port is free there
    log = workdir / f"kube-router-{node}.log"
    argv = [
        str(binary()),
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        "--enable-cni=false",
        "--enable-ipv6=false",
        f"--health-port={health}",
        "--service-cluster-ip-range=10.96.0.0/16",
        "--iptables-sync-period=10s",
        "--v=1",
    ]
    pid = spawn(net.command(argv, net.node), log)
    router = KubeRouter(pid, log, health)
    try:
        wait_until(
            lambda: net.on_node(
                lambda: httpx.get(f"http://127.0.0.1:{health}/healthz", timeout=2).status_code == 200
            ),
            120,
            pid,
            "kube-router",
            log,
        )
    except BaseException:
        router.stop()
        raise
    return router
