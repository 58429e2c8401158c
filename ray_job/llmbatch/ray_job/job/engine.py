"""Engine stage: a Ray Data callable class turning request rows into output and error rows.

Ray Data hands each engine actor several batches at once (``max_concurrency`` threads, see
:mod:`llmbatch.ray_job.job.pipeline`). Every batch thread runs its requests on one engine: an engine of the
stage's own (:class:`LocalEngine`, an :class:`~llmbatch.ray_job.engines.engine_runner.EngineRunner` over vLLM
or the fake) or the model's shared engine on Serve (:mod:`llmbatch.ray_job.engines.serve_engine`), so batches
share it by continuous batching.

Isolation: a request the engine refuses becomes an error row for that request only. An engine
that dies fails every waiting batch with :class:`~llmbatch.ray_job.errors.EngineDeadError`: the attempt
fails (retriable) instead of turning the rest of the batch into error lines.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

import orjson
import pyarrow as pa

from llmbatch.ray_job.engines.backends import make_backend
from llmbatch.ray_job.engines.engine_runner import EngineRunner
from llmbatch.ray_job.errors import RequestFailure
from llmbatch.ray_job.lines import rows
from llmbatch.ray_job.lines.embeddings import EmbeddingLine
from llmbatch.ray_job.lines.formatting import embedding_output_line, error_line, output_line
from llmbatch.ray_job.lines.records import Generation, GenRequest
from llmbatch.ray_job.lines.sampling import fit_context, fit_inputs
from llmbatch.schemas.batch import DEFAULT_PRIORITY
from llmbatch.schemas.common import Endpoint
from llmbatch.schemas.job import EngineConfig


class Engine(Protocol):
    """What the engine stage runs requests on: an engine of its own or a shared one on Serve."""

    max_model_len: int
    default_max_tokens: int | None
    engine_start_s: float
    ready_at: float

    def generate(
        self,
        requests: list[GenRequest],
        *,
        group: str = "",
        priority: int = DEFAULT_PRIORITY,
        due: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[Generation]:
        """Results in the order of ``requests``; ``group``, ``priority``, ``due`` and ``stop`` as in
        :meth:`EngineRunner.generate`."""


@runtime_checkable
class SharedEngine(Protocol):
    """An engine shared by many batches that says how many requests its replicas run at once."""

    def slots(self) -> int:
        """Requests the model's live replicas run at once (0: it does not say)."""


def engine_slots(engine: object) -> int:
    """:meth:`SharedEngine.slots` of a shared engine; 0 for an engine of the batch's own."""
    return max(0, engine.slots()) if isinstance(engine, SharedEngine) else 0


