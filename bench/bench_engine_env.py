"""Benchmark: plain ``LLM.chat`` under the engine environments, alone and beside other work.

    .venv/bin/python bench/bench_engine_env.py [--prompts 256] [--reps 2] [--background 0,0.5]
        [--variants inproc,vllm-procs] [--json]

Each run is a fresh process (bench_ray_job's plain worker: engine start, then ``llm.chat`` on the
same chat prompts, greedy, 32 tokens) with the project's engine environment
(``llmbatch.ray_job.engines.engine_env``) and one variant on top:

- ``inproc``: the environment as shipped on CPU (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine
  core and the model run in the calling process, ``OMP_NUM_THREADS`` threads, here 1 as a Ray
  actor with ``num_cpus: 1`` gets);
- ``vllm-procs``: vLLM's own CPU default (an EngineCore process, a worker process whose OpenMP
  thread is pinned to one core, the other core reserved for the EngineCore, which busy-polls the
  worker);
- ``nobind``: vLLM's processes without pinning (``VLLM_CPU_OMP_THREADS_BIND=nobind``);
- ``inproc2``, ``inproc2-bt5``, ``inproc2-bt0``: in-process on 2 OpenMP threads, with Intel OpenMP's
  default ``KMP_BLOCKTIME`` (a thread spins 200 ms after each parallel region before it sleeps),
  5 ms (what vLLM sets for its pinned workers) and 0;
- ``inproc2-bfloat16``, ``inproc2-float32``: in-process on 2 threads in that dtype (every other variant
  computes in what ``dtype: auto`` gives the service's engine on this CPU);
- ``inproc2-512``: in-process on 2 threads, steps of at most 512 tokens (``max_num_batched_tokens``, as
  the local stack's engine; every other variant takes vLLM's default).
- ``split2x1``: two in-process engines on 1 thread each, at once, each on every other prompt: output
  tokens of both / (first start -> last end of their ``llm.chat``; their starts are not synchronised,
  so an engine that starts late counts against the variant). Two engines do not wait for each other
  at OpenMP barriers, where one engine's two threads do whenever other work takes a core from one.

``--background`` (cores, in steps of 0.25) starts that many processes that each wake every 10 ms
and compute for 2.5 ms, the way a service's many small threads load the machine (Kafka, Ray, a
dispatcher, a batch runner), for the length of the run. Runs are interleaved ``--reps`` times;
compare within a run (this machine is shared and noisy). Prints output tok/s, engine start and the
1-minute load of each run. Not a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_ray_job import input_lines, prompts, run_plain  # noqa: E402

VARIANTS: dict[str, dict[str, str]] = {
    "inproc": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"},
    "vllm-procs": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    "nobind": {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    },
}
# in-process on 2 threads (what --omp-threads 2 gives a replica), with Intel OpenMP's default 200 ms
# of spinning after each parallel region, vLLM's 5 ms (it sets it for pinned workers), none
VARIANTS["inproc2"] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2"}
for _ms in ("5", "0"):
    VARIANTS[f"inproc2-bt{_ms}"] = {**VARIANTS["inproc2"], "KMP_BLOCKTIME": _ms}
# the same with the dtype named (the others compute in what `dtype: auto` gives the service's engine on
# this CPU: float32 without bfloat16 instructions, see llmbatch.ray_job.engines.cpu_dtype)
for _dtype in ("bfloat16", "float32"):
    VARIANTS[f"inproc2-{_dtype}"] = {**VARIANTS["inproc2"], "BENCH_PLAIN_DTYPE": _dtype}
# steps of at most 512 tokens, as the local stack's engine takes them (the others: vLLM's default)
VARIANTS["inproc2-512"] = {**VARIANTS["inproc2"], "BENCH_PLAIN_MAX_BATCHED_TOKENS": "512"}
# several engines at once: variant -> (engines, the variant each runs)
SPLITS: dict[str, tuple[int, str]] = {"split2x1": (2, "inproc")}
BURN_S, PERIOD_S = 0.0025, 0.010


def run_split(model: str, path: Path, engines: int, env: dict[str, str]) -> dict[str, Any]:
    """``engines`` plain workers at once, each on every ``engines``-th line of ``path``, as one run."""
    from concurrent.futures import ThreadPoolExecutor

    lines = path.read_text().splitlines(keepends=True)
    parts = []
    for i in range(engines):
        part = path.with_name(f"{path.stem}-part{i}.jsonl")
        part.write_text("".join(lines[i::engines]))
        parts.append(part)
    with ThreadPoolExecutor(engines) as pool:
        outs = list(pool.map(lambda part: run_plain(model, part, 2048, env), parts))
    return {
        "output_tokens": sum(out["output_tokens"] for out in outs),
        "generation_s": max(out["ended"] for out in outs) - min(out["began"] for out in outs),
        "engine_start_s": max(out["engine_start_s"] for out in outs),
    }


def burner(stop: Any) -> None:
    """A quarter of a core in short bursts."""
    while not stop.is_set():
        end = time.perf_counter() + BURN_S
        while time.perf_counter() < end:
            pass
        time.sleep(PERIOD_S - BURN_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--background", default="0,0.5", help="cores of background work per run")
    parser.add_argument("--variants", default="inproc,vllm-procs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS) - set(SPLITS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join([*VARIANTS, *SPLITS])}")
    backgrounds = [float(b) for b in args.background.split(",") if b]

    from llmbatch.stack.model import ensure_model

    model = str(ensure_model())
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-engine-env-") as tmp:
        path = Path(tmp) / "input.jsonl"
        path.write_text(
            "".join(json.dumps(line) + "\n" for line in input_lines(prompts(args.prompts), args.max_tokens))
        )
        for rep in range(args.reps):
            runs = [(v, b) for v in variants for b in backgrounds]
            for variant, background in runs if rep % 2 == 0 else runs[::-1]:
                stop = mp.Event()
                burners = [
                    mp.Process(target=burner, args=(stop,), daemon=True)
                    for _ in range(round(background / (BURN_S / PERIOD_S)))
                ]
                for p in burners:
                    p.start()
                load = os.getloadavg()[0]
                try:
                    if variant in SPLITS:
                        engines, each = SPLITS[variant]
                        out = run_split(model, path, engines, VARIANTS[each])
                    else:
                        out = run_plain(model, path, 2048, VARIANTS[variant])
                finally:
                    stop.set()
                    for p in burners:
                        p.join()
                row = {
                    "tok_s": round(out["output_tokens"] / out["generation_s"], 1),
                    "generation_s": round(out["generation_s"], 1),
                    "engine_start_s": round(out["engine_start_s"], 1),
                    "load1": round(load, 2),
                }
                results.setdefault(f"{variant} bg {background}", []).append(row)
                print(
                    f"rep {rep} {variant:10} background {background:4} cores: {row}",
                    file=sys.stderr,
                    flush=True,
                )
    print(f"plain LLM.chat, {args.prompts} prompts, {args.max_tokens} tokens, {args.reps} reps interleaved")
    for name, rows in results.items():
        print(
            f"  {name:24} {statistics.fmean(r['tok_s'] for r in rows):7.1f} tok/s "
            f"({', '.join(str(r['tok_s']) for r in rows)}), engine start "
            f"{statistics.fmean(r['engine_start_s'] for r in rows):5.1f} s, load1 "
            f"{', '.join(str(r['load1']) for r in rows)}"
        )
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
