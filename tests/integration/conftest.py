"""Fixtures of the deploy tests that run a Kubernetes control plane (test_kuberay_*.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.kube_control_plane import ControlPlane, start_control_plane
from tests.support.kube_objects import crds


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver with every CRD an overlay needs, and the KubeRay operator: one per test
    file (a file that needs the operator started differently defines its own ``plane``)."""
    started = start_control_plane(tmp_path_factory.mktemp("kube"), crds())
    try:
        yield started
    finally:
        started.stop()
