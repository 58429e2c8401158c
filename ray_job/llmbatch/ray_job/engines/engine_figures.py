"""The shared engines' figures per model now: every live node's metrics agent read and the replicas'
metrics summed (:func:`llmbatch.ray_job.engines.engine_stats.summarize_metrics`), for the batch runner's
``GET /engines``."""

from __future__ import annotations

import logging
from typing import Any

from llmbatch.ray_job.engines.engine_stats import summarize_metrics

log = logging.getLogger(__name__)


def engine_figures(timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """The shared engines' figures per model, from the metrics agent of every live node."""
    import urllib.request

    import ray

    texts = []
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        url = f"http://{node['NodeManagerAddress']}:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                texts.append(resp.read().decode("utf-8", "replace"))
        except OSError as exc:
            log.warning("no metrics from node %s: %s", node.get("NodeManagerAddress"), exc)
    return {model: f.as_dict() for model, f in summarize_metrics(texts).items()}
