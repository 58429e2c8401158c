"""The Grafana dashboard queries only metrics (and labels) that dispatcher/llmbatch/dispatcher/metrics.py
defines, and
shows every one of them. The live check against a real /metrics scrape is in
tests/integration/test_deploy_metrics.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.scripts import load_script

pytestmark = pytest.mark.unit


vd = load_script("validate_deploy")
grafana = load_script("validate_dashboard")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(grafana.DASHBOARD.read_text())
    return data


def test_dashboard_is_importable(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "llmbatch-dispatcher" and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    ids = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            ids.append(panel["id"])
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
                assert panel["targets"], panel["title"]
                assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
            walk(panel.get("panels") or [])

    walk(dashboard["panels"])
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_queries_name_only_dispatcher_metrics_and_labels(dashboard: dict[str, Any]) -> None:
    known = grafana.registry_metrics()
    targets = grafana.dashboard_targets(dashboard)
    assert len(targets) >= 15
    for title, expr in targets:
        names = grafana.promql_metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        unknown = names - set(known)
        assert unknown == set(), f"{title}: {expr!r} names metrics the dispatcher does not export: {unknown}"
        labels = set().union(*(known[n][1] for n in names))
        grouping = grafana.promql_grouping_labels(expr)
        assert grouping <= labels, f"{title}: grouping by a label these metrics lack"


def test_every_dispatcher_metric_is_on_the_dashboard(dashboard: dict[str, Any]) -> None:
    shown = set().union(*(grafana.promql_metric_names(e) for _, e in grafana.dashboard_targets(dashboard)))
    bases = {
        n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        for n in grafana.registry_metrics()
    }
    missing = {b for b in bases if not any(s == b or s.startswith(b + "_") for s in shown)}
    assert missing == set(), (
        f"add panels for {missing} (deploy/kubernetes/base/grafana/llmbatch-dashboard.json)"
    )


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("sum by (type) (rate(llmbatch_a_total[5m]))", {"llmbatch_a_total"}),
        ('max(llmbatch_b{state="queued", x=~"a|b"}) / on (pod) group_left up', {"llmbatch_b", "up"}),
        ("histogram_quantile(0.95, sum by (le) (rate(llmbatch_c_bucket[15m])))", {"llmbatch_c_bucket"}),
        ("sum(increase(llmbatch_d_total[1h])) * 60 > bool 1e3", {"llmbatch_d_total"}),
        ('label_replace(llmbatch_e, "dst", "$1", "src", "(.*)")', {"llmbatch_e"}),
    ],
)
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    assert grafana.promql_metric_names(expr) == names


def test_registry_introspection_sees_labels() -> None:
    known = grafana.registry_metrics()
    assert known["llmbatch_dispatcher_dead_letters_total"] == ("counter", {"reason"})
    assert "le" in known["llmbatch_job_duration_seconds_bucket"][1]
    assert all(name.startswith("llmbatch_") for name in known)
