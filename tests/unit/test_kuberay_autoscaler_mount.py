"""tests/support/kuberay_autoscaler.py reads the service account files from where our manifest
mounts them, and only if that is where Ray's KubeRay node provider looks."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest
from ray.autoscaler._private.kuberay import node_provider

from tests.support.kube_objects import vd
from tests.support.kuberay_autoscaler import SERVICE_ACCOUNT_FILES, remap_service_account_files

pytestmark = pytest.mark.unit


def _autoscaler_mount(overlay: str) -> PurePosixPath:
    cluster = vd.one(vd.render_overlay(overlay), "RayCluster")
    (mount,) = [
        m for m in cluster["spec"]["autoscalerOptions"]["volumeMounts"] if m["name"] == "autoscaler-api-token"
    ]
    return PurePosixPath(mount["mountPath"])


@pytest.mark.parametrize("overlay", ["cpu-dev", "gpu-prod"])
def test_the_files_ray_reads_are_under_the_overlays_mount(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in SERVICE_ACCOUNT_FILES:
        monkeypatch.setattr(node_provider, name, getattr(node_provider, name))  # restored after
    moved = remap_service_account_files(_autoscaler_mount(overlay), tmp_path)
    assert moved == {
        "IN_CLUSTER_TOKEN_PATH": str(tmp_path / "token"),
        "IN_CLUSTER_CA_CERT_PATH": str(tmp_path / "ca.crt"),
    }
    assert str(tmp_path / "token") == node_provider.IN_CLUSTER_TOKEN_PATH


def test_a_mount_elsewhere_than_ray_reads_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SERVICE_ACCOUNT_FILES:
        monkeypatch.setattr(node_provider, name, getattr(node_provider, name))
    with pytest.raises(ValueError, match="not under the mounted /var/run/secrets/tokens"):
        remap_service_account_files(PurePosixPath("/var/run/secrets/tokens"), tmp_path)
