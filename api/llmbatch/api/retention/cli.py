"""``llmbatch retention collect | pending``: run the collector once (from a cron job, or with the API's own
collector off), and see what waits to expire."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Annotated

import typer

from llmbatch.api.retention.collector import Collector, Report
from llmbatch.dispatcher.ops.common import emit_json, load_settings, open_store, out, run
from llmbatch.dispatcher.state.retention import RetentionIndex
from llmbatch.settings import LLMBatchSettings

app = typer.Typer(
    help="Retention: delete expired files, results and state (LLMBATCH_RETENTION__*).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of text.")]


def collector_of(settings: LLMBatchSettings, index: RetentionIndex) -> Collector:
    """The collector the API runs, over ``settings``' MinIO and ``index``."""
    from llmbatch.api.settings import ApiOptions
    from llmbatch.api.store.state import RedisStateReader
    from llmbatch.api.store.storage import MinioObjectStore
    from llmbatch.dispatcher.state.store import StateStore

    return Collector.over(
        index,
        MinioObjectStore(settings.s3),
        RedisStateReader(StateStore(index.client, index.keys)),
        input_bucket=settings.s3.input_bucket,
        results_bucket=settings.s3.results_bucket,
        settings=settings.retention,
        fallback_after_s=ApiOptions().state_fallback_after_s,
    )


@app.command()
def collect(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="Members claimed per pass.")] = 100,
    as_json: JsonOption = False,
) -> None:
    """Delete everything that has expired, once, and report what went (safe beside the API's collector)."""
    settings = load_settings(ctx)

    async def body() -> Report:
        store = await open_store(settings)
        try:
            return await collector_of(settings, RetentionIndex(store.client, store.keys)).collect(limit=limit)
        finally:
            await store.close()

    report = run(body)
    if as_json:
        emit_json(asdict(report))
        return
    out.print(
        f"removed {report.batches} batch lifecycles ({report.result_objects} result objects) and "
        f"{report.files} uploaded files; left {report.in_use} files a running batch reads and "
        f"{report.reopened} reopened batches; {report.lost} taken over by another collector, "
        f"{report.invalid} invalid entries dropped"
        + (
            f"; {report.failed} failed (tried again later), first: {report.first_error}"
            if report.failed
            else ""
        )
    )


@app.command()
def pending(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """How many files and batch lifecycles have an expiry date, and how many of them have passed it."""
    settings = load_settings(ctx)

    async def body() -> tuple[int, int]:
        store = await open_store(settings)
        try:
            return await RetentionIndex(store.client, store.keys).pending(time.time())
        finally:
            await store.close()

    total, due = run(body)
    if as_json:
        emit_json({"dated": total, "expired": due})
    else:
        out.print(f"{total} files and batch lifecycles dated, {due} of them expired (to collect)")
