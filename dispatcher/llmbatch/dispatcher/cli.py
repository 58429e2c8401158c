"""``llmbatch dispatcher run``: the service process (the lead mounts :data:`app` on ``llmbatch``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

if TYPE_CHECKING:
    from llmbatch.dispatcher.security.kafka_acl import AclBinding
    from llmbatch.dispatcher.security.kafka_acl_admin import ApplyReport
    from llmbatch.dispatcher.settings import DispatcherSettings

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
    from llmbatch.dispatcher.service import serve

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

    from llmbatch.dispatcher.domain.keys import Keys
    from llmbatch.dispatcher.security.redis_acl import ROLES, acl_lines

    passwords = {
        r: os.environ[ACL_PASSWORD_ENV.format(r.upper())]
        for r in ROLES
        if os.environ.get(ACL_PASSWORD_ENV.format(r.upper()))
    }
    if not passwords:
        names = ", ".join(ACL_PASSWORD_ENV.format(r.upper()) for r in ROLES)
        _fail(f"no password given: set one or more of {names}")
    try:
        typer.echo("\n".join(acl_lines(Keys(prefix), passwords)))
    except ValueError as exc:
        _fail(str(exc))


@app.command("kafka-acl")
def kafka_acl(
    user: Annotated[
        list[str] | None,
        typer.Option(
            "--user",
            metavar="ROLE=NAME",
            help="The SASL user of a role (producer, dispatcher, operator); repeat for more users of a "
            "role. Default: a user named like the role.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the bindings as a JSON list.")] = False,
    apply: Annotated[
        bool,
        typer.Option(
            "--apply",
            help="Create the missing topics and the missing bindings on the broker of LLMBATCH_KAFKA__*, "
            "whose SASL user must be a super user. Idempotent; other ACLs are listed, not removed.",
        ),
    ] = False,
) -> None:
    """Print the Kafka ACL bindings of each role: the producer writes requests (and follows results),
    only the dispatcher reads requests (in its group, LLMBATCH_DISPATCHER__GROUP_ID) and writes results
    and dead letters, the operator reads dead letters and replays to the requests topic.

    Topic names come from LLMBATCH_KAFKA__TOPICS__*. Every binding is an ALLOW on one literal topic or
    group; no role gets Create or anything on the cluster (the admin creates the topics: --apply)."""
    import orjson

    from llmbatch.dispatcher.security.kafka_acl import ROLES, Role, acl_bindings, check_user, render

    users: dict[Role, list[str]] = {}
    for item in user or []:
        role, sep, name = item.partition("=")
        if not sep or not name:
            _fail(f"--user takes ROLE=NAME (e.g. --user producer=batch-api), got {item!r}")
        if role not in ROLES:
            _fail(f"--user {item!r}: unknown role {role!r}, one of {', '.join(ROLES)}")
        try:
            users.setdefault(role, []).append(check_user(name))
        except ValueError as exc:
            _fail(f"--user {item!r}: {exc}")
    settings = _settings_or_exit()
    try:
        bindings = acl_bindings(settings.kafka.topics, settings.dispatcher.group_id, users)
    except ValueError as exc:
        _fail(str(exc))
    if not apply:
        if as_json:
            typer.echo(orjson.dumps([b.model_dump() for b in bindings], option=orjson.OPT_INDENT_2).decode())
        else:
            typer.echo(render(bindings))
        return
    if settings.kafka.security_protocol == "PLAINTEXT":
        _fail(
            "--apply needs the admin's credentials: set LLMBATCH_KAFKA__SECURITY_PROTOCOL (SASL_SSL or "
            "SASL_PLAINTEXT), LLMBATCH_KAFKA__SASL_MECHANISM, _SASL_USERNAME and _SASL_PASSWORD"
        )
    _apply_kafka_acl(settings, bindings, as_json)


def _apply_kafka_acl(settings: DispatcherSettings, bindings: list[AclBinding], as_json: bool) -> None:
    import orjson

    from llmbatch.adapters.errors import ProducerError
    from llmbatch.adapters.topics import ensure_topics
    from llmbatch.dispatcher.errors import DispatcherError
    from llmbatch.dispatcher.security.kafka_acl_admin import apply_bindings

    async def both() -> tuple[list[str], ApplyReport]:
        try:
            topics = await ensure_topics(settings.kafka)
        except ProducerError as exc:
            # a refused login shows up here first: ask the login why before calling it an outage
            from llmbatch.adapters.kafka import authentication_failure

            raise DispatcherError(await authentication_failure(settings.kafka) or exc.message) from exc
        return topics, await apply_bindings(settings.kafka, bindings)

    try:
        topics, report = asyncio.run(both())
    except DispatcherError as exc:
        _fail(str(exc), code=1)
    if as_json:
        typer.echo(
            orjson.dumps(
                {"topics_created": topics, **report.model_dump()}, option=orjson.OPT_INDENT_2
            ).decode()
        )
        return
    if topics:
        typer.echo(f"created topic(s): {', '.join(topics)}")
    typer.echo(f"{len(report.created)} binding(s) created, {len(report.present)} already present")
    for binding in report.created:
        typer.echo(f"  created {binding.principal} {binding.describe()}")
    if report.other:
        typer.echo(f"{len(report.other)} other ACL(s) of these users (not llmbatch's plan, left alone):")
        typer.echo("\n".join(f"  {line}" for line in report.other))


@app.command("minio-tenant")
def minio_tenant(
    tenant: Annotated[str, typer.Argument(help="The tenant whose worker pool the policy is for.")],
    user: Annotated[
        str | None,
        typer.Option(help="The pool's MinIO user (access key). Default: llmbatch-tenant-<tenant>."),
    ] = None,
    apply: Annotated[
        bool,
        typer.Option(
            "--apply",
            help="Create or replace the policy on the MinIO of LLMBATCH_S3__* (whose keys must be an "
            "admin's) and make it the user's only policy; the user is created (or its secret reset) when "
            "LLMBATCH_TENANT_S3_SECRET_KEY is set.",
        ),
    ] = False,
) -> None:
    """Print (or --apply) the MinIO policy of a tenant's worker pool: its jobs read inputs and read and
    write results only under <bucket>/<tenant>/ (buckets from LLMBATCH_S3__*), nothing else.

    Give the pool's Ray nodes that user's keys (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in their
    environment) and list the tenant in LLMBATCH_TENANTS__POOLS."""
    import os

    import orjson

    from llmbatch.dispatcher.security.minio_admin import SECRET_ENV, apply_tenant_policy
    from llmbatch.dispatcher.security.minio_policy import tenant_policy
    from llmbatch.schemas.common import check_tenant

    try:
        check_tenant(tenant)
    except ValueError as exc:
        _fail(str(exc))
    settings = _settings_or_exit()
    if not apply:
        document = tenant_policy(
            tenant, input_buckets=settings.s3.readable_buckets(), results_bucket=settings.s3.results_bucket
        )
        typer.echo(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())
        return
    from llmbatch.dispatcher.errors import DispatcherError

    try:
        report = apply_tenant_policy(
            settings.s3, tenant, user=user, secret_key=os.environ.get(SECRET_ENV) or None
        )
    except DispatcherError as exc:
        _fail(str(exc), code=1)
    created = "created" if report.user_created else "updated"
    typer.echo(
        f"policy {report.policy} applied; user {report.user} {created}, its policies: "
        f"{', '.join(report.policies_of_user) or '(none)'}"
    )


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _warn_legacy_settings() -> None:
    """Model and engine settings moved into LLMBATCH_ENGINES__MODELS; the old names are ignored."""
    import os

    legacy = sorted(k for k in os.environ if k in _LEGACY_NAMES or k.startswith("LLMBATCH_JOB__ENGINE__"))
    if legacy:
        typer.echo(
            f"warning: {', '.join(legacy)} no longer read: each model's path and engine settings are "
            "its entry in LLMBATCH_ENGINES__MODELS",
            err=True,
        )


_LEGACY_NAMES = frozenset({"LLMBATCH_JOB__MODEL_PATH", "LLMBATCH_JOB__MODEL_PATHS", "LLMBATCH_JOB__ENGINE"})


def _settings_or_exit() -> DispatcherSettings:
    from llmbatch.dispatcher.settings_loader import SettingsInvalid, load_settings

    try:
        return load_settings()
    except SettingsInvalid as exc:
        _fail(str(exc))
