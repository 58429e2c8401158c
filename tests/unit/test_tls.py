"""TLS on every hop, the parts without servers: the local CA (what Kafka, Redis and MinIO present and
clients trust), the CA bundles reaching jobs and the batch runner, the Kafka SASL_SSL properties and
the clients' TLS options. The servers themselves: tests/e2e/test_tls_e2e.py."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
import stat
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from llmbatch.dispatcher.backends.engines import runner_env_vars
from llmbatch.dispatcher.backends.ray_backend import build_submission
from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.dispatcher.runs.jobspec import build_job_spec
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.settings import KafkaSettings, RedisSettings, S3Settings
from llmbatch.stack import kafka_broker
from llmbatch.stack.process import StackError
from llmbatch.stack.tls import make_local_ca
from tests.support.dispatcher_kit import registry
from tests.unit.test_dispatcher_backend import record

pytestmark = pytest.mark.unit


def test_the_local_ca_signs_a_server_certificate_for_loopback_only(tmp_path: Path) -> None:
    from cryptography import x509

    files = make_local_ca(tmp_path / "tls")
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    assert server.issuer == ca.subject
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert server.not_valid_after_utc - dt.datetime.now(dt.UTC) <= dt.timedelta(days=7)
    for private in (files.server_key, files.server_keystore):  # keys: owner only
        assert stat.S_IMODE(private.stat().st_mode) == 0o600
    keystore = files.server_keystore.read_text()
    assert keystore.startswith("-----BEGIN PRIVATE KEY-----") and "BEGIN CERTIFICATE" in keystore
    # a TLS client trusting ca.pem accepts the server's chain (Python's own verification)
    context = ssl.create_default_context(cafile=str(files.ca_cert))
    context.load_cert_chain(str(files.server_cert), str(files.server_key))  # key and cert belong together


def test_every_call_makes_a_new_ca(tmp_path: Path) -> None:
    first, second = make_local_ca(tmp_path / "a"), make_local_ca(tmp_path / "b")
    assert first.ca_cert.read_bytes() != second.ca_cert.read_bytes()


def _settings(**redis: object) -> DispatcherSettings:
    return DispatcherSettings(
        _env_file=None,
        s3=S3Settings(
            endpoint="https://minio:9000",
            access_key=SecretStr("k"),
            secret_key=SecretStr("s"),
            ca_file=Path("/etc/llmbatch/ca.pem"),
        ),
        redis=RedisSettings(url="rediss://redis:6380/0", **redis),
        engines=registry(),
    )


def test_jobs_and_the_batch_runner_get_the_ca_bundles_paths_and_no_secret() -> None:
    settings = _settings(ssl_ca_certs=Path("/etc/llmbatch/redis-ca.pem"), password=SecretStr("pw-secret"))
    env = runner_env_vars(settings)
    assert env["LLMBATCH_S3__CA_FILE"] == "/etc/llmbatch/ca.pem"
    assert env["LLMBATCH_REDIS__SSL_CA_CERTS"] == "/etc/llmbatch/redis-ca.pem"
    assert env["LLMBATCH_S3__ENDPOINT"] == "https://minio:9000"
    job_env = build_submission(settings, build_job_spec(record(), 1, settings, Keys("p")))["runtime_env"]
    assert job_env["env_vars"]["LLMBATCH_S3__CA_FILE"] == "/etc/llmbatch/ca.pem"
    assert "pw-secret" not in str(job_env)
    plain = _settings()
    assert "LLMBATCH_REDIS__SSL_CA_CERTS" not in runner_env_vars(plain)


def test_the_state_store_verifies_a_rediss_server_against_the_ca_bundle() -> None:
    store = StateStore.from_settings(
        RedisSettings(url="rediss://redis:6380/0", ssl_ca_certs=Path("/etc/ca.pem"))
    )
    pool = store.client.connection_pool
    assert pool.connection_kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    assert pool.connection_class.__name__ == "SSLConnection"  # verifies by default (CERT_REQUIRED)
    plain = StateStore.from_settings(
        RedisSettings(url="redis://redis:6379/0", ssl_ca_certs=Path("/etc/ca.pem"))
    )
    assert "ssl_ca_certs" not in plain.client.connection_pool.connection_kwargs


def test_kafka_sasl_ssl_settings_build_a_verifying_context(tmp_path: Path) -> None:
    files = make_local_ca(tmp_path)
    kafka = KafkaSettings(
        bootstrap_servers="127.0.0.1:9093",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="u",
        sasl_password=SecretStr("p"),
        ssl_cafile=files.ca_cert,
    )
    context = kafka.client_kwargs()["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_a_tls_kafka_listens_sasl_ssl_on_its_pem_keystore(tmp_path: Path) -> None:
    files = make_local_ca(tmp_path)
    sasl = kafka_broker.KafkaSasl("admin", {"admin": "pw"})
    props = kafka_broker._kafka_properties(tmp_path, 9093, 9094, sasl, "ctl-pw", files)
    assert "listeners=SASL_SSL://127.0.0.1:9093,CONTROLLER://127.0.0.1:9094" in props
    assert "inter.broker.listener.name=SASL_SSL" in props
    assert f"ssl.keystore.location={files.server_keystore}" in props
    assert f"ssl.truststore.location={files.ca_cert}" in props
    assert any(p.startswith("listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=") for p in props)
    assert not any("PLAINTEXT://127.0.0.1:9093" in p for p in props)
    with pytest.raises(StackError, match="SASL_SSL"):
        kafka_broker.start_kafka(tmp_path, tls=files)
    client = sasl.client("admin", files.ca_cert)
    assert client["security_protocol"] == "SASL_SSL" and isinstance(client["ssl_context"], ssl.SSLContext)


def test_the_job_side_s3_filesystem_trusts_the_ca_bundle(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pyarrow import fs as pafs

    from llmbatch.ray_job.storage import s3

    files = make_local_ca(tmp_path)
    seen: dict[str, object] = {}

    def fake(**kwargs: object) -> object:
        seen.update(kwargs)
        return object()

    monkeypatch.setattr(pafs, "S3FileSystem", fake)
    monkeypatch.setenv("LLMBATCH_S3__ENDPOINT", "https://127.0.0.1:9000")
    monkeypatch.setenv("LLMBATCH_S3__CA_FILE", str(files.ca_cert))
    s3.filesystem()
    assert seen["tls_ca_file_path"] == str(files.ca_cert) and seen["scheme"] == "https"
    seen.clear()
    monkeypatch.setenv("LLMBATCH_S3__ENDPOINT", "http://127.0.0.1:9000")
    s3.filesystem()
    assert "tls_ca_file_path" not in seen


def _tls_state(tmp_path: Path) -> Any:
    from llmbatch.stack.state import ServiceRecord, StackState

    ca = str(tmp_path / "tls" / "ca.pem")
    state = StackState(tmp_path)
    state.services = {
        "kafka": ServiceRecord(
            "kafka",
            1,
            {"broker": 9093},
            "127.0.0.1:9093",
            "",
            "",
            0.0,
            {
                "security_protocol": "SASL_SSL",
                "ca_cert": ca,
                "sasl_username": "llmbatch",
                "sasl_password": "kpw",
            },
        ),
        "redis": ServiceRecord(
            "redis", 2, {"redis": 6380}, "rediss://127.0.0.1:6380/0", "", "", 0.0, {"ca_cert": ca}
        ),
        "minio": ServiceRecord(
            "minio",
            3,
            {"s3": 9000},
            "https://127.0.0.1:9000",
            "",
            "",
            0.0,
            {"access_key": "ak", "secret_key": "sk", "ca_cert": ca},
        ),
        "ray": ServiceRecord(
            "ray",
            4,
            {"dashboard": 8265, "dashboard_tls": 8443},
            "https://127.0.0.1:8443",
            "",
            "",
            0.0,
            {
                "ca_cert": ca,
                "serve_address": "https://127.0.0.1:8000",
                "serve_ssl_certfile": "/run/tls/server.pem",
                "serve_ssl_keyfile": "/run/tls/server.key",
                "front_pid": "5",
            },
        ),
    }
    return state


def test_a_tls_stacks_exports_and_settings_carry_the_ca_and_the_kafka_login(tmp_path: Path) -> None:
    from llmbatch.stack import manager

    state = _tls_state(tmp_path)
    ca = str(tmp_path / "tls" / "ca.pem")
    env = manager.env_exports(state)
    assert env["LLMBATCH_KAFKA__SECURITY_PROTOCOL"] == "SASL_SSL"
    assert env["LLMBATCH_KAFKA__SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert env["LLMBATCH_KAFKA__SASL_USERNAME"] == "llmbatch"
    assert env["LLMBATCH_KAFKA__SASL_PASSWORD"] == "kpw"
    assert env["LLMBATCH_KAFKA__SSL_CAFILE"] == env["LLMBATCH_REDIS__SSL_CA_CERTS"] == ca
    assert env["LLMBATCH_S3__CA_FILE"] == ca and env["LLMBATCH_S3__ENDPOINT"] == "https://127.0.0.1:9000"
    settings = manager.settings_for(state)
    assert settings.kafka.security_protocol == "SASL_SSL" and str(settings.kafka.ssl_cafile) == ca
    password = settings.kafka.sasl_password
    assert password is not None and password.get_secret_value() == "kpw"
    assert settings.redis.url == "rediss://127.0.0.1:6380/0" and str(settings.redis.ssl_ca_certs) == ca
    assert str(settings.s3.ca_file) == ca and settings.s3.secure
    # Ray: the dashboard through its TLS front, Serve's proxy with the certificate, both verified by the CA
    assert env["LLMBATCH_RAY__CA_FILE"] == ca and env["LLMBATCH_RAY__ADDRESS"] == "https://127.0.0.1:8443"
    assert settings.ray.serve_address == "https://127.0.0.1:8000" and str(settings.ray.ca_file) == ca
    assert (settings.ray.serve_ssl_certfile, settings.ray.serve_ssl_keyfile) == (
        "/run/tls/server.pem",
        "/run/tls/server.key",
    )
    for name in ("kafka", "redis", "minio", "ray"):  # plaintext records export no TLS
        state.services[name].extra.pop("ca_cert")
    state.services["kafka"].extra.clear()
    state.services["ray"].extra = {"serve_address": "http://127.0.0.1:8000"}
    plain = manager.env_exports(state)
    assert not any(
        k.endswith(("CA_FILE", "CA_CERTS", "CAFILE", "SECURITY_PROTOCOL", "SSL_CERTFILE")) for k in plain
    )
    assert manager.settings_for(state).kafka.security_protocol == "PLAINTEXT"
    assert manager.settings_for(state).ray.serve_address == "http://127.0.0.1:8000"


def test_up_will_not_mix_tls_and_plaintext_services(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmbatch.stack import manager

    state = _tls_state(tmp_path)
    state.save()
    monkeypatch.setattr(manager, "prepare", lambda names: None)
    monkeypatch.setattr(manager, "alive", lambda pid: True)
    with pytest.raises(StackError, match=r"redis is running with TLS .* `llmbatch stack down`"):
        manager.up(tmp_path, ["redis"])


def test_the_run_folders_ca_is_kept_while_valid(tmp_path: Path) -> None:
    from llmbatch.stack.tls import local_ca

    first = local_ca(tmp_path).ca_cert.read_bytes()
    assert local_ca(tmp_path).ca_cert.read_bytes() == first
    make_local_ca(tmp_path, now=dt.datetime.now(dt.UTC) - dt.timedelta(days=6, hours=12))  # 12 h left
    old = (tmp_path / "ca.pem").read_bytes()
    assert local_ca(tmp_path).ca_cert.read_bytes() not in {first, old}


def test_the_certificate_names_the_nodes_own_address_for_ray_and_a_missing_one_makes_a_new_ca(
    tmp_path: Path,
) -> None:
    from cryptography import x509

    from llmbatch.stack.ray_head import ray_tls_env
    from llmbatch.stack.tls import local_ca

    files = local_ca(tmp_path, node_ips=("192.0.2.7",))
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("192.0.2.7"),
    ]
    first = files.ca_cert.read_bytes()
    assert local_ca(tmp_path, node_ips=("192.0.2.7",)).ca_cert.read_bytes() == first  # kept
    assert local_ca(tmp_path).ca_cert.read_bytes() == first  # loopback only: kept too
    assert local_ca(tmp_path, node_ips=("192.0.2.8",)).ca_cert.read_bytes() != first  # the node moved
    # every process of the Ray node inherits these: mutual TLS with that certificate
    assert ray_tls_env(files) == {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(files.server_cert),
        "RAY_TLS_SERVER_KEY": str(files.server_key),
        "RAY_TLS_CA_CERT": str(files.ca_cert),
    }
