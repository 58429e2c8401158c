"""`make demo`: one real batch through the whole system on this machine.

``python -m llmbatch.demo [--keep] [--prompts N] [--summary-json PATH]``

1. starts the local stack (Apache Kafka, Redis, MinIO, a Ray head; reused when already running);
2. starts a dispatcher (``llmbatch dispatcher run`` as a subprocess, pointed at the stack, serving
   SmolLM2-135M-Instruct on vLLM-CPU from a shared engine on Ray Serve, scaled from zero);
3. submits ``llmbatch/demo/data/batch.jsonl`` (30 chat prompts and 2 invalid lines) through the
   producer SDK: the file is uploaded to MinIO as is and ``batch.requested`` is published;
4. follows the batch's events on the results topic live;
5. prints the completion event, where the output and error files are, a few answers, counts,
   tokens and timings (queue wait, engine start, generation tokens/s); then submits the same batch
   again on the now warm engine (the short path: no Ray job, no engine start) and prints both times;
6. stops the dispatcher, and the stack unless ``--keep`` (or ``LLMBATCH_DEMO_KEEP=1``).

``--prompts N`` keeps the first N valid prompts (the two invalid lines always stay) so the e2e test
runs this very code path with a smaller batch. Exit code 0 when the batch completed.

Settings: everything ``LLMBATCH_*`` in the environment still applies to the dispatcher; the demo only
fills in what is unset (model path, engine cache, eager mode, small engine batches) and the stack's
addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from contextlib import aclosing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from llmbatch.demo.batch import MODEL, Batch, prepare_batch
from llmbatch.demo.report import compare, console, report
from llmbatch.schemas.errors import LLMBatchError
from llmbatch.settings import LLMBatchSettings
from llmbatch.stack import manager
from llmbatch.stack.dispatcher_env import dispatcher_environ
from llmbatch.stack.ports import free_port
from llmbatch.stack.process import StackError, log_tail, stop_tree
from llmbatch.stack.state import StackState, default_run_dir

DATA_FILE = Path(__file__).parent / "data" / "batch.jsonl"


class DemoError(LLMBatchError):
    """Something the demo cannot go on without; printed as one line (plus a log tail)."""

    def __init__(self, message: str, tail: str | None = None) -> None:
        super().__init__(message)
        self.tail = tail


# --- the dispatcher --------------------------------------------------------------------------------------


def dispatcher_env(state: StackState, model_path: Path, metrics_port: int) -> dict[str, str]:
    """The dispatcher's environment: the local stack's dispatcher defaults (shared with
    ``llmbatch stack env``, see :mod:`llmbatch.stack.dispatcher_env`) and the demo's own, under the
    user's LLMBATCH_*, under the stack's addresses."""
    env = dispatcher_environ(
        state,
        model_path,
        extra_defaults={
            "LLMBATCH_DISPATCHER__INSTANCE_ID": "demo-dispatcher",
            "LLMBATCH_DISPATCHER__LOG_JSON": "true",
            # the warm engine on Ray Serve (scaled from zero by the first batch) and the short path
            "LLMBATCH_DISPATCHER__SHARED_ENGINES": "true",
        },
    )
    env["LLMBATCH_DISPATCHER__METRICS_HOST"] = "127.0.0.1"
    env["LLMBATCH_DISPATCHER__METRICS_PORT"] = str(metrics_port)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class DispatcherProcess:
    """``llmbatch dispatcher run`` in its own session; logs to a file; stopped by PID."""

    def __init__(self, env: dict[str, str], log_path: Path, metrics_port: int) -> None:
        self.log_path = log_path
        self.port = metrics_port
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmbatch", "dispatcher", "run"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self) -> str:
        return log_tail(self.log_path, 20)

    def wait_ready(self, timeout: float = 180.0) -> float:
        """Until ``/readyz`` answers 200; returns the seconds it took."""
        started = time.monotonic()
        url = f"http://127.0.0.1:{self.port}/readyz"
        while time.monotonic() - started < timeout:
            if not self.alive():
                raise DemoError(f"the dispatcher exited with code {self.proc.returncode}", self.tail())
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - started
            time.sleep(0.5)
        raise DemoError(f"the dispatcher was not ready after {timeout:.0f}s ({url})", self.tail())

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful: commits, leaves the group), then the whole tree if it lingers."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                stop_tree(self.proc.pid)
        return self.proc.returncode


# --- 3-5. submit, follow, report -------------------------------------------------------------------------


async def submit(client: Any, batch: Batch, batch_id: str) -> Any:
    """Upload the file as is and publish ``batch.requested`` through the producer SDK.

    ``client.submit(file=...)`` would refuse a file with invalid lines (or drop them with
    ``skip_invalid=True``); the demo sends them on purpose to show the job isolating bad lines.
    """
    from llmbatch.adapters import storage
    from llmbatch.schemas import BatchRequest, Endpoint

    settings: LLMBatchSettings = client.settings
    uri = await asyncio.to_thread(storage.upload_input, client.s3, settings.s3, batch.path, tenant="demo")
    request = BatchRequest(
        batch_id=batch_id,
        model=MODEL,
        endpoint=Endpoint.CHAT_COMPLETIONS,
        input_uri=uri,
        completion_window="1h",
        metadata={"source": "make demo", "prompts": str(len(batch.prompts))},
        tenant="demo",
    )
    published = await client.submit_request(request)
    console.print(
        f"published batch.requested for [bold]{batch_id}[/bold] "
        f"({published.topic}[{published.partition}]@{published.offset}); input {uri}"
    )
    return request


def _describe(envelope: Any) -> str:
    data = envelope.data
    kind = str(envelope.type.value).removeprefix("llmbatch.batch.").removesuffix(".v1")
    counts = getattr(data, "request_counts", None)
    text = kind
    if counts is not None and not counts.total and kind == "progress":
        return "progress: the job is running (loading the model)"
    if counts is not None:
        text += f": {counts.completed} completed, {counts.failed} failed of {counts.total}"
    usage = getattr(data, "usage", None)
    if usage is not None and usage.completion_tokens:
        text += f", {usage.completion_tokens} tokens generated"
    return text


async def follow(client: Any, batch_id: str, since: Any, proc: DispatcherProcess, limit_s: float) -> Any:
    """Print the batch's events as they arrive; return its terminal event."""
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    task = progress.add_task("waiting for the dispatcher", total=None)

    async def stream() -> Any:
        async with aclosing(client.events(batch_id, since=since)) as events:
            async for envelope in events:
                progress.console.print(f"  event {_describe(envelope)}", markup=False)
                counts = getattr(envelope.data, "request_counts", None)
                if counts is not None and counts.total:
                    progress.update(
                        task,
                        total=counts.total,
                        completed=counts.completed + counts.failed,
                        description="requests",
                    )
                elif envelope.type.value.endswith("accepted.v1"):
                    progress.update(task, description="queued, starting the Ray job and vLLM")
                if envelope.is_terminal:
                    return envelope
        raise DemoError("the results stream ended before the batch did")

    async def watchdog() -> None:
        while True:  # a subprocess exit has no awaitable here: poll it
            if not proc.alive():
                raise DemoError(f"the dispatcher exited with code {proc.proc.returncode}", proc.tail())
            await asyncio.sleep(1)

    with progress:
        tasks = [asyncio.create_task(stream()), asyncio.create_task(watchdog())]
        try:
            done, _ = await asyncio.wait(tasks, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if not done:
            raise DemoError(f"the batch did not finish within {limit_s:.0f}s", proc.tail())
        return next(iter(done)).result()


async def run_batch(
    settings: LLMBatchSettings,
    batch: Batch,
    proc: DispatcherProcess,
    limit_s: float,
    *,
    label: str = "",
    show: bool = True,
) -> dict[str, Any]:
    from llmbatch.producer import BatchClient, ensure_topics

    batch_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    async with BatchClient(settings) as client:
        await client.ensure_buckets()
        await ensure_topics(settings)
        console.rule(f"[bold]4. submit through the producer SDK{label}")
        started = client.follow_start(datetime.now(UTC))
        await submit(client, batch, batch_id)
        console.rule(f"[bold]5. progress (results topic){label}")
        terminal = await follow(client, batch_id, started, proc, limit_s)
        summary = await report(client, batch, terminal, show=show)
    return summary


# --- main --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmbatch.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--keep",
        action="store_true",
        default=os.environ.get("LLMBATCH_DEMO_KEEP") == "1",
        help="leave the stack running (stop it later with `make down`)",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=None,
        metavar="N",
        help="only the first N valid prompts (the two invalid lines always stay)",
    )
    parser.add_argument("--file", type=Path, default=DATA_FILE, help="the JSONL batch to submit")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds to wait for the batch")
    parser.add_argument("--summary-json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.prompts is not None and args.prompts < 1:
        parser.error("--prompts must be at least 1")

    run_dir = default_run_dir()
    begun = time.monotonic()
    proc: DispatcherProcess | None = None
    workdir: Path | None = None  # the batch file as sent (uploaded to MinIO, then deleted here)
    code = 1
    try:
        console.rule("[bold]1. local stack: Apache Kafka, Redis, MinIO, Ray")
        state = manager.up(run_dir)
        table = Table("service", "address", "pid", "healthy after s")
        for name, rec in state.services.items():
            table.add_row(name, rec.address, str(rec.pid), str(rec.healthy_after_s))
        console.print(table)

        console.rule("[bold]2. model and batch")
        from llmbatch.stack.model import ensure_model

        model_path = ensure_model()
        console.print(f"model {MODEL} -> {model_path}")
        workdir = Path(tempfile.mkdtemp(prefix="llmbatch-demo-"))
        batch = prepare_batch(args.file, args.prompts, workdir)
        console.print(
            f"{batch.total_lines} lines from {args.file.name}: {len(batch.prompts)} prompts and "
            f"{len(batch.invalid)} invalid lines, sent as they are to show isolation:"
        )
        for problem in batch.invalid:
            console.print(f"  {problem}", markup=False)

        console.rule("[bold]3. dispatcher")
        port = free_port()
        log_path = run_dir / "logs" / "demo-dispatcher.log"
        proc = DispatcherProcess(dispatcher_env(state, model_path, port), log_path, port)
        ready_s = proc.wait_ready()
        console.print(
            f"dispatcher pid {proc.proc.pid} ready in {ready_s:.1f} s; health and metrics on "
            f"http://127.0.0.1:{port}/readyz and /metrics; log {log_path}"
        )

        settings = manager.settings_for(state)
        summary = asyncio.run(run_batch(settings, batch, proc, args.timeout, label=" (cold engine)"))
        if summary["status"] == "completed":
            warm = asyncio.run(
                run_batch(settings, batch, proc, args.timeout, label=" (warm engine)", show=False)
            )
            summary["warm"] = warm
            compare(summary, warm)
        if args.summary_json is not None:
            args.summary_json.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
        ok = summary["status"] == "completed" and summary.get("warm", {}).get("status") == "completed"
        code = 0 if ok else 1
    except StackError as exc:
        if exc.log_tail:
            console.print(exc.log_tail, markup=False)
        console.print(f"[red]error:[/red] {exc}")
    except DemoError as exc:
        if exc.tail:
            console.print(exc.tail, markup=False)
        console.print(f"[red]error:[/red] {exc}")
    except KeyboardInterrupt:
        console.print("interrupted")
        code = 130
    except Exception as exc:
        if os.environ.get("LLMBATCH_DEBUG"):
            raise
        console.print(f"[red]error:[/red] {type(exc).__name__}: {exc} (LLMBATCH_DEBUG=1 for a traceback)")
    finally:
        console.rule("[bold]6. clean up")
        if proc is not None:
            rc = proc.stop()
            console.print(f"dispatcher stopped (exit {rc})")
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        if args.keep:
            default = run_dir == (Path.cwd() / "run" / "stack").resolve()
            where = "" if default else f" --run-dir {run_dir}"
            stop = "`make down`" if default else f"`llmbatch stack down{where}`"
            env_cmd = f'eval "$(.venv/bin/llmbatch stack env{where})"'
            console.print(
                f"stack left running ({run_dir}): `{env_cmd}`, then `.venv/bin/llmbatch stack "
                f"dispatcher{where}` runs a dispatcher like this one and `llmbatch jobs list` "
                f"shows its batches; stop it with {stop}",
                markup=False,
            )
        else:
            manager.down(run_dir)
            console.print("stack stopped")
    console.print(f"demo took {time.monotonic() - begun:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
