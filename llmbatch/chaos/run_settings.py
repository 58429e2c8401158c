"""The settings of a chaos run's dispatchers and jobs: the run's own topics and key prefix on its private
stack, the fake engine, fast timers, and the job side's clock skewed with libfaketime."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from llmbatch.dispatcher.job_options import JobOptions
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas.engines import EngineModel, EngineRegistry, ReplicaResources
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import TopicSettings
from llmbatch.stack import manager

MODEL = "chaos/fake-model"


def chaos_settings(
    stack: Any, run: str, max_in_flight: int, shared_engines: bool = False
) -> DispatcherSettings:
    """Dispatcher settings on the run's stack: its own topics and key prefix, the fake engine, fast
    timers (leases, polls, heartbeats) so faults are noticed within seconds. ``shared_engines``: the
    batches run on the model's warm Serve engine (small ones on the batch runner), else each as a Ray
    job with an engine of its own."""
    base = manager.settings_for(stack)
    topics = TopicSettings(
        requests=f"{run}.req", results=f"{run}.res", dead_letter=f"{run}.req.dlt", partitions=3
    )
    engine = EngineConfig(backend=FAKE_BACKEND, batch_size=4, num_cpus_per_replica=0.25)
    return DispatcherSettings(
        _env_file=None,
        kafka=base.kafka.model_copy(update={"topics": topics}),
        redis=base.redis.model_copy(update={"key_prefix": run}),
        s3=base.s3,
        ray=base.ray,
        dispatcher=DispatcherOptions(
            group_id=f"{run}-g",
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
            poll_interval_s=0.5,
            lease_ttl_s=4,
            retry_backoff_base_s=0.5,
            retry_backoff_max_s=4,
            io_backoff_base_s=0.2,
            io_backoff_max_s=2,
            log_json=True,
            max_in_flight=max_in_flight,
            shared_engines=shared_engines,
        ),
        engines=EngineRegistry(
            models={
                MODEL: EngineModel(
                    path="/models/unused", engine=engine, resources=ReplicaResources(num_cpus=0.25)
                )
            }
        ),
        job=JobOptions(
            python=sys.executable,
            progress_interval_s=0.5,
            ray_stop_wait_s=10,
            stop_wait_s=30,
            shard_max_seconds=2,
            shard_max_lines=10,
        ),
    )


LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def skewed_job_clock(settings: DispatcherSettings, offset_s: float) -> DispatcherSettings:
    """``settings`` whose jobs and batch-runner replicas see the wall clock ``offset_s`` ahead (libfaketime
    preloaded through the environment they are given: ``LLMBATCH_JOB__ENV_VARS``); the dispatchers, the
    engines and the services keep the true time. Their monotonic clock moves by the same constant, which
    leaves every interval as it was: excluding it (``FAKETIME_DONT_FAKE_MONOTONIC``) makes libfaketime
    0.9.10 pass a negative deadline to ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)``, so Python
    3.11's ``time.sleep`` fails with EINVAL (Ray's driver and Ray Data's executor both sleep)."""
    if not LIBFAKETIME.exists():
        raise RuntimeError(
            f"{LIBFAKETIME} is missing: the chaos suite skews the job side's clock with libfaketime "
            "(`make setup-test` installs it; apt-get install libfaketime)"
        )
    env = {
        **settings.job.env_vars,
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": f"{offset_s:+g}s",
        "FAKETIME_NO_CACHE": "1",
    }
    return settings.model_copy(update={"job": settings.job.model_copy(update={"env_vars": env})})
