"""Bring the local stack up, report on it and tear it down, idempotently and by PID."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llmbatch.settings import KafkaSettings, LLMBatchSettings, RaySettings, RedisSettings, S3Settings
from llmbatch.stack import services
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


def prepare(names: Iterable[str] = ALL_SERVICES) -> dict[str, float]:
    """Fetch/build what each service needs (cached); return seconds spent per service."""
    spent: dict[str, float] = {}
    for name in names:
        start = time.monotonic()
        services.PREPARERS[name]()
        spent[name] = round(time.monotonic() - start, 2)
    return spent


def up(run_dir: Path, names: Iterable[str] = ALL_SERVICES) -> StackState:
    """Start every named service not already running and healthy; reuse the rest."""
    wanted = list(names)
    prepare(wanted)
    state = StackState.load(run_dir)
    to_start: list[str] = []
    for name in wanted:
        rec = state.services.get(name)
        if rec and alive(rec.pid) and services.HEALTH[name](rec):
            continue
        if rec and alive(rec.pid):  # running but unhealthy: replace it
            stop_tree(rec.pid)
        state.services.pop(name, None)
        to_start.append(name)
    errors: list[StackError] = []
    # start in parallel: Ray takes 7-25 s, Kafka ~5 s, the others ~1 s
    with ThreadPoolExecutor(max_workers=len(to_start) or 1) as pool:
        futures = {name: pool.submit(services.STARTERS[name], run_dir) for name in to_start}
        for name, fut in futures.items():
            try:
                state.services[name] = fut.result()
            except StackError as exc:
                errors.append(exc)
    state.save()
    if errors:
        raise errors[0]
    return state


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
        out.append(ServiceStatus(name, running, healthy, rec.pid, rec.address,
                                 tree_rss_bytes(rec.pid) if running else 0, rec.healthy_after_s))
    return out


def settings_for(state: StackState, base: LLMBatchSettings | None = None) -> LLMBatchSettings:
    """Settings pointing at this stack's services (anything not running keeps ``base``'s value)."""
    base = base or LLMBatchSettings()
    data = base.model_copy(deep=True)
    svc = state.services
    if "kafka" in svc:
        data.kafka = KafkaSettings(**{**base.kafka.model_dump(), "bootstrap_servers": svc["kafka"].address,
                                      "security_protocol": "PLAINTEXT", "sasl_mechanism": None})
    if "redis" in svc:
        data.redis = RedisSettings(url=svc["redis"].address, key_prefix=base.redis.key_prefix)
    if "minio" in svc:
        m = svc["minio"]
        data.s3 = S3Settings(**{**base.s3.model_dump(), "endpoint": m.address,
                                "access_key": m.extra["access_key"], "secret_key": m.extra["secret_key"]})
    if "ray" in svc:
        data.ray = RaySettings(address=svc["ray"].address)
    return data


def env_exports(state: StackState) -> dict[str, str]:
    """Environment variables that point any llmbatch process at this stack."""
    svc = state.services
    env: dict[str, str] = {}
    if "kafka" in svc:
        env["LLMBATCH_KAFKA__BOOTSTRAP_SERVERS"] = svc["kafka"].address
    if "redis" in svc:
        env["LLMBATCH_REDIS__URL"] = svc["redis"].address
    if "minio" in svc:
        env["LLMBATCH_S3__ENDPOINT"] = svc["minio"].address
        env["LLMBATCH_S3__ACCESS_KEY"] = svc["minio"].extra["access_key"]
        env["LLMBATCH_S3__SECRET_KEY"] = svc["minio"].extra["secret_key"]
    if "ray" in svc:
        env["LLMBATCH_RAY__ADDRESS"] = svc["ray"].address
    return env


def record(state: StackState, name: str) -> ServiceRecord:
    try:
        return state.services[name]
    except KeyError:
        raise StackError(f"{name} is not running in {state.run_dir}: run `llmbatch stack up`") from None
