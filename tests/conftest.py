"""Session-scoped real services (see tests/support/services.py for where each comes from)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmbatch.settings import KafkaSettings, LLMBatchSettings, RaySettings, RedisSettings, S3Settings
from tests.support.services import ServiceProvider


@pytest.fixture(scope="session")
def services(request: pytest.FixtureRequest) -> Iterator[ServiceProvider]:
    run_dir = Path(tempfile.mkdtemp(prefix="llmbatch-test-stack-"))
    provider = ServiceProvider(run_dir)
    try:
        yield provider
    finally:
        provider.close()
        # the services' data and logs (some 80 MB a session): kept only when a test failed
        if request.session.testsfailed == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            print(f"\nthe test stack's data and logs are kept in {run_dir}")


@pytest.fixture(scope="session")
def kafka_settings(services: ServiceProvider) -> KafkaSettings:
    return services.kafka()


@pytest.fixture(scope="session")
def redis_settings(services: ServiceProvider) -> RedisSettings:
    return services.redis()


@pytest.fixture(scope="session")
def s3_settings(services: ServiceProvider) -> S3Settings:
    return services.s3()


@pytest.fixture(scope="session")
def ray_settings(services: ServiceProvider, s3_settings: S3Settings) -> RaySettings:
    return services.ray(s3_settings)  # a local head gets these S3 keys in its environment


@pytest.fixture(scope="session")
def settings(kafka_settings: KafkaSettings, redis_settings: RedisSettings,
             s3_settings: S3Settings) -> LLMBatchSettings:
    """Settings pointing at real Kafka, Redis and MinIO (Ray: request ``ray_settings`` too)."""
    return LLMBatchSettings(kafka=kafka_settings, redis=redis_settings, s3=s3_settings)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Seconds per test file (setup + call + teardown), slowest first: where the suite's time goes."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                path = report.nodeid.split("::", 1)[0]
                per_file[path] = per_file.get(path, 0.0) + report.duration
    if not per_file:
        return
    terminalreporter.write_sep("=", "seconds per test file")
    for path, seconds in sorted(per_file.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:9.1f}s  {path}")
