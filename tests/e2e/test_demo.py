"""`make demo` runs in CI: the same code path (``python -m llmbatch.demo``) with 4 prompts instead of 30.

Real everything: Apache Kafka, Redis, MinIO, a Ray head, a dispatcher process and vLLM (CPU) running
SmolLM2-135M-Instruct in a shared engine on Ray Serve; the batch runs twice (cold, then warm). When
the test session's services come from the local stack the demo reuses them (same run folder,
``--keep``); otherwise it starts and stops its own stack.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from llmbatch.dispatcher.backends.serve_api import ServeApi
from tests.support.services import ServiceProvider

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]
PROMPTS = 4
KEEP_FROM_ENV = {"LLMBATCH_CACHE", "LLMBATCH_MODEL_DIR", "LLMBATCH_OMP_THREADS_BIND", "LLMBATCH_DEBUG"}


def test_demo_submits_follows_and_reports_a_real_batch(services: ServiceProvider, tmp_path: Path) -> None:
    for name in ("kafka", "redis", "s3", "ray"):  # start the session's stack (reused by the demo)
        getattr(services, name)()
    local = all(services.sources.get(n) == "local stack" for n in ("kafka", "redis", "minio", "ray"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMBATCH_") or k in KEEP_FROM_ENV}
    summary_path = tmp_path / "summary.json"
    args = [
        sys.executable,
        "-m",
        "llmbatch.demo",
        "--prompts",
        str(PROMPTS),
        "--summary-json",
        str(summary_path),
        "--timeout",
        "1200",
    ]
    if local:
        env["LLMBATCH_RUN_DIR"] = str(services.run_dir)
        args.append("--keep")  # the session fixture stops its services itself
    else:
        env["LLMBATCH_RUN_DIR"] = str(tmp_path / "stack")
    try:
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1700, check=False)
    finally:
        if local:  # the demo's dispatcher deployed a warm engine on the session's head: remove it
            asyncio.run(ServeApi(services.ray().address).deploy({"applications": []}))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "Traceback" not in output

    summary = orjson.loads(summary_path.read_bytes())
    assert summary["status"] == "completed" and summary["event_type"] == "llmbatch.batch.completed.v1"
    assert summary["request_counts"] == {"total": PROMPTS + 2, "completed": PROMPTS, "failed": 2}
    assert len(summary["prompts"]) == PROMPTS and set(summary["answers"]) == set(summary["prompts"])
    assert all(text.strip() for text in summary["answers"].values())
    assert len(summary["errors"]) == 2 and "temperature-too-high" in summary["errors"]
    assert summary["usage"]["completion_tokens"] > 0 and summary["usage"]["prompt_tokens"] > 0
    assert summary["output_uris"] and summary["error_uris"] and summary["manifest_uri"]
    timings = summary["timings"]
    assert timings["queue_wait_s"] is not None and timings["queue_wait_s"] >= 0
    assert timings["engine_start_s"] and timings["engine_start_s"] > 0
    assert timings["generation_tok_per_s"] and timings["generation_tok_per_s"] > 0
    # the same batch again on the engine the first run started: no engine start, same results
    warm = summary["warm"]
    assert warm["status"] == "completed" and warm["request_counts"] == summary["request_counts"]
    assert set(warm["answers"]) == set(summary["answers"])
    assert warm["timings"]["engine_start_s"] < timings["engine_start_s"]
    assert "cold vs warm engine" in proc.stdout
    for heading in (
        "1. local stack",
        "3. dispatcher",
        "5. progress",
        "completion event",
        "results",
        "6. clean up",
    ):
        assert heading in proc.stdout, heading
    assert "dispatcher stopped (exit 0)" in proc.stdout
