"""``llmbatch dispatcher run``: the service process (the lead mounts :data:`app` on ``llmbatch``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

if TYPE_CHECKING:
    from dispatcher.settings import DispatcherSettings

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
    """Run until SIGTERM/SIGINT. Settings come from LLMBATCH_* environment variables or .env.

    Refuses to start (exit 2, one ``error:`` line) on invalid settings or when no model is
    configured in LLMBATCH_ENGINES__MODELS."""
    from dispatcher.service import serve

    settings = _settings_or_exit()
    _warn_legacy_settings()
    problem = settings.serving_problem()
    if problem is not None:
        _fail(problem)
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

    typer.echo(orjson.dumps(_settings_or_exit().redacted(), option=orjson.OPT_INDENT_2).decode())


ACL_PASSWORD_ENV = "LLMBATCH_REDIS_ACL_{}_PASSWORD"  # noqa: S105 (a variable name)


@app.command("redis-acl")
def redis_acl(
    prefix: Annotated[str, typer.Option(help="The key prefix (LLMBATCH_REDIS__KEY_PREFIX).")] = "llmbatch",
) -> None:
    """Print Redis ACL file lines: a dispatcher user (its keys, no dangerous commands), a job user
    (only the progress hashes) and an operator user (reads; writes only the replay ledger).

    Each user whose password is in LLMBATCH_REDIS_ACL_<ROLE>_PASSWORD (ROLE: DISPATCHER, JOB,
    OPERATOR) is printed, with the password's SHA-256 only. Load the lines with Redis's ``aclfile``
    (or as ``user`` lines of redis.conf); point the jobs at the job user with
    LLMBATCH_JOB__REDIS_USERNAME=job."""
    import os

    from dispatcher.keys import Keys
    from dispatcher.redis_acl import ROLES, acl_lines

    passwords = {r: os.environ[ACL_PASSWORD_ENV.format(r.upper())] for r in ROLES
                 if os.environ.get(ACL_PASSWORD_ENV.format(r.upper()))}
    if not passwords:
        names = ", ".join(ACL_PASSWORD_ENV.format(r.upper()) for r in ROLES)
        _fail(f"no password given: set one or more of {names}")
    try:
        typer.echo("\n".join(acl_lines(Keys(prefix), passwords)))
    except ValueError as exc:
        _fail(str(exc))


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _warn_legacy_settings() -> None:
    """Model and engine settings moved into LLMBATCH_ENGINES__MODELS; the old names are ignored."""
    import os

    legacy = sorted(
        k for k in os.environ if k in _LEGACY_NAMES or k.startswith("LLMBATCH_JOB__ENGINE__")
    )
    if legacy:
        typer.echo(
            f"warning: {', '.join(legacy)} no longer read: each model's path and engine settings are "
            "its entry in LLMBATCH_ENGINES__MODELS",
            err=True,
        )


_LEGACY_NAMES = frozenset({"LLMBATCH_JOB__MODEL_PATH", "LLMBATCH_JOB__MODEL_PATHS", "LLMBATCH_JOB__ENGINE"})


def _settings_or_exit() -> DispatcherSettings:
    from dispatcher.settings import SettingsInvalid, load_settings

    try:
        return load_settings()
    except SettingsInvalid as exc:
        _fail(str(exc))
