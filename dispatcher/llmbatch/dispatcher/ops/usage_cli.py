"""``llmbatch usage``: tokens, requests and batches per tenant, model and end state over a range of
days, from the durable usage record in Redis (what a bill is built from; read only)."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, date, datetime
from typing import Annotated

import typer
from rich.table import Table

from llmbatch.adapters import storage
from llmbatch.dispatcher.domain.usage import COUNTERS, DayUsage, UsageRow, totals
from llmbatch.dispatcher.ops import usage
from llmbatch.dispatcher.ops.common import EXIT_USAGE, emit_json, fail, load_settings, open_store, out, run
from llmbatch.dispatcher.runs import stored_bytes
from llmbatch.schemas.errors import LLMBatchError
from llmbatch.settings import S3Settings

app = typer.Typer(
    help="Usage per tenant (tokens, requests, batches), from the durable usage record in Redis.",
    pretty_exceptions_enable=False,
    add_completion=False,
    invoke_without_command=True,
)


def _day(text: str | None, default: date, name: str) -> date:
    if text is None:
        return default
    try:
        return date.fromisoformat(text)
    except ValueError:
        fail(f"{name} must be a day as YYYY-MM-DD (got {text[:40]!r})", EXIT_USAGE)


@app.callback()
def report(
    ctx: typer.Context,
    tenant: Annotated[
        list[str] | None, typer.Option("--tenant", "-t", help="Only this tenant (repeatable); default: all.")
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="First day, YYYY-MM-DD (UTC); default: the 1st of this month.")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="Last day, YYYY-MM-DD (UTC), included; default: today.")
    ] = None,
    by_day: Annotated[bool, typer.Option("--by-day", help="One row per day, not the range's sums.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")] = False,
    stored: Annotated[
        bool,
        typer.Option(
            "--stored",
            help="Instead: the bytes each tenant keeps now in the input and results buckets (lists them).",
        ),
    ] = False,
) -> None:
    """Usage of batches that ended from --since to --until, per tenant, model and end state."""
    settings = load_settings(ctx)
    if stored:
        _stored(settings.s3, tenant, as_json)
        return
    today = datetime.now(UTC).date()
    first = _day(since, today.replace(day=1), "--since")
    last = _day(until, today, "--until")
    try:
        usage.check_range(first, last)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)

    async def body() -> dict[str, list[DayUsage]]:
        store = await open_store(settings)
        try:
            names = tenant or await usage.tenants(store.client, store.keys)
            return {t: await usage.tenant_usage(store.client, store.keys, t, first, last) for t in names}
        finally:
            await store.close()

    found = run(body)
    rows: list[tuple[str, str, UsageRow]] = []
    for name, per_day in found.items():
        if by_day:
            rows += [(name, d.day, r) for d in per_day for r in d.rows]
        else:
            rows += [(name, f"{first}..{last}", r) for r in totals(per_day)]
    if as_json:
        emit_json([{"tenant": t, "days": span, **asdict(r)} for t, span, r in rows])
        return
    table = Table("tenant", "days", "model", "status", *COUNTERS)
    for t, span, r in rows:
        table.add_row(t, span, r.model, r.status, *(str(getattr(r, c)) for c in COUNTERS))
    out.print(table)


def _stored(s3: S3Settings, only: list[str] | None, as_json: bool) -> None:
    """Bytes per tenant in both buckets, from one listing of each (no object is read)."""
    try:
        sizes = stored_bytes.measure(s3, storage.make_client(s3))
    except LLMBatchError as exc:
        fail(str(exc))
    names = sorted(set(only or []) or {t for per in sizes.values() for t in per})
    rows = [{"tenant": t, **{f"{k}_bytes": sizes[k].get(t, 0) for k in sizes}} for t in names]
    if as_json:
        emit_json(rows)
        return
    table = Table("tenant", "input bytes", "results bytes")
    for row in rows:
        table.add_row(str(row["tenant"]), str(row["input_bytes"]), str(row["results_bytes"]))
    out.print(table)
