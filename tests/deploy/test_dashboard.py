"""deploy/grafana/elasticd.json is built on the daemon's real metrics: every metric name in
any panel's expression is one a real ``elasticd.metrics.Metrics()`` registry exposes, so a
renamed or removed metric fails here, not on an operator's empty panel."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client.metrics import MetricWrapperBase

from elasticd.metrics import Metrics
from tests.deploy.conftest import DEPLOY

DASHBOARD = DEPLOY / "grafana" / "elasticd.json"
METRIC = re.compile(r"\b(elasticd_[A-Za-z0-9_]+)\b")
# Labels every series gets from Prometheus' scrape, and the histogram bucket label.
SCRAPE_LABELS = {"job", "instance", "le"}
# The metrics the dashboard must show (a panel each, or part of one).
REQUIRED = {"elasticd_phase", "elasticd_world_size", "elasticd_steps_per_second", "elasticd_step",
            "elasticd_recovery_seconds_bucket", "elasticd_checkpoint_age_seconds",
            "elasticd_rendezvous_round", "elasticd_worker_restarts_total",
            "elasticd_peer_evictions_total", "elasticd_etcd_up",
            "elasticd_etcd_round_trip_seconds_bucket"}


def exposed_names(metrics: Metrics) -> set[str]:
    """Every sample name the registry exposes, labelled metrics included (they have no
    samples until a label is used, so the names follow from each family's type)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}
    names = set()
    for family in metrics.registry.collect():
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return names


def label_names(metrics: Metrics) -> set[str]:
    return {label for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)
            for label in m._labelnames}


def panels(node: dict) -> list[dict]:
    out = []
    for panel in node.get("panels", []):
        out.append(panel)
        out += panels(panel)          # a row's collapsed panels
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    out = [(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable {var['name']}", query))
    return out


def test_the_names_come_from_a_real_registry():
    names = exposed_names(Metrics())
    assert {"elasticd_worker_restarts_total", "elasticd_recovery_seconds_bucket",
            "elasticd_recovery_seconds_sum", "elasticd_recovery_seconds_count",
            "elasticd_phase"} <= names


def test_every_metric_in_the_dashboard_exists(dashboard):
    names = exposed_names(Metrics())
    used = {(where, name) for where, expr in expressions(dashboard) for name in METRIC.findall(expr)}
    unknown = sorted(f"{where}: {name}" for where, name in used if name not in names)
    assert not unknown, f"metrics not in elasticd.metrics.Metrics: {unknown}"
    shown = {name for _, name in used}
    assert not REQUIRED - shown, f"the dashboard does not show {sorted(REQUIRED - shown)}"


def test_every_label_in_the_dashboard_exists(dashboard):
    known = label_names(Metrics()) | SCRAPE_LABELS
    used = set()
    for _, expr in expressions(dashboard):
        used |= set(re.findall(r"\b([a-z_]+)\s*=~?", expr))
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            used |= {label.strip() for label in group.split(",") if label.strip()}
    assert used <= known, used - known


def test_panels_are_templated_and_quantiles_use_bucket_rates(dashboard):
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= variables
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert METRIC.search(expr), (panel["title"], expr)
            assert '$job' in expr and '$instance' in expr, (panel["title"], expr)
            for quantile in re.findall(r"histogram_quantile\((.*)", expr):
                assert re.search(r"rate\(elasticd_\w+_bucket\{", quantile), (panel["title"], expr)
                assert "le" in re.findall(r"by \(([^)]*)\)", quantile)[0], (panel["title"], expr)
