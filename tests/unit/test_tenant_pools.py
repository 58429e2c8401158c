"""Tenant worker pools (pure): the setting, the spec and submission that keep a pooled tenant's job on
its pool, the short path closed to it, and the MinIO policy of its keys. The placement and the
policy on real Ray and MinIO: tests/integration/test_tenant_pools.py."""

from __future__ import annotations

import fnmatch
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import SecretStr, ValidationError
from typer.testing import CliRunner

from llmbatch.dispatcher.backends.ray_backend import build_submission
from llmbatch.dispatcher.backends.runner_backend import takes_short_path
from llmbatch.dispatcher.cli import app
from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.job_options import JobOptions
from llmbatch.dispatcher.runs.jobspec import build_job_spec
from llmbatch.dispatcher.security.minio_policy import policy_name, tenant_policy
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.schemas.common import TENANT_PATTERN
from llmbatch.schemas.job import POOL_SHARE, JobSpec, tenant_pool_resource
from llmbatch.settings import S3Settings, TenantSettings
from tests.support.dispatcher_kit import batch_request, inline_lines, registry, request_message

pytestmark = pytest.mark.unit


def _settings(pools: list[str], **job: Any) -> DispatcherSettings:
    return DispatcherSettings(
        _env_file=None,
        s3=S3Settings(endpoint="http://minio:9000", access_key=SecretStr("ak"), secret_key=SecretStr("sk")),
        tenants=TenantSettings(pools=pools),
        job=JobOptions(**job),
        engines=registry(),
        dispatcher=DispatcherOptions(shared_engines=True),
    )


def _record(tenant: str, batch_id: str = "b-1") -> BatchRecord:
    _, value, _ = request_message(batch_request(batch_id, requests=inline_lines(2), tenant=tenant))
    return BatchRecord.from_hash(
        batch_key(tenant, batch_id),
        {"state": "submitted", "version": "1", "request": value.decode(), "tenant": tenant, "attempt": "1"},
    )


def test_pools_are_tenant_names_and_each_gets_its_own_resource() -> None:
    pools = TenantSettings(pools=["globex", "acme", "acme"])
    assert pools.pools == ["acme", "globex"]
    assert pools.pool_of("acme") == "llmbatch_tenant_acme" and pools.pool_of("initech") is None
    with pytest.raises(ValidationError, match=r"tenant 'Acme Corp'"):
        TenantSettings(pools=["Acme Corp"])


def test_a_pooled_tenants_spec_and_submission_ask_for_its_pool_and_others_do_not() -> None:
    s = _settings(["acme"], entrypoint_resources={"worker": 1.0})
    acme = build_job_spec(_record("acme"), 1, s, Keys("p"))
    other = build_job_spec(_record("globex"), 1, s, Keys("p"))
    assert acme.pool_resource == "llmbatch_tenant_acme" and other.pool_resource is None
    # its tasks ask the pool's resource where others ask CPUs (the pool's nodes advertise none)
    assert acme.stage_resources(0.5) == {"num_cpus": 0, "resources": {"llmbatch_tenant_acme": 0.5}}
    assert acme.stage_resources(0) == {"num_cpus": 0, "resources": {"llmbatch_tenant_acme": POOL_SHARE}}
    assert other.stage_resources(0.5) == {"num_cpus": 0.5}
    # the driver goes to the pool, beside the resources the settings ask for every job
    pooled = {"worker": 1.0, "llmbatch_tenant_acme": POOL_SHARE}
    assert build_submission(s, acme)["entrypoint_resources"] == pooled
    assert build_submission(s, other)["entrypoint_resources"] == {"worker": 1.0}
    # a driver that asks CPUs asks them of the pool instead (its nodes advertise none)
    s = _settings(["acme"], entrypoint_num_cpus=0.5)
    kwargs = build_submission(s, build_job_spec(_record("acme"), 1, s, Keys("p")))
    assert kwargs["entrypoint_num_cpus"] == 0
    assert kwargs["entrypoint_resources"] == {"llmbatch_tenant_acme": 0.5}
    other_kwargs = build_submission(s, build_job_spec(_record("globex"), 1, s, Keys("p")))
    assert other_kwargs["entrypoint_num_cpus"] == 0.5 and "entrypoint_resources" not in other_kwargs
    # the spec the job reads carries it (command line or uploaded spec)
    assert JobSpec.model_validate_json(acme.model_dump_json()).pool_resource == "llmbatch_tenant_acme"


