"""A tenant's own worker pool: its jobs run only on nodes holding its S3 keys, and MinIO lets those
keys reach nothing but the tenant's prefixes (issue 14, least privilege for S3).

Real MinIO (the session's, policies and users made through its admin API by the code the operator
CLI runs, ``llmbatch dispatcher minio-tenant --apply``) and a private two-node Ray cluster on this
machine: the head carries globex's keys in its environment; a worker node started as a pool's node
(``--num-cpus=0 --resources='{"llmbatch_tenant_acme": 2}'``) carries acme's. Jobs are submitted as
the dispatcher submits them (``llmbatch.ray_job.job.submit``) and run the fake engine: what is under test is
where the job runs and what its keys may touch.

- acme's keys read ``<inputs>/acme/`` and write ``<results>/acme/``; every other prefix, bucket and
  the bucket list are refused; the policy is the user's only one.
- acme's batch completes, and every task and actor of its job ran on acme's node (Ray's state API);
  on the head it would have read with globex's keys and failed.
- acme's job naming globex's input fails with input_not_found, and one told to write under globex's
  results prefix fails and leaves nothing there: the keys, not the dispatcher's checks, refuse.
- another tenant's job (not pooled: it asks CPUs) never lands on acme's node: it completes with the
  head's keys, every task on the head.
- a pooled tenant without a node waits (PENDING); it never runs elsewhere.
"""

from __future__ import annotations

import io
import json
import secrets
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from minio import Minio
from minio.error import S3Error
from pydantic import SecretStr
from ray.job_submission import JobStatus

from llmbatch.dispatcher.errors import PermanentError
from llmbatch.dispatcher.security.minio_admin import apply_tenant_policy, pool_user
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.errors import ExitCode
from llmbatch.ray_job.job.submit import parse_result
from llmbatch.ray_job.storage.s3 import path_of
from llmbatch.schemas.job import EngineConfig, JobSpec, tenant_pool_resource
from llmbatch.settings import RaySettings, RedisSettings, S3Settings
from tests.integration.ray_job_harness import Harness, chat_line
from tests.support.private_ray import PrivateRay, PrivateRayWorker

pytestmark = pytest.mark.integration

FAKE = EngineConfig(backend=FAKE_BACKEND, batch_size=4)


@dataclass
class Keys:
    access: str
    secret: str

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access, "AWS_SECRET_ACCESS_KEY": self.secret}


@dataclass
class Pools:
    h: Harness
    s3: S3Settings
    keys: dict[str, Keys]
    head: PrivateRay
    acme_node: PrivateRayWorker

    def client_as(self, tenant: str) -> Minio:
        k = self.keys[tenant]
        return Minio(
            self.s3.host,
            access_key=k.access,
            secret_key=k.secret,
            secure=self.s3.secure,
            region=self.s3.region,
        )

    def spec(
        self,
        name: str,
        tenant: str,
        *,
        input_tenant: str | None = None,
        output_tenant: str | None = None,
        pooled: bool = True,
        n: int = 6,
    ) -> JobSpec:
        """A file batch of ``tenant``; its input under ``input_tenant``'s prefix and its results under
        ``output_tenant``'s (both the tenant's own unless given)."""
        lines: list[dict[str, Any] | bytes] = [chat_line(f"{name}-{i}", f"question {i}") for i in range(n)]
        key = f"{input_tenant or tenant}/{name}-{uuid.uuid4().hex[:6]}.jsonl"
        uri = self.h.put_input(key, lines)
        batch_id = f"{name}-{self.h.tag}"
        return self.h.spec(
            name,
            engine=FAKE,
            tenant=tenant,
            input_uri=uri,
            output_prefix=f"s3://{self.h.results_bucket}/{output_tenant or tenant}/{batch_id}/",
            pool_resource=tenant_pool_resource(tenant) if pooled else None,
        )


