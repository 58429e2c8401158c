"""No secret leaves its owner, and each component has only its own Redis rights (issue 14, items 1 and
2): a batch runs against a Redis with ACL users (``llmbatch dispatcher redis-acl``): the dispatcher
as its user, the Ray job as the job user, which may touch only progress hashes; the Ray head's node
environment holds the S3 keys and the job user's password (as Ray pods get them from a Kubernetes
Secret). Then every place others can read is searched for each secret: the Jobs API (list and
details), each job's driver log, every object the batch wrote, every event and dead letter, and the
dispatcher's log. Before, the keys and the password rode in each job's runtime_env."""

from __future__ import annotations

import asyncio
import json
import secrets
import urllib.request
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr

from llmbatch.adapters.storage import make_client
from llmbatch.adapters.topics import ensure_topics
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.security.redis_acl import Role, acl_lines
from llmbatch.schemas.events import EventType
from llmbatch.settings import KafkaSettings, RaySettings, RedisSettings, S3Settings
from llmbatch.stack import services
from llmbatch.stack.process import alive, stop_tree
from tests.e2e.test_dispatcher_e2e import Env, buckets, world
from tests.support.dispatcher_kit import TopicReader, batch_request, inline_lines, request_message
from tests.support.private_ray import PrivateRay

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

__all__ = ["buckets"]  # the module-scoped fixture, used here too


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode("utf-8", errors="replace"))


def _readable_by_others(e: Env, head: PrivateRay, batch_id: str) -> dict[str, str]:
    """Everything a dashboard user, a results reader or a topic consumer can read, by where."""
    texts = {"GET /api/jobs/": _get(f"{head.address}/api/jobs/")}
    for job in [j for j in json.loads(texts["GET /api/jobs/"]) if j.get("submission_id")]:
        sid = job["submission_id"]
        texts[f"GET /api/jobs/{sid}"] = _get(f"{head.address}/api/jobs/{sid}")
        texts[f"GET /api/jobs/{sid}/logs"] = _get(f"{head.address}/api/jobs/{sid}/logs")
    s3 = e.settings.s3
    client = make_client(s3)
    for bucket in (s3.results_bucket, s3.input_bucket):
        for obj in client.list_objects(bucket, recursive=True):
            if batch_id in obj.object_name:
                body = client.get_object(bucket, obj.object_name).read()
                texts[f"s3://{bucket}/{obj.object_name}"] = body.decode("utf-8", errors="replace")
    for proc in e.procs:
        texts[f"dispatcher log {proc.log_path.name}"] = proc.log_path.read_text(errors="replace")
    return texts


async def _topic_texts(e: Env) -> dict[str, str]:
    texts: dict[str, str] = {}
    topics = e.settings.kafka.topics
    for topic in (topics.results, topics.dead_letter):
        records = await TopicReader(e.settings.kafka.client_kwargs(), topic).read_to_end()
        texts[topic] = "\n".join(repr(r.key) + repr(r.value) + repr(list(r.headers or ())) for r in records)
    return texts


async def test_no_secret_in_jobs_api_job_logs_objects_events_or_dispatcher_log(
    kafka_settings: KafkaSettings, buckets: S3Settings, tmp_path: Path
) -> None:
    ray = RaySettings()  # the private head's address, once it runs
    settings = world(kafka_settings, RedisSettings(), buckets, ray)
    passwords: dict[Role, str] = {"dispatcher": secrets.token_urlsafe(18), "job": secrets.token_urlsafe(18)}
    admin = secrets.token_urlsafe(18)
    lines = acl_lines(Keys(settings.redis.key_prefix), passwords)
    redis_rec = await asyncio.to_thread(
        services.start_redis, tmp_path, name="redis-acl", password=admin, acl=lines
    )
    head = PrivateRay(tmp_path / "ray", s3=buckets, redis_password=passwords["job"])
    e: Env | None = None
    try:
        await asyncio.to_thread(head.start)
        port = redis_rec.ports["redis"]
        redis = settings.redis.model_copy(
            update={
                "url": f"redis://dispatcher@127.0.0.1:{port}/0",
                "password": SecretStr(passwords["dispatcher"]),
            }
        )
        settings = settings.model_copy(
            update={
                "redis": redis,
                "ray": RaySettings(address=head.address),
                "job": settings.job.model_copy(update={"redis_username": "job"}),
            }
        )
        e = Env(settings, tmp_path)
        await ensure_topics(e.settings)
        e.spawn()
        request = batch_request(f"sec-{uuid.uuid4().hex[:8]}", requests=inline_lines(12))
        key, value, headers = request_message(request)
        await e.send((key, value, headers), (key, b"not json", headers))  # the second: a dead letter
        found = await e.wait_terminal([request.batch_id])
        event = found[request.batch_id][0]
        assert event.type is EventType.COMPLETED, event.data.error
        assert event.data.request_counts.completed == 12
        # the job wrote its progress as the job user: it found that user's password in its node's
        # environment (nobody sent it)
        assert (await e.store.read_progress(batch_key(None, request.batch_id))).get("attempt") == "1"
        texts = _readable_by_others(e, head, request.batch_id) | await _topic_texts(e)
        assert any(where.startswith("s3://") for where in texts) and any("/logs" in w for w in texts)
        owned = {
            "s3.access_key": buckets.access_key.get_secret_value(),
            "s3.secret_key": buckets.secret_key.get_secret_value(),
            "the dispatcher's Redis password": passwords["dispatcher"],
            "the job's Redis password": passwords["job"],
            "the Redis admin password": admin,
            "the batch runner's token": head.runner_token,
        }
        hits = [
            (name, where) for where, text in texts.items() for name, secret in owned.items() if secret in text
        ]
        assert hits == []
        # the attempt ran with an S3 session of its own (job S3 sessions are on by default): named on its
        # command line, taken from Redis by its driver (none is left), the node's keys blanked in the job
        jobs = [j for j in json.loads(texts["GET /api/jobs/"]) if j.get("submission_id")]
        assert jobs and all("--s3-session-key" in j["entrypoint"] for j in jobs)
        assert all(j["runtime_env"]["env_vars"].get("AWS_ACCESS_KEY_ID") == "" for j in jobs)
        # and without the runner's credential, which no job needs
        assert all(j["runtime_env"]["env_vars"].get("LLMBATCH_RAY__RUNNER_TOKEN") == "" for j in jobs)
        admin_client = aioredis.Redis(port=port, password=admin)
        try:
            left = [k async for k in admin_client.scan_iter(match=f"{settings.redis.key_prefix}:s3session:*")]
        finally:
            await admin_client.aclose()
        assert left == []
    finally:
        if e is not None:
            await e.close()
        head.stop()
        head.remove_temp()
        if alive(redis_rec.pid):
            stop_tree(redis_rec.pid)
