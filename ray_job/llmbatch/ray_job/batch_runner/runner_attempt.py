"""A batch run in a thread of the batch runner (:mod:`llmbatch.ray_job.batch_runner.runner`): the job's
attempt with no signals, no Ray Data and a warm engine, and the batch's view of that engine."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from llmbatch.ray_job.engines.tokenizers import Tokenizer
from llmbatch.ray_job.errors import CallAbandonedError
from llmbatch.ray_job.job.engine import Engine, EngineStage, engine_slots
from llmbatch.ray_job.job.main import Attempt, StopRequested
from llmbatch.ray_job.job.memory import MemoryPeak
from llmbatch.ray_job.job.outcome import SUPERSEDED
from llmbatch.ray_job.job.pipeline import rows_per_call, source_of
from llmbatch.ray_job.job.prompts import build_rows
from llmbatch.ray_job.job.reader import iter_blocks
from llmbatch.ray_job.lines import rows
from llmbatch.ray_job.lines.records import Generation, GenRequest
from llmbatch.schemas.batch import DEFAULT_PRIORITY
from llmbatch.schemas.common import utcnow
from llmbatch.schemas.deadlines import urgent
from llmbatch.schemas.job import JobSpec, S3Session


class RunnerAttempt(Attempt):
    """An attempt run in a thread of the runner: no signals, no Ray Data, a warm engine. ``redis``: a
    client for the spec's ``redis_url`` to write progress with (the runner's own: none made per batch)."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        tokenizer: Callable[[], Tokenizer],
        keep_text: bool,
        engine: Callable[[], Engine],
        s3_session: S3Session | None = None,
        redis: Any = None,
    ) -> None:
        super().__init__(spec, utcnow(), session=s3_session)  # the batch's own keys, else the node's
        # the runner's process is every run's: no figure of its own
        self.memory_peak = MemoryPeak(sample=None)
        self.redis_client = redis  # the runner's client for its Redis (the spec's URL is the runner's)
        self._tokenizer = tokenizer
        self._keep_text = keep_text
        self._engine = engine
        self._stop = threading.Event()
        self._timer: threading.Timer | None = None

    def request_stop(self, reason: str) -> None:
        """Stop at the next block boundary (``deadline``, ``stopped``, ``superseded``), keeping what
        finished."""
        self.stop_reason = self.stop_reason or reason
        self._stop.set()

    def _superseded(self) -> None:  # a thread of the runner: no signal, the stop flag
        self.request_stop(SUPERSEDED)

    def _install_stop(self) -> None:
        if self.spec.deadline is not None:
            left = (self.spec.deadline - utcnow()).total_seconds()
            self._timer = threading.Timer(max(left, 0.0), self.request_stop, args=("deadline",))
            self._timer.daemon = True
            self._timer.start()

    def _ignore_stops(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise StopRequested(self.stop_reason)

    def _run_pipeline(self, input_path: str | None) -> None:
        spec = self.spec
        tokenizer = self._tokenizer()
        engine = self._engine()
        stage = EngineStage.on(
            engine,
            endpoint=spec.endpoint.value,
            batch_id=spec.batch_id,
            model=spec.model,
            group=spec.engine_group,
            priority=spec.priority,
        )
        in_flight = max(1, spec.engine.batches_in_flight)
        per_call = rows_per_call(spec, engine_slots(engine))
        source = source_of(spec, self.prior.done_shards, input_path=input_path, block_rows=per_call)
        pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix=f"run-{spec.batch_id}"[:40])
        pending: deque[Future[list[rows.Row]]] = deque()
        began, done_before = time.monotonic(), self._done()
        try:
            for block in iter_blocks(source, self.fs):
                self._check_stop()
                prompted = build_rows(
                    tokenizer, spec.endpoint, block, batch_id=spec.batch_id, keep_text=self._keep_text
                )
                # the stop flag goes with the call: a stopped batch's calls leave the engine at once
                pending.append(
                    pool.submit(stage.process, prompted, self._due(began, done_before), self._stop)
                )
                while len(pending) >= in_flight:
                    self._take(pending.popleft())
            while pending:
                self._take(pending.popleft())
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        self.pipeline_done = True

    def _done(self) -> int:
        """Requests of the batch answered so far (earlier attempts' included)."""
        if self.progress is None:
            return 0
        counts = self.progress.snapshot()
        return counts.completed + counts.failed

    def _due(self, began: float, done_before: int) -> float | None:
        """The batch's deadline (unix seconds) while it is urgent (near, or missed at this attempt's rate
        so far: :func:`~llmbatch.schemas.deadlines.urgent`), for the engine to take its next call before
        the batches of its priority in turn; else ``None``."""
        deadline = self.spec.deadline
        if deadline is None:
            return None
        left = None if self.total is None else self.total - done_before
        running_s = time.monotonic() - began
        if urgent(self._done() - done_before, left, running_s, (deadline - utcnow()).total_seconds()):
            return deadline.timestamp()
        return None

    def _take(self, future: Future[list[rows.Row]]) -> None:
        while True:
            self._check_stop()
            try:
                finished = future.result(timeout=0.25)
            except FutureTimeout:
                continue
            except CallAbandonedError:
                if self._stop.is_set():
                    continue  # the call was given up because this attempt stops: the stop says why
                raise
            self.consume(finished)
            for writer in self.writers.values():
                writer.roll_if_old()
            return


class WarmEngine:
    """A batch's view of a cached engine: its own wait for it (zero when it was warm)."""

    def __init__(self, engine: Engine, *, waited_s: float, slots: Callable[[], int] | None = None) -> None:
        self._engine = engine
        self._slots = slots
        self.max_model_len = engine.max_model_len
        self.default_max_tokens = engine.default_max_tokens
        self.engine_start_s = waited_s
        self.ready_at = time.time()

    def slots(self) -> int:
        """Requests the engine's live replicas run at once (0 when it does not say)."""
        return self._slots() if self._slots is not None else 0

    def generate(
        self,
        requests: list[GenRequest],
        *,
        group: str = "",
        priority: int = DEFAULT_PRIORITY,
        due: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[Generation]:
        return self._engine.generate(requests, group=group, priority=priority, due=due, stop=stop)
