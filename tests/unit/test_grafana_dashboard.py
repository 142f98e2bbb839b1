"""The Grafana dashboard in compose/grafana/ asks only for metrics CapyCTL exports: every
metric named in a panel's query (or a variable's) is one the router's registry or its
scrape-time collector exposes, so renaming a metric without the dashboard fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from capyctl_router.metrics import GpuCollector, Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "compose" / "grafana" / "capyctl-dashboard.json"
# What a family of each type exposes: a counter's samples end in _total, a histogram's in
# _bucket, _sum and _count, a gauge's are its name.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
# PromQL's words that are neither functions nor metrics.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACES = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)")
_VARIABLE = re.compile(r"\$\{?\w+\}?")
_LABEL_VALUES = re.compile(r"label_values\((.+),\s*\w+\)")
_NAME = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()")


def exported() -> set[str]:
    """Every sample name /metrics may expose, from the real registry and collector."""
    families = [*Metrics().registry.collect(), *GpuCollector(None).collect()]
    assert families
    return {family.name + suffix for family in families for suffix in SUFFIXES[family.type]}


def metrics_in(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label
    matchers, ranges, groupings and Grafana's variables are gone, and is not a function."""
    bare = _VARIABLE.sub("", _GROUPING.sub("", _BRACES.sub("", _STRING.sub("", expr))))
    return {name for name in _NAME.findall(bare) if name not in KEYWORDS}


def dashboard() -> dict[str, Any]:
    found: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return found


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    flat = []
    for panel in board["panels"]:
        flat.append(panel)
        flat.extend(panel.get("panels", []))
    return [panel for panel in flat if panel["type"] != "row"]


def test_every_query_names_only_metrics_capyctl_exports() -> None:
    names = exported()
    board = dashboard()
    used: set[str] = set()
    for panel in panels(board):
        assert panel["targets"], f"{panel['title']}: no query"
        for target in panel["targets"]:
            found = metrics_in(target["expr"])
            assert found, f"{panel['title']}: {target['expr']} names no metric"
            assert found <= names, f"{panel['title']}: {sorted(found - names)} not exported"
            used |= found
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":  # Grafana's label_values(metric, label)
            query = _LABEL_VALUES.fullmatch(variable["query"]["query"])
            assert query is not None, variable["query"]
            assert metrics_in(query[1]) <= names, f"${variable['name']}: {query[1]} not exported"
    for wanted in (
        "capyctl_requests_total",
        "capyctl_requests_waiting",
        "capyctl_queue_full_total",
        "capyctl_time_to_first_token_seconds_bucket",
        "capyctl_ready_wait_seconds_bucket",
        "capyctl_lifecycle_engine_seconds_sum",
        "capyctl_lifecycle_overhead_seconds_sum",
        "capyctl_evictions_total",
        "capyctl_gpu_memory_bytes",
        "capyctl_download_bytes_total",
    ):
        assert wanted in used, f"no panel shows {wanted}"


def test_the_metric_names_are_read_as_promql_selects_them() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, operation) (rate(capyctl_x_bucket{a=~"$d", '
        'b="rate(y)"}[$__rate_interval]))) / on (gpu) capyctl_y + ignored_metric offset 5m'
    )
    assert metrics_in(expr) == {"capyctl_x_bucket", "capyctl_y", "ignored_metric"}
    assert "capyctl_requests" not in exported(), "a counter is exposed as _total"
    assert "capyctl_gpu_free_bytes" in exported(), "the scrape-time collector's gauges"


def test_every_panel_queries_the_chosen_prometheus() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 39
    (source,) = [v for v in board["templating"]["list"] if v["name"] == "datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    for panel in panels(board):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
    assert len({panel["id"] for panel in board["panels"]}) == len(board["panels"])
