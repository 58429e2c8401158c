"""Benchmark: the issue-11 figures through the real service (Kafka -> dispatcher -> Redis -> Ray Serve
batch runner + shared engine -> MinIO -> results topic), real vLLM on CPU, one run.

    .venv/bin/python bench/bench_service.py [--engine vllm|fake] [--small 16] [--per-batch 8]
        [--warm-runs 10] [--conc 4] [--conc-size 128] [--big 2000] [--cancel-big]
        [--skip ab,throughput,fairness,after-cancel,plain,plain-procs] [--stack-dir DIR] [--json]
        [--report PATH]
        [--background normal,nice19,batch-out,batch,both,split] [--plain-cpus 1]
        [--omp-threads N] [--max-replicas N] [--idle-s 60]

Starts a private local stack (``llmbatch stack up`` in ``run/bench-service-<tag>``; ``--stack-dir``
uses a running one instead and leaves it up), a dispatcher process with shared engines on the local
model (as ``make demo`` does), submits batches with the producer SDK and reads every figure from the
results topic: the accepted and terminal events' ``ce_time`` (set by the dispatcher) and the
manifest's ``generation_s``. Batches of at most ``short_path_max_lines`` lines go inline, bigger ones
as a file (both take the short path: the batch runner on the shared engine; the report says which
batches ran as a Ray job instead).

- warm-up: one small batch (engine start, tokenizer, compile caches), then the engine is dropped.
- A/B: ``--small`` batches of ``--per-batch`` prompts at once (A) vs one batch of the same prompts
  (B), each with the engine at zero replicas (the model's Serve app removed and deployed again):
  first submit -> last terminal event. Target A/B <= 1.5.
- warm: a ``--per-batch`` batch (priority 9) on the warm engine, ``--warm-runs`` times, one after
  another: accepted -> terminal minus the manifest's generation time, p50. Target < 1 s.
- throughput: ``--conc`` batches of ``--conc-size`` prompts at once vs one batch of all of them vs
  plain ``vllm.LLM.chat`` on the same prompts (bench_ray_job's worker, a fresh process after the
  stack is down, run twice: with the engine environment the service's engine has, and with vLLM's own
  CPU processes, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``): output tokens / (first submit -> last
  terminal); plain: tokens / ``llm.chat`` time. Target >= 0.9x one batch, >= 0.95x the faster plain run.
  The cores each process of the machine used during the 4 x 128 phase are printed beside it, and each
  one's wake-ups and preemptions per second (context switches summed over its threads): an engine's
  OpenMP threads stall at every barrier one of them is preempted at. The plain runs report their own.
- ``--background``: the throughput phase once per scheduling of the run's processes, in the order
  given (see :meth:`Service.scheduling`; an experiment, the stack keeps the default afterwards).
  ``split`` gives the engine replica the last core alone and the rest of the service the others, as a
  GPU worker pod has its cores to itself; compare it with ``--plain-cpus`` (plain vLLM on those cores
  alone) and ``--omp-threads`` set to their count. ``--max-replicas 2 --omp-threads 1``: the engine as
  two single-thread replicas (an experiment: the second starts once Serve scales up for the demand).
- ``--idle-s``: after the warm runs, the cores each process used that long with the engine warm and no
  batch (what the stack itself takes from an engine on the same cores).
- fairness: a ``--big``-line priority-0 batch, and once it makes progress the warm runs' batch at
  priority 9: its accepted -> terminal vs the warm runs' median (the idle engine). Target <= 2x.
- after-cancel: a ``--big``-line priority-5 batch cancelled once it makes progress, then at once a
  ``--per-batch`` batch of priority 5: its accepted -> terminal vs the warm runs' median. Target <= 1.5x.

The engine is the local stack's registry entry as shipped (``max_num_batched_tokens`` 512, eager, bf16,
``batch_size`` 4; ``--batch-size`` / ``--batches-in-flight`` change it). ``bench/bench_vs_rev.py`` runs
this bench on the code of another commit and on this checkout, one after the other, side by side.
Prints figures, ratios and the 1-minute load average of each phase. Everything started is stopped by
PID (the private run folder is removed after a successful run). The defaults with ``--cancel-big``
took 21 min on 2 cores shared with other work; ``--engine fake`` with small sizes checks the plumbing
in ~5 min. Not a test.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the parts live in bench/service/; the names are re-exported here for the tests and other scripts
from bench.service.common import BenchError, Sub, say  # noqa: E402
from bench.service.cpu import (  # noqa: E402
    component,
    cpu_by_component,
    cpu_snapshot,
    switch_snapshot,
    switches_by_component,
)
from bench.service.harness import Service, registry_json  # noqa: E402
from bench.service.ledger import Ledger, Load  # noqa: E402
from bench.service.options import PHASES, QUICK, SCHEDULINGS, parse_args  # noqa: E402
from bench.service.plain import plain  # noqa: E402
from bench.service.report import machine, ratios, show  # noqa: E402
from bench.service.scheduling import core_split  # noqa: E402
from bench.service.workload import measure  # noqa: E402

__all__ = [
    "PHASES",
    "QUICK",
    "SCHEDULINGS",
    "BenchError",
    "Ledger",
    "Load",
    "Service",
    "Sub",
    "component",
    "core_split",
    "cpu_by_component",
    "cpu_snapshot",
    "main",
    "measure",
    "plain",
    "ratios",
    "registry_json",
    "say",
    "show",
    "switch_snapshot",
    "switches_by_component",
]


def main() -> int:
    args = parse_args(__doc__)

    from llmbatch.stack.model import ensure_model
    from llmbatch.stack.process import StackError

    model_path = str(ensure_model())
    from llmbatch.schemas.engines import EngineModel
    from llmbatch.stack.model import SERVED_MODEL

    entry = EngineModel.model_validate(json.loads(registry_json(args, model_path))[SERVED_MODEL])
    report: dict[str, Any] = {
        "cpu": machine(),
        "engine": args.engine,
        "window": f"{entry.engine.batch_size} x {entry.engine.batches_in_flight}",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "load1_at_start": round(os.getloadavg()[0], 2),
    }
    began = time.monotonic()
    svc = Service(args, model_path)
    # SIGTERM as Ctrl-C: the run's stack and dispatcher are stopped by PID before it exits (a SIGTERM
    # left them running)
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    code = 0
    try:
        asyncio.run(svc.running(lambda: measure(svc, args, report)))
    except (BenchError, StackError) as exc:
        if isinstance(exc, StackError) and exc.log_tail:
            say(exc.log_tail)
        say(f"error: {exc}")
        code = 1
    if code == 0 and svc.own_stack and not args.keep:  # logs and data of a failed run stay
        shutil.rmtree(svc.run_dir, ignore_errors=True)
    if code == 0 and args.engine == "vllm" and "plain" not in args.skip:
        say("[plain] vllm LLM.chat on the throughput prompts, fresh process, the engine's environment ...")
        report["plain"] = plain(args, model_path)
        if "plain-procs" not in args.skip:  # always the slower on CPU here; --skip plain-procs saves its run
            say("[plain] ... and with vLLM's own CPU processes (EngineCore + pinned worker) ...")
            report["plain_vllm_procs"] = plain(args, model_path, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    report["total_s"] = round(time.monotonic() - began, 1)
    report["load1_at_end"] = round(os.getloadavg()[0], 2)
    if code == 0:
        report["ratios"] = ratios(report)
    text = json.dumps(report, indent=2, default=str)
    if args.report is not None:
        args.report.write_text(text + "\n")
    if args.json or code != 0:
        print(text)
    if code == 0 and not args.json:
        show(report, args)
    return code


if __name__ == "__main__":
    sys.exit(main())
