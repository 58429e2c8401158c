"""The ray_job pipeline end to end through the Ray Jobs API with the fake engine backend.

Everything but the engine is real here (MinIO, Redis, the Ray head, Ray Data, the same stages):
counts and codes, progress and heartbeats in Redis, stop + resume, exit codes, and a 2,000-line
input with flat driver memory. Real vLLM behaviour is proven in test_ray_job_vllm.py.
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from ray.job_submission import JobStatus

from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.errors import ExitCode
from llmbatch.ray_job.job.submit import SessionRef, parse_result
from llmbatch.ray_job.storage import node_secrets
from llmbatch.schemas.common import BatchStatus
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import RaySettings, RedisSettings, S3Settings
from tests.integration.ray_job_harness import Harness, chat_line
from tests.support.proc_env import environ, parent_pid

pytestmark = pytest.mark.integration

FAST = {"backend": FAKE_BACKEND, "num_cpus_per_replica": 0.25}
PROBE = Path(__file__).parents[1] / "support" / "block_stats_probe.py"


@pytest.fixture(scope="module")
def h(s3_settings: S3Settings, ray_settings: RaySettings, redis_settings: RedisSettings) -> Harness:
    return Harness(s3_settings, ray_settings, redis_settings)


def test_counts_codes_progress_heartbeat_and_idempotent_rerun(h: Harness) -> None:
    lines: list[dict[str, Any] | bytes] = [
        chat_line(f"ok-{i}", f"question number {i}", max_tokens=50) for i in range(12)
    ]
    lines += [
        b"{broken",
        chat_line("ok-0", "duplicate"),
        chat_line("boom", "engine fails this one"),
        {"custom_id": "m", "method": "GET", "url": "/v1/chat/completions", "body": {}},
    ]
    uri = h.put_input("progress.jsonl", lines)
    key = f"llmbatch:test:progress:{h.tag}"
    spec = h.spec(
        "fake-progress",
        input_uri=uri,
        redis_url=h.redis.url,
        progress_key=key,
        progress_interval_s=0.3,
        engine=EngineConfig(
            **FAST,
            backend_options={"delay_s": 0.4, "fail_custom_ids": ["boom"]},
            batch_size=4,
            batches_in_flight=1,
        ),
    )
    r = redis.Redis.from_url(h.redis.url, decode_responses=True)
    sid = h.submit(spec)
    beats: list[float] = []
    while not h.client.get_job_status(sid).is_terminal():
        beat = r.hget(key, "heartbeat_at")
        if beat is not None and (not beats or float(beat) != beats[-1]):
            beats.append(float(beat))
        time.sleep(0.1)
    assert h.client.get_job_status(sid) == JobStatus.SUCCEEDED, h.logs_tail(sid)
    assert len(beats) >= 3 and beats == sorted(beats), beats  # heartbeats kept coming while it ran

    manifest = h.manifest(spec)
    assert manifest.status == BatchStatus.COMPLETED
    assert manifest.request_counts.model_dump() == {"total": 16, "completed": 12, "failed": 4}
    outputs, errors = h.lines(manifest.output_uris), h.lines(manifest.error_uris)
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"ok-{i}" for i in range(12))
    codes = {e["error"]["line"]: e["error"]["code"] for e in errors}
    assert codes == {
        13: "invalid_json_line",
        14: "duplicate_custom_id",
        15: "engine_error",
        16: "invalid_value",
    }
    assert (
        manifest.usage.completion_tokens
        == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in outputs)
        > 0
    )
    progress = r.hgetall(key)
    assert {k: progress[k] for k in ("completed", "failed", "total", "attempt")} == {
        "completed": "12",
        "failed": "4",
        "total": "16",
        "attempt": "1",
    }
    assert int(progress["completion_tokens"]) == manifest.usage.completion_tokens
    assert time.time() - float(progress["heartbeat_at"]) < 60

    # the same batch again (attempt 2): nothing left to do, nothing duplicated
    again = spec.model_copy(update={"attempt": 2})
    status, result = h.run(again)
    assert status == JobStatus.SUCCEEDED and result["exit_code"] == 0
    second = h.manifest(again)
    assert second.request_counts == manifest.request_counts
    assert second.output_uris == manifest.output_uris and second.error_uris == manifest.error_uris
    assert [a.attempt for a in second.attempts] == [1, 2] and second.attempts[1].completed == 0


def test_stop_midway_then_attempt_2_writes_each_request_once(h: Harness) -> None:
    n = 60
    uri = h.put_input("resume.jsonl", [chat_line(f"r{i:03d}", f"item {i}") for i in range(n)])
    engine = EngineConfig(**FAST, backend_options={"delay_s": 0.5}, batch_size=5, batches_in_flight=1)
    first = h.spec("fake-resume", input_uri=uri, engine=engine, shard_max_lines=5)
    sid = h.submit(first)
    deadline = time.monotonic() + 180
    while sum("/output-a1-" in o for o in h.objects(first)) < 2:
        assert time.monotonic() < deadline, h.logs_tail(sid)
        assert not h.client.get_job_status(sid).is_terminal(), h.logs_tail(sid)
        time.sleep(0.2)
    h.client.stop_job(sid)
    assert h.wait(sid) == JobStatus.STOPPED
    partial = h.manifest(first)  # written on SIGTERM with what finished
    assert partial.status == "partial" and 10 <= partial.request_counts.completed < n

    second = first.model_copy(update={"attempt": 2})
    status, result = h.run(second)
    assert status == JobStatus.SUCCEEDED, result
    manifest = h.manifest(second)
    assert manifest.status == BatchStatus.COMPLETED and manifest.request_counts.completed == n
    ids = Counter(line["custom_id"] for line in h.lines(manifest.output_uris))
    assert ids == Counter({f"r{i:03d}": 1 for i in range(n)})
    by_attempt = Counter(s.attempt for s in manifest.output_shards)
    assert by_attempt[1] >= 2 and by_attempt[2] >= 1
    assert manifest.attempts[0].status == "partial" and manifest.attempts[1].status == BatchStatus.COMPLETED
    assert manifest.attempts[1].completed == n - sum(
        s.lines for s in manifest.output_shards if s.attempt == 1
    )
    # every shard under the prefix is listed (nothing stray, nothing appended twice)
    listed = {u.rsplit("/", 1)[1] for u in manifest.output_uris + manifest.error_uris} | {"manifest.json"}
    assert {o.rsplit("/", 1)[1] for o in h.objects(second)} == listed


def test_2000_lines_with_flat_driver_memory(h: Harness) -> None:
    filler = "lorem ipsum dolor sit amet " * 700  # ~19 KB per line: ~38 MB of input in all
    small = h.put_input("small.jsonl", [chat_line(f"s{i}", f"{i} {filler}", max_tokens=8) for i in range(20)])
    big = h.put_input("big.jsonl", [chat_line(f"b{i}", f"{i} {filler}", max_tokens=8) for i in range(2000)])
    engine = EngineConfig(**FAST, batch_size=100, max_model_len=32_768)
    small_spec = h.spec("fake-small", input_uri=small, engine=engine, shard_max_lines=250)
    big_spec = h.spec("fake-big", input_uri=big, engine=engine, shard_max_lines=250)
    status, small_result = h.run(small_spec)
    assert status == JobStatus.SUCCEEDED, small_result
    status, big_result = h.run(big_spec)
    assert status == JobStatus.SUCCEEDED, big_result
    manifest = h.manifest(big_spec)
    assert manifest.request_counts.model_dump() == {"total": 2000, "completed": 2000, "failed": 0}
    assert len(manifest.output_shards) == 8 and {s.lines for s in manifest.output_shards} == {250}
    assert len({line["custom_id"] for line in h.lines(manifest.output_uris)}) == 2000
    growth = big_result["driver_max_rss_mb"] - small_result["driver_max_rss_mb"]
    assert growth < 25, (small_result["driver_max_rss_mb"], big_result["driver_max_rss_mb"])
    # the driver's own memory at its sampled peak (every 2 s), not only at the end; the last sample
    # comes a moment after driver_uss_mb, so allow a few MB freed in between
    for result in (small_result, big_result):
        assert result["driver_uss_peak_mb"] is not None, result
        assert result["driver_uss_peak_mb"] >= result["driver_uss_mb"] - 5, result
        assert result["driver_own_peak_mb"] is not None, result


def test_exit_codes_for_missing_input_and_invalid_spec(h: Harness) -> None:
    spec = h.spec("fake-missing", input_uri=f"s3://{h.input_bucket}/nope.jsonl", engine=EngineConfig(**FAST))
    status, result = h.run(spec)
    assert status == JobStatus.FAILED and h.exit_code(spec.submission_id) == ExitCode.INPUT_NOT_FOUND
    assert result["status"] == "failed" and result["error"]["code"] == "input_not_found"
    assert h.objects(spec) == []  # nothing written

    import sys

    sid = f"fake-invalid-{h.tag}-a1"
    h.client.submit_job(
        submission_id=sid,
        entrypoint=f"{sys.executable} -P -m llmbatch.ray_job --spec-json '{{\"x\": 1}}'",
        runtime_env=h.env,
        entrypoint_num_cpus=0,
    )
    assert h.wait(sid) == JobStatus.FAILED and h.exit_code(sid) == ExitCode.INVALID_SPEC


def test_ray_datas_per_block_stats_stay_bounded_in_the_driver(h: Harness) -> None:
    """Ray Data keeps one stats entry per block until a dataset ends (the driver's slow growth on huge
    batches); the job's DataContext bounds them. Seen through Ray's own summary, which counts those
    entries: 200 blocks through a map stage, kept to 20 (at most 40 between trims), all rows through;
    without the callback Ray counts all 200."""
    sid = f"fake-blockstats-{h.tag}"
    h.client.submit_job(
        submission_id=sid,
        runtime_env=h.env,
        entrypoint_num_cpus=0,
        entrypoint=f"{sys.executable} {PROBE} 20 200",
    )
    assert h.wait(sid) == JobStatus.SUCCEEDED, h.logs_tail(sid)
    found = dict(re.findall(r"PROBE bounded=(\w+) rows=1000 counted=(\d+)", h.client.get_job_logs(sid)))
    assert set(found) == {"True", "False"}, h.logs_tail(sid)
    assert 20 <= int(found["True"]) <= 40 and int(found["False"]) == 200, found


def test_a_job_with_its_own_s3_session_runs_without_the_nodes_keys(h: Harness) -> None:
    """Issue 14: the attempt takes its session from Redis once and reads and writes with it; its driver
    and its actors (a model's code among them) start with the node's S3 keys blanked, read from their
    live processes. The batch completes, so the session's keys did the work; the Redis copy is gone."""
    lines: list[dict[str, Any] | bytes] = [chat_line(f"k{i:02d}", f"item {i}") for i in range(40)]
    engine = EngineConfig(
        **FAST, backend_options={"delay_s": 0.5}, batch_size=2, batches_in_flight=1
    )  # ~10 s of work
    spec = h.spec(
        "fake-session", input_uri=h.put_input("session.jsonl", lines), engine=engine, redis_url=h.redis.url
    )
    ref = h.issue_session(spec)
    sid = h.submit(spec, session=ref)
    deadline = time.monotonic() + 240
    pids: dict[str, int] = {}
    while "actor" not in pids:
        running = time.monotonic() < deadline and not h.client.get_job_status(sid).is_terminal()
        assert running, h.logs_tail(sid)
        info = h.client.get_job_info(sid)
        if info.driver_info is not None and info.driver_info.pid:
            pids["driver"] = int(info.driver_info.pid)
        actor = next(
            (
                int(a["pid"])
                for a in h.state("actors")
                if info.job_id
                and a.get("job_id") == info.job_id
                and a.get("state") == "ALIVE"
                and a.get("pid")
                and "MapBatches" in str(a.get("class_name"))
            ),
            None,
        )
        if actor is not None:
            pids["actor"] = actor
        time.sleep(0.3)
    envs = {name: environ(pid) for name, pid in pids.items()}
    node_env = environ(parent_pid(pids["actor"]))  # the raylet that started it holds the keys
    assert h.wait(sid) == JobStatus.SUCCEEDED, h.logs_tail(sid)
    key, secret = h.s3.access_key.get_secret_value(), h.s3.secret_key.get_secret_value()
    node_has_keys = node_env.get(node_secrets.S3_ACCESS_KEY) == key  # (failures never print values)
    assert node_has_keys, "the Ray node should hold the S3 keys"
    assert sorted(envs) == ["actor", "driver"]
    for name, env in envs.items():
        held = [v for v in node_secrets.S3_KEYS if env.get(v)]
        assert held == [], f"the job's {name} holds {held}"
        leaked = [v for v in env.values() if key in v or secret in v]
        assert not leaked, f"the job's {name} holds a key's value"
    assert h.manifest(spec).request_counts.completed == 40
    assert redis.Redis.from_url(h.redis.url).exists(ref.key) == 0  # taken by the driver
    # the blanks are job-wide, so Ray Data still fuses the reader into the prompt stage (an actor's own
    # runtime_env stops that: the read task then runs apart and its rows are shipped to the actor)
    job_id = h.client.get_job_info(sid).job_id
    actors = {str(a.get("class_name")) for a in h.state("actors") if a.get("job_id") == job_id}
    assert any("MapBatches(read_rows)->MapBatches(PromptStage)" in name for name in actors), actors


def test_a_jobs_session_reaches_its_own_batchs_files_only(h: Harness) -> None:
    """The session minted for one batch does not read another batch's input (the node's keys would):
    the attempt ends as input_not_found. A session named but not in Redis fails the attempt as
    retriable (a new attempt gets a new session), never running with the node's keys."""
    mine = h.spec(
        "fake-sess-a",
        input_uri=h.put_input("sess-a.jsonl", [chat_line("a", "x")]),
        engine=EngineConfig(**FAST),
        redis_url=h.redis.url,
    )
    other = h.spec(
        "fake-sess-b",
        input_uri=h.put_input("sess-b.jsonl", [chat_line("b", "y")]),
        engine=EngineConfig(**FAST),
        redis_url=h.redis.url,
    )
    sid = h.submit(other, session=h.issue_session(mine))
    assert h.wait(sid, 240) == JobStatus.FAILED
    assert h.exit_code(sid) == ExitCode.INPUT_NOT_FOUND, h.logs_tail(sid)
    missing = SessionRef(redis_url=h.redis.url, key=f"llmbatch:s3session:never-{h.tag}")
    retry = h.spec(
        "fake-sess-c", input_uri=other.input_uri, engine=EngineConfig(**FAST), redis_url=h.redis.url
    )
    sid = h.submit(retry, session=missing)
    assert h.wait(sid, 240) == JobStatus.FAILED
    result = parse_result(h.client.get_job_logs(sid))
    assert h.exit_code(sid) == ExitCode.RETRIABLE and result is not None
    assert result["error"]["code"] == "s3_session_missing", h.logs_tail(sid)


def test_deadline_stops_the_attempt_and_keeps_what_finished(h: Harness) -> None:
    lines = 4000  # 500 s of fake work: never all done before the deadline
    uri = h.put_input("deadline.jsonl", [chat_line(f"d{i:04d}", f"item {i}") for i in range(lines)])
    engine = EngineConfig(**FAST, backend_options={"delay_s": 0.5}, batch_size=4, batches_in_flight=1)
    # the job starts in ~15 s on an idle machine, up to a minute on a loaded one: 90 s leaves work done
    deadline = datetime.now(UTC) + timedelta(seconds=90)
    spec = h.spec("fake-deadline", input_uri=uri, engine=engine, shard_max_lines=4, deadline=deadline)
    status, result = h.run(spec)
    assert status == JobStatus.FAILED and h.exit_code(spec.submission_id) == ExitCode.RETRIABLE
    assert result["status"] == "partial" and result["error"]["code"] == "deadline_exceeded", result["error"]
    manifest = h.manifest(spec)
    assert manifest.status == "partial" and 0 < manifest.request_counts.completed < lines
    assert manifest.request_counts.total == lines  # known from the input, not just what ended
    assert manifest.error is not None and manifest.error.code == "deadline_exceeded"


def test_an_embedding_batch_runs_as_a_ray_job_one_vector_per_input(h: Harness) -> None:
    """The Ray-job path (Ray Data's prompt and engine stages) of a /v1/embeddings batch: each line's
    inputs fan out to the engine and come back as one CreateEmbeddingResponse, in order."""

    def embed(custom_id: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}

    lines: list[dict[str, Any] | bytes] = [
        embed(f"e{i}", input=[f"text {i}", "same", f"more {i}"]) for i in range(6)
    ]
    lines += [embed("ids", input=[[5, 6, 7]], encoding_format="base64"), embed("bad", input="x", foo=1)]
    uri = h.put_input("embeddings.jsonl", lines)
    spec = h.spec(
        "fake-embed",
        input_uri=uri,
        endpoint="/v1/embeddings",
        engine=EngineConfig(**FAST, runner="pooling", batch_size=3, batches_in_flight=1),
    )
    status, _ = h.run(spec)
    assert status == JobStatus.SUCCEEDED, h.logs_tail(spec.submission_id)
    manifest = h.manifest(spec)
    assert manifest.request_counts.model_dump() == {"total": 8, "completed": 7, "failed": 1}
    outputs = {o["custom_id"]: o["response"]["body"] for o in h.lines(manifest.output_uris)}
    assert set(outputs) == {*(f"e{i}" for i in range(6)), "ids"}
    for i in range(6):
        data = outputs[f"e{i}"]["data"]
        assert [d["index"] for d in data] == [0, 1, 2] and len(data[0]["embedding"]) == 8
        assert data[1]["embedding"] == outputs["e0"]["data"][1]["embedding"]  # "same" in every line
        assert data[0]["embedding"] != data[2]["embedding"]
    assert isinstance(outputs["ids"]["data"][0]["embedding"], str)  # base64
    [error] = h.lines(manifest.error_uris)
    assert error["custom_id"] == "bad" and error["error"]["code"] == "unsupported_parameter"
