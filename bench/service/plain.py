"""The baseline of the service benchmark: plain ``vllm.LLM.chat`` on the throughput prompts in a fresh
process (bench_ray_job's worker), optionally on ``--plain-cpus`` alone."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from bench.bench_ray_job import input_lines, prompts, run_plain


def plain(
    args: argparse.Namespace, model_path: str, env_overrides: dict[str, str] | None = None
) -> dict[str, Any]:
    """Plain ``vllm.LLM.chat`` on the throughput prompts, in a fresh process (bench_ray_job's worker),
    with the engine environment the service's engine has (``env_overrides`` on top)."""
    import tempfile

    from llmbatch.stack.dispatcher_env import LOCAL_ENGINE

    texts = prompts(args.conc * args.conc_size)
    load_before = os.getloadavg()[0]
    cores = os.sched_getaffinity(0)
    if args.plain_cpus:  # the child inherits this process' affinity
        env_overrides = {**(env_overrides or {}), "OMP_NUM_THREADS": str(len(args.plain_cpus))}
        os.sched_setaffinity(0, args.plain_cpus)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-service-") as tmp:
            path = Path(tmp) / "input.jsonl"
            path.write_text("".join(json.dumps(line) + "\n" for line in input_lines(texts, args.max_tokens)))
            result = run_plain(model_path, path, int(str(LOCAL_ENGINE["max_model_len"])), env_overrides)
    finally:
        os.sched_setaffinity(0, cores)
    result.pop("texts", None)
    result["tokens_per_s"] = round(result["output_tokens"] / result["generation_s"], 1)
    result["load1"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    return result
