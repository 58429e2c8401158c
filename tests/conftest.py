"""Session-scoped real services (see tests/support/services.py for where each comes from)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pluggy
import pytest
from hypothesis import settings as hypothesis_settings

from llmbatch.settings import KafkaSettings, LLMBatchSettings, RaySettings, RedisSettings, S3Settings
from tests.support.cpu_account import CpuCgroup, CpuMeter, machine_busy_seconds
from tests.support.services import ServiceProvider

# properties, not speeds: hypothesis' default 200 ms deadline per example is a wall-clock bound that a
# loaded CI machine breaks (test_fair_queue failed so beside a full suite)
hypothesis_settings.register_profile("llmbatch", deadline=None)
hypothesis_settings.load_profile("llmbatch")

CPU_PROPERTY = "cpu_s"
CPU_SOURCE_PROPERTY = "cpu_source"
_cpu_meter: CpuMeter | None = None
_cpu_source_told = False
_machine_start: tuple[float, float] | None = None


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
def settings(
    kafka_settings: KafkaSettings, redis_settings: RedisSettings, s3_settings: S3Settings
) -> LLMBatchSettings:
    """Settings pointing at real Kafka, Redis and MinIO (Ray: request ``ray_settings`` too)."""
    return LLMBatchSettings(kafka=kafka_settings, redis=redis_settings, s3=s3_settings)


DEPLOY_NEEDS_ROOT = (
    "the deploy tier needs root (network namespaces, iptables, cgroups, a kubelet): "
    "CI runs it as root; run `sudo make test-deploy` to run it here"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The deploy tier's tests are skipped, saying why, where they cannot run: not as root."""
    if os.geteuid() == 0:
        return
    for item in items:
        if item.get_closest_marker("deploy") is not None:
            item.add_marker(pytest.mark.skip(reason=DEPLOY_NEEDS_ROOT))


def pytest_sessionstart(session: pytest.Session) -> None:
    global _cpu_meter, _machine_start
    # each pytest process (xdist worker) in a cgroup of its own, which its services and Ray inherit
    # (the xdist controller runs no tests: it stays where it is)
    config = session.config
    controller = getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")
    _cpu_meter = CpuMeter(cgroup=None if controller else CpuCgroup.join(f"llmbatch-tests-{os.getpid()}"))
    _machine_start = (time.monotonic(), machine_busy_seconds())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    """Charges each phase's report with the CPU seconds this process and all it started used since the
    last report."""
    outcome = yield
    if _cpu_meter is None:
        return
    global _cpu_source_told
    report: pytest.TestReport = outcome.get_result()
    report.user_properties.append((CPU_PROPERTY, round(_cpu_meter.take(), 3)))
    if not _cpu_source_told:
        report.user_properties.append((CPU_SOURCE_PROPERTY, _cpu_meter.source))
        _cpu_source_told = True


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if _cpu_meter is not None and _cpu_meter.cgroup is not None:
        _cpu_meter.cgroup.leave()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Per test file, slowest first: wall seconds (setup + call + teardown) and the CPU seconds its tests
    and all they started used (the services included): where the suite's time and CPU go. First, what
    was skipped for want of root."""
    skipped = [
        r.nodeid
        for r in terminalreporter.stats.get("skipped", [])
        if isinstance(r, pytest.TestReport) and DEPLOY_NEEDS_ROOT in str(r.longrepr)
    ]
    if skipped:
        files = sorted({nodeid.split("::", 1)[0] for nodeid in skipped})
        terminalreporter.write_sep("=", f"{len(skipped)} deploy tests skipped: not root")
        terminalreporter.write_line(DEPLOY_NEEDS_ROOT)
        for path in files:
            terminalreporter.write_line(f"  {path}")
    per_file: dict[str, list[float]] = {}
    sources: set[str] = set()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                sources.update(str(v) for k, v in report.user_properties if k == CPU_SOURCE_PROPERTY)
                path = report.nodeid.split("::", 1)[0]
                row = per_file.setdefault(path, [0.0, 0.0])
                row[0] += report.duration
                charged = (v for k, v in report.user_properties if k == CPU_PROPERTY)
                row[1] += sum(v for v in charged if isinstance(v, float))
    if not per_file:
        return
    terminalreporter.write_sep("=", "seconds and CPU seconds per test file")
    for path, (seconds, cpu) in sorted(per_file.items(), key=lambda item: -item[1][0]):
        terminalreporter.write_line(f"{seconds:9.1f}s {cpu:9.1f} cpu-s  {path}")
    seconds, cpu = (sum(row[i] for row in per_file.values()) for i in (0, 1))
    terminalreporter.write_line(f"{seconds:9.1f}s {cpu:9.1f} cpu-s  in all")
    terminalreporter.write_line("CPU counted by: " + "; ".join(sorted(sources)))
    if _machine_start is not None:
        wall = time.monotonic() - _machine_start[0]
        busy = machine_busy_seconds() - _machine_start[1]
        cores = os.cpu_count() or 1
        terminalreporter.write_line(
            f"the machine's {cores} cores were busy {busy:.0f} of {wall * cores:.0f} "
            f"cpu-s ({busy / (wall * cores):.0%}) in the session's {wall:.0f} s"
        )