@pytest.fixture(scope="module")
def pools(
    s3_settings: S3Settings, redis_settings: RedisSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pools]:
    run_dir: Path = tmp_path_factory.mktemp("tenant-pools")
    head = PrivateRay(run_dir, num_cpus=2, resources={})
    node: PrivateRayWorker | None = None
    try:
        head.start()
        ray = RaySettings(address=head.address)
        h = Harness(s3_settings, ray, redis_settings)
        s3 = s3_settings.model_copy(
            update={"input_bucket": h.input_bucket, "results_bucket": h.results_bucket}
        )
        keys: dict[str, Keys] = {}
        for tenant in ("acme", "globex"):
            secret = secrets.token_hex(16)
            user = f"{pool_user(tenant)}-{h.tag}"
            report = apply_tenant_policy(s3, tenant, user=user, secret_key=secret)
            assert report.user_created and report.policies_of_user == [f"llmbatch-tenant-{tenant}"], report
            keys[tenant] = Keys(user, secret)
        # the head holds globex's keys (a job of acme's that leaked onto it would be refused), the
        # worker node acme's, with the resource that marks acme's pool
        head.node_env = keys["globex"].env()
        head.stop(timeout=5)
        head.start()
        # as a pool's node starts: no CPU for anyone else's work, its CPUs as the tenant's resource
        node = PrivateRayWorker(
            head,
            run_dir,
            num_cpus=0,
            name="acme-pool",
            resources={tenant_pool_resource("acme"): 2},
            node_env=keys["acme"].env(),
        )
        node.start()
        yield Pools(h, s3, keys, head, node)
    finally:
        if node is not None:
            node.stop()
        head.stop(timeout=5)
        head.remove_temp()


def _run(
    p: Pools, spec: JobSpec, timeout: float = 300
) -> tuple[JobStatus, int | None, dict[str, Any] | None]:
    """Submit, wait; the status, the driver's exit code and its result line, if the head can read it:
    here it cannot for a driver on the worker node (the job names the agent by the machine's eth0
    address, where that node's agent does not listen), so the verdicts come from the exit code and
    the manifest, as the dispatcher's do."""
    sid = p.h.submit(spec)
    status = p.h.wait(sid, timeout)
    return status, p.h.exit_code(sid), parse_result(p.h.client.get_job_logs(sid))


def _driver_log(p: Pools, sid: str) -> str:
    """The driver's log from the pool node's own session folder (the head cannot fetch it, see
    :func:`_run`), for assertion messages."""
    assert p.acme_node.temp is not None
    found = sorted(p.acme_node.temp.glob(f"session_*/logs/job-driver-{sid}.log"))
    return found[-1].read_text(errors="replace")[-6000:] if found else f"(no driver log of {sid} on the node)"


def _denied(call: Any) -> bool:
    try:
        call()
    except S3Error as exc:
        return exc.code == "AccessDenied"
    return False


RAY_DATA_SINGLETONS = (
    "ActorLocationTracker",
    "AutoscalingCoordinator",
    "datasets_stats_actor",
    "_StatsActor.",
    "_AutoscalingCoordinatorActor.",
)
"""Ray Data's bookkeeping actors (one per cluster, on the head, no resources) by actor name, and the
calls a job makes to them (tasks named after their class, which the state API lists under the job
only sometimes): they see operator names, block locations and stats, never a row; everything else
of a job is its own work."""


def _job_nodes(head: PrivateRay, submission_id: str) -> tuple[str, dict[str, set[str]]]:
    """The node of a job's driver, and the node(s) of each of its tasks and actors by name (Ray's
    state API), Ray Data's bookkeeping singletons left out."""
    with urllib.request.urlopen(f"{head.address}/api/jobs/{submission_id}", timeout=10) as resp:
        details = json.loads(resp.read())
    job_id, driver = details["job_id"], details["driver_node_id"]
    placed: dict[str, set[str]] = {}
    for kind in ("tasks", "actors"):
        query = urllib.parse.urlencode(
            {
                "detail": "true",
                "limit": "1000",
                "filter_keys": "job_id",
                "filter_predicates": "=",
                "filter_values": job_id,
            }
        )
        with urllib.request.urlopen(f"{head.address}/api/v0/{kind}?{query}", timeout=30) as resp:
            rows = json.loads(resp.read())["data"]["result"]["result"]
        for row in rows:
            name = str(row.get("name") or row.get("class_name"))
            if row.get("node_id") and not name.startswith(RAY_DATA_SINGLETONS):
                placed.setdefault(name, set()).add(str(row["node_id"]))
    return str(driver), placed


