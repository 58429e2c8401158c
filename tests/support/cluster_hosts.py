"""Cluster DNS for one pod of a :class:`~tests.support.pod_network.PodNetwork`, as a hosts file.

No CoreDNS runs here. What it would answer for a headless Service (``clusterIP: None``, as KubeRay
makes a head Service) is the addresses of the Service's ready endpoints, which kube-controller-manager's
EndpointSlice controller publishes: ``<service>.<namespace>.svc.cluster.local`` -> pod IPs. A
:class:`ClusterHosts` polls the Services and EndpointSlices through the API server and keeps those
names in ``/etc/netns/<pod netns>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts`` for a
process it starts in that namespace (:meth:`ClusterHosts.command`); Go's resolver and glibc read
it on every lookup (Go at most every 5 s). The file is rewritten in place: the mount holds its inode.

A ClusterIP Service is not resolved: its address would need kube-proxy, which does not run here.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Sequence
from typing import Any

from tests.support.kube_control_plane import KubeClient
from tests.support.pod_network import NETNS_ETC

DOMAIN = "svc.cluster.local"


def headless_hosts(
    services: Sequence[dict[str, Any]], slices: Sequence[dict[str, Any]]
) -> dict[str, list[str]]:
    """What cluster DNS answers for each headless Service: its ready endpoints' addresses (all of
    them with ``publishNotReadyAddresses``), by ``<name>.<namespace>.svc.cluster.local``."""
    found: dict[str, list[str]] = {}
    for service in services:
        meta, spec = service["metadata"], service["spec"]
        if spec.get("clusterIP") != "None":
            continue
        addresses = sorted(
            address
            for s in slices
            if s["metadata"]["namespace"] == meta["namespace"]
            and s["metadata"].get("labels", {}).get("kubernetes.io/service-name") == meta["name"]
            for e in s.get("endpoints") or []
            if spec.get("publishNotReadyAddresses") or (e.get("conditions") or {}).get("ready")
            for address in e["addresses"]
        )
        if addresses:
            found[f"{meta['name']}.{meta['namespace']}.{DOMAIN}"] = addresses
    return found


def render(names: dict[str, list[str]]) -> str:
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    lines += [f"{address} {name}" for name, addresses in sorted(names.items()) for address in addresses]
    return "\n".join(lines) + "\n"


class ClusterHosts:
    """Keeps ``/etc/netns/<netns>/hosts`` to what cluster DNS would answer (module docstring)."""

    def __init__(self, kube: KubeClient, netns: str, interval: float = 0.5) -> None:
        self.kube = kube
        self.netns = netns
        self.dir = NETNS_ETC / netns
        self.hosts = self.dir / "hosts"
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in the namespace with this hosts file as its ``/etc/hosts`` (``ip netns exec``
        execs it: same PID)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def refresh(self) -> dict[str, list[str]]:
        """Write the file from the API server once; return the names in it."""
        names = headless_hosts(
            self.kube.list("v1", "Service", None),
            self.kube.list("discovery.k8s.io/v1", "EndpointSlice", None),
        )
        text = render(names)
        if not self.hosts.exists() or self.hosts.read_text() != text:
            with self.hosts.open("r+" if self.hosts.exists() else "w") as out:  # same inode
                out.write(text)
                out.truncate()
        return names

    def start(self) -> ClusterHosts:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.refresh()
        self._thread = threading.Thread(target=self._run, name=f"hosts-{self.netns}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
            except Exception:  # the API server stopping at the end of the test: poll again
                continue

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with contextlib.suppress(OSError):
            shutil.rmtree(self.dir)
