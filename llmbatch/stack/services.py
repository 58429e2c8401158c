"""How to fetch, start and health-check each real service of the local stack.

Redis (Debian redis-server, AOF), MinIO (built from its Go module); Kafka (Apache, KRaft, jars from
Maven Central) is :mod:`llmbatch.stack.kafka_broker` and the Ray head :mod:`llmbatch.stack.ray_head`;
the registries at the end name all four. Each ``start_*`` returns a
:class:`ServiceRecord`; all bind 127.0.0.1 on ports from the stack's one allocator
(:mod:`llmbatch.stack.ports`) and keep data under the run folder. A started service owns its port
reservations; a failed start gives them back.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmbatch.stack.kafka_broker import kafka_healthy, kafka_libs, start_kafka
from llmbatch.stack.node_credentials import minio_credentials
from llmbatch.stack.process import StackError, http_ok, run_checked, spawn, wait_until
from llmbatch.stack.ray_head import ray_executable, ray_healthy, start_ray
from llmbatch.stack.start_ports import StartPorts, start_ports
from llmbatch.stack.state import CACHE_DIR, ServiceRecord
from llmbatch.stack.tls import TlsFiles

# MinIO publishes no semver tags; this is the pseudo-version `go install ...@latest` resolved to on
# 2026-11-22. Pinned so every machine builds the same server.
MINIO_MODULE = "github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c"

# --- Redis ------------------------------------------------------------------------------------


def redis_binary() -> str:
    debian = Path("/usr/bin/redis-server")
    found = shutil.which("redis-server") or (str(debian) if debian.exists() else None)
    if not found:
        raise StackError("redis-server is missing: run scripts/bootstrap.sh (apt-get install redis-server)")
    return found


def start_redis(
    run_dir: Path,
    port: int | None = None,
    name: str = "redis",
    *,
    fresh_port_if_taken: bool = False,
    password: str | None = None,
    acl: list[str] | None = None,
    tls: TlsFiles | None = None,
) -> ServiceRecord:
    """Start Redis with its data (AOF) in ``run_dir/name``.

    ``port`` asks for that port again (a restart); if something took it meanwhile this fails, or,
    with ``fresh_port_if_taken``, starts on a fresh port: the record says which, so callers re-point
    their clients at ``record.address``. ``password`` turns authentication on (``requirepass``, in a
    0600 config file rather than on the command line, where ``ps`` shows it); the record leaves it out.
    ``acl`` adds ACL users (``user ...`` lines, e.g. ``llmbatch dispatcher redis-acl``) to that file.
    ``tls`` makes it speak TLS only (no plaintext port; clients verify it against ``tls.ca_cert``):
    the record's address is then ``rediss://``.
    """
    with start_ports() as ports:
        return _start_redis(run_dir, port, name, fresh_port_if_taken, ports, password, acl or [], tls)


def _start_redis(
    run_dir: Path,
    port: int | None,
    name: str,
    fresh_port_if_taken: bool,
    ports: StartPorts,
    password: str | None = None,
    acl: list[str] | None = None,
    tls: TlsFiles | None = None,
) -> ServiceRecord:
    data = run_dir / name
    data.mkdir(parents=True, exist_ok=True)
    if port is not None and not ports.claim(port):
        if not fresh_port_if_taken:
            raise StackError(
                f"Redis cannot use port {port}: something already listens there or "
                "another process reserved it"
            )
        port = None
    port = port or ports.one()
    log = run_dir / "logs" / f"{name}.log"
    argv = [
        redis_binary(),
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(data),
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--daemonize",
        "no",
        "--save",
        "",
        "--protected-mode",
        "yes",
        "--logfile",
        "",
    ]
    if tls is not None:  # the TLS port only: a plaintext client gets nothing
        argv[argv.index("--port") + 1] = "0"
        argv += [
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(tls.server_cert),
            "--tls-key-file",
            str(tls.server_key),
            "--tls-ca-cert-file",
            str(tls.ca_cert),
            "--tls-auth-clients",
            "no",
        ]
    if password is not None or acl:
        if password is not None and (not password or any(c in password for c in '"\\\n\r')):
            raise StackError("a Redis password must be non-empty, without quotes, backslashes or line breaks")
        conf = data / "auth.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            if password is not None:
                fh.write(f'requirepass "{password}"\n')
            fh.writelines(f"{line}\n" for line in acl or [])
        argv.insert(1, str(conf))  # redis-server <config file> [--options]
    pid = spawn(argv, log)
    ports.hand_over(pid)
    ca = str(tls.ca_cert) if tls is not None else None
    waited = wait_until(lambda: _redis_ping(port, pid, password, ca), 20, pid, "Redis", log)
    scheme = "rediss" if tls is not None else "redis"
    return ServiceRecord(
        name,
        pid,
        {"redis": port},
        f"{scheme}://127.0.0.1:{port}/0",
        str(log),
        str(data),
        round(waited, 2),
        {"ca_cert": ca} if ca else {},
    )


def _redis_ping(port: int, pid: int, password: str | None = None, ca_cert: str | None = None) -> bool:
    """The server on ``port`` answers and is the process we started (not another one on that port);
    ``ca_cert``: over TLS, verified against that CA."""
    import redis

    tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": ca_cert} if ca_cert else {}
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, password=password, **tls)
    try:
        return int(client.info("server")["process_id"]) == pid
    finally:
        client.close()


def redis_healthy(rec: ServiceRecord) -> bool:
    try:
        return _redis_ping(rec.ports["redis"], rec.pid, ca_cert=rec.extra.get("ca_cert"))
    except Exception:
        return False


# --- MinIO ------------------------------------------------------------------------------------


def minio_binary() -> Path:
    """The real MinIO server, built once from its Go module into the cache."""
    tag = MINIO_MODULE.rsplit("@", 1)[1]
    binary = CACHE_DIR / "bin" / f"minio-{tag}"
    if binary.exists():
        return binary
    if not shutil.which("go"):
        raise StackError("Go is needed to build MinIO (go install); install golang")
    gobin = CACHE_DIR / "gobin-tmp"
    shutil.rmtree(gobin, ignore_errors=True)
    run_checked(
        ["go", "install", MINIO_MODULE],
        "building MinIO with `go install` (first time: minutes)",
        env={"GOBIN": str(gobin), "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"},
        cwd=Path(tempfile.gettempdir()),
    )
    binary.parent.mkdir(parents=True, exist_ok=True)
    (gobin / "minio").rename(binary)
    shutil.rmtree(gobin, ignore_errors=True)
    return binary


def start_minio(
    run_dir: Path, *, restart: ServiceRecord | None = None, tls: TlsFiles | None = None
) -> ServiceRecord:
    """Start MinIO with its data and credentials in ``run_dir``; ``restart`` (an earlier start's record)
    brings it back on the same ports (its data dir is always kept). ``tls``: https only (the record's
    address is ``https://``; clients verify it against ``tls.ca_cert``)."""
    with start_ports() as ports:
        return _start_minio(run_dir, ports, restart, tls)


def _start_minio(
    run_dir: Path, ports: StartPorts, restart: ServiceRecord | None = None, tls: TlsFiles | None = None
) -> ServiceRecord:
    binary = minio_binary()
    data = run_dir / "minio"
    data.mkdir(parents=True, exist_ok=True)
    user, password = minio_credentials(run_dir)
    if restart is not None:
        port, console = ports.again("MinIO", restart.ports, "s3", "console")
    else:
        port, console = ports.one(), ports.one()
    log = run_dir / "logs" / "minio.log"
    env = {
        "MINIO_ROOT_USER": user,
        "MINIO_ROOT_PASSWORD": password,
        "MINIO_BROWSER": "off",
        "MINIO_UPDATE": "off",
        "MINIO_CI_CD": "1",
    }
    argv = [
        str(binary),
        "server",
        str(data),
        "--address",
        f"127.0.0.1:{port}",
        "--console-address",
        f"127.0.0.1:{console}",
        "--quiet",
    ]
    extra = {"access_key": user, "secret_key": password}
    if tls is not None:  # MinIO reads public.crt / private.key from its certs folder
        certs = run_dir / "minio-certs"
        certs.mkdir(mode=0o700, exist_ok=True)
        shutil.copyfile(tls.server_cert, certs / "public.crt")
        shutil.copyfile(tls.server_key, certs / "private.key")
        (certs / "private.key").chmod(0o600)
        argv += ["--certs-dir", str(certs)]
        extra["ca_cert"] = str(tls.ca_cert)
    pid = spawn(argv, log, env=env)
    ports.hand_over(pid)
    address = f"{'https' if tls is not None else 'http'}://127.0.0.1:{port}"
    ca = extra.get("ca_cert")
    waited = wait_until(lambda: http_ok(f"{address}/minio/health/ready", ca_cert=ca), 60, pid, "MinIO", log)
    return ServiceRecord(
        "minio",
        pid,
        {"s3": port, "console": console},
        address,
        str(log),
        str(data),
        round(waited, 2),
        extra=extra,
    )


def minio_healthy(rec: ServiceRecord) -> bool:
    try:
        return http_ok(f"{rec.address}/minio/health/ready", ca_cert=rec.extra.get("ca_cert"))
    except Exception:
        return False


# --- registry ----------------------------------------------------------------------------------

STARTERS: dict[str, Callable[[Path], ServiceRecord]] = {
    "kafka": start_kafka,
    "redis": start_redis,
    "minio": start_minio,
    "ray": start_ray,
}
HEALTH: dict[str, Callable[[ServiceRecord], bool]] = {
    "kafka": kafka_healthy,
    "redis": redis_healthy,
    "minio": minio_healthy,
    "ray": ray_healthy,
}
PREPARERS: dict[str, Callable[[], object]] = {
    "kafka": kafka_libs,
    "redis": redis_binary,
    "minio": minio_binary,
    "ray": ray_executable,
}
