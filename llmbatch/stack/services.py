"""How to fetch, start and health-check each real service of the local stack.

Kafka (Apache, KRaft, jars from Maven Central), Redis (Debian redis-server, AOF), MinIO (built from
its Go module); the Ray head is :mod:`llmbatch.stack.ray_head`. Each ``start_*`` returns a
:class:`ServiceRecord`; all bind 127.0.0.1 on ports from the stack's one allocator
(:mod:`llmbatch.stack.ports`) and keep data under the run folder. A started service owns its port
reservations; a failed start gives them back.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmbatch.stack.node_credentials import minio_credentials
from llmbatch.stack.process import StackError, http_ok, port_open, spawn, wait_until
from llmbatch.stack.ray_head import ray_executable, ray_healthy, start_ray
from llmbatch.stack.start_ports import StartPorts, start_ports
from llmbatch.stack.state import CACHE_DIR, ServiceRecord
from llmbatch.stack.tls import TlsFiles

KAFKA_VERSION = "4.2.0"
# MinIO publishes no semver tags; this is the pseudo-version `go install ...@latest` resolved to on
# 2026-11-22. Pinned so every machine builds the same server.
MINIO_MODULE = "github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c"

_HERE = Path(__file__).resolve().parent


def _run(argv: list[str], what: str, env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout: float = 1800) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})},
                          cwd=cwd, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise StackError(f"{what} failed (exit {proc.returncode})", tail)


# --- Kafka ------------------------------------------------------------------------------------

def kafka_libs() -> Path:
    """Kafka broker jars, copied once from Maven Central into the cache."""
    libs = CACHE_DIR / f"kafka-{KAFKA_VERSION}" / "libs"
    if (libs / f"kafka_2.13-{KAFKA_VERSION}.jar").exists():
        return libs
    if not shutil.which("mvn"):
        raise StackError("Maven (mvn) is needed to fetch the Kafka jars: apt-get install maven")
    tmp = libs.with_name("libs.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _run(["mvn", "-q", "-B", "-f", str(_HERE / "kafka" / "pom.xml"), "dependency:copy-dependencies",
          f"-DoutputDirectory={tmp}", "-DincludeScope=runtime", f"-Dkafka.version={KAFKA_VERSION}"],
         "fetching Kafka jars from Maven Central")
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    return libs


@dataclass(frozen=True)
class KafkaSasl:
    """SCRAM-SHA-512 users of a broker started with authentication and ACLs (:func:`start_kafka`).

    ``admin`` is the super user (the broker's own inter-broker login too); ``passwords`` has every user's,
    the admin's included. Names and passwords are letters, digits and ``_ . ~ -`` only, as they are
    written into the broker's SCRAM and JAAS settings."""

    admin: str
    passwords: Mapping[str, str] = field(repr=False)

    def check(self) -> None:
        """Raise :class:`StackError` for a missing admin password or a name/password it cannot write."""
        if self.admin not in self.passwords:
            raise StackError(f"the Kafka admin {self.admin!r} needs a password in KafkaSasl.passwords")
        for name, password in self.passwords.items():
            if not _SCRAM_TEXT.fullmatch(name) or name == KAFKA_CONTROLLER_USER:
                raise StackError(f"Kafka user name {name!r}: letters, digits and _ . ~ - only, and not "
                                 f"{KAFKA_CONTROLLER_USER!r}")
            if not _SCRAM_TEXT.fullmatch(password):
                raise StackError(f"the password of Kafka user {name!r} may hold letters, digits and "
                                 "_ . ~ - only")

    def client(self, user: str, ca_cert: Path | None = None) -> dict[str, Any]:
        """aiokafka's SASL keyword arguments for ``user``; ``ca_cert``: over TLS (SASL_SSL), the broker
        verified against that CA."""
        kwargs: dict[str, Any] = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
                                  "sasl_plain_username": user, "sasl_plain_password": self.passwords[user]}
        if ca_cert is not None:
            import ssl

            context = ssl.create_default_context(cafile=str(ca_cert))
            kwargs.update(security_protocol="SASL_SSL", ssl_context=context)
        return kwargs


KAFKA_CONTROLLER_USER = "kraft-controller"
_SCRAM_TEXT = re.compile(r"[A-Za-z0-9_.~-]+")