class LocalEngine:
    """An engine started by (and for) this stage only."""

    def __init__(self, model_path: str, config: EngineConfig) -> None:
        started = time.perf_counter()
        backend = make_backend(model_path, config)
        self.engine_start_s = time.perf_counter() - started
        self.ready_at = time.time()
        self.max_model_len = backend.max_model_len
        self.default_max_tokens = backend.default_max_tokens
        self._runner = EngineRunner(backend)

    def generate(
        self,
        requests: list[GenRequest],
        *,
        group: str = "",
        priority: int = DEFAULT_PRIORITY,
        due: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[Generation]:
        return self._runner.generate(requests, group=group, priority=priority, due=due, stop=stop)


class EngineStage:
    """Ray Data callable class: request rows in, output / error rows out (other rows pass through).

    With ``engine_app`` (a Serve application of :mod:`llmbatch.ray_job.engines.serve_engine`) the requests run
    on the model's shared, warm engine; without it the stage starts an engine of its own.
    """

    def __init__(
        self,
        *,
        model_path: str,
        engine: str,
        endpoint: str,
        batch_id: str,
        model: str,
        engine_app: str | None = None,
        engine_wait_s: float = 600.0,
        group: str = "",
        priority: int = DEFAULT_PRIORITY,
    ) -> None:
        self._engine: Engine
        if engine_app is not None:
            from llmbatch.ray_job.engines.serve_client import ServeEngine

            self._engine = ServeEngine(engine_app, wait_s=engine_wait_s)
        else:
            self._engine = LocalEngine(model_path, EngineConfig.model_validate_json(engine))
        self.engine_start_s = self._engine.engine_start_s
        self.ready_at = self._engine.ready_at
        self._endpoint = Endpoint(endpoint)
        self._batch_id = batch_id
        self._model = model
        self._group = group or batch_id
        self._priority = priority

    @classmethod
    def on(
        cls,
        engine: Engine,
        *,
        endpoint: str,
        batch_id: str,
        model: str,
        group: str = "",
        priority: int = DEFAULT_PRIORITY,
    ) -> EngineStage:
        """A stage running on an engine that already exists (the batch runner's warm engines)."""
        stage = cls.__new__(cls)
        stage._engine = engine
        stage.engine_start_s = engine.engine_start_s
        stage.ready_at = engine.ready_at
        stage._endpoint = Endpoint(endpoint)
        stage._batch_id = batch_id
        stage._model = model
        stage._group = group or batch_id
        stage._priority = priority
        return stage

    def __call__(self, batch: pa.Table) -> pa.Table:
        return rows.to_table(self.process(rows.from_table(batch)))

    def process(
        self, batch: list[rows.Row], due: float | None = None, stop: threading.Event | None = None
    ) -> list[rows.Row]:
        """Run the request rows of ``batch``; keep the order of the other rows. ``due``: the batch's
        deadline while it is urgent; ``stop``: once set, the call is given up and its requests leave
        the engine (:meth:`EngineRunner.generate`)."""
        backend = self._engine
        prompt_field = "messages" if self._endpoint is Endpoint.CHAT_COMPLETIONS else "prompt"
        out: list[rows.Row] = []
        requests: list[GenRequest] = []
        owners: dict[str, rows.Row] = {}
        embedding_lines: dict[int, EmbeddingLine] = {}
        for row in batch:
            if row.kind != rows.REQUEST:
                out.append(row)
                continue
            prompt = orjson.loads(row.payload)
            if "inputs" in prompt:  # an embedding line: one request per input
                too_long = fit_inputs(prompt["inputs"], backend.max_model_len)
                if too_long is not None:
                    out.append(self._error_row(row, too_long))
                    continue
                line = EmbeddingLine.from_prompt(str(row.line_no), prompt, row.custom_id)
                embedding_lines[row.line_no] = line
                requests.extend(line.requests)
                owners.update((request.key, row) for request in line.requests)
                continue
            sampling = prompt["sampling"]
            failure = fit_context(
                sampling,
                row.prompt_tokens,
                backend.max_model_len,
                prompt_field=prompt_field,
                default_max_tokens=backend.default_max_tokens,
            )
            if failure is not None:
                out.append(self._error_row(row, failure))
                continue
            key = str(row.line_no)
            requests.append(
                GenRequest(
                    key,
                    prompt["prompt_token_ids"],
                    sampling,
                    prompt_text=prompt.get("prompt", ""),
                    custom_id=row.custom_id,
                )
            )
            owners[key] = row
        created = int(time.time())
        answers = self._engine.generate(
            requests, group=self._group, priority=self._priority, due=due, stop=stop
        )
        for gen in answers:
            row = owners[gen.key]
            if row.line_no in embedding_lines:
                embedding_lines[row.line_no].take(gen)
                continue
            if gen.failure is not None:
                out.append(self._error_row(row, gen.failure))
                continue
            payload = output_line(
                self._endpoint,
                gen,
                batch_id=self._batch_id,
                custom_id=row.custom_id,
                line_no=row.line_no,
                model=self._model,
                created=created,
            )
            out.append(
                rows.Row(
                    row.line_no,
                    rows.OUTPUT,
                    row.custom_id,
                    payload,
                    gen.prompt_tokens,
                    gen.completion_tokens,
                    self.engine_start_s,
                    self.ready_at,
                )
            )
        for line in embedding_lines.values():
            out.append(self._embedding_row(owners[line.requests[0].key], line))
        return out

    def _embedding_row(self, row: rows.Row, line: EmbeddingLine) -> rows.Row:
        failure = line.failure()
        if failure is not None:
            return self._error_row(row, failure)
        vectors = line.vectors()
        payload = embedding_output_line(
            vectors,
            batch_id=self._batch_id,
            custom_id=row.custom_id,
            line_no=row.line_no,
            model=self._model,
            encoding_format=line.encoding_format,
        )
        tokens = sum(gen.prompt_tokens for gen in vectors)
        return rows.Row(
            row.line_no, rows.OUTPUT, row.custom_id, payload, tokens, 0, self.engine_start_s, self.ready_at
        )

    def _error_row(self, row: rows.Row, failure: RequestFailure) -> rows.Row:
        payload = error_line(failure, batch_id=self._batch_id, custom_id=row.custom_id, line_no=row.line_no)
        return rows.Row(
            row.line_no, rows.ERROR, row.custom_id, payload, 0, 0, self.engine_start_s, self.ready_at
        )
