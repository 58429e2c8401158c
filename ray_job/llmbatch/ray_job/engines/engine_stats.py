"""Per-model figures of the shared engines, summed over their replicas from Ray's metrics (pure).

Each replica exports ``llmbatch_engine_*`` (:mod:`llmbatch.ray_job.engines.engine_metrics`) through its node's
metrics agent, in Prometheus text under Ray's namespace (``ray_llmbatch_engine_*``). The batch
runner scrapes every node (``GET /engines``) and sums them per model with :func:`summarize_metrics`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "ray_llmbatch_engine_"


@dataclass
class ModelFigures:
    """One model's engines: sums over replicas (idle: the least idle replica)."""

    replicas: int = 0
    queued: float = 0.0
    active: float = 0.0
    idle_s: float | None = None
    tokens_per_s: float = 0.0
    requests: float = 0.0
    completion_tokens: float = 0.0
    preempted: float = 0.0
    abandoned: float = 0.0
    cold_starts: float = 0.0
    start_s_max: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_SUMMED = {
    "queued_requests": "queued",
    "active_requests": "active",
    "tokens_per_second": "tokens_per_s",
    "requests_total": "requests",
    "completion_tokens_total": "completion_tokens",
    "preempted_total": "preempted",
    "abandoned_total": "abandoned",
    "cold_starts_total": "cold_starts",
}


def summarize_metrics(texts: list[str]) -> dict[str, ModelFigures]:
    """``model -> figures`` from the Prometheus texts of every node (malformed lines are skipped)."""
    models: dict[str, ModelFigures] = {}
    replicas: dict[str, set[str]] = {}
    for text in texts:
        for sample in _samples(text):
            name, labels, value = sample
            model = labels.get("model")
            if model is None:
                continue
            figures = models.setdefault(model, ModelFigures())
            replicas.setdefault(model, set()).add(labels.get("replica", ""))
            short = name.removeprefix(PREFIX)
            if short in _SUMMED:
                attr = _SUMMED[short]
                setattr(figures, attr, getattr(figures, attr) + value)
            elif short == "idle_seconds":
                figures.idle_s = value if figures.idle_s is None else min(figures.idle_s, value)
            elif short == "start_seconds":
                figures.start_s_max = max(figures.start_s_max, value)
    for model, figures in models.items():
        figures.replicas = len(replicas[model])
    return models


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    lines = "\n".join(
        ln for ln in text.splitlines() if ln.startswith(PREFIX) or (ln.startswith("# ") and PREFIX in ln)
    )
    out = []
    try:
        for family in text_string_to_metric_families(lines + "\n"):
            for s in family.samples:
                if s.name.startswith(PREFIX) and not s.name.endswith("_created"):
                    out.append((s.name, dict(s.labels), float(s.value)))
    except ValueError:
        pass  # a node's text we cannot read: its figures are missing, the others stand
    return out