def test_a_spec_cannot_name_another_tenants_pool() -> None:
    base = {
        "batch_id": "b",
        "attempt": 1,
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "input_uri": "s3://inputs/acme/x.jsonl",
        "output_prefix": "s3://results/acme/b/",
        "tenant": "acme",
    }
    assert JobSpec.model_validate({**base, "pool_resource": "llmbatch_tenant_acme"}).pool_resource
    with pytest.raises(ValidationError, match="pool_resource must be 'llmbatch_tenant_acme'"):
        JobSpec.model_validate({**base, "pool_resource": "llmbatch_tenant_globex"})
    with pytest.raises(ValidationError, match="pool_resource"):
        JobSpec.model_validate({**base, "pool_resource": "GPU"})


def test_a_pooled_tenants_small_batch_never_takes_the_shared_runner() -> None:
    s = _settings(["acme"])
    acme = build_job_spec(_record("acme"), 1, s, Keys("p"))
    other = build_job_spec(_record("globex"), 1, s, Keys("p"))
    assert acme.engine_app and other.engine_app  # both on the shared engine ...
    assert takes_short_path(other, max_lines=8, max_bytes=1000, input_size=None)
    assert not takes_short_path(acme, max_lines=8, max_bytes=1000, input_size=None)  # ... as a Ray job


def _allows(policy: dict[str, Any], action: str, resource: str, prefix: str | None = None) -> bool:
    """A small evaluator of the policy's Allow statements (no Deny is used): action, resource and the
    s3:prefix condition, with the wildcards IAM and MinIO use."""
    for st_ in policy["Statement"]:
        assert st_["Effect"] == "Allow"
        if action not in st_["Action"] or not any(fnmatch.fnmatchcase(resource, r) for r in st_["Resource"]):
            continue
        cond = st_.get("Condition", {}).get("StringLike", {}).get("s3:prefix")
        if cond is None or (prefix is not None and any(fnmatch.fnmatchcase(prefix, c) for c in cond)):
            return True
    return False


def test_the_policy_allows_the_tenants_prefixes_and_nothing_else() -> None:
    policy = tenant_policy("acme", input_buckets={"inputs", "in-extra"}, results_bucket="results")
    assert policy_name("acme") == "llmbatch-tenant-acme"
    assert _allows(policy, "s3:GetObject", "arn:aws:s3:::inputs/acme/x.jsonl")
    assert _allows(policy, "s3:GetObject", "arn:aws:s3:::in-extra/acme/x.jsonl")
    assert _allows(policy, "s3:PutObject", "arn:aws:s3:::results/acme/b/a1/output-a1-00000.jsonl")
    assert _allows(policy, "s3:ListBucket", "arn:aws:s3:::results", prefix="acme/b/a1/")
    for action, resource, prefix in [
        ("s3:GetObject", "arn:aws:s3:::inputs/acme-2/x.jsonl", None),  # a tenant whose name extends acme's
        ("s3:GetObject", "arn:aws:s3:::inputs/globex/x.jsonl", None),
        ("s3:PutObject", "arn:aws:s3:::inputs/acme/x.jsonl", None),  # inputs are read only
        ("s3:PutObject", "arn:aws:s3:::results/globex/b/x", None),
        ("s3:GetObject", "arn:aws:s3:::other/acme/x", None),
        ("s3:ListBucket", "arn:aws:s3:::results", None),  # the whole bucket
        ("s3:ListBucket", "arn:aws:s3:::results", "acme-2/"),
        ("s3:ListAllMyBuckets", "arn:aws:s3:::*", None),
        ("s3:DeleteBucket", "arn:aws:s3:::results", None),
    ]:
        assert not _allows(policy, action, resource, prefix), (action, resource, prefix)


