"""``llmbatch submit | cancel | watch | results``: the upstream-service commands.

:func:`register` adds them to the root Typer app. Data goes to stdout (the batch id, JSONL result
lines, ``--json`` events) and messages to stderr, so the commands compose in shell pipelines.
Every user mistake or unreachable service ends with one ``error: ...`` line on stderr and a non-zero
exit code, never a traceback (set ``LLMBATCH_DEBUG=1`` to see one).

Exit codes: 0 success; 1 error; 2 usage error; 3 the batch ended failed/cancelled/expired;
4 ``--timeout`` elapsed before the batch ended.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from llmbatch.adapters.errors import InvalidInput, ProducerError, WaitTimeout
from llmbatch.producer.cli_args import (
    EXIT_ERROR,
    CliFailure,
    parse_deadline,
    parse_endpoint,
    parse_metadata,
    parse_since,
)
from llmbatch.producer.cli_events import describe, event_json
from llmbatch.producer.client import BatchClient, ClientOptions, is_answer
from llmbatch.schemas import (
    BatchStatus,
    Envelope,
    SchemaError,
    utcnow,
)
from llmbatch.schemas.compat import TIMEOUT_ERRORS
from llmbatch.settings import LLMBatchSettings

T = TypeVar("T")
EXIT_NOT_COMPLETED = 3
EXIT_TIMEOUT = 4
CLI_CONNECT_TIMEOUT_S = 5.0

err = Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    err.print(f"[red]error:[/red] {_one_line(message)}", markup=True)
    raise typer.Exit(code)


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def _invalid_message(exc: InvalidInput) -> str:
    if not exc.errors:
        return exc.message
    headline = exc.message.splitlines()[0]
    first = exc.errors[0]
    if exc.invalid_count > 1:
        return f"{headline}; first: {first}; fix them or pass --skip-invalid"
    return headline if str(first) in headline else f"{headline}: {first}"


def _settings(ctx: typer.Context) -> LLMBatchSettings:
    obj = ctx.obj if ctx is not None else None
    if isinstance(obj, LLMBatchSettings):
        return obj
    if isinstance(obj, dict):
        found = obj.get("settings")
        if isinstance(found, LLMBatchSettings):
            return found
    return LLMBatchSettings()


def _run(ctx: typer.Context, body: Callable[[BatchClient], Awaitable[T]]) -> T:
    """Run ``body`` with a client; translate every failure into one line and an exit code."""
    if not os.environ.get("LLMBATCH_DEBUG"):
        # client libraries log connection retries; the one error line below says it all
        for name in ("aiokafka", "kafka", "urllib3"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        settings = _settings(ctx)
        options = ClientOptions(connect_timeout_s=CLI_CONNECT_TIMEOUT_S, publish_timeout_s=15.0)

        async def main() -> T:
            async with BatchClient(settings, options=options) as client:
                return await body(client)

        return asyncio.run(main())
    except typer.Exit:
        raise
    except CliFailure as exc:
        _fail(str(exc), exc.code)
    except InvalidInput as exc:
        _fail(_invalid_message(exc))
    except WaitTimeout as exc:
        _fail(exc.message, EXIT_TIMEOUT)
    except ProducerError as exc:
        _fail(exc.message)
    except SchemaError as exc:
        _fail(str(exc))
    except ValidationError as exc:  # settings from the environment
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        _fail(f"invalid setting {where}: {first['msg']} (check the LLMBATCH_* environment)")
    except OSError as exc:  # e.g. --output into a missing folder
        where = f"{exc.filename}: " if exc.filename else ""
        _fail(f"{where}{exc.strerror or exc}")
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None
    except Exception as exc:
        if os.environ.get("LLMBATCH_DEBUG"):
            raise
        _fail(f"unexpected {type(exc).__name__}: {exc} (set LLMBATCH_DEBUG=1 for a traceback)")


async def _follow(
    client: BatchClient,
    batch_id: str | None,
    *,
    since: datetime | None,
    as_json: bool,
    show_progress: bool,
    request_id: str | None = None,
    tenant: str | None = None,
) -> Envelope[Any] | None:
    """Print events as they arrive; with a batch id, stop at its answer (terminal event, or the
    rejection of ``request_id`` / a final one; see :func:`llmbatch.producer.client.is_answer`) and return
    it."""
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not (show_progress and batch_id and err.is_terminal),
    )
    task = progress.add_task(batch_id or "", total=None)
    stream = client.events(batch_id, since=since, from_end=batch_id is None and since is None, tenant=tenant)
    with progress:
        async with aclosing(stream) as events:
            async for envelope in events:
                data = envelope.data
                counts = getattr(data, "request_counts", None)
                if counts is not None and counts.total:
                    progress.update(task, total=counts.total, completed=counts.completed + counts.failed)
                if as_json:
                    sys.stdout.buffer.write(event_json(envelope) + b"\n")
                    sys.stdout.flush()
                else:
                    progress.console.print(describe(envelope), markup=False)
                if batch_id is not None and is_answer(envelope, request_id):
                    return envelope
    return None


def _exit_for(terminal: Envelope[Any] | None) -> None:
    if terminal is None:
        return
    status = getattr(terminal.data, "status", None)
    if status != BatchStatus.COMPLETED:
        raise typer.Exit(EXIT_NOT_COMPLETED)


# ------------------------------------------------------------------------------------ commands


def submit(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="JSONL file of OpenAI batch input lines.", show_default=False)],
    model: Annotated[str, typer.Option("--model", "-m", help="Model to run.", show_default=False)],
    endpoint: Annotated[str, typer.Option(help="chat | completions (or the /v1/... path).")] = "chat",
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", help="key=value, repeatable (<=16).")
    ] = None,
    batch_id: Annotated[str | None, typer.Option(help="Idempotency key (default: generated).")] = None,
    tenant: Annotated[str, typer.Option(help="Tenant slug; results go under it.")] = "default",
    priority: Annotated[int, typer.Option(min=0, max=9, help="0-9, higher first.")] = 5,
    completion_window: Annotated[str | None, typer.Option(help="e.g. 24h (default 24h).")] = None,
    deadline: Annotated[str | None, typer.Option(help="RFC 3339 time, or a duration from now (2h).")] = None,
    skip_invalid: Annotated[
        bool, typer.Option(help="Drop invalid lines instead of refusing the file.")
    ] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the batch until it ends.")] = False,
    timeout: Annotated[
        float | None, typer.Option(help="With --wait: give up after this many seconds.")
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="With --wait: print events as JSON lines.")
    ] = False,
) -> None:
    """Validate FILE, upload it and publish a batch request; print the batch id."""

    async def body(client: BatchClient) -> Envelope[Any] | None:
        handle = await client.submit(
            file=file,
            model=model,
            endpoint=parse_endpoint(endpoint),
            batch_id=batch_id,
            metadata=parse_metadata(metadata or []),
            tenant=tenant,
            priority=priority,
            completion_window=completion_window,
            deadline=parse_deadline(deadline),
            skip_invalid=skip_invalid,
        )
        typer.echo(handle.batch_id)
        skipped = f", {handle.skipped_lines} invalid lines skipped" if handle.skipped_lines else ""
        err.print(
            f"submitted {handle.batch_id}: {handle.request_count} requests{skipped} ({handle.input_uri})",
            markup=False,
        )
        if not wait:
            return None
        since = client.follow_start(handle.submitted_at)
        follow = _follow(
            client,
            handle.batch_id,
            since=since,
            as_json=json_output,
            show_progress=True,
            request_id=handle.event_id,
            tenant=handle.tenant,
        )
        try:
            return await asyncio.wait_for(follow, timeout)
        except TIMEOUT_ERRORS:
            raise WaitTimeout(f"batch {handle.batch_id} did not finish within {timeout:g}s") from None

    _exit_for(_run(ctx, body))


def cancel(
    ctx: typer.Context,
    batch_id: Annotated[str, typer.Argument(help="The batch to cancel.", show_default=False)],
    reason: Annotated[str | None, typer.Option(help="Why (kept for audit).")] = None,
    tenant: Annotated[str, typer.Option(help="The tenant whose batch it is.")] = "default",
) -> None:
    """Ask the dispatcher to cancel a batch (partial results are kept)."""

    async def body(client: BatchClient) -> None:
        await client.cancel(batch_id, tenant=tenant, reason=reason, requested_by=os.environ.get("USER"))
        err.print(f"cancel requested for {batch_id}", markup=False)

    _run(ctx, body)


def watch(
    ctx: typer.Context,
    batch_id: Annotated[str | None, typer.Argument(help="Follow one batch (default: all events).")] = None,
    since: Annotated[
        str | None,
        typer.Option(
            help="Start this long ago (30m, 2h, 1d) or at an RFC 3339 time. "
            "Default: 24h with an id, now without."
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print events as JSON lines on stdout.")
    ] = False,
    timeout: Annotated[float | None, typer.Option(help="Give up after this many seconds.")] = None,
    tenant: Annotated[
        str | None,
        typer.Option(
            help="Only this tenant's events (batch ids are scoped by tenant). Default: every tenant's."
        ),
    ] = None,
) -> None:
    """Stream result events live; with an id, show progress and stop when the batch ends."""

    async def body(client: BatchClient) -> Envelope[Any] | None:
        start = parse_since(since)
        if start is None and batch_id is not None:
            start = utcnow() - timedelta(hours=24)
        follow = _follow(
            client, batch_id, since=start, as_json=json_output, show_progress=True, tenant=tenant
        )
        try:
            return await asyncio.wait_for(follow, timeout)
        except TIMEOUT_ERRORS:
            if batch_id is None:
                return None
            raise WaitTimeout(f"batch {batch_id} did not finish within {timeout:g}s") from None

    _exit_for(_run(ctx, body))


def results(
    ctx: typer.Context,
    batch_id: Annotated[str, typer.Argument(help="The finished batch.", show_default=False)],
    errors: Annotated[bool, typer.Option("--errors", help="Print the error file lines instead.")] = False,
    tenant: Annotated[str, typer.Option(help="Tenant the batch was submitted under.")] = "default",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to a file instead of stdout.")
    ] = None,
) -> None:
    """Print a finished batch's output (or error) lines as JSONL, read via its manifest."""

    async def body(client: BatchClient) -> None:
        manifest = await client.manifest(batch_id, tenant=tenant)
        count = 0
        sink = output.open("wb") if output is not None else sys.stdout.buffer
        try:
            async for line in client.iter_results(manifest, errors=errors):
                sink.write(line.to_jsonl())
                count += 1
        finally:
            if output is not None:
                sink.close()
            else:
                sink.flush()
        kind = "error" if errors else "output"
        err.print(
            f"{count} {kind} lines of {batch_id} ({manifest.status!s}, "
            f"{manifest.request_counts.completed} completed, {manifest.request_counts.failed} failed)",
            markup=False,
        )

    _run(ctx, body)


def register(app: typer.Typer) -> None:
    """Add ``submit``, ``cancel``, ``watch`` and ``results`` to ``app``."""
    app.command("submit")(submit)
    app.command("cancel")(cancel)
    app.command("watch")(watch)
    app.command("results")(results)


app = typer.Typer(
    name="llmbatch-producer",
    help="Submit and follow llmbatch batches.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
register(app)


def main() -> None:
    """Entry point of ``llmbatch-producer`` (and ``python -m llmbatch.producer.cli``)."""
    app()


if __name__ == "__main__":
    main()
