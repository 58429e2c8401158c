"""``llmbatch engines list | deploy | scale | stop``: the shared engines of the model registry.

Each model of ``LLMBATCH_ENGINES__MODELS`` runs as one Ray Serve application on the cluster
(:mod:`ray_job.serve_engine`). ``deploy`` applies the registry to the cluster (the dispatcher does
the same when it starts, with ``LLMBATCH_ENGINES_DEPLOY`` on); ``scale`` and ``stop`` change one
model until the next deploy from settings. Every command takes ``--json`` where it prints.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.table import Table

from dispatcher.engines import EngineStatus, cluster_serve_config, summarize, with_scaling, without
from dispatcher.ops.common import OpsError, emit_json, err, load_settings, out, run
from dispatcher.serve_api import ServeApi
from dispatcher.settings import DispatcherSettings
from schemas.engines import EngineRegistry, UnknownModelError

app = typer.Typer(
    help="Inspect and manage the shared engines (one Ray Serve application per model).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")]
Model = Annotated[str, typer.Argument(help="A model name of the registry (LLMBATCH_ENGINES__MODELS).")]


def load(ctx: typer.Context | None) -> DispatcherSettings:
    """The dispatcher's settings (the registry lives there); a bad environment is a usage error."""
    try:
        return load_settings(ctx, DispatcherSettings)
    except OpsError as exc:
        raise typer.BadParameter(str(exc)) from None


def _known(registry: EngineRegistry, model: str) -> None:
    try:
        registry.get(model)
    except UnknownModelError as exc:
        raise OpsError(str(exc)) from None


def _print(rows: list[EngineStatus], as_json: bool) -> None:
    if as_json:
        emit_json({"engines": [r.__dict__ | {"running": r.running} for r in rows]})
        return
    table = Table("model", "application", "status", "replicas", "min..max", "message")
    for r in rows:
        replicas = ", ".join(f"{n} {state.lower()}" for state, n in sorted(r.replicas.items())) or "0"
        table.add_row(r.model, r.app, r.status, replicas, f"{r.min_replicas}..{r.max_replicas}", r.message)
    out.print(table)


@app.command("list")
def list_command(ctx: typer.Context, json_output: JsonOption = False) -> None:
    """Each model of the registry: its Serve application, status and replicas."""
    settings = load(ctx)

    async def body() -> list[EngineStatus]:
        details = await ServeApi(settings.ray.address).status()
        return summarize(settings.engines, details)

    rows = run(body)
    if not rows:
        err.print("no models configured (LLMBATCH_ENGINES__MODELS)")
    _print(rows, json_output)


def _apply(settings: DispatcherSettings, registry: EngineRegistry,
           shown: EngineRegistry | None = None) -> list[EngineStatus]:
    """Deploy ``registry``; report on ``shown`` (default the same)."""

    async def body() -> list[EngineStatus]:
        api = ServeApi(settings.ray.address, timeout_s=120)
        await api.deploy(cluster_serve_config(settings, registry))
        return summarize(shown or registry, await api.status())

    return run(body)


@app.command()
def deploy(ctx: typer.Context, json_output: JsonOption = False) -> None:
    """Apply the registry to the cluster (adds, changes and removes applications to match it)."""
    settings = load(ctx)
    _print(_apply(settings, settings.engines), json_output)


@app.command()
def scale(
    ctx: typer.Context,
    model: Model,
    min_replicas: Annotated[int | None, typer.Option("--min", min=0, help="Replicas kept when idle.")] = None,
    max_replicas: Annotated[int | None, typer.Option("--max", min=1, help="Most replicas.")] = None,
    json_output: JsonOption = False,
) -> None:
    """Change one model's replica range (until the next deploy from settings)."""
    settings = load(ctx)
    changes: dict[str, Any] = {}
    if min_replicas is not None:
        changes["min_replicas"] = min_replicas
    if max_replicas is not None:
        changes["max_replicas"] = max_replicas
    if not changes:
        raise typer.BadParameter("give --min and/or --max")

    def registry() -> EngineRegistry:
        _known(settings.engines, model)
        return with_scaling(settings.engines, model, **changes)

    try:
        scaled = registry()
    except ValidationError as exc:
        raise typer.BadParameter(exc.errors(include_url=False)[0]["msg"]) from None
    except OpsError as exc:
        raise typer.BadParameter(str(exc)) from None
    _print(_apply(settings, scaled), json_output)


@app.command()
def stop(ctx: typer.Context, model: Model, json_output: JsonOption = False) -> None:
    """Remove one model's application (its replicas stop; batches of it wait, then fail)."""
    settings = load(ctx)
    try:
        _known(settings.engines, model)
    except OpsError as exc:
        raise typer.BadParameter(str(exc)) from None
    _print(_apply(settings, without(settings.engines, model), settings.engines), json_output)
