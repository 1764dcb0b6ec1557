"""configs/grafana/brownout.json is an importable Grafana dashboard that queries real metrics.

Here, without a cluster: the JSON's shape (panels with targets, unique ids, a 24-column grid,
variables that exist) and that every ``ray_brownout_*`` name it queries is one the code creates.
`tests/integration/test_metrics.py` checks the same names on a running app's metrics endpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "brownout.json"
METRIC = re.compile(r"\bray_[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and query variables."""
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return out


def metric_names(dashboard: dict[str, Any] | None = None) -> set[str]:
    """The exported series names the dashboard reads (``ray_`` prefixed, as Prometheus sees them)."""
    return {m for q in queries(dashboard or load()) for m in METRIC.findall(q)}


def base_name(series: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def test_dashboard_is_valid_json_with_panels_and_targets() -> None:
    d = load()
    assert d["title"] and d["uid"] == "brownout" and isinstance(d["schemaVersion"], int)
    panels = d["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in graphs:
        assert p["title"] and p["targets"], p
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
        assert p["datasource"]["uid"] == "${datasource}"


def test_variables_used_are_defined() -> None:
    d = load()
    defined = {v["name"] for v in d["templating"]["list"]}
    used = set(re.findall(r"\$(\w+)", json.dumps(d["panels"]))) - {"__all", "__interval", "__rate_interval"}
    assert used <= defined, used - defined
    assert {"datasource", "application", "signal"} <= defined


def test_the_dashboard_covers_what_the_issue_asks() -> None:
    names = {base_name(n) for n in metric_names()}
    for needed in ("ray_brownout_level", "ray_brownout_signal", "ray_brownout_signal_threshold",
                   "ray_brownout_stage_outcomes_total", "ray_brownout_admission_refusals_total",
                   "ray_serve_http_request_latency_ms", "ray_brownout_slo_ms"):
        assert needed in names, needed


def created_in_code() -> set[str]:
    """``ray_``-prefixed names of every metric the code creates (counters exported with ``_total``)."""
    names = set()
    for path in [ROOT / "policies" / "actor.py", *(ROOT / "serve_app").glob("*.py"),
                 *(ROOT / "deployments").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        for kind, name in re.findall(r'(Counter|Gauge|Histogram)\(\s*"(brownout_[a-z0-9_]+)"', text):
            if kind == "Counter" and not name.endswith("_total"):
                name += "_total"
            names.add(f"ray_{name}")
    return names


def test_every_brownout_metric_queried_is_created_by_the_code() -> None:
    created = created_in_code()
    assert "ray_brownout_level" in created and "ray_brownout_stage_outcomes_total" in created
    queried = {base_name(n) for n in metric_names() if n.startswith("ray_brownout_")}
    assert queried <= created, queried - created