def test_a_tenants_keys_reach_only_its_own_prefixes(pools: Pools) -> None:
    p = pools
    root = p.h.minio
    for tenant in ("acme", "globex"):
        root.put_object(p.h.input_bucket, f"{tenant}/probe.jsonl", io.BytesIO(b"{}\n"), 3)
    acme = p.client_as("acme")
    # its own prefixes: read inputs, write, read back, list and delete results
    assert acme.get_object(p.h.input_bucket, "acme/probe.jsonl").read() == b"{}\n"
    acme.put_object(p.h.results_bucket, "acme/x/out.jsonl", io.BytesIO(b"ok"), 2)
    assert acme.get_object(p.h.results_bucket, "acme/x/out.jsonl").read() == b"ok"
    listed = [o.object_name for o in acme.list_objects(p.h.results_bucket, prefix="acme/x/")]
    assert listed == ["acme/x/out.jsonl"]
    acme.remove_object(p.h.results_bucket, "acme/x/out.jsonl")
    # everything else
    inputs, results = p.h.input_bucket, p.h.results_bucket
    refused = {
        "read globex's input": lambda: acme.get_object(inputs, "globex/probe.jsonl"),
        "write globex's results": lambda: acme.put_object(results, "globex/x", io.BytesIO(b"x"), 1),
        "write into the inputs": lambda: acme.put_object(inputs, "acme/new", io.BytesIO(b"x"), 1),
        "write outside any tenant": lambda: acme.put_object(results, "x", io.BytesIO(b"x"), 1),
        "list globex's inputs": lambda: list(acme.list_objects(p.h.input_bucket, prefix="globex/")),
        "list a whole bucket": lambda: list(acme.list_objects(p.h.results_bucket, recursive=True)),
        "list the buckets": lambda: acme.list_buckets(),
        "make a bucket": lambda: acme.make_bucket(f"tp-{p.h.tag}"),
    }
    allowed = [what for what, call in refused.items() if not _denied(call)]
    assert not allowed, f"acme's keys were allowed to: {allowed}"
    # applying again (no secret: the user exists) keeps the user and its one policy
    report = apply_tenant_policy(p.s3, "acme", user=p.keys["acme"].access)
    assert not report.user_created and report.policies_of_user == ["llmbatch-tenant-acme"], report
    # a tenant's keys cannot change policies (the command says whose keys it needs); a user that does
    # not exist is not made without its secret
    as_acme = p.s3.model_copy(
        update={
            "access_key": SecretStr(p.keys["acme"].access),
            "secret_key": SecretStr(p.keys["acme"].secret),
        }
    )
    with pytest.raises(PermanentError, match="must be an admin's"):
        apply_tenant_policy(as_acme, "acme", user=p.keys["acme"].access)
    with pytest.raises(PermanentError, match="LLMBATCH_TENANT_S3_SECRET_KEY"):
        apply_tenant_policy(p.s3, "acme", user=f"nobody-{p.h.tag}")


