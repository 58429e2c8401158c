"""``llmbatch dlq list | inspect | replay``: look at dead letters and replay them safely.

``replay`` is a dry run unless ``--execute`` is given: it prints what it would replay and why. See
:mod:`llmbatch.dispatcher.ops.replay` for the rules (refusals, provenance headers, rerun safety).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from llmbatch.dispatcher.ops.common import (
    EXIT_ERROR,
    EXIT_INCOMPLETE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    OpsError,
    emit_json,
    err,
    load_settings,
    open_store,
    out,
    parse_when,
    run,
    show_time,
)
from llmbatch.dispatcher.ops.dlq_reader import (
    DeadLetterView,
    Snapshot,
    existing_topics,
    parse_locator,
    read_dead_letters,
)
from llmbatch.dispatcher.ops.dlq_render import (
    entry_json,
    original,
    plan_table,
    print_letter,
    print_summary,
    short,
)
from llmbatch.dispatcher.ops.jobs_cli import operator_name
from llmbatch.dispatcher.ops.replay import (
    Decision,
    LedgerEntry,
    RateLimiter,
    ReplayFilter,
    ReplayItem,
    Summary,
    parse_rate,
)
from llmbatch.dispatcher.ops.replay_publish import Outcome, ReplayLedger, execute, plan_replays
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.settings import LLMBatchSettings

app = typer.Typer(
    help="Dead letters: list, inspect and replay records of the dead-letter topic.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of tables.")]
TopicOption = Annotated[
    str | None,
    typer.Option("--topic", help="Dead-letter topic (default: LLMBATCH_KAFKA__TOPICS__DEAD_LETTER)."),
]
ReasonOption = Annotated[
    list[str] | None,
    typer.Option("--reason", "-r", help="Only this llmbatch-dlt-reason (repeatable or comma-separated)."),
]
KeyOption = Annotated[
    list[str] | None, typer.Option("--key", "-k", help="Only this record key = batch id (repeatable).")
]
SinceOption = Annotated[
    str | None, typer.Option(help="Dead-lettered at/after: 30m, 2h, 1d or an RFC 3339 time.")
]
UntilOption = Annotated[
    str | None, typer.Option(help="Dead-lettered at/before: 30m (ago), 1d or an RFC 3339 time.")
]


def _split(values: list[str] | None) -> frozenset[str]:
    return frozenset(p.strip() for v in values or [] for p in v.split(",") if p.strip())


def _filter(
    reason: list[str] | None, key: list[str] | None, since: str | None, until: str | None, limit: int | None
) -> ReplayFilter:
    start, end = parse_when(since, "--since"), parse_when(until, "--until")
    if start is not None and end is not None and end < start:
        raise OpsError("--until is before --since: nothing can match", EXIT_USAGE)
    return ReplayFilter(reasons=_split(reason), keys=_split(key), since=start, until=end, limit=limit)


def _hidden(settings: LLMBatchSettings) -> str:
    """Kafka lists only the topics a user may Describe: with a SASL user, missing and forbidden look
    alike (the operator role's ACLs: ``llmbatch dispatcher kafka-acl``)."""
    user = settings.kafka.sasl_username
    return f" (or user {user!r} may not read it)" if user else ""


async def _snapshot(settings: LLMBatchSettings, topic: str, flt: ReplayFilter) -> Snapshot:
    return await read_dead_letters(settings.kafka, topic, since=flt.since)


async def _ledger_entries(
    settings: LLMBatchSettings, topic: str, letters: list[DeadLetterView], *, required: bool
) -> tuple[dict[str, LedgerEntry], str | None]:
    """Replay ledger entries; when not ``required`` an unreachable Redis is a warning, not an error."""
    try:
        store = await open_store(settings)
    except OpsError as exc:
        if required:
            raise
        return {}, str(exc)
    try:
        return await ReplayLedger(store, topic).entries(v.coordinate for v in letters), None
    finally:
        await store.close()


# --- list ------------------------------------------------------------------------------------------------


@app.command("list")
def list_command(
    ctx: typer.Context,
    reason: ReasonOption = None,
    key: KeyOption = None,
    since: SinceOption = None,
    until: UntilOption = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="Show the newest N matching.")] = 100,
    topic: TopicOption = None,
    json_output: JsonOption = False,
) -> None:
    """Table of dead letters: time, key, reason, original topic/partition/offset, exception message."""
    settings = load_settings(ctx)
    dlt_topic = topic or settings.kafka.topics.dead_letter

    async def body() -> tuple[Snapshot, list[DeadLetterView], dict[str, LedgerEntry], str | None]:
        flt = _filter(reason, key, since, until, None)
        snap = await _snapshot(settings, dlt_topic, flt)
        letters = flt.select(snap.letters)[-limit:]
        ledger, warning = await _ledger_entries(settings, dlt_topic, letters, required=False)
        return snap, letters, ledger, warning

    snap, letters, ledger, warning = run(body)
    if warning:
        err.print(f"warning: replay status unknown: {warning}", markup=False)
    if json_output:
        emit_json(
            {
                "topic": dlt_topic,
                "topic_exists": snap.exists,
                "total_in_topic": len(snap.letters),
                "count": len(letters),
                "dead_letters": [
                    {**v.summary(), "replayed": entry_json(ledger.get(v.coordinate))} for v in letters
                ],
            }
        )
        return
    if not snap.exists:
        err.print(
            f"dead-letter topic {dlt_topic!r} does not exist yet{_hidden(settings)}: nothing was "
            "dead-lettered",
            markup=False,
        )
        return
    if not letters:
        err.print(f"no dead letters match ({len(snap.letters)} in {dlt_topic})", markup=False)
        return
    table = Table("time", "dlt p:o", "key", "reason", "original", "replayed", "exception message")
    for v in letters:
        entry = ledger.get(v.coordinate)
        replayed = "?" if warning else (entry.replay_id if entry else "no")
        table.add_row(
            show_time(v.time),
            v.coordinate,
            v.key_text or "-",
            v.reason,
            original(v),
            replayed,
            short(v.record.exception_message if v.record else None),
        )
    out.print(table)
    err.print(f"{len(letters)} of {len(snap.letters)} dead letter(s) in {dlt_topic}", markup=False)


