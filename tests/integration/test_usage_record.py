"""The usage record on real Kafka and Redis: batches of two tenants end (as the tracker records them)
and their terminal events go out through the real publisher; each tenant's usage report (Redis, the
``llmbatch usage`` CLI, ``GET /v1/usage``) equals the sum of the usage its terminal events announce,
exactly, and publishing again counts nothing twice."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from llmbatch.api.tenancy.usage import RedisUsage
from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.domain.events import Outcome, terminal_fields
from llmbatch.dispatcher.domain.keys import BatchKey, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.domain.usage import totals
from llmbatch.dispatcher.intake.commands import Accept, IntakeRules, classify
from llmbatch.dispatcher.ops import usage, usage_cli
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.batch import InlineLimits
from llmbatch.settings import LLMBatchSettings
from tests.integration.test_dispatcher_publisher import World, make_world, topic_settings, worlds  # noqa: F401
from tests.support.api_fakes import make_api
from tests.support.dispatcher_kit import MODEL, batch_request, decode_results, inline_lines, request_message

pytestmark = pytest.mark.integration
PATHS = {
    State.COMPLETED: (State.SUBMITTED, State.RUNNING, State.FINALIZING, State.COMPLETED),
    State.FAILED: (State.SUBMITTED, State.RUNNING, State.FAILED),
    State.CANCELLED: (State.CANCELLED,),
    State.EXPIRED: (State.SUBMITTED, State.RUNNING, State.EXPIRED),
}


async def _ended(w: World, tenant: str, state: State, n: int) -> BatchKey:
    """A batch of ``tenant`` accepted as the consumer would, then ended in ``state`` with usage (as the
    tracker records it)."""
    request = batch_request(f"u-{uuid.uuid4().hex[:8]}", tenant=tenant, requests=inline_lines(3))
    key, value, headers = request_message(request)
    topics = w.kafka.topics
    rules = IntakeRules(
        requests_topic=topics.requests,
        dlt_topic=topics.dead_letter,
        group_id="g-usage",
        served_models=frozenset({MODEL}),
        inline_limits=InlineLimits(max_requests=1000, max_bytes=2_000_000),
    )
    origin = OriginalRecord(topics.requests, 0, n, key, value, tuple(headers), int(time.time() * 1000), 0)
    accept = classify(origin, rules, time.time())
    assert isinstance(accept, Accept)
    assert (await w.store.intake(accept.item)).is_new
    bkey = batch_key(tenant, request.batch_id)
    failed = n % 3
    outcome = Outcome(
        state,
        time.time(),
        counts={"total": 3, "completed": 3 - failed, "failed": failed},
        usage={"prompt_tokens": 100 + 7 * n, "completion_tokens": 11 * n},
        started_at=time.time() - 5,
        error_code="engine_error" if state is State.FAILED else None,
        error_message="boom" if state is State.FAILED else None,
    )
    for step in PATHS[state]:
        record = await w.store.get(bkey)
        assert record is not None
        fields = terminal_fields(record, outcome) if step is state else {"attempt": "1"}
        assert (await w.store.transition(bkey, step, expected_version=record.version, fields=fields)).ok
    return bkey


async def test_each_tenants_usage_report_is_the_sum_of_its_terminal_events(
    settings: LLMBatchSettings,
    worlds: list[World],  # noqa: F811
) -> None:
    topics = topic_settings()
    w = await make_world(settings, topics)
    worlds.append(w)
    plan = [("acme", State.COMPLETED)] * 3 + [("acme", State.FAILED), ("acme", State.CANCELLED)]
    plan += [("globex", State.COMPLETED), ("globex", State.EXPIRED)]
    for n, (tenant, state) in enumerate(plan):
        await _ended(w, tenant, state, n)
    assert await w.publisher.publish_pending() == len(plan)

    # what the terminal events announce, summed by tenant, model and status
    announced: dict[str, Counter[tuple[str, str, str]]] = {"acme": Counter(), "globex": Counter()}
    for event in decode_results(await w.reader(topics.results).read_to_end()):
        if event.is_terminal:
            d = event.data
            into, k = announced[d.tenant], (d.model, d.status.value)
            for name, value in (
                ("batches", 1),
                ("requests", d.request_counts.total),
                ("completed", d.request_counts.completed),
                ("failed", d.request_counts.failed),
                ("prompt_tokens", d.usage.prompt_tokens),
                ("completion_tokens", d.usage.completion_tokens),
            ):
                into[(*k, name)] += value
    today = datetime.now(UTC).date()
    for tenant, expected in announced.items():
        rows = totals(await usage.tenant_usage(w.store.client, w.store.keys, tenant, today, today))
        recorded = Counter(
            {
                (r.model, r.status, c): getattr(r, c)
                for r in rows
                for c in ("batches", "requests", "completed", "failed", "prompt_tokens", "completion_tokens")
            }
        )
        assert +recorded == +expected, tenant
    assert await usage.tenants(w.store.client, w.store.keys) == ["acme", "globex"]

    # publishing a terminal event again (a crash after it went out, a reconcile) counts nothing twice
    record = await w.store.get(batch_key("acme", (await _first_acme(w)).batch_id))
    assert record is not None
    again = await w.store.mark_published(
        record.key, record.get("terminal_event_id") or "", ended_at=time.time()
    )
    assert again == "ok"
    rows = totals(await usage.tenant_usage(w.store.client, w.store.keys, "acme", today, today))
    assert sum(r.batches for r in rows) == 5

    # the metrics say the same (tenants outside the configured set would be "other")
    sample = w.metrics.registry.get_sample_value
    assert sample(
        "llmbatch_tenant_tokens_total", {"tenant": "other", "model": MODEL, "kind": "prompt"}
    ) == sum(v for (m, s, c), v in (announced["acme"] + announced["globex"]).items() if c == "prompt_tokens")

    # the operator's CLI and the tenant's own endpoint read the same record
    cli_settings = LLMBatchSettings(
        redis=settings.redis.model_copy(update={"key_prefix": w.store.keys.prefix})
    )
    shown = await asyncio.to_thread(CliRunner().invoke, usage_cli.app, ["--json"], obj=cli_settings)
    assert shown.exit_code == 0, shown.output
    by_cli = {(r["tenant"], r["model"], r["status"]): r for r in orjson.loads(shown.stdout)}
    assert {k: v["completion_tokens"] for k, v in by_cli.items()} == {
        (t, m, s): n
        for t, c in announced.items()
        for (m, s, name), n in c.items()
        if name == "completion_tokens"
    }
    # a client of its own: the app runs on the test client's event loop, not this one
    api_store = StateStore.from_url(settings.redis.url, keys=w.store.keys)
    api = make_api(usage=RedisUsage(api_store.client, api_store.keys))
    start = int(datetime(today.year, today.month, today.day, tzinfo=UTC).timestamp())
    answer = await asyncio.to_thread(
        api.client.get, f"/v1/usage?start_time={start}&end_time={start + 86400}", headers=api.auth("acme")
    )
    assert answer.status_code == 200, answer.text
    (bucket,) = answer.json()["data"]
    assert bucket["start_time"] == start and bucket["end_time"] == start + 86400
    got = Counter({(r["model"], r["status"], "prompt_tokens"): r["input_tokens"] for r in bucket["results"]})
    assert got == Counter({k: v for k, v in announced["acme"].items() if k[2] == "prompt_tokens"})


async def _first_acme(w: World) -> Any:
    for event in decode_results(await w.reader(w.kafka.topics.results).read_to_end()):
        if event.is_terminal and event.data.tenant == "acme":
            return event.data
    raise AssertionError("no acme event")