@given(st.from_regex(TENANT_PATTERN, fullmatch=True), st.from_regex(TENANT_PATTERN, fullmatch=True))
def test_no_tenants_policy_reaches_another_tenants_objects(tenant: str, other: str) -> None:
    policy = tenant_policy(tenant, input_buckets=["inputs"], results_bucket="results")
    assert _allows(policy, "s3:GetObject", f"arn:aws:s3:::inputs/{tenant}/f")
    if other != tenant:
        assert not _allows(policy, "s3:GetObject", f"arn:aws:s3:::inputs/{other}/f")
        assert not _allows(policy, "s3:PutObject", f"arn:aws:s3:::results/{other}/f")
        assert not _allows(policy, "s3:ListBucket", "arn:aws:s3:::results", prefix=f"{other}/")


def test_bad_tenants_and_buckets_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="tenant 'a/b'"):
        tenant_policy("a/b", input_buckets=["inputs"], results_bucket="results")
    with pytest.raises(ValueError, match=r"bucket 'inputs/\*'"):
        tenant_policy("acme", input_buckets=["inputs/*"], results_bucket="results")


def test_the_cli_prints_the_policy_of_the_settings_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMBATCH_S3__INPUT_BUCKET", "my-inputs")
    monkeypatch.setenv("LLMBATCH_S3__RESULTS_BUCKET", "my-results")
    runner = CliRunner()
    assert runner.invoke(app, ["minio-tenant", "--help"]).exit_code == 0
    result = runner.invoke(app, ["minio-tenant", "acme"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == tenant_policy(
        "acme", input_buckets=["my-inputs"], results_bucket="my-results"
    )
    bad = runner.invoke(app, ["minio-tenant", "Acme"])
    assert bad.exit_code == 2 and "lowercase letters" in bad.output


def test_the_pool_resource_is_named_after_the_tenant() -> None:
    assert tenant_pool_resource("acme") == "llmbatch_tenant_acme"


def test_applying_needs_a_secret_long_enough_and_a_server_that_answers() -> None:
    from llmbatch.dispatcher.errors import PermanentError, StorageUnavailable
    from llmbatch.dispatcher.security.minio_admin import SECRET_ENV, apply_tenant_policy
    from llmbatch.stack.ports import free_port

    nowhere = S3Settings(
        endpoint=f"http://127.0.0.1:{free_port()}",
        access_key=SecretStr("admin"),
        secret_key=SecretStr("admin-secret"),
    )
    with pytest.raises(PermanentError, match=SECRET_ENV):
        apply_tenant_policy(nowhere, "acme", secret_key="short")
    with pytest.raises(StorageUnavailable, match="MinIO did not answer") as caught:
        apply_tenant_policy(nowhere, "acme", secret_key="long-enough-secret")
    assert caught.value.retriable
    assert "admin-secret" not in str(caught.value) and "long-enough-secret" not in str(caught.value)


def test_a_tenant_name_with_a_trailing_newline_is_refused_everywhere_it_is_checked() -> None:
    # re.match with `$` lets "acme\n" through; the one check all three use matches the whole name
    with pytest.raises(ValidationError, match="tenant 'acme\\\\n'"):
        TenantSettings(pools=["acme\n"])
    with pytest.raises(ValidationError, match="tenant 'acme\\\\n'"):
        TenantSettings(keys={"acme\n": SecretStr("k" * 32)})
    with pytest.raises(ValueError, match="tenant 'acme\\\\n'"):
        policy_name("acme\n")
