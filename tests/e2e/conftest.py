"""The end-to-end tests' own Ray head.

On one pytest process they ran last, after some 40 minutes of integration tests on the session's head,
and measured 1.5-2x slower there than alone (a kill -9 test 40-48 s against 19-27 s; each Ray job's
submit -> running 4.5 s against 2.7 s) while the machine was half idle: a head with that history is
slower. They get a fresh one (same Kafka, Redis and MinIO): the session's is stopped by PID and started
again on its ports, so the integration tests a pytest-xdist worker may run afterwards still reach it.
"""

from __future__ import annotations

import pytest

from llmbatch.settings import RaySettings, S3Settings
from tests.support.services import ServiceProvider


@pytest.fixture(scope="package")
def ray_settings(services: ServiceProvider, s3_settings: S3Settings) -> RaySettings:
    return services.fresh_ray(s3_settings)
