"""The workload of the service benchmark: its phases in order (warm-up, A/B on a cold engine, warm runs,
throughput under each ``--background`` scheduling, fairness beside a big batch, a batch right after a big
one was cancelled) and their figures."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from bench.bench_ray_job import prompts
from bench.service.common import say
from bench.service.cpu import (
    cpu_by_component,
    cpu_outside_engine,
    cpu_snapshot,
    switch_snapshot,
    switches_by_component,
)
from bench.service.harness import Service


async def measure(svc: Service, args: argparse.Namespace, report: dict[str, Any]) -> None:
    skip = set(args.skip)
    report["setup"] = await svc.start()
    small = prompts(args.per_batch)

    say("[warm-up] one small batch (engine start, tokenizer, caches) ...")
    report["warmup"] = await svc.phase("warmup", [(small, 5)])

    if "ab" not in skip:
        texts = prompts(args.small * args.per_batch)
        chunks = [texts[i * args.per_batch : (i + 1) * args.per_batch] for i in range(args.small)]
        await svc.cold()
        say(f"[A] {args.small} x {args.per_batch} at once, engine cold ...")
        report["A"] = await svc.phase("a", [(c, 5) for c in chunks])
        await svc.cold()
        say(f"[B] 1 x {len(texts)}, engine cold ...")
        report["B"] = await svc.phase("b", [(texts, 5)])

    say(f"[warm] {args.warm_runs} x 1 batch of {args.per_batch} (priority 9) on the warm engine ...")
    warm_began = time.time()
    warm = [await svc.phase("warm", [(small, 9)]) for _ in range(args.warm_runs)]
    rows = [w["rows"][0] for w in warm]
    service = [r["accepted_to_terminal_s"] for r in rows]
    overhead = [r["accepted_to_terminal_s"] - (r["generation_s"] or 0.0) for r in rows]
    report["warm"] = {
        "accepted_to_terminal_s": service,
        "generation_s": [r["generation_s"] for r in rows],
        "overhead_s": [round(x, 3) for x in overhead],
        "submit_to_accepted_s": [r["submit_to_accepted_s"] for r in rows],
        "p50_accepted_to_terminal_s": statistics.median(service),
        "p50_generation_s": statistics.median(r["generation_s"] or 0.0 for r in rows),
        "p50_overhead_s": round(statistics.median(overhead), 3),
        "p50_submit_to_accepted_s": statistics.median(r["submit_to_accepted_s"] for r in rows),
        "load1": svc.load.window(warm_began, time.time()),
    }

    if args.idle_s > 0:
        say(f"[idle] the stack with a warm engine and no batch, {args.idle_s:.0f} s ...")
        before, switched, began = cpu_snapshot(), switch_snapshot(), time.perf_counter()
        await asyncio.sleep(args.idle_s)
        wall = time.perf_counter() - began
        after = cpu_snapshot()
        report["idle"] = {
            "cpu_cores": cpu_by_component(before, after, wall, top=40),
            "cores_outside_the_engine": round(cpu_outside_engine(before, after, wall), 3),
            "switches": switches_by_component(switched, switch_snapshot(), wall),
        }

    if "throughput" not in skip:
        texts = prompts(args.conc * args.conc_size)
        for run, mode in enumerate(args.background or [None]):
            key = "conc" if mode is None else f"conc_{mode}_{run}"
            if mode is not None:
                say(f"[throughput] scheduling {mode}: {svc.scheduling(mode)}")
            say(f"[throughput] {args.conc} x {args.conc_size} at once, warm engine ...")
            before, switched, began = cpu_snapshot(), switch_snapshot(), time.perf_counter()
            report[key] = await svc.phase(
                "conc", [(texts[i * args.conc_size : (i + 1) * args.conc_size], 5) for i in range(args.conc)]
            )
            wall = time.perf_counter() - began
            report[key]["cpu_cores"] = cpu_by_component(before, cpu_snapshot(), wall)
            report[key]["switches"] = switches_by_component(switched, switch_snapshot(), wall)
            say(
                f"[throughput] {mode}: {report[key]['tokens_per_s']:.1f} tok/s; "
                f"switches {report[key]['switches']}"
            )
        if args.background:
            report["conc"] = report[f"conc_{args.background[0]}_0"]
            svc.scheduling("normal")
        say(f"[throughput] 1 x {len(texts)}, warm engine ...")
        report["one"] = await svc.phase("one", [(texts, 5)])

    if "fairness" not in skip:
        say(f"[fairness] {args.big}-line batch at priority 0 ...")
        big = await svc.submit(prompts(args.big), priority=0, name="big")
        await svc.under_way(big, "the big batch")
        say(f"[fairness] ... under way; {args.per_batch}-line batch at priority 9 beside it ...")
        urgent = await svc.phase("urgent", [(small, 9)])
        big_done_first = big.batch_id in svc.ledger.terminal
        if args.cancel_big and not big_done_first:
            client, _, _, _ = svc.need()
            await client.cancel(big.batch_id, reason="bench: fairness measured")
        say("[fairness] waiting for the big batch to end ...")
        await svc.wait([big], "the big batch")
        big_figures = await svc.figures([big], cancelled_ok=True)
        idle = report["warm"]["p50_accepted_to_terminal_s"]
        loaded = urgent["rows"][0]["accepted_to_terminal_s"]
        report["fairness"] = {
            "idle_s": idle,
            "loaded_s": loaded,
            "ratio": round(loaded / idle, 2),
            "big_finished_first": big_done_first,  # True: the figure is void
            "big": {k: v for k, v in big_figures.items() if k != "rows"}
            | {"status": big_figures["rows"][0]["status"], "completed": big_figures["rows"][0]["completed"]},
            "urgent": urgent,
        }
    if "after-cancel" not in skip:
        report["after_cancel"] = await after_cancel(svc, args, small, report["warm"])
    report["routes"] = await svc.routes()


async def after_cancel(
    svc: Service, args: argparse.Namespace, small: list[str], warm: dict[str, Any]
) -> dict[str, Any]:
    """A ``--big``-line batch cancelled once under way, then at once a ``--per-batch`` batch of the same
    priority: its accepted -> terminal against the warm runs' median (the idle engine). What a stopped
    batch leaves running on the engine (its calls in flight) delays the next one."""
    client, _, _, _ = svc.need()
    say(f"[after-cancel] {args.big}-line batch at priority 5, cancelled once under way ...")
    gone = await svc.submit(prompts(args.big), priority=5, name="gone")
    await svc.under_way(gone, "the batch to cancel")
    finished_first = gone.batch_id in svc.ledger.terminal
    if not finished_first:
        await client.cancel(gone.batch_id, reason="bench: after-cancel")
    await svc.wait([gone], "the cancelled batch")
    say(f"[after-cancel] ... ended; {args.per_batch}-line batch at priority 5 right after it ...")
    after = await svc.phase("after-cancel", [(small, 5)])
    idle = warm["p50_accepted_to_terminal_s"]
    took = after["rows"][0]["accepted_to_terminal_s"]
    return {
        "idle_s": idle,
        "after_s": took,
        "ratio": round(took / idle, 2),
        "gone_finished_first": finished_first,  # True: the figure is void
        "after": after,
    }
