"""The batch runner trusts no caller: a credential on every request, keys and prefix from the batch's
identity (the runner's side and the dispatcher's client). Real Redis runs are in
tests/integration/test_run_store.py; the whole runner behind Serve's proxy in test_batch_runner.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import SecretStr
from starlette.requests import Request

from llmbatch.dispatcher.backends.runner_backend import RunnerClient
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.errors import RayUnavailable
from llmbatch.ray_job.batch_runner.run_store import MemoryRuns
from llmbatch.ray_job.batch_runner.runner import BatchRunner
from llmbatch.ray_job.batch_runner.runner_config import RunnerPlace
from llmbatch.ray_job.batch_runner.runner_http import ROUTE_PREFIX, credential_problem
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.storage import job_keys, node_secrets
from llmbatch.schemas.job import JobSpec
from tests.support.scripted_http import ScriptedHttpServer

TOKEN = "r" * 48


def _spec(**kw: Any) -> JobSpec:
    data: dict[str, Any] = {
        "batch_id": "b-1",
        "attempt": 1,
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "tenant": "acme",
        "lifecycle": "l1",
        "output_prefix": "s3://results/acme/b-1/l1/",
        "engine": {"backend": FAKE_BACKEND},
        "engine_app": "llmbatch-engine-m",
        "requests": [
            {
                "custom_id": "c",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            }
        ],
    }
    data.update(kw)
    return JobSpec.model_validate(data)


@pytest.mark.parametrize(
    ("header", "token", "code"),
    [
        (f"Bearer {TOKEN}", None, 503),  # a runner whose node has no credential answers no one
        ("Bearer short", "short", 503),  # nor one with a credential too short to be a secret
        (None, TOKEN, 401),
        ("", TOKEN, 401),
        (f"Basic {TOKEN}", TOKEN, 401),
        (f"Bearer {TOKEN}x", TOKEN, 401),
        (f"Bearer {TOKEN[:-1]}", TOKEN, 401),
        (f"Bearer {TOKEN}", TOKEN, None),
        (f"bearer  {TOKEN} ", TOKEN, None),
    ],
)
def test_the_credential_is_checked_whole(header: str | None, token: str | None, code: int | None) -> None:
    problem = credential_problem(header, token)
    assert (problem[0] if problem else None) == code
    if problem is not None:
        assert "LLMBATCH_RAY__RUNNER_TOKEN" in problem[1] and TOKEN not in problem[1]


@given(st.text(max_size=200))
def test_no_header_but_the_token_passes(header: str) -> None:
    assert credential_problem(header, TOKEN) is not None or header.split()[-1:] == [TOKEN]


async def _ask(runner: BatchRunner, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    """``runner`` as Serve calls it: a starlette request in, a response out (over httpx's ASGI transport)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        response = await runner(Request(scope, receive))
        await response(scope, receive, send)

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://runner") as client:
        return await client.request(method, ROUTE_PREFIX + path, headers=headers, content=b"{}")


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> Iterator[BatchRunner]:
    monkeypatch.setenv(node_secrets.RUNNER_TOKEN, TOKEN)
    r = BatchRunner(max_runs=0)
    yield r
    r.close()


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/runs"), ("GET", "/runs/b-1-a1"), ("POST", "/statuses"), ("GET", "/engines")],
)
def test_every_route_refuses_a_caller_without_the_credential(
    runner: BatchRunner, method: str, path: str
) -> None:
    for headers in ({}, {"Authorization": "Bearer " + "x" * 48}):
        answer = asyncio.run(_ask(runner, method, path, headers))
        assert answer.status_code == 401 and "LLMBATCH_RAY__RUNNER_TOKEN" in answer.json()["error"]
    allowed = asyncio.run(_ask(runner, "POST", "/statuses", {"Authorization": f"Bearer {TOKEN}"}))
    assert allowed.status_code == 400  # past the check: the (empty) body is judged


def test_a_runner_without_a_credential_answers_no_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(node_secrets.RUNNER_TOKEN, raising=False)
    r = BatchRunner(max_runs=0)
    try:
        answer = asyncio.run(_ask(r, "POST", "/statuses", {"Authorization": f"Bearer {TOKEN}"}))
    finally:
        r.close()
    assert answer.status_code == 503 and "LLMBATCH_RAY__RUNNER_TOKEN" in answer.json()["error"]


def test_the_client_sends_its_credential_and_takes_a_refusal_for_an_outage() -> None:
    server = ScriptedHttpServer()
    try:
        server.answers[("POST", ROUTE_PREFIX + "/statuses")] = (401, b'{"error": "authorization: ..."}')
        client = RunnerClient(server.address, timeout_s=5, token=SecretStr(TOKEN))
        with pytest.raises(RayUnavailable, match="LLMBATCH_RAY__RUNNER_TOKEN"):
            asyncio.run(client.statuses(["b-1-a1"]))
        assert server.seen[0].headers.get("Authorization") == f"Bearer {TOKEN}"
    finally:
        server.close()


def test_the_runner_derives_redis_keys_from_the_identity() -> None:
    place = RunnerPlace(redis_url="redis://job@redis:6379/0", key_prefix="lb", results_bucket="results")
    hostile = _spec(redis_url="redis://evil:6379/0", progress_key="lb:batch:acme/b-1")
    derived = place.spec_for(hostile)
    assert derived.redis_url == "redis://job@redis:6379/0"
    assert derived.progress_key == "lb:progress:acme/b-1"
    # the dispatcher reads the same hash
    assert derived.progress_key == Keys("lb").progress(batch_key("acme", "b-1"))
    assert RunnerPlace().spec_for(hostile).progress_key is None  # no Redis of its own: none at all


@pytest.mark.parametrize(
    ("prefix", "ok"),
    [
        ("s3://results/acme/b-1/l1/", True),
        ("s3://other/acme/b-1/l1/", False),  # another bucket
        ("s3://results/other/b-1/l1/", False),  # another tenant's folder
    ],
)
def test_the_output_prefix_must_be_the_identitys(prefix: str, ok: bool) -> None:
    place = RunnerPlace(results_bucket="results")
    spec = _spec(output_prefix=prefix)
    assert (place.prefix_problem(spec) is None) is ok
    if not ok:
        r = BatchRunner(max_runs=0, place=place)
        try:
            code, body = r.submit(spec.model_dump_json().encode())
        finally:
            r.close()
        assert (
            code == 400
            and body["error"].startswith("output_prefix")
            and "s3://results/acme/b-1/l1/" in body["error"]
        )


def test_memory_runs_claim_once_and_pass_stops_on() -> None:
    runs = MemoryRuns()
    view = {"status": "RUNNING", "owner": "r1"}
    assert runs.claim("s-a1", view) and not runs.claim("s-a1", view)
    assert runs.ask_stop("s-a1") is True and runs.stops_asked(["s-a1", "x"]) == {"s-a1"}
    runs.save("s-a1", {"status": "SUCCEEDED", "owner": "r1", "end_time": 1.0})
    assert runs.ask_stop("s-a1") is False and runs.ask_stop("never") is None


def test_job_keys_match_the_dispatchers() -> None:
    for tenant, batch in (("default", "b"), ("acme", "b-2")):
        assert Keys("p").progress(batch_key(tenant, batch)) == job_keys.progress_key("p", tenant, batch)
    assert orjson.dumps(job_keys.run_key("p", "s-a1")) == b'"p:runner:run:s-a1"'
