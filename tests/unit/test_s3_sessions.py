"""A runner batch's own S3 session (issue 14): the policy it is minted with (pure), how its keys travel
to the batch runner and only there, and what the runner does with a bad or expired one. The keys'
reach on the real MinIO is tests/integration/test_s3_sessions.py."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import orjson
import pytest

from llmbatch.dispatcher.backends.runner_backend import RunnerClient
from llmbatch.dispatcher.backends.s3_sessions import JobSessions, SessionMinter
from llmbatch.dispatcher.errors import JobRejected
from llmbatch.dispatcher.security.minio_policy import batch_policy
from llmbatch.ray_job.batch_runner.runner import BatchRunner
from llmbatch.ray_job.batch_runner.runner_http import ROUTE_PREFIX, parse_submission
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas.common import utcnow
from llmbatch.schemas.job import JobSpec, S3Session
from llmbatch.settings import S3Settings
from tests.support.scripted_http import ScriptedHttpServer

pytestmark = pytest.mark.unit

SECRET = "s3cr3t-value-that-must-not-leak"
TOKEN = "t0ken-value-that-must-not-leak"


def _spec(**extra: Any) -> JobSpec:
    data: dict[str, Any] = {
        "batch_id": "b-1",
        "attempt": 1,
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "tenant": "acme",
        "output_prefix": "s3://results/acme/b-1/",
        "engine": {"backend": FAKE_BACKEND},
        "engine_app": "llmbatch-engine-m",
        "input_uri": "s3://inputs/acme/k.jsonl",
    }
    return JobSpec.model_validate(data | extra)


def _session(expires_in_s: float = 3600) -> S3Session:
    return S3Session(
        access_key="AK",
        secret_key=SECRET,
        session_token=TOKEN,
        expires_at=utcnow() + timedelta(seconds=expires_in_s),
    )


def test_a_batch_policy_names_its_input_object_and_its_prefix_only() -> None:
    policy = batch_policy(input_uri="s3://inputs/acme/k.jsonl", output_prefix="s3://results/acme/b-1/")
    by_sid = {s["Sid"]: s for s in policy["Statement"]}
    assert by_sid["TheBatchsInput"]["Action"] == ["s3:GetObject"]
    assert by_sid["TheBatchsInput"]["Resource"] == ["arn:aws:s3:::inputs/acme/k.jsonl"]
    assert by_sid["TheBatchsResults"]["Resource"] == ["arn:aws:s3:::results/acme/b-1/*"]
    assert "s3:ListBucket" not in by_sid["TheBatchsResults"]["Action"]
    assert by_sid["ListOnlyTheBatchsResults"]["Resource"] == ["arn:aws:s3:::results"]
    assert by_sid["ListOnlyTheBatchsResults"]["Condition"] == {"StringLike": {"s3:prefix": ["acme/b-1/*"]}}
    resources = [r for s in policy["Statement"] for r in s["Resource"]]
    assert all("*" not in r or r.endswith("/b-1/*") for r in resources)
    inline = batch_policy(input_uri=None, output_prefix="s3://results/acme/b-1/")
    assert {s["Sid"] for s in inline["Statement"]} == {"TheBatchsResults", "ListOnlyTheBatchsResults"}


@pytest.mark.parametrize(
    ("input_uri", "prefix", "field"),
    [
        (None, "s3://results/acme/b-1", "output_prefix"),  # not a prefix
        (None, "s3://results/acme/*/", "output_prefix"),  # a wildcard would widen it
        (None, "https://results/acme/b-1/", "output_prefix"),
        ("s3://inputs/acme/", "s3://results/acme/b-1/", "input_uri"),  # a prefix, not one object
        ("s3://inputs/acme/*.jsonl", "s3://results/acme/b-1/", "input_uri"),
        ("s3://Bad_Bucket/k", "s3://results/acme/b-1/", "bucket"),
    ],
)
def test_a_policy_that_would_reach_more_is_refused(input_uri: str | None, prefix: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        batch_policy(input_uri=input_uri, output_prefix=prefix)


def test_the_session_travels_in_the_submit_body_and_the_runner_reads_it_back() -> None:
    class OneSession(SessionMinter):
        def __init__(self) -> None:
            super().__init__(S3Settings())
            self.minted_for: list[str] = []

        def mint(self, spec: JobSpec) -> S3Session:
            self.minted_for.append(spec.submission_id)
            return _session()

    server = ScriptedHttpServer()
    try:
        server.answers[("POST", ROUTE_PREFIX + "/runs")] = (202, b'{"submission_id": "b-1-a1"}')
        minter = OneSession()
        spec = _spec()
        asyncio.run(RunnerClient(server.address, timeout_s=5, sessions=minter).submit(spec))
        body = server.seen[0][2]
    finally:
        server.close()
    assert minter.minted_for == [spec.submission_id]  # one session per batch attempt
    got = parse_submission(body)
    assert got.spec == spec and got.s3_session is not None
    assert got.s3_session.secret_key.get_secret_value() == SECRET
    assert got.s3_session.session_token.get_secret_value() == TOKEN
    assert SECRET not in got.spec.model_dump_json()  # the keys are beside the spec, never in it


def test_a_bad_session_is_refused_without_echoing_the_keys() -> None:
    runner = BatchRunner(max_runs=0)  # nothing can start: only the parsing answers
    spec = orjson.loads(_spec().model_dump_json())
    bad = [
        {"spec": spec, "s3_session": {"access_key": "AK", "secret_key": SECRET}},  # no token
        {"spec": spec, "s3_session": {**_session().plain(), "extra": SECRET}},
        {"spec": spec, "s3_session": SECRET},
        {"spec": spec, "s3_session": {**_session().plain(), "expires_at": SECRET}},
    ]
    for body in bad:
        code, answer = runner.submit(orjson.dumps(body))
        assert code == 400 and answer["error"].startswith("invalid job spec: s3_session"), answer
        assert SECRET not in answer["error"] and TOKEN not in answer["error"]
    expired = {"spec": spec, "s3_session": _session(expires_in_s=-1).plain()}
    code, answer = runner.submit(orjson.dumps(expired))
    assert code == 400 and "expired" in answer["error"] and SECRET not in answer["error"]
    code, answer = runner.submit(orjson.dumps({"spec": spec, "s3_session": _session().plain()}))
    assert code == 429  # a good session passes the checks (and then meets max_runs=0)


def test_a_runner_without_node_keys_refuses_a_batch_without_a_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A runner deployed for sessions has its node's keys blanked: a bare spec (a dispatcher with
    RUNNER_S3_SESSIONS false) is refused naming the setting, not run into S3's access denied. Keys given
    another way (unset variables: a web identity, say) do not count as withheld."""
    runner = BatchRunner(max_runs=0)
    bare = _spec().model_dump_json().encode()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "")
    code, answer = runner.submit(bare)
    assert code == 400 and "LLMBATCH_DISPATCHER__RUNNER_S3_SESSIONS" in answer["error"], answer
    code, _ = runner.submit(orjson.dumps({"spec": orjson.loads(bare), "s3_session": _session().plain()}))
    assert code == 429  # with a session it passes (and meets max_runs=0)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    assert runner.submit(bare)[0] == 429


def test_an_input_name_no_policy_can_hold_fails_the_batch_before_any_call() -> None:
    from llmbatch.dispatcher.errors import JobRejected

    minter = SessionMinter(S3Settings(endpoint="http://127.0.0.1:9"))  # never reached
    with pytest.raises(JobRejected, match="wildcard"):
        minter.mint(_spec(input_uri="s3://inputs/acme/all*.jsonl"))


async def test_a_job_session_needs_the_jobs_redis_and_asks_no_sts_without_it() -> None:
    """JobSessions refuses a spec without a Redis URL before minting (nothing could take the keys)."""
    minter = SessionMinter(S3Settings(endpoint="http://127.0.0.1:9", access_key="a", secret_key="b"))
    sessions = JobSessions(minter, store=None)  # type: ignore[arg-type]  # never reached
    with pytest.raises(JobRejected, match="LLMBATCH_JOB__PASS_REDIS_URL=true"):
        await sessions.issue(_spec(redis_url=None))
