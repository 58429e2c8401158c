"""Engine figures: a replica's metrics (ray_job.engines.engine_metrics), their sums per model over Ray's
metrics texts (ray_job.engines.engine_stats), the dispatcher's gauges, and the runner's route."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from llmbatch.dispatcher.metrics import ENGINE_GAUGES, Metrics
from llmbatch.ray_job.batch_runner.runner_http import route
from llmbatch.ray_job.engines.engine_metrics import COUNTERS, GAUGES, RATE_WINDOW_S, EngineMetrics
from llmbatch.ray_job.engines.engine_stats import summarize_metrics

pytestmark = pytest.mark.unit

LABELS = 'Component="core_worker",NodeAddress="127.0.0.1",SessionName="s",Version="2.60.0"'


def node_text(
    model: str,
    replica: str,
    *,
    queued: int,
    active: int,
    idle: float,
    requests: int,
    tokens: int,
    rate: float,
) -> str:
    tags = f'{LABELS},model="{model}",replica="{replica}"'
    return "\n".join(
        [
            "# HELP ray_llmbatch_engine_queued_requests Requests waiting in the replica's fair queue.",
            "# TYPE ray_llmbatch_engine_queued_requests gauge",
            f"ray_llmbatch_engine_queued_requests{{{tags}}} {queued}.0",
            "# TYPE ray_llmbatch_engine_active_requests gauge",
            f"ray_llmbatch_engine_active_requests{{{tags}}} {active}.0",
            "# TYPE ray_llmbatch_engine_idle_seconds gauge",
            f"ray_llmbatch_engine_idle_seconds{{{tags}}} {idle}",
            "# TYPE ray_llmbatch_engine_tokens_per_second gauge",
            f"ray_llmbatch_engine_tokens_per_second{{{tags}}} {rate}",
            "# TYPE ray_llmbatch_engine_start_seconds gauge",
            f"ray_llmbatch_engine_start_seconds{{{tags}}} 41.5",
            "# TYPE ray_llmbatch_engine_requests_total counter",
            f"ray_llmbatch_engine_requests_total{{{tags}}} {requests}.0",
            "# TYPE ray_llmbatch_engine_completion_tokens_total counter",
            f"ray_llmbatch_engine_completion_tokens_total{{{tags}}} {tokens}.0",
            "# TYPE ray_llmbatch_engine_cold_starts_total counter",
            f"ray_llmbatch_engine_cold_starts_total{{{tags}}} 1.0",
            "# TYPE ray_serve_num_router_requests_total counter",
            f'ray_serve_num_router_requests_total{{{LABELS},deployment="EngineServer"}} 99.0',
            "",
        ]
    )


def test_figures_are_summed_per_model_over_replicas_and_nodes() -> None:
    head = node_text("m", "r1", queued=3, active=8, idle=0.0, requests=10, tokens=100, rate=5.0)
    worker = node_text("m", "r2", queued=1, active=2, idle=7.5, requests=4, tokens=40, rate=1.5) + node_text(
        "other", "r3", queued=0, active=0, idle=60.0, requests=1, tokens=2, rate=0.0
    )
    figures = summarize_metrics([head, worker])
    m = figures["m"].as_dict()
    assert m["replicas"] == 2 and m["queued"] == 4 and m["active"] == 10
    assert m["requests"] == 14 and m["completion_tokens"] == 140 and m["tokens_per_s"] == 6.5
    assert m["idle_s"] == 0.0 and m["cold_starts"] == 2 and m["start_s_max"] == 41.5
    assert figures["other"].replicas == 1 and figures["other"].idle_s == 60.0
    assert summarize_metrics(['ray_llmbatch_engine_queued_requests{model="x" 1']) == {}  # unreadable


@given(st.text(max_size=300))
def test_any_text_is_read_without_raising(text: str) -> None:
    summarize_metrics([text, "ray_llmbatch_engine_" + text])


def test_replica_metrics_are_off_without_ray_and_keep_a_token_rate() -> None:
    metrics = EngineMetrics("m")
    assert not metrics.enabled
    metrics.answered(3, 120)
    assert metrics.tokens_per_second() == pytest.approx(120 / RATE_WINDOW_S)
    import time

    assert metrics.tokens_per_second(now=time.monotonic() + RATE_WINDOW_S + 1) == 0.0
    assert all(name.startswith("llmbatch_engine_") for name in [*GAUGES, *COUNTERS])


def test_dispatcher_gauges_follow_the_latest_figures() -> None:
    metrics = Metrics(CollectorRegistry())
    metrics.set_engines(
        {
            "m": {
                "replicas": 2,
                "queued": 4.0,
                "active": 1.0,
                "idle_s": None,
                "tokens_per_s": 6.5,
                "cold_starts": 2.0,
            }
        }
    )
    text = generate_latest(metrics.registry).decode()
    assert 'llmbatch_engine_queued_requests{model="m"} 4.0' in text
    assert 'llmbatch_engine_tokens_per_second{model="m"} 6.5' in text
    assert 'llmbatch_engine_idle_seconds{model="m"}' not in text  # unknown is absent, not 0
    metrics.set_engines({})
    assert 'model="m"' not in generate_latest(metrics.registry).decode()
    assert set(metrics.engine) == set(ENGINE_GAUGES)


def test_runner_routes_the_engines_report() -> None:
    assert route("GET", "/llmbatch-runner/engines") == ("engines", None)
    assert route("POST", "/llmbatch-runner/engines") == ("", None)
    assert route("GET", "/llmbatch-runner/runs/x") == ("status", "x")