def test_a_pooled_tenants_batch_runs_on_its_pool_only_and_completes(pools: Pools) -> None:
    p = pools
    spec = p.spec("pool-acme", "acme")
    status, code, result = _run(p, spec)
    assert status == JobStatus.SUCCEEDED and code == 0, _driver_log(p, spec.submission_id)
    manifest = p.h.manifest(spec)
    assert manifest.request_counts.completed == 6 and manifest.request_counts.failed == 0, manifest
    answered = sorted(line["custom_id"] for line in p.h.lines(manifest.output_uris))
    assert answered == sorted(f"pool-acme-{i}" for i in range(6))
    # the driver, the read task and prompt actor, the rebatch tasks and the engine actor. Workers
    # report task events to the GCS every second or so: a stage's events may come after the job ends
    # (under load, a stage's came after 30 s once: CI on 6e4c0b1)
    wanted = {"read_rows", "PromptStage", "Repartition", "EngineStage"}
    deadline = time.monotonic() + 90
    while True:
        driver, placed = _job_nodes(p.head, spec.submission_id)
        stages = {stage for name in placed for stage in wanted if stage in name}
        if stages == wanted or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert driver == p.acme_node.node_id, (driver, p.acme_node.node_id)
    assert stages == wanted, placed
    elsewhere = {name: nodes for name, nodes in placed.items() if nodes != {p.acme_node.node_id}}
    assert not elsewhere, (p.acme_node.node_id, elsewhere)
    assert result is None or result["exit_code"] == 0, result
    # the tenant's keys live in its nodes' environment only: not in what the Jobs API shows
    with urllib.request.urlopen(f"{p.head.address}/api/jobs/", timeout=10) as resp:
        shown = resp.read().decode()
    assert spec.submission_id in shown
    assert p.keys["acme"].secret not in shown and p.keys["acme"].access not in shown


def test_a_pooled_job_cannot_read_or_write_another_tenants_prefix(pools: Pools) -> None:
    p = pools
    theirs = p.spec("pool-steal", "acme", input_tenant="globex")
    status, code, result = _run(p, theirs)
    log = _driver_log(p, theirs.submission_id)
    # input_not_found: failed at once, not retried (pyarrow says ACCESS_DENIED, which was taken for an
    # outage and retried before)
    assert status == JobStatus.FAILED and code == ExitCode.INPUT_NOT_FOUND, log
    assert "ACCESS_DENIED" in log
    assert result is None or result["exit_code"] == code, result

    into = p.spec("pool-write", "acme", output_tenant="globex")
    status = p.h.wait(p.h.submit(into), 300)
    assert status == JobStatus.FAILED, _driver_log(p, into.submission_id)
    prefix = path_of(into.output_prefix).split("/", 1)[1]
    assert not list(p.h.minio.list_objects(p.h.results_bucket, prefix=prefix, recursive=True))


def test_another_tenants_job_never_lands_on_the_pool(pools: Pools) -> None:
    p = pools
    spec = p.spec("pool-other", "globex", pooled=False)  # reads with the head's keys (globex's)
    status, code, result = _run(p, spec)
    assert status == JobStatus.SUCCEEDED and code == 0, p.h.logs_tail(spec.submission_id)
    assert result is None or result["exit_code"] == code, result
    assert p.h.manifest(spec).request_counts.completed == 6
    [head_node] = [n["node_id"] for n in p.head.nodes() if n["is_head_node"] and n["state"] == "ALIVE"]
    driver, placed = _job_nodes(p.head, spec.submission_id)
    assert driver == head_node and len(placed) >= 4, (driver, placed)
    elsewhere = {name: nodes for name, nodes in placed.items() if nodes != {head_node}}
    assert not elsewhere, (p.acme_node.node_id, elsewhere)


def test_a_pooled_tenant_without_a_node_waits_and_never_runs_elsewhere(pools: Pools) -> None:
    p = pools
    spec = p.spec("pool-none", "initech")  # no node carries llmbatch_tenant_initech
    sid = p.h.submit(spec)
    try:
        time.sleep(15)
        assert p.h.client.get_job_status(sid) == JobStatus.PENDING
    finally:
        p.h.client.stop_job(sid)
    assert not list(
        p.h.minio.list_objects(p.h.results_bucket, prefix=f"initech/{spec.batch_id}/", recursive=True)
    )
