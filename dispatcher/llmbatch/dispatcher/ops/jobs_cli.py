"""``llmbatch jobs list | get | cancel``: what the dispatcher knows about batches, from Redis.

``list`` and ``get`` only read Redis; ``cancel`` publishes ``batch.cancel_requested`` on the requests
topic (through the producer SDK, like any upstream service) after checking that the batch exists
and has not ended. Every command takes ``--json``.
"""

from __future__ import annotations

import getpass
import socket
from datetime import timedelta
from typing import Annotated, Any

import typer
from rich.table import Table

from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.ops.common import (
    EXIT_TIMEOUT,
    EXIT_USAGE,
    OpsError,
    ago,
    emit_json,
    err,
    from_ts,
    load_settings,
    open_store,
    out,
    parse_when,
    run,
    show_time,
)
from llmbatch.dispatcher.ops.jobs import JobDetail, JobSummary, get_job, list_jobs

app = typer.Typer(
    help="Inspect and cancel batches (the dispatcher's state in Redis).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")]


def operator_name() -> str:
    """``user@host`` of whoever runs the command (recorded as requested_by / replayed_by)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname() or 'localhost'}"


def parse_states(values: list[str] | None) -> list[State]:
    chosen: list[State] = []
    for value in values or []:
        for part in value.split(","):
            name = part.strip().lower()
            if not name:
                continue
            try:
                chosen.append(State(name))
            except ValueError:
                raise OpsError(
                    f"--state {part!r}: unknown state; choose from {', '.join(s.value for s in State)}",
                    EXIT_USAGE,
                ) from None
    return chosen


def _done(summary: JobSummary) -> str:
    c = summary.counts
    if not c.total and not c.completed and not c.failed:
        return "-"
    failed = f" ({c.failed} failed)" if c.failed else ""
    return f"{c.completed + c.failed}/{c.total or '?'}{failed}"


@app.command("list")
def list_command(
    ctx: typer.Context,
    state: Annotated[
        list[str] | None,
        typer.Option("--state", "-s", help="Only these states (repeatable or comma-separated)."),
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Entered its state at/after this: 30m, 2h, 1d or an RFC 3339 time.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="At most this many, newest first.")] = 50,
    json_output: JsonOption = False,
) -> None:
    """List batches, newest state change first."""
    settings = load_settings(ctx)

    async def body() -> list[JobSummary]:
        states = parse_states(state)
        start = parse_when(since, "--since")
        store = await open_store(settings)
        try:
            return await list_jobs(store, states=states, since=start, limit=limit)
        finally:
            await store.close()

    jobs = run(body)
    if json_output:
        emit_json({"jobs": [j.model_dump(mode="json") for j in jobs], "count": len(jobs)})
        return
    if not jobs:
        err.print("no batches match")
        return
    table = Table("batch id", "state", "since", "attempt", "done", "tenant", "model", "error")
    for job in jobs:
        table.add_row(
            job.batch_id,
            job.state.value,
            ago(job.state_at),
            str(job.attempt or "-"),
            _done(job),
            job.tenant,
            job.model,
            job.error_code or "",
        )
    out.print(table)
    err.print(f"{len(jobs)} batch(es)")


def _print_detail(job: JobDetail) -> None:
    facts = Table(show_header=False, box=None, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    rows: list[tuple[str, Any]] = [
        ("batch id", job.batch_id),
        ("state", f"{job.state.value} (since {show_time(job.state_at)}, {ago(job.state_at)})"),
        ("tenant / model", f"{job.tenant} / {job.model}"),
        ("endpoint", job.endpoint),
        ("priority", job.priority),
        ("input", job.input_uri or "inline requests"),
        ("accepted", show_time(job.accepted_at)),
        ("deadline", show_time(job.deadline)),
        ("started", show_time(job.started_at)),
        ("finished", show_time(job.finished_at)),
        (
            "requests",
            f"{job.counts.total} total, {job.counts.completed} completed, {job.counts.failed} failed",
        ),
        ("tokens", f"{job.usage.prompt_tokens} prompt, {job.usage.completion_tokens} completion"),
        (
            "attempts",
            ", ".join(a.submission_id + (" (current)" if a.current else "") for a in job.attempts)
            or "none started",
        ),
    ]
    if job.started_at is not None and not job.state.is_terminal:  # after "deadline"
        end = "unknown yet" if job.expected_finish_at is None else show_time(job.expected_finish_at)
        rows.insert(8, ("expected end", end + (" (AT RISK: after the deadline)" if job.at_risk else "")))
    if job.metadata:
        rows.append(("metadata", ", ".join(f"{k}={v}" for k, v in sorted(job.metadata.items()))))
    if job.last_error:
        rows.append(("last error", f"{job.last_error.code}: {job.last_error.message}"))
    if job.dlt_reason:
        rows.append(("dead-letter reason", job.dlt_reason))
    if job.replay_id:
        rows.append(("replayed as", f"{job.replay_id} (lifecycle {job.generation})"))
    if job.cancel_requested:
        rows.append(("cancel", "requested"))
    if job.terminal_event_id:
        published = "published" if job.terminal_event_published else "not yet published"
        rows.append(("terminal event", f"{job.terminal_event_id} ({published})"))
    if job.manifest_uri:
        rows.append(("manifest", job.manifest_uri))
    for uri in job.output_uris:
        rows.append(("output", uri))
    for uri in job.error_uris:
        rows.append(("errors", uri))
    for name, value in rows:
        facts.add_row(name, "-" if value is None else str(value))
    out.print(facts)
    if job.timeline:
        timeline = Table("time", "step", "detail", title="timeline (latest entry into each step)")
        for entry in job.timeline:
            timeline.add_row(show_time(entry.at), entry.step, entry.detail or "")
        out.print(timeline)


@app.command("get")
def get_command(
    ctx: typer.Context,
    batch_id: Annotated[str, typer.Argument(help="The batch id.", show_default=False)],
    tenant: Annotated[
        str, typer.Option(help="The tenant whose batch it is (batch ids are scoped by tenant).")
    ] = "default",
    json_output: JsonOption = False,
) -> None:
    """Show one batch: state timeline, attempts and Ray submission ids, counts, results, last error."""
    settings = load_settings(ctx)

    async def body() -> JobDetail:
        store = await open_store(settings)
        try:
            job = await get_job(store, batch_id, tenant)
        finally:
            await store.close()
        if job is None:
            raise OpsError(
                f"no batch {batch_id!r} of tenant {tenant!r} in Redis at this key prefix "
                f"({settings.redis.key_prefix!r}); "
                "finished batches are kept for LLMBATCH_DISPATCHER__FINISHED_TTL_S (7 days by default)"
            )
        return job

    job = run(body)
    if json_output:
        emit_json(job.model_dump(mode="json"))
    else:
        _print_detail(job)


@app.command("cancel")
def cancel_command(
    ctx: typer.Context,
    batch_id: Annotated[str, typer.Argument(help="The batch to cancel.", show_default=False)],
    reason: Annotated[str | None, typer.Option(help="Why (kept with the batch for audit).")] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Publish the cancel even if Redis does not know the batch.")
    ] = False,
    tenant: Annotated[
        str, typer.Option(help="The tenant whose batch it is (batch ids are scoped by tenant).")
    ] = "default",
    wait: Annotated[bool, typer.Option("--wait", help="Wait for the batch's terminal event.")] = False,
    timeout: Annotated[float, typer.Option(min=1, help="With --wait: seconds to wait at most.")] = 300.0,
    json_output: JsonOption = False,
) -> None:
    """Ask the dispatcher to cancel a batch: its Ray job is stopped, partial results are kept."""
    settings = load_settings(ctx)

    async def body() -> dict[str, Any]:
        from llmbatch.adapters.errors import ProducerError, WaitTimeout
        from llmbatch.producer.client import BatchClient, ClientOptions

        store = await open_store(settings)
        try:
            record = await store.get(batch_key(tenant, batch_id))
        finally:
            await store.close()
        if record is None and not force:
            raise OpsError(
                f"no batch {batch_id!r} of tenant {tenant!r} in Redis; pass --force to publish "
                "the cancel anyway"
            )
        if record is not None and record.state.is_terminal:
            raise OpsError(f"batch {batch_id!r} already ended {record.state.value}; nothing to cancel")
        result: dict[str, Any] = {
            "batch_id": batch_id,
            "state": record.state.value if record is not None else None,
            "requested_by": operator_name(),
        }
        options = ClientOptions(connect_timeout_s=5.0, publish_timeout_s=15.0)
        try:
            async with BatchClient(settings, options=options) as client:
                published = await client.cancel(
                    batch_id,
                    tenant=tenant,
                    reason=reason,
                    requested_by=result["requested_by"],
                )
                result["published"] = {
                    "topic": published.topic,
                    "partition": published.partition,
                    "offset": published.offset,
                }
                if not json_output:
                    err.print(
                        f"cancel requested for {batch_id} (was {result['state'] or 'unknown'}); the "
                        "dispatcher stops its job and publishes 'cancelled' with the partial results",
                        markup=False,
                    )
                if wait:
                    accepted = record.number("accepted_at") if record is not None else None
                    since = None
                    start = from_ts(accepted)
                    if start is not None:
                        since = start - timedelta(minutes=5)
                    terminal = await client.wait(batch_id, timeout, since=since, tenant=tenant)
                    result["terminal"] = {
                        "type": terminal.type.value,
                        "id": terminal.id,
                        "status": str(terminal.data.status),
                    }
                    if not json_output:
                        err.print(f"{batch_id} ended {terminal.data.status}", markup=False)
        except WaitTimeout as exc:
            raise OpsError(exc.message, EXIT_TIMEOUT) from None
        except ProducerError as exc:
            raise OpsError(exc.message) from None
        return result

    result = run(body)
    if json_output:
        emit_json(result)
