"""What the pod network looks like at one moment, for a test that saw a connection fail where it
should not: each namespace's routes and neighbours, the nodes' iptables with their packet counters
(which rule took the packets), the conntrack entries for the destination, the listening sockets of
the destination pod, and fresh connects from each hop towards the destination (where the path
breaks)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Sequence

from tests.support.pod_network import PodNetwork


def _run(net: PodNetwork, netns: str, argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(
            net.command(argv, netns), capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({' '.join(argv)}: {exc})"
    return (done.stdout + done.stderr).strip()


def connect_outcome(ip: str, port: int) -> str:
    """``connected``, or the name of the error a TCP connect to ``ip:port`` ended with from the
    calling thread's namespace (``ConnectionRefusedError``: the packets got there; ``TimeoutError``:
    they did not)."""
    try:
        with socket.create_connection((ip, port), timeout=3):
            return "connected"
    except OSError as exc:
        return type(exc).__name__


def path_snapshot(src: PodNetwork, src_pod: str, dst: PodNetwork, dst_pod: str, port: int) -> str:
    """A text report of the path from pod ``src_pod`` (on ``src``) to ``dst_pod``'s ``port`` (on
    ``dst``): see the module docstring."""
    ip = dst.pods[dst_pod].ip
    out: list[str] = [f"=== path {src_pod} ({src.pods[src_pod].ip}) -> {dst_pod} {ip}:{port}"]
    probes: list[tuple[str, Callable[[], str]]] = [
        (f"pod {src_pod}", lambda: src.in_pod(src_pod, lambda: connect_outcome(ip, port))),
        ("node of the source", lambda: src.on_node(lambda: connect_outcome(ip, port))),
        ("node of the destination", lambda: dst.on_node(lambda: connect_outcome(ip, port))),
        (f"pod {dst_pod} to itself", lambda: dst.in_pod(dst_pod, lambda: connect_outcome(ip, port))),
    ]
    for name, probe in probes:
        out.append(f"--- connect from {name}: {probe()}")
    spaces = [(src, src.pods[src_pod].netns, f"pod {src_pod}"), (src, src.node, "source node")]
    if dst is not src:
        spaces.append((dst, dst.node, "destination node"))
    spaces.append((dst, dst.pods[dst_pod].netns, f"pod {dst_pod}"))
    for net, netns, name in spaces:
        out.append(f"--- {name} ({netns})")
        out.append(_run(net, netns, ["ip", "route"]))
        out.append(_run(net, netns, ["ip", "-s", "link"]))
        out.append(_run(net, netns, ["ip", "neigh"]))
        out.append(_run(net, netns, ["sh", "-c", f"grep -F '{ip}' /proc/net/nf_conntrack || true"]))
    out.append(f"--- pod {dst_pod}: listening sockets")
    out.append(_run(dst, dst.pods[dst_pod].netns, ["ss", "-ltn"]))
    nodes = [(src, "source node")] + ([(dst, "destination node")] if dst is not src else [])
    for net, name in nodes:
        out.append(f"--- {name}: iptables-save -c")
        out.append(_run(net, net.node, ["iptables-save", "-c"]))
    return "\n".join(out)
