"""The local stack's Apache Kafka broker (KRaft, one node): fetch its jars from Maven Central once,
start it on 127.0.0.1 (optionally with SCRAM users and ACLs, and TLS), health-check it. See
:mod:`llmbatch.stack.services` for the other services and the registries naming all of them.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmbatch.stack.process import StackError, port_open, run_checked, spawn, wait_until
from llmbatch.stack.start_ports import StartPorts, start_ports
from llmbatch.stack.state import CACHE_DIR, ServiceRecord
from llmbatch.stack.tls import TlsFiles

KAFKA_VERSION = "4.2.0"

_HERE = Path(__file__).resolve().parent
LOG4J = _HERE / "kafka" / "log4j2.properties"  # the brokers' quiet logging


def kafka_libs() -> Path:
    """Kafka broker jars, copied once from Maven Central into the cache."""
    libs = CACHE_DIR / f"kafka-{KAFKA_VERSION}" / "libs"
    if (libs / f"kafka_2.13-{KAFKA_VERSION}.jar").exists():
        return libs
    if not shutil.which("mvn"):
        raise StackError("Maven (mvn) is needed to fetch the Kafka jars: apt-get install maven")
    tmp = libs.with_name("libs.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    run_checked(
        [
            "mvn",
            "-q",
            "-B",
            "-f",
            str(_HERE / "kafka" / "pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={tmp}",
            "-DincludeScope=runtime",
            f"-Dkafka.version={KAFKA_VERSION}",
        ],
        "fetching Kafka jars from Maven Central",
    )
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
                raise StackError(
                    f"Kafka user name {name!r}: letters, digits and _ . ~ - only, and not "
                    f"{KAFKA_CONTROLLER_USER!r}"
                )
            if not _SCRAM_TEXT.fullmatch(password):
                raise StackError(
                    f"the password of Kafka user {name!r} may hold letters, digits and _ . ~ - only"
                )

    def client(self, user: str, ca_cert: Path | None = None) -> dict[str, Any]:
        """aiokafka's SASL keyword arguments for ``user``; ``ca_cert``: over TLS (SASL_SSL), the broker
        verified against that CA."""
        kwargs: dict[str, Any] = {
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": user,
            "sasl_plain_password": self.passwords[user],
        }
        if ca_cert is not None:
            import ssl

            context = ssl.create_default_context(cafile=str(ca_cert))
            kwargs.update(security_protocol="SASL_SSL", ssl_context=context)
        return kwargs


KAFKA_CONTROLLER_USER = "kraft-controller"
_SCRAM_TEXT = re.compile(r"[A-Za-z0-9_.~-]+")


def start_kafka(
    run_dir: Path,
    *,
    restart: ServiceRecord | None = None,
    sasl: KafkaSasl | None = None,
    tls: TlsFiles | None = None,
) -> ServiceRecord:
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


def _kafka_properties(
    data: Path,
    port: int,
    controller: int,
    sasl: KafkaSasl | None,
    controller_password: str,
    tls: TlsFiles | None = None,
) -> list[str]:
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


def _start_kafka(
    run_dir: Path,
    ports: StartPorts,
    restart: ServiceRecord | None = None,
    sasl: KafkaSasl | None = None,
    tls: TlsFiles | None = None,
) -> ServiceRecord:
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
    log4j = LOG4J
    java_opts = [
        "-Xms256m",
        "-Xmx512m",
        "-XX:+UseG1GC",
        f"-Dlog4j2.configurationFile={log4j}",
        "-Djava.awt.headless=true",
    ]
    if restart is None or not (data / "logs" / "meta.properties").exists():
        # a fresh data dir per new start: ports change between starts and KRaft pins the controller
        # address in the data; a restart keeps both
        shutil.rmtree(data / "logs", ignore_errors=True)
        fmt = [
            "kafka.tools.StorageTool",
            "format",
            "--standalone",
            "-t",
            kafka_cluster_id(),
            "-c",
            str(props),
        ]
        if sasl is None:
            run_checked(["java", *java_opts, "-cp", classpath, *fmt], "formatting the Kafka storage")
        else:
            # the users' passwords go through a java @argument file (0600), not the command line
            args = data / "format.args"
            users = [f"SCRAM-SHA-512=[name={n},password={p}]" for n, p in sasl.passwords.items()]
            _owner_only(args, "\n".join([*fmt, *(f"--add-scram {u}" for u in users), ""]))
            try:
                run_checked(
                    ["java", *java_opts, "-cp", classpath, f"@{args}"], "formatting the Kafka storage"
                )
            finally:
                args.unlink(missing_ok=True)
    pid = spawn(["java", *java_opts, "-cp", classpath, "kafka.Kafka", str(props)], log)
    ports.hand_over(pid)
    ca = tls.ca_cert if tls is not None else None
    client = sasl.client(sasl.admin, ca) if sasl is not None else {}
    waited = wait_until(lambda: kafka_ready(port, client), 90, pid, "Kafka", log)
    extra = {"security_protocol": str(client["security_protocol"])} if sasl is not None else {}
    if ca is not None:
        extra["ca_cert"] = str(ca)
    return ServiceRecord(
        "kafka",
        pid,
        {"broker": port, "controller": controller},
        f"127.0.0.1:{port}",
        str(log),
        str(data),
        round(waited, 2),
        extra,
    )


def kafka_cluster_id(random_bytes: Callable[[], bytes] = lambda: uuid.uuid4().bytes) -> str:
    """A KRaft cluster id (16 random bytes, URL-safe base64) that cannot be read as a CLI option.

    One id in 64 starts with ``-``, and ``kafka-storage format -t -xyz`` then fails with "expected one
    argument" (exit 1), as Kafka's own ``Uuid.randomUuid`` also avoids.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(random_bytes()).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def kafka_ready(port: int, client: Mapping[str, Any] | None = None) -> bool:
    """The broker answers a metadata request (not just an open port); ``client``: SASL login options."""
    if not port_open(port):
        return False
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    async def check() -> bool:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=f"127.0.0.1:{port}", request_timeout_ms=3000, **(client or {})
        )
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
        return kafka_ready(rec.ports["broker"], client)
    except Exception:
        return False
