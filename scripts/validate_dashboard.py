#!/usr/bin/env python3
"""The Grafana dashboard against the dispatcher's metrics: the metric names and grouping labels a
PromQL query uses, the dashboard's queries, the names of a Prometheus exposition, and every series
``llmbatch.dispatcher.metrics.Metrics`` defines. Loaded by path (scripts/ is no package) by the deploy
tests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "kubernetes" / "base" / "grafana" / "llmbatch-dashboard.json"


_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
    "atan2",
    "start",
    "end",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are neither functions, keywords, label
    names (inside ``{...}`` or ``by/without/on/ignoring (...)``), strings nor durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges / subqueries
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group(0)
        following = text[match.end() :].lstrip()
        if following.startswith("(") or word.lower() in _PROMQL_WORDS:
            continue
        if match.start() > 0 and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue  # 5m, 1e3
        names.add(word)
    return names


def promql_grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for match in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in match.group(1).split(",") if x.strip()}
    return labels


def dashboard_targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query, rows' nested panels included."""
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets") or []:
                if target.get("expr"):
                    out.append((panel.get("title", "?"), target["expr"]))
            walk(panel.get("panels") or [])

    walk(dashboard.get("panels") or [])
    return out


def exposition_names(text: str) -> set[str]:
    """Every series name a Prometheus text exposition can produce (from its TYPE lines and samples):
    histograms add _bucket/_sum/_count/_created, counters their _total/_created."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind in {"histogram", "summary"}:
                names |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
            elif kind == "counter":
                base = name[: -len("_total")] if name.endswith("_total") else name
                names |= {base, base + "_total", base + "_created"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def registry_metrics() -> dict[str, tuple[str, set[str]]]:
    """series name -> (type, label names) for every metric of ``llmbatch.dispatcher.metrics.Metrics``."""
    from llmbatch.dispatcher.metrics import Metrics

    out: dict[str, tuple[str, set[str]]] = {}
    for collector in list(Metrics().registry._collector_to_names):
        base = collector._name  # type: ignore[attr-defined]
        kind = collector._type  # type: ignore[attr-defined]
        labels = set(collector._labelnames)  # type: ignore[attr-defined]
        if kind == "counter":
            out[base + "_total"] = (kind, labels)
        elif kind == "histogram":
            for suffix in ("_sum", "_count"):
                out[base + suffix] = (kind, labels)
            out[base + "_bucket"] = (kind, labels | {"le"})
        else:
            out[base] = (kind, labels)
    return out
