"""`make demo`: start the local stack and show a real generation on the real model.

Run as ``python -m llmbatch.demo [--keep]``. Without ``--keep`` (or ``LLMBATCH_DEMO_KEEP=1``) the stack
is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from rich.console import Console
from rich.table import Table

from llmbatch.stack import manager
from llmbatch.stack.process import StackError
from llmbatch.stack.state import default_run_dir
from llmbatch.stack.vllm_check import run_in_subprocess

console = Console()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", action="store_true", default=os.environ.get("LLMBATCH_DEMO_KEEP") == "1",
                        help="leave the stack running (stop it later with `make down`)")
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    run_dir = default_run_dir()
    started = time.monotonic()
    console.rule("[bold]llmbatch demo: local stack")
    try:
        state = manager.up(run_dir)
    except StackError as exc:
        if exc.log_tail:
            console.print(exc.log_tail, markup=False)
        console.print(f"[red]error:[/red] {exc}")
        return 1
    table = Table("service", "address", "pid", "healthy after s")
    for name, rec in state.services.items():
        table.add_row(name, rec.address, str(rec.pid), str(rec.healthy_after_s))
    console.print(table)
    try:
        console.rule("[bold]real vLLM generation (SmolLM2-135M-Instruct on CPU)")
        result = run_in_subprocess(prompts=args.prompts, max_tokens=48)
        for item in result["outputs"][:5]:
            console.print(f"[bold]> {item['prompt']}[/bold]")
            console.print("  " + item["text"].strip().replace("\n", " ")[:200], markup=False)
        console.print(
            f"engine start {result['engine_start_s']} s; {result['output_tokens']} output tokens in "
            f"{result['generation_s']} s = [bold]{result['output_tok_per_s']} tok/s[/bold]"
        )
        console.print("[yellow]batch flow through Kafka → dispatcher → Ray Job: demo not wired yet[/yellow]")
    finally:
        if args.keep:
            console.print(f"stack left running (state {state.path}); stop it with `make down`")
        else:
            manager.down(run_dir)
            console.print("stack stopped")
    console.print(f"demo took {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
