"""ray_job.storage.job_redis: the job's Redis client takes its password and CA from the node, never the
URL."""

from __future__ import annotations

import pytest

from llmbatch.ray_job.storage import job_redis, node_secrets

pytestmark = pytest.mark.unit


def test_the_password_comes_from_the_nodes_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(node_secrets.REDIS_PASSWORD, "node-pw")
    kwargs = job_redis.connect("redis://h:6379/0", timeout_s=3).connection_pool.connection_kwargs
    assert kwargs["password"] == "node-pw"
    assert kwargs["socket_timeout"] == 3 and kwargs["socket_connect_timeout"] == 3
    assert "ssl_ca_certs" not in kwargs


def test_an_empty_password_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(node_secrets.REDIS_PASSWORD, "")  # withheld on purpose
    kwargs = job_redis.connect("redis://h:6379/0", timeout_s=1).connection_pool.connection_kwargs
    assert kwargs["password"] is None


def test_the_ca_applies_to_rediss_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMBATCH_REDIS__SSL_CA_CERTS", "/tmp/ca.pem")
    tls = job_redis.connect("rediss://h:6380/0", timeout_s=1).connection_pool.connection_kwargs
    assert tls["ssl_ca_certs"] == "/tmp/ca.pem"
    plain = job_redis.connect("redis://h:6379/0", timeout_s=1).connection_pool.connection_kwargs
    assert "ssl_ca_certs" not in plain
