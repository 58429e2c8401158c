"""Benchmark: many small batches, real vLLM on CPU, one run, same prompts and engine settings, in
up to three modes side by side: an engine per batch (``own``: main before the shared engines), the
shared warm engine on Ray Serve with a Ray job per batch (``shared``), and the short path, where the
batch runner (ray_job.batch_runner.runner, a warm Serve replica) runs each batch on the shared engine
(``short``: what the dispatcher does for batches under ``short_path_max_lines``).

    eval "$(.venv/bin/llmbatch stack env)"      # MinIO + Ray head of `llmbatch stack up minio ray`
    .venv/bin/python bench/bench_small_batches.py [--small 16] [--per-batch 8] [--warm-runs 10]
                                                 [--skip-own] [--skip-jobs] [--json]

Batches go through the real ray_job code (MinIO in, shards + manifest out) as the dispatcher
submits them; the dispatcher, Kafka and Redis are left out (the same in every mode).
- A/B: ``--small`` batches of ``--per-batch`` prompts submitted at once (A) vs one batch of all the
  prompts (B); first submit -> last batch finished; every mode starts cold (own: every job starts
  an engine; shared and short: the model's Serve application is deployed at zero replicas, the
  first call starts one). Target A/B <= 1.5.
- warm: a ``--per-batch`` batch on the warm shared engine, ``--warm-runs`` times, through the runner
  and as a Ray job: wall time minus the manifest's generation time (= the per-batch overhead), p50.
  Target p50 <= 3 s.
- plain: ``vllm.LLM.chat`` on the same prompts in a fresh process (bench_ray_job.py's worker).
Prints the figures and the ratios. Not a test; the machine's CPU flags are printed with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_ray_job import engine_environment, input_lines, prompts, run_plain  # noqa: E402
from llmbatch.dispatcher.settings import OWN_ENGINE_IN_FLIGHT  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


class Runner:
    """Submits batches as the dispatcher would and waits for them."""

    def __init__(self, model_path: str, args: argparse.Namespace) -> None:
        from ray.job_submission import JobSubmissionClient

        from llmbatch.adapters.storage import ensure_buckets, make_client
        from llmbatch.dispatcher.settings import DispatcherSettings
        from llmbatch.ray_job.job.submit import runtime_env

        self.settings = DispatcherSettings()
        s3 = self.settings.s3
        self.s3 = s3
        self.minio = make_client(s3)
        ensure_buckets(self.minio, s3)
        self.jobs = JobSubmissionClient(self.settings.ray.address)
        self.env = runtime_env(
            s3_endpoint=s3.endpoint,
            engine_env=engine_environment(),
        )
        self.model_path = model_path
        self.args = args

    def engine(self) -> Any:
        from llmbatch.schemas.job import EngineConfig

        return EngineConfig(
            backend="vllm",
            dtype="auto",
            enforce_eager=True,
            max_model_len=self.args.max_model_len,
            batch_size=self.args.per_batch,
            batches_in_flight=4,
            num_cpus_per_replica=1.0,
        )

    def spec(self, texts: list[str], engine_app: str | None) -> Any:
        from llmbatch.schemas.job import JobSpec

        batch_id = f"bench-{uuid.uuid4().hex[:10]}"
        data = b"".join(
            json.dumps(line).encode() + b"\n" for line in input_lines(texts, self.args.max_tokens)
        )
        key = f"bench/{batch_id}.jsonl"
        self.minio.put_object(self.s3.input_bucket, key, io.BytesIO(data), len(data))
        return JobSpec(
            batch_id=batch_id,
            attempt=1,
            endpoint="/v1/chat/completions",
            model=MODEL,
            model_path=self.model_path,
            input_uri=f"s3://{self.s3.input_bucket}/{key}",
            output_prefix=f"s3://{self.s3.results_bucket}/bench/{batch_id}/",
            engine=self.engine(),
            engine_app=engine_app,
            engine_wait_s=1800,
        )

    def run(self, specs: list[Any], via: str = "job", in_flight: int | None = None) -> dict[str, Any]:
        """Submit all at once (``via`` a Ray job each, or the batch ``runner`` of the short path), or
        at most ``in_flight`` at a time, the next as one ends (the dispatcher's admission); wall time
        from the first submit to the last one finished, plus each manifest."""
        from llmbatch.adapters.storage import get_bytes
        from llmbatch.dispatcher.backends.runner_backend import RunnerClient
        from llmbatch.ray_job.job.submit import submit_kwargs
        from llmbatch.schemas.job import parse_manifest

        client = RunnerClient.of(self.settings.ray)

        def finished(sid: str) -> tuple[bool, bool, str]:
            if via == "runner":
                info = asyncio.run(client.status(sid))
                if info is None:
                    return True, False, "the runner forgot it"
                return info.state.is_terminal, info.state.value == "SUCCEEDED", info.message or ""
            status = self.jobs.get_job_status(sid)
            return status.is_terminal(), status.value == "SUCCEEDED", ""

        def submit(spec: Any) -> None:
            if via == "runner":
                asyncio.run(client.submit(spec))
            else:
                self.jobs.submit_job(**submit_kwargs(spec, self.env, python=sys.executable))

        waiting = list(specs)
        submitted: list[Any] = []
        t0 = time.perf_counter()
        ends: dict[str, float] = {}
        outcome: dict[str, tuple[bool, str]] = {}
        while len(ends) < len(specs):
            while waiting and (in_flight is None or len(submitted) - len(ends) < in_flight):
                submitted.append(waiting.pop(0))
                submit(submitted[-1])
            for spec in submitted:
                if spec.submission_id in ends:
                    continue
                done, ok, message = finished(spec.submission_id)
                if done:
                    ends[spec.submission_id] = time.perf_counter() - t0
                    outcome[spec.submission_id] = (ok, message)
            time.sleep(0.1)
        manifests = []
        for spec in specs:
            ok, message = outcome[spec.submission_id]
            if not ok:
                logs = message if via == "runner" else self.jobs.get_job_logs(spec.submission_id)[-3000:]
                raise RuntimeError(f"{spec.submission_id} failed:\n{logs}")
            manifests.append(parse_manifest(get_bytes(self.minio, self.s3, spec.manifest_uri)))
        return {
            "wall_s": max(ends.values()),
            "job_s": [ends[s.submission_id] for s in specs],
            "completed": sum(m.request_counts.completed for m in manifests),
            "failed": sum(m.request_counts.failed for m in manifests),
            "output_tokens": sum(m.usage.completion_tokens for m in manifests),
            "generation_s": [m.timings.generation_s or 0.0 for m in manifests],
            "engine_wait_s": [m.timings.engine_start_s or 0.0 for m in manifests],
        }


def deploy(runner: Runner, *, cold: bool) -> str:
    """(Re)deploy the model's shared engine; ``cold`` = at zero replicas (the first call starts one)."""
    from llmbatch.dispatcher.backends.engines import runner_env_vars, serve_config, summarize
    from llmbatch.dispatcher.backends.serve_api import ServeApi
    from llmbatch.ray_job.batch_runner.runner_config import serve_application as runner_application
    from llmbatch.ray_job.batch_runner.runner_http import APP_NAME
    from llmbatch.schemas.engines import EngineModel, EngineRegistry, ReplicaResources, Scaling, app_name

    api = ServeApi(runner.settings.ray.address, timeout_s=120)
    registry = EngineRegistry(
        models={
            MODEL: EngineModel(
                path=runner.model_path,
                engine=runner.engine(),
                resources=ReplicaResources(num_cpus=1.0),
                scaling=Scaling(
                    min_replicas=0 if cold else 1,
                    max_replicas=1,
                    idle_s=600,
                    max_ongoing_requests=64,
                    target_ongoing_requests=16,
                ),
            )
        }
    )
    if cold:  # drop any warm replica first
        undeploy(runner)
    # the dispatcher's runner environment: no secret (the stack's Ray head holds the S3 keys)
    batch_runner = runner_application(max_runs=64, env_vars=runner_env_vars(runner.settings))
    asyncio.run(
        api.deploy(
            serve_config(
                registry,
                engine_environment(),
                runner=batch_runner,
                http_address=runner.settings.ray.serve_address,
            )
        )
    )
    want_running = 0 if cold else 1
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        details = asyncio.run(api.status())
        row = summarize(registry, details)[0]
        runner_up = ((details.get("applications") or {}).get(APP_NAME) or {}).get("status") == "RUNNING"
        if row.status == "DEPLOY_FAILED" or (
            row.status == "RUNNING" and row.running >= want_running and runner_up
        ):
            if row.status == "DEPLOY_FAILED":
                raise RuntimeError(row.message)
            return app_name(MODEL)
        time.sleep(1)
    raise RuntimeError("the engine app did not come up")


def undeploy(runner: Runner) -> None:
    """Remove the engine and the batch runner (with the proxy options: this deploy may start Serve),
    so no replica holds CPUs or memory beside what runs next."""
    from llmbatch.dispatcher.backends.engines import serve_config
    from llmbatch.dispatcher.backends.serve_api import ServeApi
    from llmbatch.schemas.engines import EngineRegistry

    api = ServeApi(runner.settings.ray.address, timeout_s=120)
    empty = serve_config(EngineRegistry(models={}), http_address=runner.settings.ray.serve_address)
    asyncio.run(api.deploy(empty))
    time.sleep(3)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", type=int, default=16, help="small batches in A")
    parser.add_argument("--per-batch", type=int, default=8, help="prompts per small batch")
    parser.add_argument("--warm-runs", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--skip-own", action="store_true", help="skip the engine-per-batch mode")
    parser.add_argument(
        "--own-in-flight",
        type=int,
        default=OWN_ENGINE_IN_FLIGHT,
        help="engine-per-batch jobs at once, the next as one ends (default: the "
        "dispatcher's; 16 at once on a 2-CPU head stalled)",
    )
    parser.add_argument(
        "--skip-jobs",
        action="store_true",
        help="skip the shared engine with a Ray job per batch (short path off)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from llmbatch.stack.model import ensure_model

    model_path = str(ensure_model())
    runner = Runner(model_path, args)
    texts = prompts(args.small * args.per_batch)
    chunks = [texts[i * args.per_batch : (i + 1) * args.per_batch] for i in range(args.small)]
    report: dict[str, Any] = {
        "cpu_avx512": "avx512" in Path("/proc/cpuinfo").read_text(),
        "prompts": len(texts),
        "max_tokens": args.max_tokens,
    }

    if not args.skip_own:
        print(
            f"[own engine per batch] A: {args.small} x {args.per_batch}, {args.own_in_flight} at a "
            "time (the dispatcher's admission) ...",
            flush=True,
        )
        report["own_A"] = runner.run([runner.spec(c, None) for c in chunks], in_flight=args.own_in_flight)
        print(f"[own engine per batch] B: 1 x {len(texts)} ...", flush=True)
        report["own_B"] = runner.run([runner.spec(texts, None)])

    if not args.skip_jobs:
        app = deploy(runner, cold=True)
        print(
            f"[shared engine, Ray job each] A: {args.small} x {args.per_batch} at once, cold ...", flush=True
        )
        report["shared_A"] = runner.run([runner.spec(c, app) for c in chunks])
        app = deploy(runner, cold=True)
        print(f"[shared engine, Ray job each] B: 1 x {len(texts)}, cold ...", flush=True)
        report["shared_B"] = runner.run([runner.spec(texts, app)])

    app = deploy(runner, cold=True)
    print(f"[short path: batch runner] A: {args.small} x {args.per_batch} at once, cold ...", flush=True)
    report["short_A"] = runner.run([runner.spec(c, app) for c in chunks], via="runner")
    app = deploy(runner, cold=True)
    print(f"[short path: batch runner] B: 1 x {len(texts)}, cold ...", flush=True)
    report["short_B"] = runner.run([runner.spec(texts, app)], via="runner")

    app = deploy(runner, cold=False)
    for via in ("runner", "job"):
        if via == "job" and args.skip_jobs:
            continue
        print(f"[warm engine, {via}] {args.warm_runs} x 1 batch of {args.per_batch} ...", flush=True)
        warm = [
            runner.run([runner.spec(chunks[i % len(chunks)], app)], via=via) for i in range(args.warm_runs)
        ]
        overheads = [w["wall_s"] - w["generation_s"][0] for w in warm]
        report[f"warm_{via}"] = {
            "overhead_s": overheads,
            "p50_overhead_s": statistics.median(overheads),
            "wall_s": [w["wall_s"] for w in warm],
        }

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as fh:
        for line in input_lines(texts, args.max_tokens):
            fh.write(json.dumps(line) + "\n")
    undeploy(runner)  # plain vLLM gets the machine to itself, and the stack is left as it was found
    print("[plain vLLM] LLM.chat on the same prompts ...", flush=True)
    plain = run_plain(model_path, Path(fh.name), args.max_model_len)
    plain.pop("texts", None)
    report["plain"] = plain

    def ratio(a: str, b: str) -> float | None:
        if a in report and b in report:
            return round(float(report[a]["wall_s"]) / float(report[b]["wall_s"]), 2)
        return None

    plain_tps = plain["output_tokens"] / (plain["engine_start_s"] + plain["generation_s"])
    report["ratios"] = {
        "own A/B": ratio("own_A", "own_B"),
        "shared-jobs A/B": ratio("shared_A", "shared_B"),
        "short A/B": ratio("short_A", "short_B"),
        "own A / short A": ratio("own_A", "short_A"),
        "short B tok/s / plain tok/s": round(
            (report["short_B"]["output_tokens"] / report["short_B"]["wall_s"]) / plain_tps, 2
        ),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"\nprompts {len(texts)} (max_tokens {args.max_tokens}), AVX-512: {report['cpu_avx512']}")
    for key in ("own_A", "own_B", "shared_A", "shared_B", "short_A", "short_B"):
        if key in report:
            r = report[key]
            print(
                f"  {key:9} wall {r['wall_s']:7.1f} s  completed {r['completed']:4}  "
                f"output tokens {r['output_tokens']:6}  max engine wait {max(r['engine_wait_s']):6.1f} s"
            )
    for via in ("runner", "job"):
        if f"warm_{via}" in report:
            w = report[f"warm_{via}"]
            print(
                f"  warm small batch via {via}: overhead (wall - generation) "
                f"p50 {w['p50_overhead_s']:.2f} s  all {[round(x, 2) for x in w['overhead_s']]}"
            )
    print(
        f"  plain vLLM: engine start {plain['engine_start_s']:.1f} s, "
        f"generation {plain['generation_s']:.1f} s, "
        f"{plain['output_tokens']} tokens"
    )
    for name, value in report["ratios"].items():
        print(f"  {name:32} {value}")


if __name__ == "__main__":
    main()
