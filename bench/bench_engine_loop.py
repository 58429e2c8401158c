"""Benchmark: where a shared engine's throughput goes, side by side on ONE vLLM engine, in one process.

    .venv/bin/python bench/bench_engine_loop.py [--prompts 512] [--max-tokens 32] [--reps 2]
        [--modes chat,ids,runner,window,4x128] [--budgets 512,0] [--json]

The same prompts (bench_ray_job's chat prompts, greedy) run on the same engine in several ways,
interleaved ``--reps`` times (this machine is noisy: compare within a run, read the ratios):

- ``chat``: plain ``LLM.chat`` (vLLM tokenizes and steps; what bench_service calls "plain").
- ``ids``: ``LLM.generate`` on the token ids our prompt stage makes (vLLM's loop, no tokenizing).
- ``runner``: :class:`llmbatch.ray_job.engines.engine_runner.EngineRunner` with the registry's
  ``max_active`` (256), all prompts in one call (our step loop and fair queue instead of vLLM's).
- ``window``: the batch runner's windows: calls of ``--batch-size`` prompts, ``--in-flight`` at
  once, the oldest awaited before the next is sent (as ``llmbatch.ray_job.batch_runner.runner``
  does), one group.
- ``4x128``: ``--conc`` calls of equal size at once, one group each (four batches sharing).

``--budgets``: one engine per ``max_num_batched_tokens`` (0 = vLLM's default), each built as the
local stack's registry entry builds it (eager, bf16, max_model_len 2048). Prints output tok/s per
mode and engine, the engine steps and the 1-minute load. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_ray_job import engine_environment, prompts  # noqa: E402

MAX_MODEL_LEN = 2048
MODES = ("chat", "ids", "runner", "window", "4x128")


class Counted:
    """A backend that counts its steps and the time spent in them."""

    def __init__(self, backend: Any) -> None:
        self.inner = backend
        self.max_model_len = backend.max_model_len
        self.default_max_tokens = backend.default_max_tokens
        self.steps = 0
        self.step_s = 0.0

    def add(self, request: Any) -> None:
        self.inner.add(request)

    def abort(self, keys: list[str]) -> None:
        self.inner.abort(keys)

    def has_unfinished(self) -> bool:
        return bool(self.inner.has_unfinished())

    def step(self) -> list[Any]:
        began = time.perf_counter()
        out: list[Any] = self.inner.step()
        self.step_s += time.perf_counter() - began
        self.steps += 1
        return out


def run_mode(
    mode: str, backend: Any, counted: Counted, requests: list[Any], convs: list[Any], args: argparse.Namespace
) -> tuple[float, int, int]:
    """(seconds, output tokens, engine steps seen by our loop) of one mode."""
    from vllm import SamplingParams

    from llmbatch.ray_job.engines.engine_runner import EngineRunner

    llm = backend._llm
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    counted.steps = 0
    began = time.perf_counter()
    if mode == "chat":
        done = llm.chat(convs, params, use_tqdm=False)
        return time.perf_counter() - began, sum(len(o.outputs[0].token_ids) for o in done), 0
    if mode == "ids":
        done = llm.generate(
            [{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False
        )
        return time.perf_counter() - began, sum(len(o.outputs[0].token_ids) for o in done), 0
    runner = EngineRunner(counted, max_active=args.max_active)
    tag = f"{mode}-{time.monotonic_ns()}-"
    reqs = [type(r)(tag + r.key, r.prompt_token_ids, r.sampling) for r in requests]
    if mode == "runner":
        gens = runner.generate(reqs, group="one")
    elif mode == "window":
        gens = []
        pool = ThreadPoolExecutor(max_workers=args.in_flight)
        pending: deque[Future[list[Any]]] = deque()
        for i in range(0, len(reqs), args.batch_size):
            pending.append(pool.submit(runner.generate, reqs[i : i + args.batch_size], group="one"))
            while len(pending) >= args.in_flight:
                gens.extend(pending.popleft().result())
        while pending:
            gens.extend(pending.popleft().result())
        pool.shutdown()
    elif mode == "4x128":
        size = -(-len(reqs) // args.conc)
        outs: list[list[Any]] = [[] for _ in range(args.conc)]
        threads = [
            threading.Thread(
                target=lambda i=i: outs[i].extend(
                    runner.generate(reqs[i * size : (i + 1) * size], group=f"batch{i}")
                )
            )
            for i in range(args.conc)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gens = [g for o in outs for g in o]
    else:
        raise ValueError(mode)
    seconds = time.perf_counter() - began
    failed = [g for g in gens if g.failure is not None]
    if failed:
        raise RuntimeError(f"{mode}: {len(failed)} failed, e.g. {failed[0].failure}")
    return seconds, sum(g.completion_tokens for g in gens), counted.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--budgets", default="512,0", help="max_num_batched_tokens per engine (0 = vLLM's)")
    parser.add_argument("--max-active", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--conc", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}")
    os.environ.update(engine_environment())

    from llmbatch.ray_job.engines.backend_vllm import VllmBackend
    from llmbatch.ray_job.engines.tokenizers import HFTokenizer
    from llmbatch.ray_job.lines.records import GenRequest
    from llmbatch.schemas.job import EngineConfig
    from llmbatch.stack.model import ensure_model

    model = str(ensure_model())
    tok = HFTokenizer(model)
    texts = prompts(args.prompts)
    convs = [[{"role": "user", "content": t}] for t in texts]
    requests = []
    for i, conv in enumerate(convs):
        ids = tok.encode(tok.render_chat(conv), add_special_tokens=False)
        requests.append(GenRequest(str(i), ids, {"n": 1, "temperature": 0.0, "max_tokens": args.max_tokens}))

    engines: dict[str, tuple[Any, Counted]] = {}
    for budget in [int(b) for b in args.budgets.split(",") if b]:
        config = EngineConfig(
            dtype="auto",
            enforce_eager=True,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=budget or None,
            engine_kwargs={"seed": 0},
        )
        backend = VllmBackend(model, config)
        engines[f"mnbt={budget or 'default'}"] = (backend, Counted(backend))
    # one untimed warm-up per engine (first steps allocate and fill caches)
    for backend, counted in engines.values():
        run_mode("ids", backend, counted, requests[:32], convs[:32], args)

    results: dict[str, dict[str, list[dict[str, float]]]] = {e: {m: [] for m in modes} for e in engines}
    for rep in range(args.reps):
        order = modes if rep % 2 == 0 else modes[::-1]
        for name, (backend, counted) in engines.items():
            for mode in order:
                load = os.getloadavg()[0]
                seconds, tokens, steps = run_mode(mode, backend, counted, requests, convs, args)
                row = {
                    "s": round(seconds, 2),
                    "tokens": tokens,
                    "tok_s": round(tokens / seconds, 1),
                    "steps": steps,
                    "load1": round(load, 2),
                }
                results[name][mode].append(row)
                print(f"rep {rep} {name:18} {mode:7} {row}", file=sys.stderr, flush=True)

    base_engine = next(iter(engines))
    base = statistics.fmean(r["tok_s"] for r in results[base_engine][modes[0]])
    print(
        f"{args.prompts} chat prompts, max_tokens {args.max_tokens}, {args.reps} reps interleaved; "
        f"ratios to {base_engine} {modes[0]}"
    )
    for name in engines:
        for mode in modes:
            rows = results[name][mode]
            mean = statistics.fmean(r["tok_s"] for r in rows)
            print(
                f"  {name:18} {mode:7} {mean:7.1f} tok/s ({', '.join(str(r['tok_s']) for r in rows)})  "
                f"{mean / base:5.2f}x  steps {rows[0]['steps']}  load1 "
                f"{', '.join(str(r['load1']) for r in rows)}"
            )
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
