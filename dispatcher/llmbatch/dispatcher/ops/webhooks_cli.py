"""``llmbatch webhooks dead | pending``: the webhook deliveries in Redis, for operators (read only)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from llmbatch.dispatcher.ops.common import emit_json, load_settings, open_store, out, run
from llmbatch.dispatcher.webhooks.store import WebhookStore

app = typer.Typer(
    help="Webhook deliveries (the dispatchers' queue in Redis).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")]
FIELDS = ("tenant", "endpoint", "batch_id", "type", "event_id", "attempts", "last_status", "last_error")


@app.command()
def dead(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="How many, newest first.")] = 100,
    as_json: JsonOption = False,
) -> None:
    """Deliveries that ran out of retries (kept LLMBATCH_WEBHOOKS__DEAD_TTL_S)."""
    settings = load_settings(ctx)

    async def body() -> list[dict[str, str]]:
        store = await open_store(settings)
        try:
            return await WebhookStore(store.client, store.keys).dead(limit)
        finally:
            await store.close()

    rows = run(body)
    if as_json:
        emit_json([{k: row.get(k, "") for k in FIELDS} for row in rows])
        return
    table = Table(*FIELDS)
    for row in rows:
        table.add_row(*(row.get(k, "")[:80] for k in FIELDS))
    out.print(table)


@app.command()
def pending(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """How many deliveries wait (due now or later, being attempted included)."""
    settings = load_settings(ctx)

    async def body() -> int:
        store = await open_store(settings)
        try:
            return await WebhookStore(store.client, store.keys).depth()
        finally:
            await store.close()

    depth = run(body)
    if as_json:
        emit_json({"pending": depth})
    else:
        out.print(f"{depth} webhook deliveries pending")
