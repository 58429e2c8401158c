"""Where the test suite gets each real service from, in this order:

1. an address given in the environment (``LLMBATCH_KAFKA__BOOTSTRAP_SERVERS``, ``LLMBATCH_REDIS__URL``,
   ``LLMBATCH_S3__ENDPOINT`` + keys, ``LLMBATCH_RAY__ADDRESS``);
2. a container via testcontainers when a Docker engine answers (Kafka, Redis, MinIO; Ray has no
   supported container here, so it always comes from 1 or 3);
3. the project's local stack (real binaries), started once per test session in a temporary run
   folder on free 127.0.0.1 ports and stopped by PID at the end.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from llmbatch.settings import KafkaSettings, LLMBatchSettings, RaySettings, RedisSettings, S3Settings
from llmbatch.stack import manager
from llmbatch.stack.node_credentials import keep_minio_credentials
from llmbatch.stack.process import alive, stop_tree
from llmbatch.stack.state import ServiceRecord, StackState

ENV_KEYS = {
    "kafka": "LLMBATCH_KAFKA__BOOTSTRAP_SERVERS",
    "redis": "LLMBATCH_REDIS__URL",
    "minio": "LLMBATCH_S3__ENDPOINT",
    "ray": "LLMBATCH_RAY__ADDRESS",
}


def docker_available() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=2)
        client.ping()
        return True
    except Exception:
        return False


class ServiceProvider:
    """Hands out real services on demand and cleans up whatever it started itself."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._docker = docker_available()
        self._containers: list[Any] = []
        self._local: set[str] = set()
        self.sources: dict[str, str] = {}

    # each method returns the address in the form the settings want
    def kafka(self) -> KafkaSettings:
        if os.environ.get(ENV_KEYS["kafka"]):
            self.sources["kafka"] = "env"
            return LLMBatchSettings().kafka
        if self._docker:
            from testcontainers.kafka import KafkaContainer

            container = KafkaContainer("apache/kafka:4.2.0").with_kraft()
            container.start()
            self._containers.append(container)
            self.sources["kafka"] = "testcontainers"
            return KafkaSettings(bootstrap_servers=container.get_bootstrap_server())
        rec = self._start_local("kafka")
        return KafkaSettings(bootstrap_servers=rec.address)

    def redis(self) -> RedisSettings:
        if os.environ.get(ENV_KEYS["redis"]):
            self.sources["redis"] = "env"
            return LLMBatchSettings().redis
        if self._docker:
            from testcontainers.redis import RedisContainer

            container = RedisContainer("redis:7.4").with_command("redis-server --appendonly yes")
            container.start()
            self._containers.append(container)
            self.sources["redis"] = "testcontainers"
            host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
            return RedisSettings(url=f"redis://{host}:{port}/0")
        rec = self._start_local("redis")
        return RedisSettings(url=rec.address)

    def s3(self) -> S3Settings:
        if os.environ.get(ENV_KEYS["minio"]):
            self.sources["minio"] = "env"
            return LLMBatchSettings().s3
        if self._docker:
            from testcontainers.minio import MinioContainer

            container = MinioContainer("minio/minio:RELEASE.2025-09-07T16-13-09Z")
            container.start()
            self._containers.append(container)
            self.sources["minio"] = "testcontainers"
            cfg = container.get_config()
            return S3Settings(
                endpoint=f"http://{cfg['endpoint']}",
                access_key=cfg["access_key"],
                secret_key=cfg["secret_key"],
            )
        rec = self._start_local("minio")
        return S3Settings(
            endpoint=rec.address, access_key=rec.extra["access_key"], secret_key=rec.extra["secret_key"]
        )

    def ray(self, s3: S3Settings | None = None) -> RaySettings:
        """A Ray head; a local one gets ``s3``'s keys in its environment, as Ray pods get them from a
        Secret (jobs and replicas are never sent them)."""
        if os.environ.get(ENV_KEYS["ray"]):
            self.sources["ray"] = "env"
            return LLMBatchSettings().ray
        if s3 is not None and self.sources.get("minio") != "local stack":
            keep_minio_credentials(
                self.run_dir, s3.access_key.get_secret_value(), s3.secret_key.get_secret_value()
            )
        return manager.ray_settings(self._start_local("ray"))

    def fresh_ray(self, s3: S3Settings | None = None) -> RaySettings:
        """A Ray head with no history on the same addresses: the local one is stopped (by PID) and
        started again on its ports, so the settings handed out before stay right (with pytest-xdist a
        worker may run integration tests after the e2e package, which asks for this); a head given
        in the environment is returned as it is."""
        record = self.local_record("ray") if self.sources.get("ray") == "local stack" else None
        if record is None:
            return self.ray(s3)
        if alive(record.pid):
            stop_tree(record.pid)
        return manager.ray_settings(manager.start_again(self.run_dir, "ray"))

    def local_record(self, name: str) -> ServiceRecord | None:
        return StackState.load(self.run_dir).services.get(name)

    def _start_local(self, name: str) -> ServiceRecord:
        state = manager.up(self.run_dir, [name])
        self._local.add(name)
        self.sources[name] = "local stack"
        return state.services[name]

    def close(self) -> None:
        for container in self._containers:
            try:
                container.stop()
            except Exception:
                continue  # best effort: the next container still gets stopped
        if self._local:
            manager.down(self.run_dir, sorted(self._local))


def reaped_or_alive(pid: int) -> bool:
    """Reap ``pid`` if it is our exited child (never blocks); whether it still runs."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return alive(pid)
