"""Real vLLM (SmolLM2-135M-Instruct on CPU) through the dispatcher on the default path, the shared warm
engine and the batch runner: a cancel and a deadline of running batches, kill -9 of every batch-runner
replica and of the engine's replica in the middle of a batch. Each batch ends in exactly one terminal
event, and its results are checked line by line: every answered line is a real completion of its own
prompt (its prompt's token count, a non-empty answer), no custom_id is answered twice, a completed batch
answers every line, a cancelled or expired one keeps what finished."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmbatch.adapters.storage import make_client
from llmbatch.adapters.topics import ensure_topics
from llmbatch.dispatcher.backends.engines import replica_pids, runner_pids
from llmbatch.dispatcher.backends.runner_backend import RunnerClient
from llmbatch.dispatcher.backends.serve_api import ServeApi
from llmbatch.schemas.batch import CancelRequest
from llmbatch.schemas.engines import EngineRegistry
from llmbatch.schemas.events import EventType
from llmbatch.settings import KafkaSettings, RaySettings, RedisSettings, S3Settings
from tests.e2e.test_api_e2e import vllm_world
from tests.e2e.test_dispatcher_e2e import (  # noqa: F401 (buckets: a fixture)
    Env,
    _progress_at_least,
    assert_one_terminal,
    buckets,
)
from tests.support.dispatcher_kit import MODEL, batch_request, request_message, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS = 48


def _lines(n: int) -> list[dict[str, Any]]:
    """``n`` chat requests whose prompts differ in length (``q-<i>``: the same prompt in every batch)."""
    return [
        {
            "custom_id": f"q-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": _prompt(i)}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            },
        }
        for i in range(n)
    ]


def _prompt(i: int) -> str:
    # answers run to max_tokens mostly: every line costs about the same generation
    return f"Write a long story about the number {i}." + " Use many words." * (i % 5)


@pytest.fixture
async def env(
    kafka_settings: KafkaSettings,
    redis_settings: RedisSettings,
    buckets: S3Settings,  # noqa: F811
    ray_settings: RaySettings,
    tmp_path: Path,
) -> AsyncIterator[Env]:
    # the default path: the shared engine, small batches on the runner
    settings = vllm_world(
        kafka_settings,
        redis_settings,
        buckets,
        ray_settings,
        batch_size=4,
        shared_engines=True,
        max_in_flight=None,
    )
    # the engine runs 16 requests at once (a batch alone fills those slots): a 256-line batch takes
    # 16 rounds of them, so its deadline falls mid-batch with lines answered before it
    entry = settings.engines.get(MODEL).model_copy(update={"max_active_requests": 16})
    settings = settings.model_copy(update={"engines": EngineRegistry(models={MODEL: entry})})
    e = Env(settings, tmp_path)
    await ensure_topics(e.settings)
    try:
        yield e
    finally:
        await e.close()
        await ServeApi(ray_settings.address, timeout_s=60).deploy({"applications": []})


def _read(s3: S3Settings, uris: list[str]) -> list[dict[str, Any]]:
    client = make_client(s3)
    out: list[dict[str, Any]] = []
    for uri in uris:
        bucket, _, name = uri.removeprefix("s3://").partition("/")
        out += [orjson.loads(x) for x in client.get_object(bucket, name).read().splitlines() if x]
    return out


def _prompt_lengths(model_path: str, n: int) -> dict[str, int]:
    """The chat-templated prompt length of each ``q-<i>``, from the model's own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)

    def length(i: int) -> int:
        messages = [{"role": "user", "content": _prompt(i)}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tok.encode(text, add_special_tokens=False))

    return {f"q-{i}": length(i) for i in range(n)}


async def _grown(read: Callable[[], Awaitable[float]], before: float) -> float:
    """How much ``read()`` grew over ``before`` (0: not yet)."""
    return max(0.0, await read() - before)


def _check_lines(
    s3: S3Settings, event: Any, n: int, lengths: dict[str, int], *, complete: bool
) -> tuple[int, int]:
    """Line by line (see the module docstring); returns (answered, error lines)."""
    outputs, errors = _read(s3, event.data.output_uris), _read(s3, event.data.error_uris)
    ids = [o["custom_id"] for o in outputs]
    expected = {f"q-{i}" for i in range(n)}
    assert len(ids) == len(set(ids)), "a custom_id answered twice"
    assert set(ids) <= expected
    offsets = set()
    for line in outputs:
        response = line["response"]
        assert response["status_code"] == 200, line
        body = response["body"]
        assert body["model"] == MODEL and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"].strip(), line
        assert body["choices"][0]["finish_reason"] in ("stop", "length"), line
        usage = body["usage"]
        assert 0 < usage["completion_tokens"] <= MAX_TOKENS, line
        # its own prompt: the prompts differ in length, and every line is off by the same (template) count
        offsets.add(usage["prompt_tokens"] - lengths[line["custom_id"]])
    assert len(offsets) <= 1, f"answers do not match their prompts' lengths: {offsets}"
    error_ids = [e["custom_id"] for e in errors]
    assert not set(error_ids) & set(ids), "a line answered and errored"
    assert set(error_ids) <= expected
    if complete:
        assert sorted(ids) == sorted(expected) and errors == [], (len(ids), errors[:3])
    else:
        assert 0 < len(ids) < n, len(ids)
    return len(ids), len(errors)


