"""The ray_job pipeline with REAL vLLM (CPU build, SmolLM2-135M-Instruct) through the Ray Jobs API.

Two engine starts in all (each costs 50-90 s here), one per way a job can reach vLLM:

* own engine: ``test_inline_completions`` runs a job without ``engine_app``, whose engine stage
  starts a vLLM engine of its own (the path without shared engines);
* shared engine: the module deploys the model's shared engine once, as the dispatcher does (a Ray
  Serve application of :mod:`llmbatch.ray_job.engines.serve_engine`, deployed from
  :func:`llmbatch.dispatcher.backends.engines.serve_config` through
  :class:`llmbatch.dispatcher.backends.serve_api.ServeApi`),
  and the
  20-line file and the stop + resume tests run their jobs on it (``spec.engine_app``). Each of them
  checks on the replica that its requests ran there and that no engine was started or replaced.

The shared engine is deployed as the module starts and comes up while the own-engine test (first)
runs; it is removed at the end of the module.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from ray.job_submission import JobStatus

from llmbatch.dispatcher.backends.engines import replica_pids, serve_config
from llmbatch.dispatcher.backends.serve_api import ServeApi
from llmbatch.schemas.common import BatchStatus
from llmbatch.schemas.engines import (
    DEPLOYMENT_NAME,
    EngineModel,
    EngineRegistry,
    ReplicaResources,
    Scaling,
    app_name,
)
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import RaySettings, RedisSettings, S3Settings
from llmbatch.stack.model import ensure_model
from tests.integration.ray_job_harness import CMPL, Harness, chat_line, completion_line, engine_vars

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"  # the harness's model name: the name the shared engine serves
ENGINE: dict[str, Any] = {
    "backend": "vllm",
    "enforce_eager": True,
    "dtype": "auto",
    "max_model_len": 1024,
    "num_cpus_per_replica": 1.0,
    "engine_kwargs": {"max_logprobs": 2},
    "batch_size": 8,
}
# the replica's Ray reservation only (Ray gives it OMP_NUM_THREADS=1, as it gives the jobs' 1-CPU
# engine actors): small, so a job with an engine of its own (1 CPU + its stages) fits beside it
# on the 2-CPU head
SHARED_CPUS = 0.25
# Ray job asking the replica for its counters (EngineServer.info); writes one PROBE line in one call,
# after a newline (see tests/integration/test_serve_engine.py's EMIT)
INFO_PROBE = (
    "import sys, orjson; from ray import serve; "
    "h = serve.get_deployment_handle(sys.argv[1], app_name=sys.argv[2]); "
    "sys.stdout.write('\\nPROBE ' + orjson.dumps(h.info.remote().result(timeout_s=120)).decode() + '\\n'); "
    "sys.stdout.flush()"
)


@pytest.fixture(scope="module")
def h(s3_settings: S3Settings, ray_settings: RaySettings, redis_settings: RedisSettings) -> Harness:
    return Harness(s3_settings, ray_settings, redis_settings)


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(ensure_model())


@dataclass
class SharedEngine:
    """The module's shared vLLM engine (one replica) and how to look at it."""

    api: ServeApi
    h: Harness
    _last: dict[str, Any] | None = None

    @property
    def app(self) -> str:
        return app_name(MODEL)

    def replicas(self) -> list[int]:
        return replica_pids(asyncio.run(self.api.status()), MODEL)

    def info(self) -> dict[str, Any]:
        """The replica's ``EngineServer.info()`` (requests answered so far, when it started), asked
        by a Ray job as a batch would (~10 s here)."""
        job_id = f"engine-info-{uuid.uuid4().hex[:8]}"
        self.h.client.submit_job(
            submission_id=job_id,
            entrypoint=f"{shlex.quote(sys.executable)} -P -c {shlex.quote(INFO_PROBE)} "
            f"{DEPLOYMENT_NAME} {self.app}",
            entrypoint_num_cpus=0,
        )
        status = self.h.wait(job_id, timeout=300)
        logs = self.h.client.get_job_logs(job_id)
        lines = [ln for ln in logs.splitlines() if ln.startswith("PROBE ")]
        assert status == JobStatus.SUCCEEDED and lines, logs[-3000:]
        info: dict[str, Any] = orjson.loads(lines[-1][len("PROBE ") :])
        self._last = info
        return info

    def ran(self) -> None:
        """Work ran on the engine since the last :meth:`info`: the next :meth:`before` asks again."""
        self._last = None

    def before(self) -> dict[str, Any]:
        """:meth:`info` as a test starts: the last answer when nothing ran on the engine since
        (each test asks once more at its end), else a fresh one."""
        last, self._last = self._last, None
        return last if last is not None else self.info()


