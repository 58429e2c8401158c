"""The report of the service benchmark: the machine it ran on, each issue-11 figure against its target
(:func:`ratios`) and the printed summary (:func:`show`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """The CPU model, the core count and whether it has AVX-512 (``report["cpu"]``)."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    names = [x.split(":", 1)[1].strip() for x in cpuinfo.splitlines() if x.startswith("model name")]
    return {"model": names[0] if names else "?", "cores": os.cpu_count(), "avx512": "avx512" in cpuinfo}


def ratios(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each figure with its target (issue 53's); absent when its phase was skipped."""
    out: dict[str, dict[str, Any]] = {}

    def put(name: str, value: float, target: str, ok: bool) -> None:
        out[name] = {"value": round(value, 2), "target": target, "met": ok}

    if "A" in report and "B" in report:
        ab = report["A"]["wall_s"] / report["B"]["wall_s"]
        put("A/B (first submit -> last terminal)", ab, "<= 1.5", ab <= 1.5)
    warm = report["warm"]["p50_overhead_s"]
    put("warm p50 accepted->terminal minus generation (s)", warm, "< 1", warm < 1)
    if "conc" in report and "one" in report:
        conc = report["conc"]["tokens_per_s"]
        put(
            "concurrent / one batch (tok/s)",
            conc / report["one"]["tokens_per_s"],
            ">= 0.9",
            conc >= 0.9 * report["one"]["tokens_per_s"],
        )
        # against the faster of the two plain runs (the engine's environment, vLLM's own processes)
        best = max(
            (report[k]["tokens_per_s"] for k in ("plain", "plain_vllm_procs") if k in report), default=None
        )
        if best is not None:
            put(
                "concurrent / plain LLM.chat, the faster (tok/s)", conc / best, ">= 0.95", conc >= 0.95 * best
            )
            # issue 13's figure: one big batch (e.g. --conc 2 --conc-size 1024: 1 x 2048) against plain
            one = report["one"]["tokens_per_s"]
            put("one batch / plain LLM.chat, the faster (tok/s)", one / best, ">= 0.95", one >= 0.95 * best)
    if "fairness" in report:
        f = report["fairness"]
        put(
            "fairness: beside the big batch / idle",
            f["ratio"],
            "<= 2",
            f["ratio"] <= 2 and not f["big_finished_first"],
        )
    if "after_cancel" in report:
        a = report["after_cancel"]
        put(
            "right after a cancelled batch / idle",
            a["ratio"],
            "<= 1.5",
            a["ratio"] <= 1.5 and not a["gone_finished_first"],
        )
    return out


def show(report: dict[str, Any], args: argparse.Namespace) -> None:
    cpu = report["cpu"]
    print(
        f"through the service ({args.engine} engine), {cpu['model']}, {cpu['cores']} cores, "
        f"AVX-512 {cpu['avx512']}; batch_size x batches_in_flight {report.get('window', '?')}, "
        f"max_tokens {args.max_tokens}; routes {report.get('routes')}"
    )

    def line(label: str, key: str) -> None:
        if key in report:
            r = report[key]
            print(
                f"  {label:34} {r['wall_s']:8.1f} s  {r['output_tokens']:6} tokens  "
                f"{r['tokens_per_s']:7.1f} tok/s  load1 {r['load1']['mean']:.1f} "
                f"(max {r['load1']['max']:.1f})"
            )

    line(f"warm-up (engine start {report['warmup']['max_engine_start_s'] or 0:.0f} s)", "warmup")
    line(f"A: {args.small} x {args.per_batch} at once, cold", "A")
    line(f"B: 1 x {args.small * args.per_batch}, cold", "B")
    w = report["warm"]
    print(
        f"  warm {args.per_batch}-line batch x {len(w['overhead_s'])}: accepted->terminal p50 "
        f"{w['p50_accepted_to_terminal_s']:.2f} s, generation p50 {w['p50_generation_s']:.2f} s, overhead "
        f"p50 {w['p50_overhead_s']:.2f} s (all {w['overhead_s']}), submit->accepted p50 "
        f"{w['p50_submit_to_accepted_s']:.2f} s; load1 {w['load1']['mean']:.1f}"
    )
    if "idle" in report:
        idle = report["idle"]
        shares = ", ".join(f"{k} {v:.3f}" for k, v in idle["cpu_cores"].items())
        outside = idle["cores_outside_the_engine"]
        print(f"  idle, warm engine: cores outside the engine {outside:.2f}; {shares}")
    line(f"{args.conc} x {args.conc_size} at once, warm", "conc")
    if "cpu_cores" in report.get("conc", {}):
        shares = ", ".join(f"{k} {v:.2f}" for k, v in report["conc"]["cpu_cores"].items())
        print(f"    cores used during it, by process: {shares}")
    if "switches" in report.get("conc", {}):
        rates = ", ".join(
            f"{k} {v['wakeups_per_s']} ({v['preempted_per_s']})"
            for k, v in report["conc"]["switches"].items()
        )
        print(f"    wake-ups/s (preempted/s) during it, by process: {rates}")
    for run, mode in enumerate(args.background):
        line(f"  scheduling {mode}", f"conc_{mode}_{run}")
    line(f"1 x {args.conc * args.conc_size}, warm", "one")
    for key, label in (
        ("plain", "plain LLM.chat, engine env"),
        ("plain_vllm_procs", "plain, vLLM's processes"),
    ):
        if key in report:
            p = report[key]
            print(
                f"  {label:34} engine start {p['engine_start_s']:.1f} s, generation "
                f"{p['generation_s']:.1f} s, {p['output_tokens']} tokens, {p['tokens_per_s']:.1f} tok/s; "
                f"load1 {p['load1']['before']:.1f} -> {p['load1']['after']:.1f}; its threads preempted "
                f"{p.get('preempted_per_s', '?')}/s, woken {p.get('wakeups_per_s', '?')}/s"
            )
    if "fairness" in report:
        f = report["fairness"]
        big = f["big"]
        print(
            f"  fairness: {args.per_batch}-line p9 batch idle {f['idle_s']:.2f} s, beside the "
            f"{args.big}-line p0 batch {f['loaded_s']:.2f} s (accepted->terminal); big batch "
            f"{big['status']} {big['completed']}/{big['lines']} lines, {big['tokens_per_s']:.1f} tok/s, "
            f"finished first: {f['big_finished_first']}; load1 {f['urgent']['load1']['mean']:.1f}"
        )
    if "after_cancel" in report:
        a = report["after_cancel"]
        print(
            f"  after a cancel: {args.per_batch}-line p5 batch idle {a['idle_s']:.2f} s, right after the "
            f"{args.big}-line p5 batch was cancelled {a['after_s']:.2f} s (accepted->terminal); "
            f"the big batch finished first: {a['gone_finished_first']}"
        )
    for name, r in report["ratios"].items():
        print(f"  {name:50} {r['value']:7.2f}  target {r['target']:6}  {'met' if r['met'] else 'NOT met'}")
