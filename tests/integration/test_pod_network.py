"""The tests' pod network (tests/support/pod_network.py), on real network namespaces: pods reach
each other by pod IP through the node and nothing of it is on this machine's own network; the
relay onto the node's loopback; namespaces of a killed test are cleaned up; pods of two nodes joined
by a LAN reach each other through both nodes; a new pod does not change the node's MAC address under
the pods already running; the path snapshot tests print on a failed connect. A few seconds."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.net_snapshot import connect_outcome, path_snapshot
from tests.support.pod_network import NETNS_DIR, PREFIX, NodeLan, PodNetwork, in_netns, remove_stale

pytestmark = [pytest.mark.integration, pytest.mark.deploy]


@pytest.fixture
def net() -> Iterator[PodNetwork]:
    with PodNetwork("10.244.7") as started:
        yield started


def _serve_once(net: PodNetwork, pod: str, port: int, reply: bytes) -> threading.Thread:
    server = net.in_pod(pod, lambda: socket.create_server(("0.0.0.0", port)))

    def answer() -> None:
        with server:
            conn, (peer, _) = server.accept()
            with conn:
                conn.sendall(reply + b" " + peer.encode())

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def _fetch(ip: str, port: int) -> bytes:
    with socket.create_connection((ip, port), timeout=5) as conn:
        return conn.recv(100)


def test_pods_reach_each_other_by_pod_ip_and_see_each_others_address(net: PodNetwork) -> None:
    a, b = net.add_pod("a"), net.add_pod("b")
    assert (a.ip, b.ip, net.node_ip) == ("10.244.7.2", "10.244.7.3", "10.244.7.1")
    served = _serve_once(net, "a", 8265, b"from-a")
    assert net.in_pod("b", lambda: _fetch(a.ip, 8265)) == f"from-a {b.ip}".encode()
    served.join(5)
    # the node reaches its pods too (as a kubelet's probe), from the node's address
    _serve_once(net, "b", 8265, b"from-b")
    assert net.on_node(lambda: _fetch(b.ip, 8265)) == f"from-b {net.node_ip}".encode()


def _bridge_port(net: PodNetwork, name: str, mac: str) -> None:
    """A new port on the node's bridge whose MAC is ``mac``: the host end of a new pod's veth."""
    node = ["ip", "-n", net.node, "link"]
    subprocess.run(
        [*node, "add", name, "address", mac, "type", "veth", "peer", "name", f"{name}p"], check=True
    )
    subprocess.run([*node, "set", name, "master", "cbr0", "up"], check=True)


def _bridge_mac(net: PodNetwork) -> str:
    out = subprocess.run(
        ["ip", "-n", net.node, "-br", "link", "show", "cbr0"], capture_output=True, text=True, check=True
    ).stdout
    return out.split()[2]


def _reaches_the_node(net: PodNetwork, pod: str) -> str:
    """Connect from ``pod`` to a closed port of the node: refused means the packet got there."""
    return net.in_pod(pod, lambda: connect_outcome(net.node_ip, 1))


def test_a_new_pod_does_not_change_the_nodes_mac_under_the_running_pods(net: PodNetwork) -> None:
    # A bridge whose MAC is not set takes the lowest of its ports' MACs, so a new pod's veth can
    # change it; a running pod still sends to the gateway MAC it has cached (for up to ~45 s) and
    # the node drops those frames, as the two-node test's first job after its worker joined saw.
    # The bridge CNI plugin pins the bridge's MAC (kubernetes#30783); so does PodNetwork.
    _bridge_port(net, "vfirst", "02:00:00:00:00:02")  # the lowest MAC so far
    net.add_pod("a")
    assert _reaches_the_node(net, "a") == "ConnectionRefusedError"  # "a" caches the gateway's MAC
    before = _bridge_mac(net)
    _bridge_port(net, "vlower", "02:00:00:00:00:01")  # a new pod's veth, lower than every other
    assert _bridge_mac(net) == before
    assert _reaches_the_node(net, "a") == "ConnectionRefusedError"


def test_a_path_snapshot_reports_each_hop_of_a_pod_to_pod_path(net: PodNetwork) -> None:
    # what a test prints when a connect it expects times out: it must itself work
    net.add_pod("a")
    b = net.add_pod("b")
    server = net.in_pod("b", lambda: socket.create_server(("0.0.0.0", 8265)))
    with server:
        report = path_snapshot(net, "a", net, "b", 8265)
    assert report.splitlines()[0] == f"=== path a (10.244.7.2) -> b {b.ip}:8265"
    assert "--- connect from pod a: connected" in report
    assert "--- connect from pod b to itself: connected" in report
    assert f"10.244.7.0/24 dev eth0 proto kernel scope link src {b.ip}" in report  # b's routes
    assert "--- pod b: listening sockets" in report and ":8265" in report
    assert "--- source node: iptables-save -c" in report
    closed = path_snapshot(net, "a", net, "b", 8266)
    assert "--- connect from pod a: ConnectionRefusedError" in closed


def test_each_pod_has_its_own_ports_and_a_command_runs_in_its_namespace(net: PodNetwork) -> None:
    a, b = net.add_pod("a"), net.add_pod("b")
    servers = [net.in_pod(name, lambda: socket.create_server(("127.0.0.1", 6379))) for name in ("a", "b")]
    try:
        shown = subprocess.run(
            net.command(["ip", "-4", "-o", "addr", "show", "eth0"], b.netns),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert f"inet {b.ip}/24" in shown and a.ip not in shown
    finally:
        for server in servers:
            server.close()


def test_a_relay_brings_a_port_of_this_machine_onto_the_nodes_and_a_pods_loopback(net: PodNetwork) -> None:
    net.add_pod("a")
    with socket.create_server(("127.0.0.1", 0)) as upstream:

        def answer() -> None:
            for _ in range(2):
                conn, _ = upstream.accept()
                with conn:
                    conn.sendall(conn.recv(100).upper())

        threading.Thread(target=answer, daemon=True).start()
        on_node = net.forward_from_node(upstream.getsockname()[1])
        in_pod = net.forward_into_pod("a", upstream.getsockname()[1])

        def ask(port: int) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(b"ping")
                return conn.recv(100)

        assert net.on_node(lambda: ask(on_node)) == b"PING"
        assert net.in_pod("a", lambda: ask(in_pod)) == b"PING"
        if in_pod != on_node:  # each relay listens in its own namespace only
            with pytest.raises(ConnectionRefusedError):
                net.in_pod("a", lambda: ask(on_node))


def test_an_error_in_a_namespace_reaches_the_caller_and_the_network_is_gone_after_close() -> None:
    net = PodNetwork("10.244.8")
    net.start()
    pod = net.add_pod("a")
    with pytest.raises(ConnectionRefusedError):
        net.in_pod("a", lambda: socket.create_connection((pod.ip, 1), timeout=5))
    net.close()
    assert not (NETNS_DIR / net.node).exists() and not (NETNS_DIR / pod.netns).exists()


def test_namespaces_of_a_process_that_is_gone_are_removed_and_live_ones_kept(net: PodNetwork) -> None:
    done = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    dead = f"{PREFIX}{done.stdout.strip()}-0000-node"  # that shell has exited
    subprocess.run(["ip", "netns", "add", dead], check=True)
    try:
        assert dead in remove_stale()
        assert not (NETNS_DIR / dead).exists()
        assert (NETNS_DIR / net.node).exists()  # this process's own
    finally:
        subprocess.run(["ip", "netns", "del", dead], capture_output=True, check=False)


def test_in_netns_leaves_the_calling_thread_where_it_was(net: PodNetwork) -> None:
    def links() -> set[str]:  # the interfaces of the calling thread's namespace (not their counters)
        lines = Path("/proc/thread-self/net/dev").read_text().splitlines()[2:]
        return {line.split(":")[0].strip() for line in lines}

    before = links()
    assert "cbr0" in in_netns(net.node, links)
    assert links() == before and "cbr0" not in before


def _count_forwarded(net: PodNetwork, src: str, dst: str) -> Callable[[], int]:
    """Count the packets from ``src`` to ``dst`` that ``net``'s node routes (its FORWARD chain, where
    policies are enforced); the returned function reads the count."""
    rule = ["FORWARD", "-s", src, "-d", dst]
    subprocess.run(net.command(["iptables", "-A", *rule], net.node), check=True)

    def read() -> int:
        done = subprocess.run(
            net.command(["iptables", "-L", "FORWARD", "-v", "-x", "-n"], net.node),
            capture_output=True,
            text=True,
            check=True,
        )
        (line,) = [row for row in done.stdout.splitlines()[2:] if src in row and dst in row]
        return int(line.split()[0])

    return read


def test_pods_on_two_nodes_reach_each_other_routed_through_both_nodes_with_their_own_addresses() -> None:
    with PodNetwork("10.244.9") as one, PodNetwork("10.244.10") as two:
        a, b = one.add_pod("a"), two.add_pod("b")
        # not joined yet: node one has no route to the other node's pods
        with pytest.raises(OSError, match="unreachable"):
            one.in_pod("a", lambda: socket.create_connection((b.ip, 8265), timeout=2))
        with NodeLan([one, two]) as lan:
            assert (lan.address(one), lan.address(two)) == ("10.245.0.1", "10.245.0.2")
            seen = [_count_forwarded(node, a.ip, b.ip) for node in (one, two)]
            served = _serve_once(two, "b", 8265, b"from-b")
            # no NAT on the way: the pod on the other node sees this pod's own address
            assert one.in_pod("a", lambda: _fetch(b.ip, 8265)) == f"from-b {a.ip}".encode()
            served.join(5)
            served = _serve_once(one, "a", 6379, b"from-a")
            assert two.in_pod("b", lambda: _fetch(a.ip, 6379)) == f"from-a {b.ip}".encode()
            served.join(5)
            # both nodes routed the packets, so their iptables (where policies are) saw them
            assert [count() > 0 for count in seen] == [True, True]
        assert not (NETNS_DIR / lan.netns).exists()
        # the uplinks are gone as soon as the LAN is closed (not whenever the kernel finishes tearing
        # the LAN's namespace down), so the nodes are apart again at once, and can be joined again
        for node in (one, two):
            shown = subprocess.run(
                ["ip", "-n", node.node, "link", "show", "uplink"], capture_output=True, check=False
            )
            assert shown.returncode != 0, node.node
        with pytest.raises(OSError, match="unreachable"):
            one.in_pod("a", lambda: socket.create_connection((b.ip, 8265), timeout=2))
        with NodeLan([one, two]):
            served = _serve_once(two, "b", 8265, b"again")
            assert one.in_pod("a", lambda: _fetch(b.ip, 8265)) == f"again {a.ip}".encode()
            served.join(5)
