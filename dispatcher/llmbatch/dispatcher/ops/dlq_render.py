"""How ``llmbatch dlq`` shows dead letters and replay plans in a terminal (rich tables on stdout,
summaries on stderr). What is shown is decided in :mod:`llmbatch.dispatcher.ops.replay`."""

from __future__ import annotations

from typing import Any

import orjson
from rich.json import JSON
from rich.table import Table

from llmbatch.dispatcher.ops.common import err, out, show_time
from llmbatch.dispatcher.ops.dlq_reader import DeadLetterView
from llmbatch.dispatcher.ops.replay import Decision, LedgerEntry, ReplayItem, Summary
from llmbatch.dispatcher.ops.replay_publish import Outcome

MESSAGE_WIDTH = 70


def short(text: str | None, width: int = MESSAGE_WIDTH) -> str:
    """``text`` on one line, cut to ``width`` characters."""
    if not text:
        return ""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def original(letter: DeadLetterView) -> str:
    """Where the dead letter came from: ``topic/partition@offset``."""
    rec = letter.record
    if rec is None:
        return "-"
    return f"{rec.original_topic}/{rec.original_partition}@{rec.original_offset}"


def entry_json(entry: LedgerEntry | None) -> dict[str, Any] | None:
    """A replay ledger entry as JSON (None when the letter was never replayed)."""
    return entry.model_dump(mode="json") if entry is not None else None


def print_letter(v: DeadLetterView, entry: LedgerEntry | None) -> None:
    """One dead letter in full: its facts, headers and payload."""
    full = v.full()
    out.rule(f"{v.topic} {v.coordinate}")
    facts = Table(show_header=False, box=None, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    rec = v.record
    rows: list[tuple[str, Any]] = [
        ("dead-lettered", show_time(v.time)),
        ("key", v.key_text),
        ("reason", v.reason),
        ("event", f"{v.event_type or '?'} id={v.event_id or '?'} source={v.event_source or '?'}"),
        ("original", original(v)),
        ("original time", show_time(full["original_timestamp"])),
        ("consumer group", rec.consumer_group if rec else None),
        ("exception", rec.exception_fqcn if rec else None),
        ("message", rec.exception_message if rec else None),
        ("valid now", "yes" if full["valid_now"] else f"no: {full['validation_error_now']}"),
        (
            "replayed",
            f"{entry.replay_id} at {show_time(entry.at)} by {entry.by} -> {entry.to_topic}"
            if entry
            else "no",
        ),
    ]
    previous = v.previous_replay
    if previous is not None:
        rows.append(("was a replay", f"{previous.replay_id} by {previous.replayed_by}"))
    for name, value in rows:
        facts.add_row(name, "-" if value is None else str(value))
    out.print(facts)
    headers = Table("header", "value", "encoding", title="headers")
    for h in full["headers"]:
        headers.add_row(h["name"], str(h["value"]), h["encoding"])
    out.print(headers)
    out.print("[bold]payload[/bold]" + (f" ({full['payload_bytes']} bytes)" if full["payload_bytes"] else ""))
    payload = full["payload"]
    if payload is None:
        out.print("(null)")
    else:
        out.print(JSON(orjson.dumps(payload).decode()))


def plan_table(items: list[ReplayItem], *, dry_run: bool) -> Table:
    """The replay plan: each letter, what replay decided and why."""
    title = "replay plan (dry run)" if dry_run else "replay plan"
    table = Table("time", "dlt p:o", "key", "reason", "decision", "why", "to", title=title)
    for item in items:
        v = item.letter
        style = {Decision.REPLAY: "green", Decision.REFUSED: "red"}.get(item.decision, "dim")
        table.add_row(
            show_time(v.time),
            v.coordinate,
            v.key_text or "-",
            v.reason,
            f"[{style}]{item.decision.value}[/{style}]",
            item.why,
            item.target_topic,
        )
    return table


def print_summary(summary: Summary, outcomes: list[Outcome]) -> None:
    """One line of counts on stderr, and what to do next."""
    parts = [f"{summary.selected} selected"]
    if summary.dry_run:
        parts.append(f"{summary.to_replay} would be replayed")
    else:
        parts.append(f"{summary.replayed} replayed")
        if summary.failed:
            parts.append(f"{summary.failed} failed")
    parts.append(f"{summary.already_replayed} already replayed")
    parts.append(f"{summary.refused} refused")
    prefix = "dry run: " if summary.dry_run else ("interrupted: " if summary.interrupted else "")
    err.print(prefix + ", ".join(parts), markup=False)
    if summary.dry_run and summary.to_replay:
        err.print("nothing was published; run again with --execute to replay", markup=False)
    if summary.refused:
        err.print("refused items need --force (see 'why')", markup=False)
    if summary.interrupted:
        err.print("what was replayed is recorded; rerun the same command to continue", markup=False)
