"""The engine registry: which models the service runs, and how their shared engines are deployed.

Each model of the registry is served by one Ray Serve application (``llmbatch-engine-<slug>``)
whose replicas each hold one engine (vLLM, or the fake for tests) and run requests of many
batches at once. Serve scales the replicas between ``min_replicas`` and ``max_replicas`` on the
requests queued per replica and removes idle ones after ``idle_s`` (down to zero when
``min_replicas`` is 0). A request naming a model that is not in the registry is rejected
(``model_not_found``); it never runs on another model.

Pure contract: the dispatcher reads it from its settings, the engine deployment
(:mod:`llmbatch.ray_job.engines.serve_engine`) from its Serve application arguments.
"""

from __future__ import annotations

import hashlib
import math
import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmbatch.schemas.common import ModelName
from llmbatch.schemas.errors import LLMBatchError
from llmbatch.schemas.job import EngineConfig

APP_PREFIX = "llmbatch-engine-"
FILL_ROUNDS = 2
"""Rounds of the engine's request slots a batch alone keeps at it (:func:`call_rows`): one running and
one waiting in the replica's fair queue, so a slot a finished request frees is taken at once (as vLLM's
own waiting queue does for one big ``LLM.chat``) instead of when a whole call has come back."""
DEPLOYMENT_NAME = "EngineServer"


class ReplicaResources(BaseModel):
    """What one engine replica reserves on the cluster (its Ray actor's resources)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_cpus: float = Field(
        default=1.0, ge=0, le=1024, description="CPUs the replica's actor reserves (vLLM's workers included)."
    )
    omp_threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Threads a CPU engine computes on (OMP_NUM_THREADS). Unset: Ray's default, "
        "num_cpus (1 thread for 1 CPU). A node that runs little but its engine is faster with all its "
        "cores (2 cores: 1.9x tokens/s, bench/bench_service.py --omp-threads).",
    )
    num_gpus: float = Field(default=0.0, ge=0, le=64, description="0 on CPU.")
    memory: int = Field(default=0, ge=0, description="Bytes of memory to reserve; 0 = unset.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources, e.g. {'llmbatch_engine': 1} to place replicas on engine nodes.",
    )


class Scaling(BaseModel):
    """Serve autoscaling of one model's replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(default=0, ge=0, le=1024, description="0 = scale to zero when idle.")
    max_replicas: int = Field(default=1, ge=1, le=1024)
    initial_replicas: int | None = Field(
        default=None, ge=0, le=1024, description="Replicas at deploy time (default min_replicas)."
    )
    idle_s: float = Field(default=300.0, ge=0, description="Idle seconds before a replica is removed.")
    target_ongoing_requests: float = Field(
        default=8.0, gt=0, description="Calls in flight per replica Serve scales towards."
    )
    max_ongoing_requests: int = Field(
        default=32, ge=1, le=100_000, description="Calls a replica accepts at once; more wait in the queue."
    )
    max_queued_requests: int = Field(
        default=-1, ge=-1, description="Calls waiting before Serve refuses more (-1 = no limit)."
    )

    @model_validator(mode="after")
    def _coherent(self) -> Scaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        return self


class EngineModel(BaseModel):
    """One model of the registry: what to load, how to run it, where and how many."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, description="What the engine loads: a folder on the workers or an HF id.")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    resources: ReplicaResources = Field(default_factory=ReplicaResources)
    scaling: Scaling = Field(default_factory=Scaling)
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="Extra environment of the replicas (no secrets)."
    )
    max_active_requests: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="Requests a replica's engine runs at once; the rest wait in its fair queue "
        "(priority first, then batches at risk of their deadline, then batches taking turns). "
        "Keep it at most the engine's max_num_seqs, so the engine's own first-come queue stays short. "
        "A batch alone keeps twice this at every live replica (running, and waiting its turn), "
        "whatever its batch_size (then only the least a call carries).",
    )
    admit_per_replica: int = Field(
        default=1024,
        ge=1,
        le=10_000_000,
        description="Requests of launched batches each replica is given at most (on its engine and in "
        "its fair queue; a batch counts its window, twice max_active_requests (at least batch_size x "
        "batches_in_flight), or what it has left). The dispatcher launches more of the model's "
        "batches only while they fit; the rest wait in queued. Higher-priority batches count only "
        "work of their rank or above.",
    )

    @property
    def batch_window(self) -> int:
        """Requests one batch can have at a replica at once: :data:`FILL_ROUNDS` x what its engine runs
        (``max_active_requests``), at least ``batch_size x batches_in_flight`` (see :func:`call_rows`)."""
        return max(
            self.engine.batch_size * self.engine.batches_in_flight, FILL_ROUNDS * self.max_active_requests
        )


def call_rows(*, batch_size: int, batches_in_flight: int, engine_slots: int, lines: int | None = None) -> int:
    """Lines of a batch per call to the shared engine. A batch keeps ``batches_in_flight`` calls at the
    engine, so a batch alone keeps :data:`FILL_ROUNDS` x every request slot the model's live replicas
    have (``engine_slots``: their ``max_active_requests`` summed) whatever its ``batch_size``; a batch
    of ``lines`` lines (when known) that needs fewer spreads them over its calls, and ``batch_size`` is
    the least a call carries. Batches that arrive later share the engine through its fair queue
    (priority, then turns), so nobody tunes this per model."""
    calls = max(1, batches_in_flight)
    fill = FILL_ROUNDS * max(0, engine_slots)
    want = fill if lines is None else min(fill, max(0, lines))
    return max(max(1, batch_size), math.ceil(want / calls))


def app_name(model: str) -> str:
    """The Serve application of ``model``: ``llmbatch-engine-<slug>`` (stable, URL-safe)."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[:40] or "model"
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"{APP_PREFIX}{slug}-{digest}"


class UnknownModelError(LLMBatchError, KeyError):
    """A request names a model the registry does not serve."""

    def __init__(self, model: str, known: list[str]) -> None:
        self.model = model
        self.known = known
        listed = ", ".join(repr(m) for m in known) or "none configured"
        super().__init__(f"model {model!r} is not served here; models: {listed}")

    def __str__(self) -> str:
        return str(self.args[0])


class EngineRegistry(BaseModel):
    """``model name -> EngineModel`` (``LLMBATCH_ENGINES__MODELS`` as JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: dict[ModelName, EngineModel] = Field(default_factory=dict)

    def get(self, model: str) -> EngineModel:
        """The entry of ``model``; raises :class:`UnknownModelError`."""
        try:
            return self.models[model]
        except KeyError:
            raise UnknownModelError(model, sorted(self.models)) from None

    def __contains__(self, model: object) -> bool:
        return model in self.models
