"""Benchmark: ``bench/bench_service.py`` (or ``--bench flow``: ``bench/bench_flow.py``, ``--bench
deadlines``: ``bench/bench_deadlines.py``, ``--bench load``: ``bench/bench_dispatcher_load.py``,
``--bench tenants``: ``bench/bench_tenant_share.py``) on the code of an earlier commit and on this
checkout, one after the other on the same machine, figures side by side with their ratio (after / before).

    .venv/bin/python bench/bench_vs_rev.py --before REV [--bench service|flow|deadlines|load|tenants] \
        [--after-first] [--this-bench] [--report PATH] -- [the bench's args]

The earlier commit runs from a clone of this repository in ``run/compare-<rev>`` with a venv of its own
(``scripts/bootstrap.sh demo`` there: its own lock, the shared download caches), so neither run imports
the other's code. Both get the same arguments after ``--`` (each must accept them: an older bench may
not know a newer option) and each starts and stops its own private stack. ``--after-first`` runs this
checkout first (to see whether order matters). ``--this-bench`` copies this checkout's ``bench/`` folder
into the earlier commit's clone first: the same bench on both codes, when the earlier commit lacks the
bench or one of its options (the clone's own ``bench/`` is restored from git before each copy). Prints
one table; ``--report PATH`` writes both reports as JSON. Not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# (label, path in the report, higher is better)
Figures = tuple[tuple[str, tuple[str, ...], bool], ...]
SERVICE_FIGURES: Figures = (
    ("1 x N, tok/s", ("one", "tokens_per_s"), True),
    ("conc x size at once, tok/s", ("conc", "tokens_per_s"), True),
    ("plain LLM.chat, tok/s", ("plain", "tokens_per_s"), True),
    ("warm p50 overhead, s", ("warm", "p50_overhead_s"), False),
    ("warm p50 accepted->terminal, s", ("warm", "p50_accepted_to_terminal_s"), False),
    ("urgent idle, s", ("fairness", "idle_s"), False),
    ("urgent beside the big batch, s", ("fairness", "loaded_s"), False),
    ("urgent beside / idle", ("fairness", "ratio"), False),
    ("right after a cancelled batch, s", ("after_cancel", "after_s"), False),
    ("right after a cancel / idle", ("after_cancel", "ratio"), False),
    ("A: small batches cold, s", ("A", "wall_s"), False),
    ("B: one batch cold, s", ("B", "wall_s"), False),
)
FLOW_FIGURES: Figures = (
    ("batches per minute", ("flow", "batches_per_min"), True),
    ("p50 accepted->terminal, s", ("flow", "p50_accepted_to_terminal_s"), False),
    ("p90 accepted->terminal, s", ("flow", "p90_accepted_to_terminal_s"), False),
    ("Redis commands per batch", ("flow", "redis_commands_per_batch"), False),
    ("Redis connections per batch", ("flow", "redis_connections_per_batch"), False),
    ("Kafka records per batch", ("flow", "kafka_records_per_batch"), False),
)
DEADLINE_FIGURES: Figures = (
    ("tight batch alone, s", ("idle", "submit_to_terminal_s"), False),
    ("its deadline beside the big one, s", ("loaded", "deadline_s"), False),
    ("tight batch beside the big one, s", ("loaded", "submit_to_terminal_s"), False),
    ("  requests answered", ("loaded", "completed"), True),
    ("  beside / alone", ("loaded", "vs_idle"), False),
    ("  made its deadline (1 = yes)", ("loaded", "made_it"), True),
)
TENANT_FIGURES: Figures = (
    ("lone tenant's batch alone, s", ("idle", "submit_to_terminal_s"), False),
    ("beside the other tenant's batches, s", ("loaded", "submit_to_terminal_s"), False),
    ("  beside / alone", ("loaded", "vs_idle"), False),
    ("  the other's batches still running", ("loaded", "many_still_running"), True),
)
# the per-process CPU figures of a flow run (their labels are the processes' names)
FLOW_CPU = ("flow", "cpu_ms_per_batch")
BENCHES = {
    "service": "bench/bench_service.py",
    "flow": "bench/bench_flow.py",
    "deadlines": "bench/bench_deadlines.py",
    "load": "bench/bench_dispatcher_load.py",
    "tenants": "bench/bench_tenant_share.py",
}
LOAD_FIGURES = (  # per run of the load bench (one per replica count), after "N replica(s): "
    ("batches per minute", "batches_per_min", True),
    ("p50 accepted->terminal, s", "p50_accepted_to_terminal_s", False),
    ("p90 accepted->terminal, s", "p90_accepted_to_terminal_s", False),
    ("Redis commands per batch", "redis_commands_per_batch", False),
)


def _get(report: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = report
    for key in path:
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
            continue
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, int | float) else None  # bool: 1.0 / 0.0


def clone_at(rev: str) -> Path:
    """A clone of this repository at ``rev`` with its own venv (made once, reused)."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    where = ROOT / "run" / f"compare-{sha[:10]}"
    if not (where / ".git").exists():
        subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True)
        subprocess.run(["git", "-C", str(where), "checkout", "-q", sha], check=True)
    subprocess.run(["bash", "scripts/bootstrap.sh", "demo"], cwd=where, check=True)
    return where


