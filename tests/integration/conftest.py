"""Fixtures of the integration tests: the S3 keys of a job's node (the runner's attempts in this process),
and the Kubernetes control plane of the deploy tests (test_kuberay_*.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from minio import Minio

from llmbatch.adapters.storage import ensure_buckets, make_client
from llmbatch.settings import S3Settings
from tests.support.kube_control_plane import ControlPlane, start_control_plane
from tests.support.kube_objects import crds


@pytest.fixture
def node_s3_env(s3_settings: S3Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's environment holds keys that reach every bucket, as a runner's node does (an
    attempt run here without a session of its own takes them)."""
    monkeypatch.setenv("LLMBATCH_S3__ENDPOINT", s3_settings.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_settings.access_key.get_secret_value())
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_settings.secret_key.get_secret_value())


@pytest.fixture
def node_minio(s3_settings: S3Settings, node_s3_env: None) -> Minio:
    """The product's own MinIO client with both buckets, the node's keys in the environment."""
    minio: Minio = make_client(s3_settings)
    ensure_buckets(minio, s3_settings)
    return minio


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver with every CRD an overlay needs, and the KubeRay operator: one per test
    file (a file that needs the operator started differently defines its own ``plane``)."""
    started = start_control_plane(tmp_path_factory.mktemp("kube"), crds())
    try:
        yield started
    finally:
        started.stop()
