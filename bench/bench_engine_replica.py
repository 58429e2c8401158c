"""Benchmark: the shared engine's Serve replica alone on a bare Ray head vs plain vLLM (issue 11's gap).

    .venv/bin/python bench/bench_engine_replica.py [--prompts 512] [--conc 4] [--max-tokens 32]
        [--reps 2] [--omp-threads 2] [--plain-reps 2] [--json]

The service's 4 x 128 batches generate slower than plain ``LLM.chat`` on this CPU. This separates the
engine's own surroundings from the service's: the same prompts, in one run,

- ``replica``: the model's Serve application as the local stack's dispatcher deploys it (the registry
  entry of ``llmbatch stack dispatcher``: ``max_num_batched_tokens`` 512, eager, bf16, the engine
  environment, ``--omp-threads`` threads) on a private Ray head where nothing else runs (no Kafka,
  Redis, MinIO, dispatcher, batch runner or Ray Data). This process calls it through a deployment handle
  (:class:`llmbatch.ray_job.engines.serve_client.ServeEngine`, as a batch does), ``--conc`` calls of
  equal size at once, the prompts tokenized here beforehand (as the prompt stage does): output tokens /
  wall time of the calls, ``--reps`` times on the warm replica;
- ``plain``: ``LLM.chat`` on the same prompts in a fresh process with the engine's environment, after the
  head is down (bench_ray_job's worker), ``--plain-reps`` times.

Prints tok/s per run, the ratio replica / plain, and the 1-minute load of each run. Everything started is
stopped by PID; the private run folder is removed. Compare with bench_service's throughput phase (the
whole service). Not a test.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_ray_job import input_lines, prompts, run_plain  # noqa: E402


def deploy_config(ray: Any, model_path: str, omp_threads: int) -> dict[str, Any]:
    """The local dispatcher's Serve config for the model alone (no batch runner)."""
    from llmbatch.dispatcher.backends.engines import cluster_serve_config
    from llmbatch.dispatcher.settings import DispatcherSettings
    from llmbatch.schemas.engines import EngineModel, EngineRegistry, ReplicaResources, Scaling
    from llmbatch.schemas.job import EngineConfig
    from llmbatch.stack.dispatcher_env import LOCAL_ENGINE, engine_cache_dir
    from llmbatch.stack.model import SERVED_MODEL

    entry = EngineModel(
        path=model_path,
        engine=EngineConfig.model_validate(LOCAL_ENGINE),
        resources=ReplicaResources(num_cpus=1.0, omp_threads=omp_threads or None),
        scaling=Scaling(min_replicas=1, max_replicas=1, idle_s=3600),
    )
    settings = DispatcherSettings.model_validate(
        {
            "ray": ray.model_dump(),
            "engines": EngineRegistry(models={SERVED_MODEL: entry}).model_dump(),
            "job": {"engine_cache_dir": str(engine_cache_dir())},
            "dispatcher": {"short_path_max_lines": 0},
        }
    )
    return cluster_serve_config(settings)


def requests_for(model_path: str, texts: list[str], max_tokens: int) -> list[Any]:
    from llmbatch.ray_job.engines.tokenizers import HFTokenizer
    from llmbatch.ray_job.lines.records import GenRequest

    tok = HFTokenizer(model_path)
    out = []
    for i, text in enumerate(texts):
        ids = tok.encode(tok.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)
        out.append(GenRequest(str(i), ids, {"n": 1, "temperature": 0.0, "max_tokens": max_tokens}))
    return out


def run_calls(engine: Any, requests: list[Any], conc: int) -> dict[str, float]:
    """``conc`` calls of equal size at once (one group each, as batches): output tok/s of the wall time."""
    size = -(-len(requests) // conc)
    chunks = [requests[i : i + size] for i in range(0, len(requests), size)]
    load = os.getloadavg()[0]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(chunks)) as pool:
        outs = list(pool.map(lambda c: engine.generate(c[1], group=f"b{c[0]}"), enumerate(chunks)))
    seconds = time.perf_counter() - started
    tokens = sum(g.completion_tokens for out in outs for g in out)
    failed = sum(1 for out in outs for g in out if g.failure is not None)
    return {
        "s": round(seconds, 2),
        "tokens": tokens,
        "tok_s": round(tokens / seconds, 1),
        "failed": failed,
        "load1": round(load, 2),
    }


