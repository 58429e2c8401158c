"""What the demo prints once a batch ended: the completion event, where the results are, a few
answers, the error lines, counts, tokens and timings; and the cold-vs-warm comparison."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import orjson
from rich.console import Console
from rich.json import JSON
from rich.markup import escape
from rich.table import Table

from llmbatch.demo.batch import Batch

console = Console(highlight=False)
ANSWERS_SHOWN = 5


def _seconds(delta: timedelta | None) -> float | None:
    return round(delta.total_seconds(), 2) if delta is not None else None


def _answer_text(line: Any) -> str:
    body: dict[str, Any] = line.response.body if line.response is not None else {}
    try:
        return str(body["choices"][0]["message"]["content"]).strip()
    except (KeyError, IndexError, TypeError):
        return orjson.dumps(body).decode()[:200]


def show_results(batch: Batch, data: Any, answers: dict[str, str], errors: dict[str, dict[str, str]]) -> None:
    """Where the results are, a few answers, and the error lines."""
    console.rule("[bold]results")
    locations = Table(show_header=False, box=None)
    for uri in data.output_uris:
        locations.add_row("output", uri)
    for uri in data.error_uris:
        locations.add_row("errors", uri)
    if data.manifest_uri:
        locations.add_row("manifest", data.manifest_uri)
    console.print(locations)
    shown = Table(
        "custom_id",
        "prompt",
        "answer",
        title=f"{min(ANSWERS_SHOWN, len(answers))} of {len(answers)} answers",
        show_lines=True,
    )
    for custom_id, text in list(answers.items())[:ANSWERS_SHOWN]:
        shown.add_row(custom_id, batch.prompts.get(custom_id, ""), text[:300])
    console.print(shown)
    if errors:
        failed = Table("custom_id", "error code", "message", title="error file (isolated bad lines)")
        for custom_id, error in errors.items():
            failed.add_row(custom_id, error["code"], error["message"][:160])
        console.print(failed)


async def report(client: Any, batch: Batch, terminal: Any, *, show: bool = True) -> dict[str, Any]:
    """Print what the batch produced (the figures only unless ``show``); return the same as a dict
    (``--summary-json``)."""
    data = terminal.data
    console.rule("[bold]completion event")
    console.print(f"type {terminal.type.value}  ce_id {terminal.id}", markup=False)
    if show:
        console.print(JSON(data.model_dump_json()))
    answers: dict[str, str] = {}
    errors: dict[str, dict[str, str]] = {}
    async for line in client.iter_results(terminal):
        answers[line.custom_id] = _answer_text(line)
    async for line in client.iter_results(terminal, errors=True):
        errors[line.custom_id] = {
            "code": line.error.code if line.error else "error",
            "message": line.error.message if line.error else "",
        }
    manifest = None
    with contextlib.suppress(Exception):  # the event has everything that matters; timings are a bonus
        manifest = await client.manifest(data.batch_id, tenant=data.tenant)

    if show:
        show_results(batch, data, answers, errors)
    counts, usage = data.request_counts, data.usage
    engine_start = manifest.timings.engine_start_s if manifest is not None else None
    generation = manifest.timings.generation_s if manifest is not None else None
    timings = {
        "queue_wait_s": _seconds(data.started_at - data.accepted_at) if data.started_at else None,
        "engine_start_s": round(engine_start, 2) if engine_start is not None else None,
        "generation_s": round(generation, 2) if generation is not None else None,
        "generation_tok_per_s": round(usage.completion_tokens / generation, 1) if generation else None,
        "accepted_to_finished_s": _seconds(data.finished_at - data.accepted_at),
    }
    figures = Table(show_header=False, box=None)
    figures.add_row("status", f"[bold]{data.status}[/bold]")
    figures.add_row("requests", f"{counts.total} total: {counts.completed} completed, {counts.failed} failed")
    figures.add_row("tokens", f"{usage.prompt_tokens} prompt, {usage.completion_tokens} completion")
    figures.add_row("queue wait", _fmt_s(timings["queue_wait_s"]) + " (accepted -> attempt started)")
    figures.add_row(
        "engine start",
        _fmt_s(timings["engine_start_s"]) + " (waited for an engine: vLLM load + warm-up when it was cold)",
    )
    rate = timings["generation_tok_per_s"]
    figures.add_row(
        "generation", _fmt_s(timings["generation_s"]) + (f" = [bold]{rate} tokens/s[/bold]" if rate else "")
    )
    figures.add_row("end to end", _fmt_s(timings["accepted_to_finished_s"]) + " (accepted -> finished)")
    figures.add_row("attempts", f"{data.attempts} ({data.ray_submission_id})")
    if data.error is not None:
        first = data.error.message.strip().splitlines()[0] if data.error.message.strip() else ""
        figures.add_row("error", f"[red]{escape(data.error.code)}[/red]: {escape(first[:200])}")
    console.print(figures)
    return {
        "batch_id": data.batch_id,
        "status": str(data.status),
        "event_id": terminal.id,
        "event_type": terminal.type.value,
        "request_counts": counts.model_dump(),
        "usage": usage.model_dump(),
        "output_uris": list(data.output_uris),
        "error_uris": list(data.error_uris),
        "manifest_uri": data.manifest_uri,
        "timings": timings,
        "answers": answers,
        "errors": errors,
        "prompts": batch.prompts,
        "invalid_lines": batch.invalid,
    }


def _fmt_s(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, int | float) else "-"


def compare(cold: dict[str, Any], warm: dict[str, Any]) -> None:
    """The same batch twice: the first started the engine, the second found it warm."""
    table = Table("run", "status", "end to end", "engine wait", "generation", title="cold vs warm engine")
    for name, run in (("cold (engine starts)", cold), ("warm (engine running)", warm)):
        t = run["timings"]
        table.add_row(
            name,
            run["status"],
            _fmt_s(t["accepted_to_finished_s"]),
            _fmt_s(t["engine_start_s"]),
            _fmt_s(t["generation_s"]),
        )
    console.print(table)
