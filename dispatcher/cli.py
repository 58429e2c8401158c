"""``llmbatch dispatcher run``: the service process (the lead mounts :data:`app` on ``llmbatch``)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

app = typer.Typer(
    help="The dispatcher service: consume batch requests, run Ray jobs, publish results.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.command()
def run(
    max_in_flight: Annotated[
        int | None, typer.Option(help="Override LLMBATCH_DISPATCHER__MAX_IN_FLIGHT.")
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Override LLMBATCH_DISPATCHER__METRICS_PORT.")
    ] = None,
    instance_id: Annotated[str | None, typer.Option(help="Name of this replica (logs, leases).")] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG, INFO, WARNING, ...")] = None,
) -> None:
    """Run until SIGTERM/SIGINT. Settings come from LLMBATCH_* environment variables or .env."""
    from dispatcher.service import serve
    from dispatcher.settings import DispatcherSettings

    settings = DispatcherSettings()
    overrides = {
        k: v
        for k, v in {
            "max_in_flight": max_in_flight,
            "metrics_port": metrics_port,
            "instance_id": instance_id,
            "log_level": log_level,
        }.items()
        if v is not None
    }
    if overrides:
        settings = settings.model_copy(
            update={"dispatcher": settings.dispatcher.model_copy(update=overrides)}
        )
    raise typer.Exit(asyncio.run(serve(settings)))


@app.command("settings")
def show_settings() -> None:
    """Print the effective settings as JSON (secrets masked)."""
    import orjson

    from dispatcher.settings import DispatcherSettings

    typer.echo(orjson.dumps(DispatcherSettings().redacted(), option=orjson.OPT_INDENT_2).decode())