# --- inspect ---------------------------------------------------------------------------------------------


@app.command("inspect")
def inspect_command(
    ctx: typer.Context,
    locator: Annotated[
        str,
        typer.Argument(
            help="PARTITION:OFFSET in the dead-letter topic, an OFFSET (every partition), "
            "or a KEY (batch id).",
            show_default=False,
        ),
    ],
    topic: TopicOption = None,
    json_output: JsonOption = False,
) -> None:
    """Everything about dead letters: all headers decoded, the payload, whether it was replayed."""
    settings = load_settings(ctx)
    dlt_topic = topic or settings.kafka.topics.dead_letter

    async def body() -> tuple[list[DeadLetterView], dict[str, LedgerEntry], str | None]:
        where = parse_locator(locator)
        letters: list[DeadLetterView] = []
        if where is not None:
            snap = await read_dead_letters(settings.kafka, dlt_topic, at=[where])
            letters = [v for v in snap.letters if v.offset == where[1]]
        if not letters and (where is None or ":" not in locator):
            snap = await read_dead_letters(settings.kafka, dlt_topic)
            letters = [v for v in snap.letters if v.key_text == locator]
        if not letters:
            raise OpsError(f"no dead letter at {locator!r} in {dlt_topic} (use P:O, an offset or a batch id)")
        ledger, warning = await _ledger_entries(settings, dlt_topic, letters, required=False)
        return letters, ledger, warning

    letters, ledger, warning = run(body)
    if warning:
        err.print(f"warning: replay status unknown: {warning}", markup=False)
    if json_output:
        emit_json([{**v.full(), "replayed": entry_json(ledger.get(v.coordinate))} for v in letters])
        return
    for v in letters:
        print_letter(v, ledger.get(v.coordinate))


# --- replay ----------------------------------------------------------------------------------------------


