"""One attempt of one batch, end to end: spec -> resume scan -> pipeline -> shards -> manifest.

The driver consumes the pipeline's finished rows as they stream in, writes them into rolling
shards (:mod:`llmbatch.ray_job.job.writer`), keeps the progress counters and, last, writes the manifest and
prints the ``LLMBATCH_RESULT`` line. On SIGTERM (Ray ``stop_job``, cancellation) or at the spec's
deadline it stops early, still writing what finished and a ``partial`` manifest.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import sys
import threading
import time
from datetime import datetime
from types import FrameType
from typing import Any

from pyarrow import fs as pafs

from llmbatch.ray_job.errors import (
    EngineUnavailableError,
    ExitCode,
    InfraUnavailableError,
    InputNotFoundError,
    JobError,
    SupersededError,
)
from llmbatch.ray_job.job import manifest, pipeline, resume
from llmbatch.ray_job.job import spec as spec_loader
from llmbatch.ray_job.job.manifest import Status
from llmbatch.ray_job.job.memory import MemoryPeak, mib
from llmbatch.ray_job.job.outcome import (
    SUPERSEDED,
    attempt_result,
    emit_result,
    failure_code,
    failure_result,
    settle,
    stop_error,
)
from llmbatch.ray_job.job.progress import Counters, Progress
from llmbatch.ray_job.job.reservation import Reservation, bundle_of
from llmbatch.ray_job.job.writer import ShardWriter
from llmbatch.ray_job.lines import rows
from llmbatch.ray_job.lines.parse import count_request_lines
from llmbatch.ray_job.storage import s3, s3_session
from llmbatch.schemas.common import BatchStatus, utcnow
from llmbatch.schemas.job import MANIFEST_NAME, AttemptRecord, JobSpec, Manifest, S3Session
from llmbatch.schemas.openai import ErrorObject, Usage

log = logging.getLogger("ray_job")


class StopRequested(BaseException):
    """SIGTERM/SIGINT or the deadline: stop, keep what finished (a BaseException so no
    ``except Exception`` on the way swallows it)."""


class Attempt:
    """State of the running attempt (see the module docstring)."""

    def __init__(self, spec: JobSpec, started_at: datetime, *, session: S3Session | None = None) -> None:
        self.spec = spec
        self.session = session
        """The attempt's own S3 keys (:mod:`llmbatch.ray_job.storage.s3_session`); ``None``: the process's."""
        self.started_at = started_at
        self.prefix_path = s3.path_of(spec.output_prefix)
        self.manifest_path = self.prefix_path + MANIFEST_NAME
        self.fs: pafs.FileSystem | None = None
        self.prior = resume.Prior()
        self.previous: Manifest | None = None
        self.progress: Progress | None = None
        self.writers: dict[str, ShardWriter] = {}
        self.seen = rows.SeenLines()
        self.invalid_lines = 0  # input lines that failed validation (this attempt)
        self.total: int | None = len(spec.requests) if spec.requests is not None else None
        self.engine_start_s: float | None = None
        self.engine_ready_at: float | None = None
        self.stop_reason = ""
        self.pipeline_done = False
        self.result: dict[str, Any] | None = None  # the LLMBATCH_RESULT of the attempt, once it ended
        self.memory_peak = MemoryPeak()
        self.redis_client: Any = None  # a client for the progress hash lent by a long-lived process

    # --- setup ------------------------------------------------------------------------------

    def _filesystem(self) -> pafs.FileSystem:
        """The attempt's S3 filesystem: its session's keys, else those of the process's environment."""
        return s3.filesystem(self.session)

    def _input_path(self, fs: pafs.FileSystem) -> str | None:
        if self.spec.input_uri is None:
            return None
        path = s3.path_of(self.spec.input_uri)
        s3.check_readable(fs, path)
        return path

    def _start_heartbeat(self) -> None:
        """Heartbeats from the start: a long resume scan must not look like a dead attempt."""
        self.progress = Progress(
            self.spec.redis_url,
            self.spec.progress_key,
            attempt=self.spec.attempt,
            interval_s=self.spec.progress_interval_s,
            base=None,
            on_superseded=self._superseded,
            client=self.redis_client,
        )
        self.progress.start()

    def _start_progress(self, fs: pafs.FileSystem, input_path: str | None) -> None:
        p = self.prior
        assert self.progress is not None
        base = Counters(p.completed, p.failed, p.prompt_tokens, p.completion_tokens, self.total)
        self.progress.set_base(base)
        self.progress.publish()
        if input_path is not None:
            threading.Thread(
                target=self._count_input, args=(fs, input_path), name="count", daemon=True
            ).start()

    def _count_input(self, fs: pafs.FileSystem, path: str) -> None:
        try:
            self.total = count_request_lines(s3.read_chunks(fs, path))
        except Exception as exc:  # the total is informative only
            log.warning("could not count the input lines: %s", exc)
            return
        if self.progress is not None:
            self.progress.set_total(self.total)

    def _open_writers(self, fs: pafs.FileSystem) -> None:
        spec, attempt = self.spec, self.spec.attempt
        for kind in ("output", "error"):
            self.writers[kind] = ShardWriter(
                fs,
                self.prefix_path,
                "output" if kind == "output" else "error",
                attempt,
                start_index=self.prior.next_index(kind, attempt),
                max_lines=spec.shard_max_lines,
                max_bytes=spec.shard_max_bytes,
                max_seconds=spec.shard_max_seconds,
                fence=self._still_current,
            )

    def _still_current(self) -> bool:
        """No later attempt of the batch has started (the progress hash is the fence)."""
        return self.progress is None or self.progress.still_current()

    def _ignore_stops(self) -> None:
        """From here on a stop request changes nothing (the attempt is ending anyway)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._ignore_stops()
        self.stop_reason = self.stop_reason or signal.Signals(signum).name
        raise StopRequested(self.stop_reason)

    def _install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _install_stop(self) -> None:
        self._install_signal_handlers()
        if self.spec.deadline is not None:
            left = (self.spec.deadline - utcnow()).total_seconds()
            timer = threading.Timer(max(left, 0.0), self._deadline_reached)
            timer.daemon = True
            timer.start()

    def _deadline_reached(self) -> None:
        self.stop_reason = "deadline"
        os.kill(os.getpid(), signal.SIGTERM)

    def _superseded(self) -> None:
        """A later attempt started or the batch ended: stop now, as at the deadline (only while the
        attempt's own handler would take the signal: never once it is ending)."""
        self.stop_reason = self.stop_reason or SUPERSEDED
        if signal.getsignal(signal.SIGTERM) == self._on_signal:
            os.kill(os.getpid(), signal.SIGTERM)

    # --- the run ------------------------------------------------------------------------------

    def _run_pipeline(self, input_path: str | None) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(log_to_driver=True)
        self._install_signal_handlers()  # again: ray.init installs its own SIGTERM handler (it just dies)
        pipeline.configure_data_context()
        placement: dict[str, Any] | None = None
        block_rows: int | None = None
        if self.spec.engine_app is not None:
            # wait here for a replica of the shared engine (a cold start when it scaled to zero):
            # no engine within engine_wait_s ends the attempt with engine_unavailable
            from llmbatch.ray_job.engines.serve_client import ServeEngine

            engine = ServeEngine(self.spec.engine_app, wait_s=self.spec.engine_wait_s)
            block_rows = pipeline.rows_per_call(self.spec, engine.slots())
            # then all of the stages' resources at once, or none (see ray_job.job.reservation)
            reservation = Reservation(self.spec, bundle_of(pipeline.stage_requests(self.spec)))
            waited = reservation.wait(pipeline.WAIT_FOR_ACTORS_S)
            log.info("stages reserved %s after %.1f s", reservation.bundle, waited)
            placement = reservation.remote_args()
        ds = pipeline.build(
            self.spec,
            self.prior.done_shards,
            input_path=input_path,
            placement=placement,
            session=self.session,
            block_rows=block_rows,
        )
        for table in ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=1):
            self.consume(rows.from_table(table))
            for writer in self.writers.values():
                writer.roll_if_old()
        self.pipeline_done = True

    def consume(self, batch: list[rows.Row]) -> None:
        """Write finished rows into the shards and count them."""
        assert self.progress is not None
        for row in batch:
            if row.kind not in (rows.OUTPUT, rows.ERROR, rows.INVALID):
                raise RuntimeError(f"unfinished row {row.kind!r} for line {row.line_no} reached the driver")
            if not self.seen.add(row.line_no):
                log.warning("line %d delivered twice; keeping the first result", row.line_no)
                continue
            if row.engine_ready_at:
                self.engine_ready_at = min(self.engine_ready_at or row.engine_ready_at, row.engine_ready_at)
                self.engine_start_s = max(self.engine_start_s or 0.0, row.engine_start_s)
            if row.kind == rows.OUTPUT:
                self.writers["output"].add(row.payload, row.prompt_tokens, row.completion_tokens)
                self.progress.add(
                    completed=1, prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens
                )
            else:
                self.writers["error"].add(row.payload)
                self.progress.add(failed=1)
                if row.kind == rows.INVALID:
                    self.invalid_lines += 1

    # --- the end ------------------------------------------------------------------------------

    def finish(self, status: Status, error: ErrorObject | None) -> tuple[dict[str, Any], bool]:
        """Flush shards, write the manifest; (result dict, whether all of it was written)."""
        finished = utcnow()
        intact = True
        for writer in self.writers.values():
            try:
                writer.flush()
            except Exception as exc:
                intact = False
                log.error("could not write the last %s shard: %s", writer.kind, exc)
        if error is None and self.progress is not None and self.progress.superseded:
            error = ErrorObject(code=SupersededError.code, message="a later attempt of the batch started")
        written = [info for w in self.writers.values() for info in w.shards]
        shards = [s.info() for s in self.prior.shards] + written
        usage = Usage(
            prompt_tokens=self.prior.prompt_tokens + sum(w.prompt_tokens for w in self.writers.values()),
            completion_tokens=self.prior.completion_tokens
            + sum(w.completion_tokens for w in self.writers.values()),
        )
        out_lines = sum(i.lines for i in self.writers["output"].shards) if "output" in self.writers else 0
        err_lines = sum(i.lines for i in self.writers["error"].shards) if "error" in self.writers else 0
        status, error = settle(
            status,
            error,
            intact=intact,
            resumed=bool(self.prior.shards),
            output_lines=out_lines,
            error_lines=err_lines,
            invalid_lines=self.invalid_lines,
        )
        record = AttemptRecord(
            attempt=self.spec.attempt,
            submission_id=self.spec.submission_id,
            status={"completed": BatchStatus.COMPLETED, "failed": BatchStatus.FAILED}.get(status, "partial"),
            started_at=self.started_at,
            finished_at=finished,
            completed=out_lines,
            failed=err_lines,
            error=error,
        )
        generation_s = time.time() - self.engine_ready_at if self.engine_ready_at else None
        built = manifest.build(
            batch_id=self.spec.batch_id,
            attempt=self.spec.attempt,
            status=status,
            total=self.total,
            shards=shards,
            usage=usage,
            attempts=manifest.history(
                self.spec.batch_id, self.previous, self.prior, record, self.spec.lifecycle
            ),
            started_at=self.started_at,
            finished_at=finished,
            engine_start_s=round(self.engine_start_s, 3) if self.engine_start_s is not None else None,
            generation_s=round(generation_s, 3) if generation_s is not None else None,
            error=error,
        )
        if self.fs is not None and not self._still_current():
            intact = False  # the later attempt's manifest is the batch's: never overwrite it
            log.warning("a later attempt of the batch is running: no manifest written")
        elif self.fs is not None:
            try:
                manifest.write(self.fs, self.manifest_path, built)
            except Exception as exc:
                intact = False
                log.error("could not write the manifest: %s", exc)
        self.memory_peak.stop()
        now = self.memory_peak.now()
        memory = {
            "driver_max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "driver_uss_mb": mib(now.uss) if now is not None else None,
            "driver_uss_peak_mb": self.memory_peak.uss_mb,
            "driver_own_peak_mb": self.memory_peak.own_mb,
        }
        return {**attempt_result(self.spec, built, error), **memory}, intact

    def run(self) -> int:
        """Run the attempt; returns the exit code (see :class:`llmbatch.ray_job.errors.ExitCode`)."""
        status: Status = "completed"
        error: ErrorObject | None = None
        code = ExitCode.OK
        try:
            self._install_stop()
            self.memory_peak.start()
            self._start_heartbeat()
            self.fs = self._filesystem()
            input_path = self._input_path(self.fs)
            self.prior = resume.scan(self.fs, self.prefix_path)
            self.previous = manifest.read_previous(self.fs, self.manifest_path)
            if self.prior.shards:
                log.info(
                    "resuming: %d shards of earlier attempts (%d done, %d failed)",
                    len(self.prior.shards),
                    self.prior.completed,
                    self.prior.failed,
                )
            self._start_progress(self.fs, input_path)
            self._open_writers(self.fs)
            self._run_pipeline(input_path)
        except StopRequested:
            if self.pipeline_done:  # the signal came after every request had ended
                return self._end("completed", None, ExitCode.OK)
            log.warning("stopping early (%s): keeping what finished", self.stop_reason)
            status, code = "partial", ExitCode.RETRIABLE
            error = stop_error(self.stop_reason)
        except (InputNotFoundError, EngineUnavailableError, InfraUnavailableError) as exc:
            log.error("%s", exc)
            self._close_progress()
            self._emit(failure_result(self.spec, exc.exit_code, exc.code, str(exc)))
            return int(exc.exit_code)
        except Exception as exc:
            status, code = "partial", ExitCode.RETRIABLE
            if self.stop_reason:
                # the stop (deadline, SIGTERM) arrived inside a library call (ray.init, Ray Data's
                # executor), which turned our StopRequested into an error of its own
                log.warning(
                    "stopping early (%s), surfaced as %s: keeping what finished",
                    self.stop_reason,
                    type(exc).__name__,
                )
                error = stop_error(self.stop_reason)
            else:
                log.exception("the attempt failed")
                error = ErrorObject(code=failure_code(exc), message=f"{type(exc).__name__}: {exc}"[:4000])
        return self._end(status, error, code)

    def _end(self, status: Status, error: ErrorObject | None, code: ExitCode) -> int:
        self._ignore_stops()
        result, intact = self.finish(status, error)
        if not intact and code == ExitCode.OK:
            code = ExitCode.RETRIABLE
        self._close_progress()
        self._emit({**result, "exit_code": int(code)})
        return int(code)

    def _emit(self, result: dict[str, Any]) -> None:
        self.result = result
        emit_result(result)

    def _close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m llmbatch.ray_job``: returns the process exit code."""
    setup_logging()
    started_at = utcnow()
    session: S3Session | None = None
    try:
        args = spec_loader.parse_args(argv)
        if args.s3_session_key is not None:  # before the spec: a --spec-uri is read with its keys
            session = s3_session.fetch(args.s3_session_redis, args.s3_session_key)
        spec = spec_loader.load_spec(args, session)
    except JobError as exc:
        log.error("%s", exc)
        emit_result(failure_result(None, exc.exit_code, exc.code, str(exc)))
        return int(exc.exit_code)
    log.info(
        "batch %s attempt %d: %s -> %s",
        spec.batch_id,
        spec.attempt,
        spec.input_uri or f"{len(spec.requests or [])} inline requests",
        spec.output_prefix,
    )
    return Attempt(spec, started_at, session=session).run()
