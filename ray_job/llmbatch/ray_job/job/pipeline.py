"""The Ray Data pipeline: read+parse (task) -> prompt (actor) -> engine (actor pool) -> driver.

Resources follow the traps measured on Ray 2.60 (docs/ENVIRONMENT): the reader and the prompt
stage take fractional CPUs so an engine actor can never starve them; the job's driver takes none
(``entrypoint_num_cpus=0`` at submit); a no-progress timeout turns a hung pipeline into a failed
(retriable) attempt; ``max_errored_blocks`` stays 0 (per-request errors are rows, never dropped
blocks). Each engine replica receives ``batches_in_flight`` batches at once and runs them
concurrently on one engine (see :mod:`llmbatch.ray_job.job.engine`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, cast

import ray
from ray.data import ActorPoolStrategy, DataContext, Dataset

from llmbatch.ray_job.job.data_stats import BoundedBlockStats
from llmbatch.ray_job.job.engine import EngineStage
from llmbatch.ray_job.job.prompts import PromptStage
from llmbatch.ray_job.job.reader import Source, read_rows
from llmbatch.schemas.engines import call_rows
from llmbatch.schemas.job import JobSpec, S3Session

READ_CPUS = 0.1
PROMPT_CPUS = 0.1
REBATCH_CPUS = 0.1
SHARED_CLIENT_CPUS = 0.1
NO_PROGRESS_TIMEOUT_S = float(os.environ.get("LLMBATCH_JOB_NO_PROGRESS_TIMEOUT_S", "1800"))
TARGET_BLOCK_BYTES = 8 << 20
WAIT_FOR_ACTORS_S = int(os.environ.get("LLMBATCH_JOB_WAIT_FOR_ACTORS_S", "1800"))


def configure_data_context() -> DataContext:
    """Ray Data settings for this job (call after ``ray.init``)."""
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.execution_options.preserve_order = False
    ctx.max_errored_blocks = 0
    ctx.execution_no_progress_timeout_s = NO_PROGRESS_TIMEOUT_S
    ctx.wait_for_min_actors_s = WAIT_FOR_ACTORS_S
    # the reader's output is merged into blocks up to this size before it moves on: keep it small
    # so the engine starts on the first lines of a big file instead of waiting for 128 MiB of them
    ctx.target_max_block_size = TARGET_BLOCK_BYTES
    # Ray Data keeps one stats entry per block until the dataset ends: bounded instead (data_stats)
    if BoundedBlockStats not in ctx.custom_execution_callback_classes:
        ctx.custom_execution_callback_classes = [*ctx.custom_execution_callback_classes, BoundedBlockStats]
    return ctx


def engine_compute(spec: JobSpec) -> ActorPoolStrategy:
    """A fixed pool of engine replicas, each running ``batches_in_flight`` batches concurrently.

    On a shared engine (``spec.engine_app``) one light client actor sends ``batches_in_flight``
    batches at once; Serve spreads them over the model's replicas."""
    in_flight = spec.engine.batches_in_flight
    return ActorPoolStrategy(
        size=1 if spec.engine_app else spec.engine.replicas,
        max_tasks_in_flight_per_actor=in_flight,
        max_concurrent_calls_per_actor=in_flight,
        enable_true_multi_threading=True,
    )


def engine_settings(spec: JobSpec) -> str:
    """The engine config as JSON for the actors; multi-GPU replicas default to vLLM's mp executor."""
    engine = spec.engine
    if engine.tensor_parallel_size > 1 and "distributed_executor_backend" not in engine.engine_kwargs:
        engine = engine.model_copy(
            update={"engine_kwargs": {**engine.engine_kwargs, "distributed_executor_backend": "mp"}}
        )
    return engine.model_dump_json()


def rebatch(ds: Dataset, rows: int, resources: dict[str, Any] | None = None) -> Dataset:
    """Blocks of ``rows`` rows, so each engine task is one batch: the batches of one replica then
    run concurrently on its engine, and each batch's results reach the driver as soon as it ends
    (a task's outputs are merged into one block released when the task finishes).

    This is ``ds.repartition(target_num_rows_per_block=rows)`` with fractional CPUs: the public call
    gives its tasks 1 CPU each, which an engine replica holding the node's other CPU starves forever
    on a small node. ``resources``: its tasks' (:meth:`llmbatch.schemas.job.JobSpec.stage_resources`). Falls
    back to the public call if Ray's internals move (not for a pooled tenant's job).
    """
    remote_args = resources or {"num_cpus": REBATCH_CPUS}
    try:
        from ray.data._internal.logical.interfaces import LogicalPlan
        from ray.data._internal.logical.operators import StreamingRepartition

        op = StreamingRepartition(
            target_num_rows_per_block=rows,
            input_dependencies=[ds._logical_plan.dag],
            ray_remote_args=remote_args,
        )
        return Dataset._from_parent(ds, LogicalPlan(op, ds.context))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - other Ray versions
        if set(remote_args) - {"num_cpus"}:  # a pooled tenant's or a reserved job's tasks must stay there
            raise
        return ds.repartition(target_num_rows_per_block=rows)


