"""`llmbatch stack prepare|up|down|status|env`: the local stack of real services."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from llmbatch.stack import manager
from llmbatch.stack.process import StackError
from llmbatch.stack.state import StackState, default_run_dir

app = typer.Typer(help="Run the local stack: Apache Kafka, Redis, MinIO and a Ray head on 127.0.0.1.",
                  no_args_is_help=True)
err = Console(stderr=True)
out = Console()

RunDir = Annotated[Path | None, typer.Option("--run-dir", help="state/data folder (default ./run/stack)")]
Services = Annotated[list[str] | None, typer.Argument(help="services (default: all)")]


def _names(names: list[str] | None) -> list[str]:
    chosen = names or list(manager.ALL_SERVICES)
    unknown = [n for n in chosen if n not in manager.ALL_SERVICES]
    if unknown:
        err.print(f"error: unknown service {unknown[0]!r}; choose from {', '.join(manager.ALL_SERVICES)}")
        raise typer.Exit(2)
    return chosen


def _fail(exc: StackError) -> None:
    if exc.log_tail:
        err.print(exc.log_tail, markup=False, highlight=False)
    err.print(f"error: {exc}", markup=False)
    raise typer.Exit(1)


@app.command()
def prepare(names: Services = None, model: bool = typer.Option(True, help="also convert the model")) -> None:
    """Fetch/build everything the stack needs into ~/.cache/llmbatch (idempotent)."""
    try:
        spent = manager.prepare(_names(names))
        if model:
            from llmbatch.stack.model import ensure_model

            out.print(f"model: {ensure_model()}")
    except StackError as exc:
        _fail(exc)
    out.print(json.dumps(spent))


@app.command()
def up(names: Services = None, run_dir: RunDir = None) -> None:
    """Start the services (already running and healthy ones are reused)."""
    folder = run_dir or default_run_dir()
    try:
        state = manager.up(folder, _names(names))
    except StackError as exc:
        _fail(exc)
    for name, rec in state.services.items():
        out.print(f"{name:6} {rec.address:28} pid {rec.pid}")
    out.print(f"state: {state.path}")


@app.command()
def down(names: Services = None, run_dir: RunDir = None) -> None:
    """Stop the services by their recorded PIDs."""
    stopped = manager.down(run_dir or default_run_dir(), _names(names))
    out.print("stopped: " + (", ".join(stopped) or "nothing was running"))


@app.command()
def status(run_dir: RunDir = None, as_json: bool = typer.Option(False, "--json")) -> None:
    """Show each service: running, healthy, address, memory."""
    rows = manager.status(run_dir or default_run_dir())
    if as_json:
        out.print_json(json.dumps([r.__dict__ for r in rows]))
        return
    table = Table("service", "running", "healthy", "pid", "address", "RSS MiB", "healthy after s")
    for r in rows:
        table.add_row(r.name, str(r.running), str(r.healthy), str(r.pid or "-"), r.address or "-",
                      f"{r.rss_bytes / 2**20:.0f}", str(r.healthy_after_s or "-"))
    out.print(table)
    if not all(r.healthy for r in rows):
        raise typer.Exit(1)


@app.command()
def env(run_dir: RunDir = None) -> None:
    """Print `export` lines pointing llmbatch at this stack (includes the local MinIO secret)."""
    state = StackState.load(run_dir or default_run_dir())
    for key, value in manager.env_exports(state).items():
        print(f"export {key}={value}")