def replica_runs(args: argparse.Namespace, model_path: str, texts: list[str]) -> list[dict[str, float]]:
    import asyncio

    import ray

    from llmbatch.dispatcher.backends.serve_api import ServeApi
    from llmbatch.ray_job.engines.serve_client import ServeEngine
    from llmbatch.schemas.engines import app_name
    from llmbatch.stack import manager
    from llmbatch.stack.model import SERVED_MODEL

    run = ROOT / "run" / f"bench-replica-{uuid.uuid4().hex[:6]}"
    requests = requests_for(model_path, texts, args.max_tokens)
    rows: list[dict[str, float]] = []
    try:
        state = manager.up(run, ["ray"])
        settings = manager.settings_for(state)
        api = ServeApi.of(settings.ray, timeout_s=120)
        asyncio.run(api.deploy(deploy_config(settings.ray, model_path, args.omp_threads)))
        app = app_name(SERVED_MODEL)
        deadline = time.monotonic() + 900
        while (asyncio.run(api.status()).get("applications") or {}).get(app, {}).get("status") != "RUNNING":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{app} did not start within 900 s")
            time.sleep(2)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(
            address=state.services["ray"].extra["gcs_address"],
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
        try:
            engine = ServeEngine(app, wait_s=900)
            run_calls(engine, requests[:32], 1)  # warm-up: first steps allocate and fill caches
            for rep in range(args.reps):
                row = run_calls(engine, requests, args.conc)
                rows.append(row)
                print(f"replica rep {rep}: {row}", file=sys.stderr, flush=True)
        finally:
            ray.shutdown()
            asyncio.run(api.deploy({"applications": []}))
    finally:
        manager.down(run)
        shutil.rmtree(run, ignore_errors=True)
    return rows


def plain_runs(args: argparse.Namespace, model_path: str, texts: list[str]) -> list[dict[str, float]]:
    from llmbatch.stack.dispatcher_env import LOCAL_ENGINE

    rows: list[dict[str, float]] = []
    env = {"OMP_NUM_THREADS": str(args.omp_threads)} if args.omp_threads else {}
    with tempfile.TemporaryDirectory(prefix="bench-replica-") as tmp:
        path = Path(tmp) / "input.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in input_lines(texts, args.max_tokens)))
        for rep in range(args.plain_reps):
            load = os.getloadavg()[0]
            result = run_plain(model_path, path, int(str(LOCAL_ENGINE["max_model_len"])), env)
            seconds, tokens = result["generation_s"], result["output_tokens"]
            row = {
                "s": round(seconds, 2),
                "tokens": tokens,
                "tok_s": round(tokens / seconds, 1),
                "load1": round(load, 2),
            }
            rows.append(row)
            print(f"plain rep {rep}: {row}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--conc", type=int, default=4, help="calls at once (batches sharing the engine)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2, help="timed runs on the replica")
    parser.add_argument("--plain-reps", type=int, default=2, help="plain LLM.chat runs")
    parser.add_argument(
        "--omp-threads",
        type=int,
        default=0,
        help="engine threads (0: the local stack's, every core of this machine)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.prompts < 1 or args.conc < 1 or args.reps < 1 or args.plain_reps < 1:
        parser.error("--prompts, --conc, --reps and --plain-reps must be at least 1")

    from llmbatch.stack.dispatcher_env import local_engine_threads
    from llmbatch.stack.model import ensure_model

    args.omp_threads = args.omp_threads or local_engine_threads()
    model_path = str(ensure_model())
    texts = prompts(args.prompts)
    replica = replica_runs(args, model_path, texts)
    plain = plain_runs(args, model_path, texts)
    r, p = (statistics.fmean(x["tok_s"] for x in rows) for rows in (replica, plain))
    print(f"{args.prompts} chat prompts, max_tokens {args.max_tokens}, {args.omp_threads} engine threads")

    def runs(rows: list[dict[str, float]]) -> str:
        return (
            f"({', '.join(str(x['tok_s']) for x in rows)}; load1 {', '.join(str(x['load1']) for x in rows)})"
        )

    print(f"  replica ({args.conc} calls at once, bare Ray head): {r:7.1f} tok/s {runs(replica)}")
    print(f"  plain LLM.chat (fresh process, engine env):        {p:7.1f} tok/s {runs(plain)}")
    print(f"  replica / plain: {r / p:.2f}x")
    if args.json:
        print(json.dumps({"replica": replica, "plain": plain, "ratio": round(r / p, 3)}, indent=2))


if __name__ == "__main__":
    main()
