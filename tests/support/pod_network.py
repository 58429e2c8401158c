"""A pod network on this machine: a node and its pods, each in a network namespace of its own.

No kubelet and no CNI plugin run here; this does what the bridge CNI plugin does on a node. The
node is a network namespace holding a bridge with the node's address (``<subnet>.1``) and a MAC of
its own (pinned, so a new pod never changes it). Each pod is a network namespace with its own
loopback and ``eth0`` (a veth pair whose other end is on the bridge), a pod IP of the subnet, and a
default route through the node. So pods reach each other by pod IP through the node's bridge, where
the node's iptables (``br_netfilter``) see every packet, as on a Kubernetes node, and each pod has
the whole port space to itself (a Ray head listens on its pod's 6379, 8265, 8080 as in the pod spec).

The network is private to the test that made it: nothing of it is in this machine's own network
namespace. The test process reaches it in two ways:

- :meth:`PodNetwork.on_node` runs a function in a thread that entered the node's namespace (what a
  process on the node, such as the kubelet's probes, would see);
- :meth:`PodNetwork.command` prefixes a command with ``nsenter`` so that it runs in a pod's (or the
  node's) namespace.

:meth:`PodNetwork.forward_from_node` makes a local port of this machine (the API server) reachable
from the node at ``127.0.0.1:<port>``, for a node agent such as kube-router, and
:meth:`PodNetwork.forward_into_pod` from a pod's own loopback, for a container such as the autoscaler.

Several nodes make one cluster network with :class:`NodeLan`: each node (a :class:`PodNetwork` of
its own /24) gets an uplink on a shared LAN and a route to every other node's pod CIDR through that
node's LAN address, as kube-router's or flannel's host-gateway routing programs it. Pods on different
nodes then reach each other by pod IP, routed through both nodes (no NAT, so each side sees the
other's pod IP), and each node's iptables see the packets that enter or leave its pods.

Namespaces are named ``llmbatch-<pid>-...``; :meth:`close` deletes them, and a new network deletes
those of processes that no longer run (a test that was killed).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")  # per-namespace /etc files, which `ip netns exec` mounts
PREFIX = "llmbatch-"

_libc = ctypes.CDLL(None, use_errno=True)


def enter_netns(name: str) -> None:
    """Move the calling thread (only it: ``setns`` is per thread) into network namespace ``name``."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(name: str, fn: Callable[[], T]) -> T:
    """``fn()`` run in a new thread inside network namespace ``name``; its result or its exception."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            enter_netns(name)
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


def _ip(*args: str, netns: str | None = None, check: bool = True) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def _sysctl(netns: str, key: str, value: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", netns, "sysctl", "-q", "-w", f"{key}={value}"],
        check=True,
        capture_output=True,
        timeout=30,
    )


def remove_stale() -> list[str]:
    """Delete the namespaces of test processes that no longer run, and their ``/etc/netns`` files
    (:mod:`tests.support.cluster_hosts`); return their names."""
    removed = []
    for path in NETNS_DIR.glob(f"{PREFIX}*") if NETNS_DIR.is_dir() else []:
        if _stale(path):
            _ip("netns", "del", path.name)
            removed.append(path.name)
    for path in NETNS_ETC.glob(f"{PREFIX}*") if NETNS_ETC.is_dir() else []:
        if _stale(path):
            shutil.rmtree(path, ignore_errors=True)
    return removed


def _stale(path: Path) -> bool:
    match = re.match(rf"{PREFIX}(\d+)-", path.name)
    return match is not None and not Path(f"/proc/{match[1]}").exists()


@dataclass(frozen=True)
class Pod:
    """One pod's network: its namespace and address."""

    name: str
    netns: str
    ip: str


