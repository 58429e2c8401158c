"""A Ray head with token auth (a private head on this machine): a wrong or rotated token is an outage
the dispatcher waits out, never a verdict on the batch. Before, 401 was a JobRejected and every launch
ended ``failed`` + dead letter ``submit_rejected``."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import SecretStr

from llmbatch.dispatcher.backends.backend import JobState
from llmbatch.dispatcher.backends.ray_backend import RayJobsBackend
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import RayUnavailable
from llmbatch.dispatcher.job_options import JobOptions
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.tracker import Tracker
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas.engines import EngineModel, EngineRegistry
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import RaySettings, RedisSettings
from tests.integration.test_dispatcher_tracker import drop, queue
from tests.support.private_ray import PrivateRay

pytestmark = pytest.mark.integration

TOKEN = secrets.token_hex(16)


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRay]:
    ray = PrivateRay(tmp_path_factory.mktemp("ray-auth"), num_cpus=1, auth_token=TOKEN)
    try:
        ray.start()
        yield ray
    finally:
        ray.stop()
        ray.remove_temp()


def settings_for(
    head: PrivateRay, redis_settings: RedisSettings, token: str, prefix: str
) -> DispatcherSettings:
    return DispatcherSettings(
        _env_file=None,
        ray=RaySettings(address=head.address, auth_token=SecretStr(token)),
        redis=RedisSettings(url=redis_settings.url, password=SecretStr(""), key_prefix=prefix),
        job=JobOptions(ship_modules=False),
        engines=EngineRegistry(
            models={"a": EngineModel(path="fake", engine=EngineConfig(backend=FAKE_BACKEND))}
        ),
    )


async def test_the_right_token_is_served_and_a_wrong_one_is_an_outage(
    head: PrivateRay, redis_settings: RedisSettings
) -> None:
    good = RayJobsBackend(settings_for(head, redis_settings, TOKEN, "x"))
    assert (await good.status("never-submitted")).state is JobState.NOT_FOUND
    bad = RayJobsBackend(settings_for(head, redis_settings, "rotated-" + TOKEN, "x"))
    with pytest.raises(RayUnavailable, match="LLMBATCH_RAY__AUTH_TOKEN") as info:
        await bad.status("never-submitted")
    assert info.value.retriable
    assert TOKEN not in str(info.value)  # the token itself is never in a message


async def test_a_launch_with_a_rotated_token_waits_instead_of_failing_the_batch(
    head: PrivateRay, redis_settings: RedisSettings
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings = settings_for(head, redis_settings, "rotated-" + TOKEN, prefix)
    store = StateStore.from_url(redis_settings.url, keys=Keys(prefix), finished_ttl_s=3600, dedupe_ttl_s=3600)
    backend = RayJobsBackend(settings)
    results: Any = None  # a failure would need them (or the producer): reaching them fails the test too
    tracker = Tracker(RunContext(settings, store, backend, results, producer=results, metrics=Metrics()))
    await tracker.leases.step()  # a lone replica: it leads and holds every shard
    try:
        await queue(store, "rotated", 2)
        await tracker.launch()
        record = await store.get(batch_key(None, "rotated"))
        assert record is not None and record.state is State.SUBMITTED, record and record.fields
        assert not record.flag("confirmed")  # resubmitted on the next tick, once the token is fixed
        assert tracker.metrics.attempts.labels(event="submitted")._value.get() == 1
        await tracker.poll_in_flight()  # asks Ray for the attempt: the same refusal, an outage again
        record = await store.get(batch_key(None, "rotated"))
        assert record is not None and record.state is State.SUBMITTED
        assert tracker.metrics.transient_errors.labels(component="ray")._value.get() >= 1
    finally:
        await drop(store)
        await backend.close()


async def test_the_serve_api_on_a_head_with_token_auth_sends_the_token(head: PrivateRay) -> None:
    """The dispatcher deploys and reads its engines through the dashboard's Serve API: on a head with
    token auth it must send the token there too (it used to send none: 401, taken for a refused config).
    A wrong token is an outage, as for jobs."""
    from llmbatch.dispatcher.backends.serve_api import ServeApi

    details = await ServeApi.of(RaySettings(address=head.address, auth_token=SecretStr(TOKEN))).status()
    assert "applications" in details
    for token in (None, SecretStr("rotated-" + TOKEN)):
        with pytest.raises(RayUnavailable, match=r"\(40[13]\): check LLMBATCH_RAY__AUTH_TOKEN") as info:
            await ServeApi.of(RaySettings(address=head.address, auth_token=token)).status()
        assert info.value.retriable and TOKEN not in str(info.value)