def _uses_shared(request: pytest.FixtureRequest) -> bool:
    return any(
        "shared" in getattr(item, "fixturenames", ())
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.module is request.module
    )


@pytest.fixture(scope="module", autouse=True)
def shared_deploy(
    request: pytest.FixtureRequest, ray_settings: RaySettings, model_path: str
) -> Iterator[ServeApi | None]:
    """Deploys the model's shared engine as the module starts, when one of its selected tests uses
    it, with the jobs' engine settings and engine environment (``VLLM_CPU_KVCACHE_SPACE``, caches,
    offline); it starts while the own-engine test runs. Removed again at the end of the module."""
    if not _uses_shared(request):
        yield None
        return
    registry = EngineRegistry(
        models={
            MODEL: EngineModel(
                path=model_path,
                engine=EngineConfig(**ENGINE),
                resources=ReplicaResources(num_cpus=SHARED_CPUS),
                scaling=Scaling(min_replicas=1, max_replicas=1, idle_s=3600),
                # 8 at once: a batch alone keeps twice that in calls of batch_size 4 (call_rows), so the
                # stop test's batch has 4 calls of 4 at the engine and work left after its first shards
                max_active_requests=8,
            )
        }
    )
    api = ServeApi(ray_settings.address, timeout_s=120)
    http = ray_settings.serve_address
    asyncio.run(api.deploy(serve_config(registry, engine_vars(), http_address=http)))
    try:
        yield api
    finally:
        # the same HTTP options as every deploy of this cluster (Serve keeps the first ones)
        asyncio.run(api.deploy(serve_config(EngineRegistry(models={}), http_address=http)))
        deadline = time.monotonic() + 120
        while app_name(MODEL) in (asyncio.run(api.status()).get("applications") or {}):
            if time.monotonic() > deadline:
                break  # best effort: the session's Ray head goes away at the end anyway
            time.sleep(1)


@pytest.fixture(scope="module")
def shared(h: Harness, shared_deploy: ServeApi | None) -> SharedEngine:
    """The shared engine, once its replica runs."""
    api = shared_deploy
    assert api is not None
    deadline = time.monotonic() + 900
    while True:
        details = asyncio.run(api.status())
        app = (details.get("applications") or {}).get(app_name(MODEL)) or {}
        status = app.get("status")
        if status == "RUNNING" and len(replica_pids(details, MODEL)) == 1:
            break
        assert status not in ("DEPLOY_FAILED", "UNHEALTHY"), app
        assert time.monotonic() < deadline, f"the shared engine did not start: {app}"
        time.sleep(1)
    engine = SharedEngine(api, h)
    engine.info()
    return engine


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Give one tip for writing clean code.",
    "Name a planet in our solar system.",
    "Translate 'good morning' into Spanish.",
    "What is Kafka used for?",
    "Describe a cat in one sentence.",
    "What color is the sky?",
    "Say hello.",
    "What is the opposite of hot?",
]