class PodNetwork:
    """One node and its pods (see the module docstring). ``subnet``: the first three octets of the
    node's pod CIDR (a /24)."""

    def __init__(self, subnet: str = "10.244.0") -> None:
        self.subnet = subnet
        self.tag = f"{os.getpid()}-{secrets.token_hex(2)}"
        self.node = f"{PREFIX}{self.tag}-node"
        self.pods: dict[str, Pod] = {}
        self._forwarders: list[socket.socket] = []
        self._closed = threading.Event()

    @property
    def node_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def node_mac(self) -> str:
        """The node bridge's MAC: locally administered, from the node's address (``0a:58:`` and
        its four octets, as the bridge CNI plugin made it)."""
        return "0a:58:" + ":".join(f"{int(octet):02x}" for octet in self.node_ip.split("."))

    def __enter__(self) -> PodNetwork:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        remove_stale()
        _ip("netns", "add", self.node)
        try:
            _ip("link", "set", "lo", "up", netns=self.node)
            _ip("link", "add", "cbr0", "type", "bridge", netns=self.node)
            # pinned, as the bridge CNI plugin does: a bridge without a MAC of its own takes its
            # lowest port's, so a new pod could change it under the pods that have it cached
            _ip("link", "set", "cbr0", "address", self.node_mac, netns=self.node)
            _ip("addr", "add", f"{self.node_ip}/24", "dev", "cbr0", netns=self.node)
            _ip("link", "set", "cbr0", "up", netns=self.node)
            # bridged pod-to-pod packets go through the node's iptables, where policies are enforced
            _sysctl(self.node, "net.bridge.bridge-nf-call-iptables", "1")
            _sysctl(self.node, "net.ipv4.ip_forward", "1")
        except BaseException:
            self.close()
            raise

    def add_pod(self, name: str) -> Pod:
        """A new pod namespace with the next free address of the subnet."""
        assert name not in self.pods, name
        index = len(self.pods) + 2
        pod = Pod(name, f"{PREFIX}{self.tag}-p{index}", f"{self.subnet}.{index}")
        _ip("netns", "add", pod.netns)
        host_end = f"veth{secrets.token_hex(4)}"  # interface names: 15 characters at most
        _ip(
            "link",
            "add",
            host_end,
            "netns",
            self.node,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            pod.netns,
        )
        _ip("link", "set", host_end, "master", "cbr0", "up", netns=self.node)
        _ip("link", "set", "lo", "up", netns=pod.netns)
        _ip("addr", "add", f"{pod.ip}/24", "dev", "eth0", netns=pod.netns)
        _ip("link", "set", "eth0", "up", netns=pod.netns)
        _ip("route", "add", "default", "via", self.node_ip, netns=pod.netns)
        self.pods[name] = pod
        return pod

    def command(self, argv: Sequence[str], netns: str) -> list[str]:
        """``argv`` run in network namespace ``netns`` (nsenter execs it: same PID)."""
        return ["nsenter", f"--net={NETNS_DIR / netns}", "--", *argv]

    def on_node(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the node (in a thread inside the node's namespace)."""
        return in_netns(self.node, fn)

    def in_pod(self, name: str, fn: Callable[[], T]) -> T:
        """``fn()`` run in pod ``name`` (in a thread inside its namespace): its connections come
        from the pod's IP."""
        return in_netns(self.pods[name].netns, fn)

    def forward_from_node(self, host_port: int, bind: str = "127.0.0.1") -> int:
        """Make ``127.0.0.1:<host_port>`` of this machine reachable from the node; return the port on
        the node's loopback (or its address ``bind``) that leads there (plain TCP relay, each
        connection in two threads)."""
        return self._forward_into(self.node, host_port, bind)

    def forward_into_pod(self, name: str, host_port: int) -> int:
        """As :meth:`forward_from_node`, onto pod ``name``'s own loopback (for a container that
        talks to the API server, which a pod reaches through the ``kubernetes`` Service)."""
        return self._forward_into(self.pods[name].netns, host_port)

    def _forward_into(self, netns: str, host_port: int, bind: str = "127.0.0.1") -> int:
        listener = in_netns(netns, lambda: socket.create_server((bind, 0)))
        self._forwarders.append(listener)
        threading.Thread(
            target=self._relay_accept, args=(listener, host_port), daemon=True, name=f"relay-{host_port}"
        ).start()  # started here: dials from this namespace
        port: int = listener.getsockname()[1]
        return port

    def _relay_accept(self, listener: socket.socket, host_port: int) -> None:
        while not self._closed.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", host_port), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        """Close the relays and delete every namespace (stop the processes in them first)."""
        self._closed.set()
        for listener in self._forwarders:
            listener.close()
        for pod in self.pods.values():
            _ip("netns", "del", pod.netns, check=False)
        self.pods.clear()
        _ip("netns", "del", self.node, check=False)


class NodeLan:
    """The LAN between the nodes of several :class:`PodNetwork` (see the module docstring): a
    namespace of its own holding a bridge, each node's ``uplink`` on it at ``<lan>.<n>`` (n = 1, 2,
    ... in the order given) and on each node a route to every other node's pod CIDR. Start the nodes
    first; :meth:`close` deletes the LAN (the nodes keep their own pods)."""

    def __init__(self, nodes: Sequence[PodNetwork], lan: str = "10.245.0") -> None:
        assert len({n.subnet for n in nodes}) == len(nodes), "each node needs a pod CIDR of its own"
        self.nodes = list(nodes)
        self.lan = lan
        self.netns = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}-lan"

    def address(self, node: PodNetwork) -> str:
        """``node``'s address on the LAN."""
        return f"{self.lan}.{self.nodes.index(node) + 1}"

    def __enter__(self) -> NodeLan:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        _ip("netns", "add", self.netns)
        try:
            _ip("link", "set", "lo", "up", netns=self.netns)
            _ip("link", "add", "lan0", "type", "bridge", netns=self.netns)
            _ip("link", "set", "lan0", "up", netns=self.netns)
            for node in self.nodes:
                lan_end = f"veth{secrets.token_hex(4)}"
                _ip(
                    "link",
                    "add",
                    lan_end,
                    "netns",
                    self.netns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "uplink",
                    "netns",
                    node.node,
                )
                _ip("link", "set", lan_end, "master", "lan0", "up", netns=self.netns)
                _ip("addr", "add", f"{self.address(node)}/24", "dev", "uplink", netns=node.node)
                _ip("link", "set", "uplink", "up", netns=node.node)
            for node in self.nodes:
                for other in self.nodes:
                    if other is not node:
                        _ip(
                            "route",
                            "add",
                            f"{other.subnet}.0/24",
                            "via",
                            self.address(other),
                            netns=node.node,
                        )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Delete the LAN and the nodes' uplinks. Each uplink is deleted first, in its node: the
        kernel tears a deleted namespace's interfaces down later, in the background, so until then
        an uplink whose LAN end is going would still carry the route to the other nodes' pods."""
        for node in self.nodes:
            _ip("link", "del", "uplink", netns=node.node, check=False)
        _ip("netns", "del", self.netns, check=False)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for sock in (src, dst):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
