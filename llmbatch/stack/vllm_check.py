"""A real generation with vLLM on the local model: proves the engine environment works.

Run as ``python -m llmbatch.stack.vllm_check [--prompts N] [--max-tokens M] [--json]``. It must be a
``__main__`` module because vLLM starts its workers with spawn.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what Kafka is in one sentence.",
    "List three primary colors.",
    "What is 12 times 12?",
    "Give me a short tip for writing clean code.",
    "Name a planet in our solar system.",
    "Translate 'good morning' into Spanish.",
]


def generate(model: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from llmbatch.ray_job.engines.cpu_dtype import host_auto_dtype

    dtype = host_auto_dtype()  # as the local stack's engine (dtype auto) on this CPU
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=2048, seed=0)
    start_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    conversations: list[list[Any]] = [[{"role": "user", "content": p}] for p in prompts]
    t1 = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "dtype": dtype,
        "engine_start_s": round(start_s, 2),
        "generation_s": round(gen_s, 2),
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / gen_s, 1) if gen_s else 0.0,
        "outputs": [{"prompt": p, "text": o.outputs[0].text} for p, o in zip(prompts, outputs, strict=True)],
    }


def run_in_subprocess(prompts: int = 8, max_tokens: int = 48, timeout: float = 900) -> dict[str, Any]:
    """Run the check in a fresh process with the engine environment; return its JSON result."""
    from llmbatch.ray_job.engines.engine_env import engine_env
    from llmbatch.stack.model import ensure_model
    from llmbatch.stack.state import CACHE_DIR

    model = ensure_model()
    env = {
        **os.environ,
        **engine_env(
            CACHE_DIR / "engine-cache", omp_threads_bind=os.environ.get("LLMBATCH_OMP_THREADS_BIND") or None
        ),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmbatch.stack.vllm_check",
            "--model",
            str(model),
            "--prompts",
            str(prompts),
            "--max-tokens",
            str(max_tokens),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"vLLM check failed (exit {proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    result = generate(str(args.model), prompts, args.max_tokens)
    if args.json:
        print(json.dumps(result))
    else:
        for item in result["outputs"]:
            print(f"> {item['prompt']}\n  {item['text'].strip()}")
        print(f"engine start {result['engine_start_s']} s, {result['output_tok_per_s']} output tok/s")


if __name__ == "__main__":
    main()