def test_inline_completions(h: Harness, model_path: str) -> None:
    """The own-engine path: no ``engine_app``, the job starts (and times) a vLLM engine itself."""
    prompts = [
        "The capital of France is",
        "1, 2, 3, 4,",
        "Once upon a time",
        "The sky is",
        "def add(a, b):",
        "Water boils at",
    ]
    requests = [completion_line(f"c{i}", p, max_tokens=8, temperature=0.0) for i, p in enumerate(prompts)]
    requests[1]["body"]["logprobs"] = 2
    requests[2]["body"]["stop"] = ["."]
    spec = h.spec(
        "vllm-inline-cmpl",
        endpoint=CMPL,
        requests=requests,
        model_path=model_path,
        engine=EngineConfig(**ENGINE),
    )
    assert spec.engine_app is None
    status, result = h.run(spec, timeout=900)
    assert status == JobStatus.SUCCEEDED, h.logs_tail(spec.submission_id)
    manifest = h.manifest(spec)
    assert manifest.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0}
    assert manifest.error_uris == []
    outputs = {o["custom_id"]: o["response"]["body"] for o in h.lines(manifest.output_uris)}
    assert sorted(outputs) == [f"c{i}" for i in range(6)]
    for body in outputs.values():
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"].strip()
        assert 0 < body["usage"]["completion_tokens"] <= 8 and body["usage"]["prompt_tokens"] > 0
    lp = outputs["c1"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == outputs["c1"]["usage"]["completion_tokens"]
    assert "".join(lp["tokens"]) == outputs["c1"]["choices"][0]["text"]
    assert "." not in outputs["c2"]["choices"][0]["text"]
    assert result["usage"]["completion_tokens"] == sum(
        b["usage"]["completion_tokens"] for b in outputs.values()
    )
    # the job started an engine of its own, and timed it
    assert manifest.timings.engine_start_s and manifest.timings.engine_start_s > 1


def test_20_line_file_exact_counts_codes_text_and_usage(
    h: Harness, model_path: str, shared: SharedEngine
) -> None:
    from transformers import AutoTokenizer

    [replica] = shared.replicas()
    before = shared.before()
    good = [chat_line(f"q{i:02d}", q, max_tokens=16, temperature=0.0) for i, q in enumerate(QUESTIONS)]
    good[3]["body"].update(temperature=0.8, seed=7)
    good[4]["body"]["stop"] = ["\n"]
    lines: list[dict[str, Any] | bytes] = [
        *good,
        chat_line("lp", "Say yes.", max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2),  # 13
        b'{"custom_id": "broken", "method": "POST",',  # 14 invalid JSON
        {
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "no id"}]},
        },  # 15 missing custom_id
        chat_line("q00", "duplicate id"),  # 16 duplicate custom_id
        {"custom_id": "emb", "method": "POST", "url": "/v1/moderations", "body": {"input": "x"}},  # 17 url
        {**chat_line("get", "wrong method"), "method": "GET"},  # 18 method
        chat_line("long", "word " * 1500, max_tokens=8),  # 19 longer than max_model_len 1024
        chat_line("engine", "Say no.", max_tokens=4, logprobs=True, top_logprobs=5),  # 20 vLLM refuses it
    ]
    assert len(lines) == 20
    spec = h.spec(
        "vllm-20",
        input_uri=h.put_input("twenty.jsonl", lines),
        model_path=model_path,
        engine=EngineConfig(**ENGINE),
        engine_app=shared.app,
        engine_wait_s=300,
    )
    status, result = h.run(spec, timeout=900)
    assert status == JobStatus.SUCCEEDED, h.logs_tail(spec.submission_id)
    assert result["exit_code"] == 0 and result["status"] == "completed"

    manifest = h.manifest(spec)
    assert manifest.request_counts.model_dump() == {"total": 20, "completed": 13, "failed": 7}
    assert result["request_counts"] == manifest.request_counts.model_dump()
    errors = {e["error"]["line"]: e for e in h.lines(manifest.error_uris)}
    assert {n: e["error"]["code"] for n, e in errors.items()} == {
        14: "invalid_json_line",
        15: "missing_required_parameter",
        16: "duplicate_custom_id",
        17: "invalid_value",
        18: "invalid_value",
        19: "context_length_exceeded",
        20: "engine_error",
    }
    assert errors[16]["custom_id"] == "q00" and errors[14]["custom_id"] == "@line-14"
    assert errors[19]["response"]["status_code"] == 400 and "1024" in errors[19]["error"]["message"]
    assert errors[20]["response"]["status_code"] == 400 and "logprobs" in errors[20]["error"]["message"]
    assert errors[14]["response"] is None

    tok = AutoTokenizer.from_pretrained(model_path)
    outputs = {o["custom_id"]: o for o in h.lines(manifest.output_uris)}
    assert sorted(outputs) == sorted([f"q{i:02d}" for i in range(12)] + ["lp"])
    logprob_line = lines[12]
    assert isinstance(logprob_line, dict)
    by_id = {line["custom_id"]: line for line in [*good, logprob_line]}  # first occurrences only
    for custom_id, out in outputs.items():
        assert out["response"]["status_code"] == 200 and out["error"] is None
        body = out["response"]["body"]
        choice = body["choices"][0]
        assert body["object"] == "chat.completion" and body["model"] == spec.model
        assert choice["message"]["content"].strip(), (custom_id, choice)
        usage = body["usage"]
        messages = by_id[custom_id]["body"]["messages"]
        encoded: Any = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        expected_prompt = len(encoded["input_ids"])
        assert usage["prompt_tokens"] == expected_prompt, (custom_id, usage)
        limit = by_id[custom_id]["body"]["max_tokens"]
        assert 0 < usage["completion_tokens"] <= limit
        assert choice["finish_reason"] in {"stop", "length"}
        if choice["finish_reason"] == "length":
            assert usage["completion_tokens"] == limit
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "\n" not in outputs["q04"]["response"]["body"]["choices"][0]["message"]["content"].strip()
    logprobs = outputs["lp"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(logprobs) == outputs["lp"]["response"]["body"]["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) <= 2 and t["logprob"] <= 0 for t in logprobs)
    assert manifest.usage.prompt_tokens == sum(
        o["response"]["body"]["usage"]["prompt_tokens"] for o in outputs.values()
    )
    assert manifest.usage.completion_tokens == sum(
        o["response"]["body"]["usage"]["completion_tokens"] for o in outputs.values()
    )
    # greedy requests are deterministic: the same question twice gives the same text
    texts = [o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs.values()]
    assert len(set(texts)) > 5

    # it all ran on the shared engine: its 13 answers + the one vLLM refused (line 19 never left
    # the job: too long for the engine's context), on the same replica, which started no engine
    after = shared.info()
    assert after["requests"] - before["requests"] == 14, (before, after)
    assert after["completion_tokens"] - before["completion_tokens"] == manifest.usage.completion_tokens
    assert after["ready_at"] == before["ready_at"] and shared.replicas() == [replica]
    assert manifest.timings.engine_start_s is not None and manifest.timings.engine_start_s < 60


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
UNKNOWN_FORMAT = {"type": "string", "format": "no-such-format"}  # valid JSON, but xgrammar cannot compile it


def test_structured_outputs_and_logit_bias_and_a_bad_schema_or_token_fails_its_line_only(
    h: Harness, model_path: str, shared: SharedEngine
) -> None:
    import jsonschema
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    forced = tok.encode(" banana", add_special_tokens=False)[0]

    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    lines: list[dict[str, Any] | bytes] = [
        *(
            chat_line(
                f"person-{i}",
                f"Describe {who} as JSON.",
                max_tokens=200,
                temperature=0.0,
                response_format=person,
            )
            for i, who in enumerate(["a baker", "a pilot", "a child"])
        ),
        chat_line(
            "object",
            'Answer with a JSON object like {"colour": "red"}.',
            max_tokens=200,
            temperature=0.0,
            response_format={"type": "json_object"},
        ),
        chat_line(
            "bad-schema",
            "Anything.",
            max_tokens=16,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": UNKNOWN_FORMAT}},
        ),
        chat_line("text", "Say hello.", max_tokens=8, response_format={"type": "text"}),
        chat_line("bias", "Name a colour.", max_tokens=3, temperature=0.0, logit_bias={str(forced): 100}),
        chat_line("bad-token", "Name a colour.", max_tokens=3, logit_bias={"999999999": 5}),  # > vocab
    ]
    spec = h.spec(
        "vllm-structured",
        input_uri=h.put_input("structured.jsonl", lines),
        model_path=model_path,
        engine=EngineConfig(**ENGINE),
        engine_app=shared.app,
        engine_wait_s=300,
    )
    status, _ = h.run(spec, timeout=900)
    assert status == JobStatus.SUCCEEDED, h.logs_tail(spec.submission_id)
    manifest = h.manifest(spec)
    assert manifest.request_counts.model_dump() == {"total": 8, "completed": 6, "failed": 2}
    errors = {e["custom_id"]: e for e in h.lines(manifest.error_uris)}
    assert errors["bad-schema"]["error"]["code"] == "invalid_response_format"
    assert errors["bad-schema"]["response"]["status_code"] == 400
    assert "format" in errors["bad-schema"]["error"]["message"]
    assert errors["bad-token"]["response"]["status_code"] == 400, errors["bad-token"]
    assert "999999999" in errors["bad-token"]["error"]["message"], errors["bad-token"]
    outputs = {o["custom_id"]: o["response"]["body"]["choices"][0] for o in h.lines(manifest.output_uris)}
    for custom_id in ("person-0", "person-1", "person-2"):
        choice = outputs[custom_id]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(orjson.loads(choice["message"]["content"]), PERSON)
    # json_object bounds nothing but the syntax: this small model may nest objects until max_tokens
    free = outputs["object"]
    assert free["message"]["content"].lstrip().startswith("{"), free
    if free["finish_reason"] == "stop":
        assert isinstance(orjson.loads(free["message"]["content"]), dict), free
    assert outputs["text"]["message"]["content"].strip()
    # +100 on one token: greedy decoding picks it every time
    assert outputs["bias"]["message"]["content"] == tok.decode([forced] * 3), outputs["bias"]
    shared.ran()


def test_stop_midway_then_attempt_2_each_custom_id_exactly_once(
    h: Harness, model_path: str, shared: SharedEngine
) -> None:
    [replica] = shared.replicas()
    before = shared.before()
    n = 32
    uri = h.put_input(
        "resume.jsonl",
        [
            chat_line(f"r{i:02d}", f"Tell me a fact about the number {i}.", max_tokens=24, temperature=0.0)
            for i in range(n)
        ],
    )
    # 4 calls of 4 requests on the engine at once (8 slots: call_rows): the stop always finds work in
    # flight
    engine = EngineConfig(**{**ENGINE, "batch_size": 4, "batches_in_flight": 4})
    first = h.spec(
        "vllm-resume",
        input_uri=uri,
        model_path=model_path,
        engine=engine,
        shard_max_lines=4,
        engine_app=shared.app,
        engine_wait_s=300,
    )
    sid = h.submit(first)
    deadline = time.monotonic() + 600
    while sum("/output-a1-" in o for o in h.objects(first)) < 2:
        assert time.monotonic() < deadline, h.logs_tail(sid)
        assert not h.client.get_job_status(sid).is_terminal(), h.logs_tail(sid)
        time.sleep(0.3)
    h.client.stop_job(sid)
    assert h.wait(sid) == JobStatus.STOPPED
    done_by_1 = sum(s.lines for s in h.manifest(first).output_shards)
    assert 8 <= done_by_1 < n, done_by_1

    # attempt 2 reuses the spec, so the batch's group on the engine too: a call attempt 1 left
    # on the replica finishes there unread, and none of its answers may reach attempt 2's shards
    second = first.model_copy(update={"attempt": 2})
    status, result = h.run(second, timeout=900)
    assert status == JobStatus.SUCCEEDED, h.logs_tail(second.submission_id)
    manifest = h.manifest(second)
    assert manifest.status == BatchStatus.COMPLETED
    assert manifest.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
    outputs = h.lines(manifest.output_uris)
    assert Counter(o["custom_id"] for o in outputs) == Counter({f"r{i:02d}": 1 for i in range(n)})
    assert all(o["response"]["body"]["choices"][0]["message"]["content"].strip() for o in outputs)
    assert sum(s.lines for s in manifest.output_shards if s.attempt == 1) == done_by_1
    assert manifest.attempts[-1].completed == n - done_by_1
    assert result["request_counts"]["completed"] == n

    # both attempts ran on the shared engine (the stop ended the job, not the engine): every line
    # was answered there at least once (lines in flight at the stop twice)
    after = shared.info()
    assert after["requests"] - before["requests"] >= n, (before, after)
    assert after["ready_at"] == before["ready_at"] and shared.replicas() == [replica]
