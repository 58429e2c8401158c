"""tests/support/cluster_hosts.py: what the hosts-file stand-in for cluster DNS answers."""

from __future__ import annotations

from typing import Any

from tests.support.cluster_hosts import headless_hosts, render


def _service(name: str, namespace: str = "llmbatch", cluster_ip: str = "None", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"clusterIP": cluster_ip, **spec}}


def _slice(service: str, namespace: str, *endpoints: tuple[str, bool]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints],
    }


def test_a_headless_service_resolves_to_its_ready_endpoints_in_its_own_namespace() -> None:
    services = [_service("ray-head-svc"), _service("ray-serve-svc", cluster_ip="10.96.0.7")]
    slices = [
        _slice("ray-head-svc", "llmbatch", ("10.244.0.3", True), ("10.244.0.2", True), ("10.244.0.9", False)),
        _slice("ray-head-svc", "other", ("10.244.0.50", True)),  # another namespace's Service
        _slice("ray-serve-svc", "llmbatch", ("10.244.0.2", True)),
    ]
    assert headless_hosts(services, slices) == {
        "ray-head-svc.llmbatch.svc.cluster.local": ["10.244.0.2", "10.244.0.3"]
    }


def test_publish_not_ready_addresses_and_services_without_endpoints() -> None:
    services = [_service("a", publishNotReadyAddresses=True), _service("b")]
    slices = [_slice("a", "llmbatch", ("10.244.0.4", False)), _slice("b", "llmbatch", ("10.244.0.5", False))]
    assert headless_hosts(services, slices) == {"a.llmbatch.svc.cluster.local": ["10.244.0.4"]}


def test_render_keeps_localhost_and_one_line_per_address() -> None:
    text = render(
        {"b.ns.svc.cluster.local": ["10.0.0.2"], "a.ns.svc.cluster.local": ["10.0.0.1", "10.0.0.3"]}
    )
    assert text.splitlines() == [
        "127.0.0.1 localhost",
        "::1 localhost",
        "10.0.0.1 a.ns.svc.cluster.local",
        "10.0.0.3 a.ns.svc.cluster.local",
        "10.0.0.2 b.ns.svc.cluster.local",
    ]
