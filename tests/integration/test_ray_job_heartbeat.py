"""An attempt's heartbeats start before its resume scan (ray_job.job.main.Attempt, real Redis, results on a
local filesystem): a batch with many earlier shards takes a while to scan, and a silent scan looked
like a dead attempt to the dispatcher (heartbeat_timeout_s), which stopped a healthy job."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from pyarrow import fs as pafs

from llmbatch.ray_job.job import main as job_main
from llmbatch.ray_job.job import resume
from llmbatch.ray_job.storage import s3 as job_s3
from llmbatch.schemas.common import utcnow
from llmbatch.schemas.job import JobSpec
from llmbatch.settings import RedisSettings

pytestmark = pytest.mark.integration


def test_heartbeats_run_during_the_resume_scan(
    redis_settings: RedisSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"test:progress:{uuid.uuid4().hex[:8]}"
    spec = JobSpec.model_validate(
        {
            "batch_id": "b1",
            "attempt": 3,
            "endpoint": "/v1/chat/completions",
            "model": "m",
            "requests": [
                {
                    "custom_id": "x",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}]},
                }
            ],
            "output_prefix": "s3://results/default/b1/",
            "redis_url": redis_settings.url,
            "progress_key": key,
            "progress_interval_s": 0.2,
        }
    )
    client = redis.Redis.from_url(redis_settings.url, decode_responses=True)
    # what earlier attempts left: their counters must survive the scan untouched
    client.hset(key, mapping={"completed": "40", "failed": "2", "attempt": "2", "heartbeat_at": "1.0"})
    (tmp_path / "results").mkdir()
    local = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    monkeypatch.setattr(job_s3, "filesystem", lambda session=None: local)
    seen: list[dict[str, str]] = []

    def slow_scan(fs: Any, prefix: str) -> resume.Prior:
        deadline = time.monotonic() + 5  # a scan of many shards: seconds
        while time.monotonic() < deadline:
            seen.append(cast(dict[str, str], client.hgetall(key)))  # decode_responses=True
            beat = [float(s.get("heartbeat_at", 0)) for s in seen[-2:]]
            if len(seen) > 3 and beat[-1] > beat[0]:
                break
            time.sleep(0.1)
        return resume.Prior()

    monkeypatch.setattr(resume, "scan", slow_scan)
    attempt = job_main.Attempt(spec, utcnow())
    monkeypatch.setattr(attempt, "_install_stop", lambda: None)
    monkeypatch.setattr(attempt, "_run_pipeline", lambda _input: None)
    try:
        attempt.run()
        beats = [float(s.get("heartbeat_at", 0)) for s in seen]
        assert seen[-1]["attempt"] == "3" and beats[-1] > beats[-2] > 1.0, seen[-4:]  # beating, this attempt
        assert all(s["completed"] == "40" and s["failed"] == "2" for s in seen)  # counters left alone
    finally:
        client.delete(key)
        client.close()