def start_kafka(run_dir: Path, *, restart: ServiceRecord | None = None,
                sasl: KafkaSasl | None = None, tls: TlsFiles | None = None) -> ServiceRecord:
    """Start a single-node KRaft Kafka with its data in ``run_dir/kafka``.

    ``restart`` is the record of an earlier start in the same ``run_dir``: the broker comes back on its
    ports with its data (topics, records, committed offsets), as after a crash (a chaos test's kill -9).
    Without it the data dir is formatted anew on fresh ports.

    ``sasl`` (default: none, a PLAINTEXT broker) makes clients log in with SCRAM-SHA-512 on a
    SASL_PLAINTEXT listener, and turns on the StandardAuthorizer with ``allow.everyone.if.no.acl.found``
    false: a user can do only what an ACL allows, but ``sasl.admin``, a super user. The users are created
    when the storage is formatted. Passwords are only in owner-only files (the broker's properties, the
    format's argument file, removed after use), never on a command line. The controller listener is
    on 127.0.0.1 too, with SASL/PLAIN and a principal of its own in ``super.users`` (KRaft sends the
    broker's registration there; a PLAINTEXT controller listener would need ``User:ANONYMOUS`` as a
    super user, which anyone reaching the port would be).

    ``tls`` (with ``sasl``) makes the client listener SASL_SSL: the broker presents ``tls``'s server
    certificate (a PEM keystore) and clients verify it against ``tls.ca_cert``.
    """
    if sasl is not None:
        sasl.check()
    if tls is not None and sasl is None:
        raise StackError("a TLS Kafka here is SASL_SSL: give it KafkaSasl users too")
    with start_ports() as ports:
        return _start_kafka(run_dir, ports, restart, sasl, tls)