async def test_real_vllm_cancel_deadline_and_killed_replicas_through_the_dispatcher(
    env: Env, ray_settings: RaySettings
) -> None:
    s3 = env.settings.s3
    model_path = env.settings.engines.get(MODEL).path
    api = ServeApi(ray_settings.address, timeout_s=60)
    env.spawn("d1")
    tag = uuid.uuid4().hex[:6]
    started = time.monotonic()
    figures: dict[str, Any] = {}

    # a first batch warms the engine (a cold start) and must simply complete
    warm = batch_request(f"vw-{tag}", requests=_lines(8))
    await env.send(request_message(warm))
    await env.wait_terminal([warm.batch_id], within=600)
    figures["engine warm after s"] = round(time.monotonic() - started, 1)

    # 1. cancel a running batch (160 lines x up to 48 tokens: tens of seconds of generation)
    cancel = batch_request(f"vc-{tag}", requests=_lines(160))
    await env.send(request_message(cancel))
    sent = time.monotonic()
    await wait_for(lambda: _progress_at_least(env, cancel.batch_id, 8), 300, what="cancel's progress")
    first_lines_s = time.monotonic() - sent  # this machine's time to a batch's first answered lines
    runner = RunnerClient.of(ray_settings, timeout_s=30)

    async def abandoned() -> float:  # Ray's metrics of the model's replicas, summed by the runner
        return float((await runner.engines()).get(MODEL, {}).get("abandoned", 0))

    abandoned_before = await abandoned()
    await env.send(request_message(CancelRequest(batch_id=cancel.batch_id, reason="test cancel")))
    await env.wait_terminal([cancel.batch_id], within=300)
    # the cancelled batch's calls left vLLM (aborted, or taken out of the replica's queue) instead of
    # running to their end
    figures["requests abandoned by the cancel"] = await wait_for(
        lambda: _grown(abandoned, abandoned_before), 120, interval=3, what="the cancel's abandoned requests"
    )

    # 2. a deadline that falls while its batch runs (256 lines x 48 tokens: about 30 s of generation
    # on a fast 2-core machine, the first lines within 2-3 s). The deadline leaves 3x the time the
    # cancelled batch took to its first lines (at least 12 s): on a slower or busier machine a fixed 12 s
    # could fall before any line was answered. The engine is the batch's alone: the cancelled batch's
    # calls left it
    window_s = max(12.0, 3 * first_lines_s)
    figures["expire deadline after s"] = round(window_s, 1)
    deadline = datetime.fromtimestamp(time.time() + window_s, UTC).isoformat()
    expire = batch_request(f"ve-{tag}", requests=_lines(256), deadline=deadline)
    await env.send(request_message(expire))
    await wait_for(
        lambda: _progress_at_least(env, expire.batch_id, 8), window_s + 60, what="expire's progress"
    )
    await env.wait_terminal([expire.batch_id], within=300)

    # 3. every batch-runner replica killed mid-batch: the attempt is lost, the next resumes
    runner_victim = batch_request(f"vr-{tag}", requests=_lines(40))
    await env.send(request_message(runner_victim))
    await wait_for(lambda: _progress_at_least(env, runner_victim.batch_id, 8), 300, what="runner batch")
    for pid in runner_pids(await api.status()):
        os.kill(pid, signal.SIGKILL)
    await env.wait_terminal([runner_victim.batch_id], within=600)

    # 4. the engine's replica killed mid-batch: Serve starts another, the calls are sent again
    engine_victim = batch_request(f"vk-{tag}", requests=_lines(40))
    await env.send(request_message(engine_victim))
    await wait_for(lambda: _progress_at_least(env, engine_victim.batch_id, 8), 600, what="engine batch")
    engines = replica_pids(await api.status(), MODEL)
    assert engines, "no engine replica to kill"
    for pid in engines:
        os.kill(pid, signal.SIGKILL)

    ids = [warm.batch_id, cancel.batch_id, expire.batch_id, runner_victim.batch_id, engine_victim.batch_id]
    found = await env.wait_terminal(ids, within=1200)
    assert_one_terminal(await env.results(), ids)
    done = {b: found[b][0] for b in ids}
    assert [done[b].type for b in ids] == [
        EventType.COMPLETED,
        EventType.CANCELLED,
        EventType.EXPIRED,
        EventType.COMPLETED,
        EventType.COMPLETED,
    ], {b: (e.type, e.data.error) for b, e in done.items()}
    lengths = _prompt_lengths(model_path, 256)
    _check_lines(s3, done[warm.batch_id], 8, lengths, complete=True)
    figures["cancelled: answered, error lines"] = _check_lines(
        s3, done[cancel.batch_id], 160, lengths, complete=False
    )
    figures["expired: answered, error lines"] = _check_lines(
        s3, done[expire.batch_id], 256, lengths, complete=False
    )
    for victim in (runner_victim, engine_victim):
        _check_lines(s3, done[victim.batch_id], 40, lengths, complete=True)
    assert done[runner_victim.batch_id].data.attempts >= 2  # the lost attempt ran again, resumed
    figures["attempts (runner killed, engine killed)"] = (
        done[runner_victim.batch_id].data.attempts,
        done[engine_victim.batch_id].data.attempts,
    )
    figures["all terminal after s"] = round(time.monotonic() - started, 1)
    print(f"\nreal vLLM faults through the dispatcher: {figures}")
