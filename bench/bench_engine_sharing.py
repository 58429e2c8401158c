"""Benchmark: how batches share one warm engine (real vLLM on CPU, in one process, no Ray).

What the shared engine's replica does with the requests of many batches
(ray_job.engines.engine_runner.EngineRunner and its fair queue), measured on one vLLM engine, side by
side in one run:

- fairness: an 8-line priority-9 batch alone on the idle engine, then while a ``--big``-line
  priority-0 batch runs: with priorities (the runner as shipped), with equal priorities (batches
  take turns), and as before the fair queue (every request straight into vLLM, first come first
  served). Target: loaded / idle <= 2.
- prefix: ``--prefix-lines`` requests over 4 long system prompts, interleaved: taken in prompt order
  (the fair queue groups shared prefixes), in arrival order, and with vLLM's prefix cache off.
- throughput: 4 batches x 128 prompts at once vs one batch of 512 vs plain ``vllm.LLM.chat`` on the
  same prompts (fresh process, vLLM's defaults). Target >= 0.9x both.

The engine is set up as the local stack's registry sets it up (``max_num_batched_tokens`` 512).

    .venv/bin/python bench/bench_engine_sharing.py [--big 2000] [--skip-prefix] [--skip-throughput]

Prints figures and ratios (and JSON with ``--json``). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_ray_job import engine_environment, input_lines, prompts, run_plain  # noqa: E402

MAX_MODEL_LEN = 2048
SYSTEM_TOPICS = ["a ship's navigator", "a pastry chef", "a tax adviser", "a mountain guide"]


class Bench:
    def __init__(self, model: str, args: argparse.Namespace) -> None:
        from llmbatch.ray_job.engines.tokenizers import HFTokenizer

        self.model = model
        self.args = args
        self.tok = HFTokenizer(model)

    def request(self, key: str, messages: list[dict[str, str]], max_tokens: int) -> Any:
        from llmbatch.ray_job.lines.records import GenRequest

        text = self.tok.render_chat(messages)
        ids = self.tok.encode(text, add_special_tokens=False)
        return GenRequest(key, ids, {"max_tokens": max_tokens, "temperature": 0.0}, prompt_text=text)

    def user(self, texts: list[str], max_tokens: int, tag: str) -> list[Any]:
        return [
            self.request(f"{tag}{i}", [{"role": "user", "content": t}], max_tokens)
            for i, t in enumerate(texts)
        ]

    def engine(self, **engine_kwargs: Any) -> Any:
        from llmbatch.ray_job.engines.backend_vllm import VllmBackend
        from llmbatch.schemas.job import EngineConfig

        config = EngineConfig(
            dtype="auto",
            enforce_eager=True,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=self.args.max_num_batched_tokens or None,
            engine_kwargs={"seed": 0, **engine_kwargs},
        )
        return VllmBackend(self.model, config)


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def tokens(out: list[Any]) -> int:
    return sum(g.completion_tokens for g in out)


def fairness(b: Bench, backend: Any) -> dict[str, Any]:
    from llmbatch.ray_job.engines.engine_runner import EngineRunner

    small = b.user(prompts(8), 32, "s")
    big = b.user(prompts(b.args.big), 32, "b")
    results: dict[str, Any] = {}
    runner = EngineRunner(backend, max_active=b.args.max_active)
    runner.generate(small, group="warmup", priority=9)
    idle = [timed(lambda: runner.generate(small, group="small", priority=9))[0] for _ in range(3)]
    results["idle_s"] = statistics.median(idle)
    modes = [
        ("priority", b.args.max_active, 0, 9),
        ("equal", b.args.max_active, 5, 5),
        ("before (no fair queue)", None, 5, 5),
    ]
    for name, max_active, big_priority, small_priority in modes:
        runner = EngineRunner(backend, max_active=max_active)
        big_out: list[Any] = []
        started = time.perf_counter()
        thread = threading.Thread(
            target=lambda r=runner, p=big_priority, out=big_out: out.extend(
                r.generate(big, group="big", priority=p)
            )
        )
        thread.start()
        time.sleep(b.args.settle_s)  # the big batch is well under way
        small_s, _ = timed(lambda r=runner, p=small_priority: r.generate(small, group="small", priority=p))
        thread.join()
        big_s = time.perf_counter() - started
        results[name] = {
            "small_s": small_s,
            "ratio_to_idle": small_s / results["idle_s"],
            "big_s": big_s,
            "big_tokens_per_s": tokens(big_out) / big_s,
            "preempted": runner.stats().preempted,
        }
    return results


def system_prompt(topic: str) -> str:
    rules = " ".join(
        f"Rule {i}: as {topic}, answer in plain words, stay polite and precise, "
        f"never invent facts, and mention {topic} once."
        for i in range(12)
    )
    return f"You are {topic}. {rules}"


def prefix(b: Bench, backends: dict[str, Any]) -> dict[str, Any]:
    from llmbatch.ray_job.engines import fair_queue
    from llmbatch.ray_job.engines.engine_runner import EngineRunner

    asks = prompts(b.args.prefix_lines)
    requests = [
        b.request(
            f"x{i}",
            [
                {"role": "system", "content": system_prompt(SYSTEM_TOPICS[i % 4])},
                {"role": "user", "content": ask},
            ],
            8,
        )
        for i, ask in enumerate(asks)
    ]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    results: dict[str, Any] = {"lines": len(requests), "prompt_tokens": prompt_tokens}
    order_tokens = fair_queue.ORDER_TOKENS
    for name, backend_name, order in [
        ("grouped", "cache", order_tokens),
        ("arrival order", "cache", 0),
        ("no prefix cache", "nocache", order_tokens),
    ]:
        backend = backends[backend_name]
        backend._llm.reset_prefix_cache()
        fair_queue.ORDER_TOKENS = order
        try:
            runner = EngineRunner(backend, max_active=b.args.max_active)
            seconds, _ = timed(lambda r=runner: r.generate(requests, group="p"))
        finally:
            fair_queue.ORDER_TOKENS = order_tokens
        results[name] = {"s": seconds, "prompt_tokens_per_s": prompt_tokens / seconds}
    return results


def throughput(b: Bench, backend: Any) -> dict[str, Any]:
    from llmbatch.ray_job.engines.engine_runner import EngineRunner

    texts = prompts(512)
    runner = EngineRunner(backend, max_active=b.args.max_active)
    batches = [b.user(texts[i * 128 : (i + 1) * 128], 32, f"t{i}-") for i in range(4)]
    outs: list[list[Any]] = [[] for _ in batches]

    def four() -> None:
        threads = [
            threading.Thread(
                target=lambda i=i: outs[i].extend(runner.generate(batches[i], group=f"batch{i}"))
            )
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    four_s, _ = timed(four)
    one_s, one = timed(lambda: runner.generate([r for batch in batches for r in batch], group="one"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "input.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in input_lines(texts, 32)))
        plain = run_plain(b.model, path, MAX_MODEL_LEN)
    four_tps = sum(tokens(o) for o in outs) / four_s
    one_tps = tokens(one) / one_s
    plain_tps = plain["output_tokens"] / plain["generation_s"]
    return {
        "4x128_tokens_per_s": four_tps,
        "1x512_tokens_per_s": one_tps,
        "plain_tokens_per_s": plain_tps,
        "4x128_over_1x512": four_tps / one_tps,
        "4x128_over_plain": four_tps / plain_tps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big", type=int, default=2000, help="lines of the low-priority batch")
    parser.add_argument("--settle-s", type=float, default=5.0, help="how long the big batch runs first")
    parser.add_argument("--max-active", type=int, default=256, help="the registry's max_active_requests")
    parser.add_argument("--prefix-lines", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="the engine's step budget (the local stack's; 0 = vLLM's default)",
    )
    parser.add_argument("--skip-fairness", action="store_true")
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.update(engine_environment())
    from llmbatch.stack.model import ensure_model

    b = Bench(str(ensure_model()), args)
    report: dict[str, Any] = {}
    backend = b.engine()
    if not args.skip_fairness:
        report["fairness"] = fairness(b, backend)
        f = report["fairness"]
        print(f"fairness: 8-line batch alone {f['idle_s']:.2f} s")
        for name in ("priority", "equal", "before (no fair queue)"):
            m = f[name]
            print(
                f"  beside a {args.big}-line batch, {name:24s}: {m['small_s']:7.2f} s = "
                f"{m['ratio_to_idle']:5.2f}x idle (big batch {m['big_s']:.0f} s, "
                f"{m['big_tokens_per_s']:.0f} tok/s, {m['preempted']} preempted)"
            )
    if not args.skip_throughput:
        report["throughput"] = t = throughput(b, backend)
        print(
            f"throughput: 4x128 at once {t['4x128_tokens_per_s']:.0f} tok/s, 1x512 "
            f"{t['1x512_tokens_per_s']:.0f} tok/s, plain LLM.chat {t['plain_tokens_per_s']:.0f} tok/s -> "
            f"{t['4x128_over_1x512']:.2f}x one batch, {t['4x128_over_plain']:.2f}x plain"
        )
    if not args.skip_prefix:
        report["prefix"] = p = prefix(b, {"cache": backend, "nocache": b.engine(enable_prefix_caching=False)})
        print(f"prefix: {p['lines']} lines over 4 system prompts ({p['prompt_tokens']} prompt tokens)")
        base = p["no prefix cache"]["s"]
        for name in ("grouped", "arrival order", "no prefix cache"):
            print(f"  {name:16s}: {p[name]['s']:6.2f} s ({base / p[name]['s']:.2f}x the uncached time)")
    if args.json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
