"""`llmbatch stack prepare|up|down|status|env|dispatcher`: the local stack of real services."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from llmbatch.stack import manager
from llmbatch.stack.dispatcher_env import dispatcher_environ, shell_exports
from llmbatch.stack.process import StackError, alive
from llmbatch.stack.state import StackState, default_run_dir

app = typer.Typer(
    help="Run the local stack: Apache Kafka, Redis, MinIO and a Ray head on 127.0.0.1.", no_args_is_help=True
)
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


def _say(line: str) -> None:
    """One plain line on stderr (no rich wrapping: paths and commands stay copyable)."""
    typer.echo(line, err=True)


def _fail(exc: StackError) -> None:
    if exc.log_tail:
        err.print(exc.log_tail, markup=False, highlight=False)
    err.print(f"error: {exc}", markup=False)
    raise typer.Exit(1)


@app.command()
def prepare(names: Services = None, model: bool = typer.Option(True, help="also convert the model")) -> None:
    """Fetch/build everything the stack needs into ~/.cache/llmbatch (idempotent).

    Says on stderr what each step not cached yet does and how long it usually takes, then sums up.
    """
    steps = _names(names) + (["model"] if model else [])
    try:
        outcomes = manager.prepare(steps, report=_say)
    except StackError as exc:
        _fail(exc)
    _say(manager.prepare_summary(outcomes))
    if model:
        from llmbatch.stack.model import model_dir

        typer.echo(f"model: {model_dir()}")


@app.command()
def up(
    names: Services = None,
    run_dir: RunDir = None,
    tls: bool = typer.Option(
        False,
        "--tls",
        help="Kafka (SASL_SSL), Redis and MinIO over TLS only, "
        "with a CA made for the run folder; `stack env` then exports the CA "
        "bundles and the Kafka login",
    ),
) -> None:
    """Start the services (already running and healthy ones are reused)."""
    folder = run_dir or default_run_dir()
    try:
        state = manager.up(folder, _names(names), tls=tls)
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
        table.add_row(
            r.name,
            str(r.running),
            str(r.healthy),
            str(r.pid or "-"),
            r.address or "-",
            f"{r.rss_bytes / 2**20:.0f}",
            str(r.healthy_after_s or "-"),
        )
    out.print(table)
    if not all(r.healthy for r in rows):
        raise typer.Exit(1)


@app.command()
def env(run_dir: RunDir = None) -> None:
    """Print `export` lines for `eval`: this stack's addresses (and its local MinIO keys) and what a
    dispatcher needs to run jobs here (the job's python, the local model, engine settings).

    Reads the state file only; notes about anything missing go to stderr.
    """
    state = StackState.load(run_dir or default_run_dir())
    exports, notes = shell_exports(state)
    for note in notes:
        _say(f"# {note}")
    for key, value in exports.items():
        print(f"export {key}={shlex.quote(value)}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def dispatcher(ctx: typer.Context, run_dir: RunDir = None) -> None:
    """Run a dispatcher in the foreground on this stack, set up like the demo's (Ctrl-C stops it).

    Other options go to `llmbatch dispatcher run` (e.g. --max-in-flight 2, --metrics-port 0).
    Your LLMBATCH_* settings win over the local defaults; the stack's addresses win over both.
    """
    from llmbatch.stack.model import cached_model

    folder = run_dir or default_run_dir()
    state = StackState.load(folder)
    missing = [n for n in manager.ALL_SERVICES if n not in state.services or not alive(state.services[n].pid)]
    if missing:
        _say(
            f"error: {', '.join(missing)} not running in {folder}: start the stack with "
            "`.venv/bin/llmbatch stack up` (or `LLMBATCH_DEMO_KEEP=1 make demo`)"
        )
        raise typer.Exit(1)
    model_path = cached_model()
    if model_path is None:
        _say(
            "error: the local model is not prepared: run `.venv/bin/llmbatch stack prepare` "
            "(converts it once, about 1 min)"
        )
        raise typer.Exit(1)
    env = dispatcher_environ(state, model_path, extra_defaults={"LLMBATCH_DISPATCHER__LOG_JSON": "false"})
    argv = [sys.executable, "-m", "llmbatch", "dispatcher", "run", *ctx.args]
    _say(
        f"[dispatcher] on the stack in {folder}: jobs run {model_path} with {sys.executable}; Ctrl-C stops it"
    )
    # replace this process: Ctrl-C and SIGTERM reach the dispatcher, which stops gracefully itself
    os.execve(sys.executable, argv, env)  # noqa: S606 - our own interpreter, fixed argv