def copy_bench(clone: Path) -> None:
    """This checkout's ``bench/`` over the clone's (its own restored from git first)."""
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", "--", "bench"], check=True)
    subprocess.run(["git", "-C", str(clone), "clean", "-fdq", "--", "bench"], check=True)
    shutil.copytree(
        ROOT / "bench", clone / "bench", dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
    )


def load_figures(before: dict[str, Any], after: dict[str, Any]) -> Figures:
    """Rows of the load bench: each figure of each run (one per replica count), by its replica count."""
    rows: list[tuple[str, tuple[str, ...], bool]] = []
    runs = max(len(before.get("runs") or []), len(after.get("runs") or []))
    for i in range(runs):
        count = _get(after, ("runs", str(i), "replicas")) or _get(before, ("runs", str(i), "replicas"))
        for label, key, higher in LOAD_FIGURES:
            rows.append((f"{int(count or 0)} replica(s): {label}", ("runs", str(i), key), higher))
    return tuple(rows)


def run_bench(checkout: Path, script: str, bench_args: list[str], label: str) -> dict[str, Any]:
    """One run of ``script`` in ``checkout`` with its own venv; its JSON report."""
    report = ROOT / "run" / f"compare-report-{label}-{int(time.time())}.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(checkout / ".venv/bin/python"), script, *bench_args, "--report", str(report)]
    print(f"[compare] {label}: {' '.join(cmd)} (in {checkout})", flush=True)
    began = time.monotonic()
    subprocess.run(cmd, cwd=checkout, check=True)
    out: dict[str, Any] = json.loads(report.read_text())
    out["compare_wall_s"] = round(time.monotonic() - began, 1)
    return out


def cpu_figures(before: dict[str, Any], after: dict[str, Any]) -> Figures:
    """One row per process named in either flow report's CPU figures."""
    names: dict[str, None] = {}
    for report in (before, after):
        value: Any = report
        for key in FLOW_CPU:
            value = value.get(key, {}) if isinstance(value, dict) else {}
        names.update(dict.fromkeys(value if isinstance(value, dict) else {}))
    return tuple((f"CPU ms/batch {name[:22]}", (*FLOW_CPU, name), False) for name in names)


def table(before: dict[str, Any], after: dict[str, Any], rev: str, bench: str = "service") -> str:
    figures = {
        "service": SERVICE_FIGURES,
        "deadlines": DEADLINE_FIGURES,
        "tenants": TENANT_FIGURES,
        "load": load_figures(before, after),
    }.get(bench) or FLOW_FIGURES + cpu_figures(before, after)
    lines = [f"{'figure':44} {'before ' + rev[:10]:>18} {'after':>10} {'after/before':>13}"]
    for label, path, _higher in figures:
        b, a = _get(before, path), _get(after, path)
        if b is None and a is None:
            continue
        ratio = f"{a / b:.2f}" if a is not None and b else "-"
        show_b = f"{b:.2f}" if b is not None else "-"
        show_a = f"{a:.2f}" if a is not None else "-"
        lines.append(f"{label:44} {show_b:>18} {show_a:>10} {ratio:>13}")
    for name, report in (("before", before), ("after", after)):
        plain = _get(report, ("plain", "tokens_per_s"))
        for key, what in (("one", "1 x N"), ("conc", "conc x size")):
            got = _get(report, (key, "tokens_per_s"))
            if got is not None and plain:
                lines.append(f"{name}: {what} / plain LLM.chat = {got / plain:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--bench", choices=sorted(BENCHES), default="service", help="which bench runs")
    parser.add_argument("--after-first", action="store_true", help="run this checkout first")
    parser.add_argument("--report", type=Path, help="write both reports here as JSON")
    parser.add_argument(
        "--this-bench", action="store_true", help="run this checkout's bench/ on the earlier code too"
    )
    args = parser.parse_args(ours)
    old = clone_at(args.before)
    if args.this_bench:
        copy_bench(old)
    runs = [("after", ROOT), ("before", old)]
    if not args.after_first:
        runs.reverse()
    script = BENCHES[args.bench]
    reports = {label: run_bench(where, script, bench_args, label) for label, where in runs}
    text = table(reports["before"], reports["after"], args.before, args.bench)
    print(text)
    if args.report is not None:
        args.report.write_text(json.dumps({"before_rev": args.before, **reports}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