def source_of(
    spec: JobSpec,
    done_shards: Sequence[str],
    *,
    input_path: str | None,
    session: S3Session | None = None,
    block_rows: int | None = None,
) -> Source:
    """What the reader reads for ``spec``: the input file or the inline requests, minus done lines
    (with ``session``'s keys, the attempt's own, when given), in blocks of ``block_rows`` lines
    (default ``batch_size``; :func:`~llmbatch.schemas.engines.call_rows` on a shared engine)."""
    inline = b"".join(line.to_jsonl() for line in spec.requests) if spec.requests is not None else None
    return Source(
        batch_id=spec.batch_id,
        endpoint=spec.endpoint.value,
        model=spec.model,
        input_path=input_path,
        inline=inline,
        done_shards=tuple(done_shards),
        block_rows=block_rows or spec.engine.batch_size,
        max_line_bytes=spec.max_line_bytes,
        session=session,
    )


def rows_per_call(spec: JobSpec, engine_slots: int) -> int:
    """Lines of ``spec``'s batch per call to a shared engine whose live replicas run ``engine_slots``
    requests at once (:func:`~llmbatch.schemas.engines.call_rows`; the inline lines when known)."""
    return call_rows(
        batch_size=spec.engine.batch_size,
        batches_in_flight=spec.engine.batches_in_flight,
        engine_slots=engine_slots,
        lines=len(spec.requests) if spec.requests is not None else None,
    )


def prompt_actors(spec: JobSpec) -> int:
    """Size of the prompt stage's actor pool."""
    return min(spec.engine.replicas, 4)


def stage_requests(spec: JobSpec) -> list[dict[str, Any]]:
    """The Ray resources of every task and actor slot of a shared-engine job's pipeline, as
    :func:`build` asks them: the reader's task, the prompt actors, one repartition task and the
    engine client (what :mod:`llmbatch.ray_job.job.reservation` reserves for the job)."""
    slots = [READ_CPUS] + [PROMPT_CPUS] * prompt_actors(spec) + [REBATCH_CPUS, SHARED_CLIENT_CPUS]
    return [spec.stage_resources(cpus) for cpus in slots]


def build(
    spec: JobSpec,
    done_shards: Sequence[str],
    *,
    input_path: str | None,
    placement: dict[str, Any] | None = None,
    session: S3Session | None = None,
    block_rows: int | None = None,
) -> Dataset:
    """The dataset of finished rows (``output`` / ``error``) for the lines still to do (those the
    shards at ``done_shards`` answer are skipped). ``placement``: remote args that put every task
    and actor inside the job's reservation (:meth:`llmbatch.ray_job.job.reservation.Reservation.remote_args`;
    a shared-engine job's, whose slots :func:`stage_requests` lists). ``session``: the attempt's own S3
    keys, for the reader (:mod:`llmbatch.ray_job.storage.s3_session`). ``block_rows``: lines per engine call
    (default ``batch_size``; a shared engine's :func:`~llmbatch.schemas.engines.call_rows`)."""
    block = block_rows or spec.engine.batch_size
    source = source_of(spec, done_shards, input_path=input_path, session=session, block_rows=block)
    model_path = spec.model_path or spec.model
    extra = placement or {}

    def resources(cpus: float) -> dict[str, Any]:
        # every task and actor asks spec.stage_resources: a pooled tenant's run only on its pool's nodes
        return {**spec.stage_resources(cpus), **extra}

    ds: Dataset = ray.data.from_items([{"part": 0}])
    ds = ds.map_batches(
        cast(Any, read_rows),
        batch_size=1,
        batch_format="pyarrow",
        fn_kwargs={"source": source},
        **resources(READ_CPUS),
    )
    ds = ds.map_batches(
        PromptStage,
        batch_size=None,
        batch_format="pyarrow",
        compute=ActorPoolStrategy(size=prompt_actors(spec)),
        fn_constructor_kwargs={
            "model_path": model_path,
            "endpoint": spec.endpoint.value,
            "batch_id": spec.batch_id,
            "backend": spec.engine.backend,
        },
        **resources(PROMPT_CPUS),
    )
    ds = rebatch(ds, block, resources(REBATCH_CPUS))
    return ds.map_batches(
        EngineStage,
        batch_size=block,
        batch_format="pyarrow",
        compute=engine_compute(spec),
        fn_constructor_kwargs={
            "model_path": model_path,
            "engine": engine_settings(spec),
            "endpoint": spec.endpoint.value,
            "batch_id": spec.batch_id,
            "model": spec.model,
            "engine_app": spec.engine_app,
            "engine_wait_s": spec.engine_wait_s,
            "group": spec.engine_group,
            "priority": spec.priority,
        },
        # a client of the shared engine needs next to no CPU and never a GPU
        **resources(SHARED_CLIENT_CPUS if spec.engine_app else spec.engine.num_cpus_per_replica),
        num_gpus=None if spec.engine_app else (spec.engine.num_gpus_per_replica or None),
    )