def _kafka_properties(data: Path, port: int, controller: int, sasl: KafkaSasl | None,
                      controller_password: str, tls: TlsFiles | None = None) -> list[str]:
    if sasl is None:
        listeners = [
            f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{port}",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        ]
    else:
        scram = "org.apache.kafka.common.security.scram.ScramLoginModule"
        plain = "org.apache.kafka.common.security.plain.PlainLoginModule"
        ctl = KAFKA_CONTROLLER_USER
        name = "SASL_SSL" if tls is not None else "SASL_PLAINTEXT"
        listeners = [
            f"listeners={name}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
            f"advertised.listeners={name}://127.0.0.1:{port}",
            f"inter.broker.listener.name={name}",
            f"listener.security.protocol.map=CONTROLLER:SASL_PLAINTEXT,{name}:{name}",
            "sasl.enabled.mechanisms=SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512",
            # the broker's own login on its client listener: the admin, a super user
            f"listener.name.{name.lower()}.scram-sha-512.sasl.jaas.config={scram} required "
            f'username="{sasl.admin}" password="{sasl.passwords[sasl.admin]}";',
            # SCRAM cannot guard the controller listener (its credentials live in the metadata it
            # serves): a static PLAIN user that only this node knows
            "sasl.mechanism.controller.protocol=PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms=PLAIN",
            f"listener.name.controller.plain.sasl.jaas.config={plain} required "
            f'username="{ctl}" password="{controller_password}" user_{ctl}="{controller_password}";',
            "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            f"super.users=User:{sasl.admin};User:{ctl}",
            "allow.everyone.if.no.acl.found=false",
        ]
        if tls is not None:  # PEM files as they are (no JKS conversion); no client certificates
            listeners += [
                "ssl.keystore.type=PEM",
                f"ssl.keystore.location={tls.server_keystore}",
                "ssl.truststore.type=PEM",
                f"ssl.truststore.location={tls.ca_cert}",
                "ssl.client.auth=none",
            ]
    return [
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.bootstrap.servers=127.0.0.1:{controller}",
        *listeners,
        "controller.listener.names=CONTROLLER",
        f"log.dirs={data / 'logs'}",
        "num.partitions=3",
        "offsets.topic.replication.factor=1",
        "offsets.topic.num.partitions=6",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "share.coordinator.state.topic.replication.factor=1",
        "share.coordinator.state.topic.min.isr=1",
        "group.initial.rebalance.delay.ms=0",
        "auto.create.topics.enable=false",
        "log.retention.hours=168",
        "",
    ]


def _owner_only(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable and writable by its owner only (0600 from the start)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _start_kafka(run_dir: Path, ports: StartPorts, restart: ServiceRecord | None = None,
                 sasl: KafkaSasl | None = None, tls: TlsFiles | None = None) -> ServiceRecord:
    libs = kafka_libs()
    data = run_dir / "kafka"
    data.mkdir(parents=True, exist_ok=True)
    if sasl is not None:
        data.chmod(0o700)
    if restart is not None:
        port, controller = ports.again("Kafka", restart.ports, "broker", "controller")
    else:
        port, controller = ports.one(), ports.one()
    log = run_dir / "logs" / "kafka.log"
    props = data / "server.properties"
    text = "\n".join(_kafka_properties(data, port, controller, sasl, secrets.token_urlsafe(24), tls))
    if sasl is None:
        props.write_text(text)
    else:  # it holds the admin's and the controller's passwords
        _owner_only(props, text)
    classpath = f"{libs}/*"
    log4j = _HERE / "kafka" / "log4j2.properties"
    java_opts = ["-Xms256m", "-Xmx512m", "-XX:+UseG1GC", f"-Dlog4j2.configurationFile={log4j}",
                 "-Djava.awt.headless=true"]
    if restart is None or not (data / "logs" / "meta.properties").exists():
        # a fresh data dir per new start: ports change between starts and KRaft pins the controller
        # address in the data; a restart keeps both
        shutil.rmtree(data / "logs", ignore_errors=True)
        fmt = ["kafka.tools.StorageTool", "format", "--standalone", "-t", kafka_cluster_id(),
               "-c", str(props)]
        if sasl is None:
            _run(["java", *java_opts, "-cp", classpath, *fmt], "formatting the Kafka storage")
        else:
            # the users' passwords go through a java @argument file (0600), not the command line
            args = data / "format.args"
            users = [f"SCRAM-SHA-512=[name={n},password={p}]" for n, p in sasl.passwords.items()]
            _owner_only(args, "\n".join([*fmt, *(f"--add-scram {u}" for u in users), ""]))
            try:
                _run(["java", *java_opts, "-cp", classpath, f"@{args}"], "formatting the Kafka storage")
            finally:
                args.unlink(missing_ok=True)
    pid = spawn(["java", *java_opts, "-cp", classpath, "kafka.Kafka", str(props)], log)
    ports.hand_over(pid)
    ca = tls.ca_cert if tls is not None else None
    client = sasl.client(sasl.admin, ca) if sasl is not None else {}
    waited = wait_until(lambda: _kafka_ready(port, client), 90, pid, "Kafka", log)
    extra = {"security_protocol": str(client["security_protocol"])} if sasl is not None else {}
    if ca is not None:
        extra["ca_cert"] = str(ca)
    return ServiceRecord("kafka", pid, {"broker": port, "controller": controller},
                         f"127.0.0.1:{port}", str(log), str(data), round(waited, 2), extra)


def kafka_cluster_id(random_bytes: Callable[[], bytes] = lambda: uuid.uuid4().bytes) -> str:
    """A KRaft cluster id (16 random bytes, URL-safe base64) that cannot be read as a CLI option.

    One id in 64 starts with ``-``, and ``kafka-storage format -t -xyz`` then fails with "expected one
    argument" (exit 1), as Kafka's own ``Uuid.randomUuid`` also avoids.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(random_bytes()).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _kafka_ready(port: int, client: Mapping[str, Any] | None = None) -> bool:
    """The broker answers a metadata request (not just an open port); ``client``: SASL login options."""
    if not port_open(port):
        return False
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    async def check() -> bool:
        admin = AIOKafkaAdminClient(bootstrap_servers=f"127.0.0.1:{port}", request_timeout_ms=3000,
                                    **(client or {}))
        try:
            await admin.start()
            await admin.describe_cluster()
            return True
        finally:
            await admin.close()

    return asyncio.run(check())


def kafka_healthy(rec: ServiceRecord) -> bool:
    client: dict[str, Any] = {}
    user = rec.extra.get("sasl_username")
    if user:  # a TLS stack's broker: its login and CA are in the record
        ca = rec.extra.get("ca_cert")
        client = KafkaSasl(user, {user: rec.extra["sasl_password"]}).client(user, Path(ca) if ca else None)
    try:
        return _kafka_ready(rec.ports["broker"], client)
    except Exception:
        return False


# --- Redis ------------------------------------------------------------------------------------

def redis_binary() -> str:
    debian = Path("/usr/bin/redis-server")
    found = shutil.which("redis-server") or (str(debian) if debian.exists() else None)
    if not found:
        raise StackError("redis-server is missing: run scripts/bootstrap.sh (apt-get install redis-server)")
    return found


def start_redis(run_dir: Path, port: int | None = None, name: str = "redis", *,
                fresh_port_if_taken: bool = False, password: str | None = None,
                acl: list[str] | None = None, tls: TlsFiles | None = None) -> ServiceRecord:
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


def _start_redis(run_dir: Path, port: int | None, name: str, fresh_port_if_taken: bool,
                 ports: StartPorts, password: str | None = None,
                 acl: list[str] | None = None, tls: TlsFiles | None = None) -> ServiceRecord:
    data = run_dir / name
    data.mkdir(parents=True, exist_ok=True)
    if port is not None and not ports.claim(port):
        if not fresh_port_if_taken:
            raise StackError(f"Redis cannot use port {port}: something already listens there or "
                             "another process reserved it")
        port = None
    port = port or ports.one()
    log = run_dir / "logs" / f"{name}.log"
    argv = [redis_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data),
            "--appendonly", "yes", "--appendfsync", "always", "--daemonize", "no",
            "--save", "", "--protected-mode", "yes", "--logfile", ""]
    if tls is not None:  # the TLS port only: a plaintext client gets nothing
        argv[argv.index("--port") + 1] = "0"
        argv += ["--tls-port", str(port), "--tls-cert-file", str(tls.server_cert),
                 "--tls-key-file", str(tls.server_key), "--tls-ca-cert-file", str(tls.ca_cert),
                 "--tls-auth-clients", "no"]
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
    return ServiceRecord(name, pid, {"redis": port}, f"{scheme}://127.0.0.1:{port}/0", str(log), str(data),
                         round(waited, 2), {"ca_cert": ca} if ca else {})


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
    _run(["go", "install", MINIO_MODULE], "building MinIO with `go install` (first time: minutes)",
         env={"GOBIN": str(gobin), "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"},
         cwd=Path(tempfile.gettempdir()))
    binary.parent.mkdir(parents=True, exist_ok=True)
    (gobin / "minio").rename(binary)
    shutil.rmtree(gobin, ignore_errors=True)
    return binary


def start_minio(run_dir: Path, *, restart: ServiceRecord | None = None,
                tls: TlsFiles | None = None) -> ServiceRecord:
    """Start MinIO with its data and credentials in ``run_dir``; ``restart`` (an earlier start's record)
    brings it back on the same ports (its data dir is always kept). ``tls``: https only (the record's
    address is ``https://``; clients verify it against ``tls.ca_cert``)."""
    with start_ports() as ports:
        return _start_minio(run_dir, ports, restart, tls)


def _start_minio(run_dir: Path, ports: StartPorts, restart: ServiceRecord | None = None,
                 tls: TlsFiles | None = None) -> ServiceRecord:
    binary = minio_binary()
    data = run_dir / "minio"
    data.mkdir(parents=True, exist_ok=True)
    user, password = minio_credentials(run_dir)
    if restart is not None:
        port, console = ports.again("MinIO", restart.ports, "s3", "console")
    else:
        port, console = ports.one(), ports.one()
    log = run_dir / "logs" / "minio.log"
    env = {"MINIO_ROOT_USER": user, "MINIO_ROOT_PASSWORD": password, "MINIO_BROWSER": "off",
           "MINIO_UPDATE": "off", "MINIO_CI_CD": "1"}
    argv = [str(binary), "server", str(data), "--address", f"127.0.0.1:{port}",
            "--console-address", f"127.0.0.1:{console}", "--quiet"]
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
    return ServiceRecord("minio", pid, {"s3": port, "console": console}, address,
                         str(log), str(data), round(waited, 2), extra=extra)


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

