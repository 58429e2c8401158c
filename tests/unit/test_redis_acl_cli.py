"""``llmbatch dispatcher redis-acl`` and the job's Redis user in its spec (no Redis needed: the ACL
rules themselves are exercised on a real Redis in tests/integration/test_redis_acl.py)."""

from __future__ import annotations

import fnmatch
import hashlib
import inspect

import pytest
from typer.testing import CliRunner

from llmbatch.dispatcher.cli import app
from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.dispatcher.security.redis_acl import OPERATOR_READS
from llmbatch.settings import RedisSettings

pytestmark = pytest.mark.unit


def test_prints_a_user_per_password_given_and_never_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    for role in ("DISPATCHER", "JOB", "OPERATOR"):
        monkeypatch.delenv(f"LLMBATCH_REDIS_ACL_{role}_PASSWORD", raising=False)
    runner = CliRunner()
    assert runner.invoke(app, ["redis-acl", "--help"]).exit_code == 0
    missing = runner.invoke(app, ["redis-acl"])
    assert missing.exit_code == 2 and "LLMBATCH_REDIS_ACL_JOB_PASSWORD" in missing.output
    monkeypatch.setenv("LLMBATCH_REDIS_ACL_JOB_PASSWORD", "job-secret-1")
    monkeypatch.setenv("LLMBATCH_REDIS_ACL_OPERATOR_PASSWORD", "op-secret-2")
    result = runner.invoke(app, ["redis-acl", "--prefix", "tenant*a"])
    assert result.exit_code == 0, result.output
    job, operator = result.stdout.splitlines()
    assert job.startswith(f"user job reset on #{hashlib.sha256(b'job-secret-1').hexdigest()} ")
    assert r"~tenant\*a:progress:* " in job and "+hset" in job and "+@all" not in job
    assert operator.startswith("user operator ") and r"%R~tenant\*a:batch:*" in operator
    assert "s3session" not in operator
    assert "secret" not in result.stdout


@pytest.mark.parametrize(
    ("url", "user", "expected"),
    [
        ("redis://dispatcher:pw@redis:6379/0", "job", "redis://job@redis:6379/0"),
        ("redis://redis:6379/0", "job", "redis://job@redis:6379/0"),
        ("rediss://dispatcher:pw@redis:6380/1", None, "rediss://dispatcher@redis:6380/1"),
        ("redis://redis:6379/0", None, "redis://redis:6379/0"),
    ],
)
def test_the_job_url_names_the_job_user_and_no_password(url: str, user: str | None, expected: str) -> None:
    assert RedisSettings(url=url).url_without_password(user) == expected


def test_the_operator_reads_every_key_of_the_layout_but_the_s3_sessions() -> None:
    """Each name :class:`Keys` makes (one per method or property, found by introspection, so a new key
    fails here until the operator's patterns say whether it may read it)."""
    keys = Keys("p")
    made: dict[str, str] = {}
    for name, member in inspect.getmembers(Keys):
        if name.startswith("_") or name in {"prefix"}:
            continue
        if isinstance(member, property):
            made[name] = getattr(keys, name)
        elif inspect.isfunction(member):
            params = list(inspect.signature(member).parameters)[1:]
            value = getattr(keys, name)(*["queued" if param == "state" else "x" for param in params])
            made[name] = value if isinstance(value, str) else value[0]
    assert {"batch", "progress", "s3_session", "replay_ledger", "ready"} <= set(made)
    patterns = [f"p:{pattern}" for pattern in OPERATOR_READS]
    readable = {name for name, key in made.items() if any(fnmatch.fnmatchcase(key, pat) for pat in patterns)}
    # the tracker's wake-up channel is a Pub/Sub channel, not a key: no operator subscribes to it
    assert set(made) - readable == {"s3_session", "s3_session_prefix", "tracker_wake"}, made