@app.command("replay")
def replay_command(
    ctx: typer.Context,
    execute_: Annotated[
        bool, typer.Option("--execute", help="Really publish. Without it: a dry run that changes nothing.")
    ] = False,
    reason: ReasonOption = None,
    key: KeyOption = None,
    since: SinceOption = None,
    until: UntilOption = None,
    limit: Annotated[
        int | None, typer.Option(min=1, help="Consider only the first (oldest) N matching dead letters.")
    ] = None,
    rate: Annotated[
        str | None, typer.Option(help="Publish at most this fast: N, N/s or N/m (default: unlimited).")
    ] = None,
    to_topic: Annotated[
        str | None, typer.Option(help="Publish here instead of each record's original topic.")
    ] = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Also replay events whose batch completed, ended or is in flight."),
    ] = False,
    include_replayed: Annotated[
        bool,
        typer.Option("--include-replayed", help="Replay again what an earlier run replayed (new replay id)."),
    ] = False,
    by: Annotated[
        str | None, typer.Option(help="Recorded in llmbatch-replay-by (default: user@host).")
    ] = None,
    topic: TopicOption = None,
    json_output: JsonOption = False,
) -> None:
    """Re-publish dead letters to their original topic with llmbatch-replay-{id,at,by} headers.

    Dry run by default (prints what would be replayed and why). Payload and ce_id are kept.
    Batches that already completed are refused unless --force. Safe to interrupt and rerun:
    replayed records are remembered and never replayed twice.
    """
    settings = load_settings(ctx)
    dlt_topic = topic or settings.kafka.topics.dead_letter
    who = by or operator_name()
    dry_run = not execute_

    async def body() -> tuple[list[ReplayItem], Summary, list[Outcome]]:
        flt = _filter(reason, key, since, until, limit)
        try:
            per_second = parse_rate(rate)
        except ValueError as exc:
            raise OpsError(str(exc), EXIT_USAGE) from None
        snap = await _snapshot(settings, dlt_topic, flt)
        selected = flt.select(snap.letters)
        store = await open_store(settings)
        try:
            items = await plan_replays(
                store,
                dlt_topic,
                selected,
                default_topic=settings.kafka.topics.requests,
                to_topic=to_topic,
                force=force,
                include_replayed=include_replayed,
            )
            summary = Summary.of(items, dry_run=dry_run)
            if not json_output:
                if not snap.exists:
                    err.print(
                        f"dead-letter topic {dlt_topic!r} does not exist yet{_hidden(settings)}: "
                        "nothing to replay",
                        markup=False,
                    )
                elif items:
                    out.print(plan_table(items, dry_run=dry_run))
                else:
                    err.print(f"no dead letters match ({len(snap.letters)} in {dlt_topic})", markup=False)
            targets = {i.target_topic for i in items if i.decision is Decision.REPLAY}
            missing = sorted(targets - await existing_topics(settings.kafka)) if targets else []
            if missing and not dry_run:
                raise OpsError(f"target topic {missing[0]!r} does not exist; nothing was replayed")
            if missing and not json_output:
                err.print(
                    f"warning: target topic {missing[0]!r} does not exist: --execute would stop", markup=False
                )
            outcomes: list[Outcome] = []
            if not dry_run and summary.to_replay:
                outcomes, interrupted = await _execute(
                    store, dlt_topic, items, settings, who, per_second, show=not json_output
                )
                summary.replayed = sum(1 for o in outcomes if o.ok)
                summary.failed = sum(1 for o in outcomes if not o.ok)
                summary.interrupted = interrupted
            return items, summary, outcomes
        finally:
            await store.close()

    items, summary, outcomes = run(body)
    if json_output:
        emit_json(
            {
                "dlt_topic": dlt_topic,
                "replayed_by": who,
                "summary": summary.to_json(),
                "items": [i.to_json() for i in items],
                "outcomes": [o.to_json() for o in outcomes],
            }
        )
    else:
        print_summary(summary, outcomes)
    if summary.interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)
    if summary.failed:
        raise typer.Exit(EXIT_ERROR)
    if summary.refused and not dry_run:
        raise typer.Exit(EXIT_INCOMPLETE)


async def _execute(
    store: StateStore,
    dlt_topic: str,
    items: list[ReplayItem],
    settings: LLMBatchSettings,
    who: str,
    per_second: float | None,
    *,
    show: bool,
) -> tuple[list[Outcome], bool]:
    total = sum(1 for i in items if i.decision is Decision.REPLAY)
    progress = Progress(
        TextColumn("replaying"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"),
        console=err,
        disable=not show,
    )
    task = progress.add_task("replay", total=total, last="")

    def on_outcome(outcome: Outcome) -> None:
        note = outcome.item.letter.key_text or outcome.item.letter.coordinate
        if not outcome.ok:
            progress.console.print(f"failed {outcome.item.letter.coordinate}: {outcome.error}", markup=False)
        progress.update(task, advance=1, last=note)

    with progress:
        return await execute(
            items,
            kafka=settings.kafka,
            ledger=ReplayLedger(store, dlt_topic),
            by=who,
            limiter=RateLimiter(per_second),
            on_outcome=on_outcome,
            replay_key=settings.replay.key_bytes(),
        )
