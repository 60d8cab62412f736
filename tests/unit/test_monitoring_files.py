"""deploy/prometheus/alerts.yml and the Grafana dashboard: valid, and every metric they query is
one that server/metrics.py really exports.

promtool (Makefile setup installs it) checks the rules, runs the alert unit test and parses every
dashboard expression; without promtool, a small PromQL sanity parser still runs.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ultrafast.local_tools import find_tool
from ultrafast.server.metrics import ServerMetrics, exported_metric_names

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "ultrafast-dashboard.json"
PROMTOOL = find_tool("promtool")
GRAFANA_VARS = {"$__rate_interval": "5m", "$instance": ".*", "${datasource}": "x"}
_NAME = re.compile(r"\b(ultrafast_[a-z0-9_]+)")


def exported() -> set[str]:
    from ultrafast.cluster.health import CLUSTER_METRIC_NAMES  # the cluster ingress's own

    metrics = ServerMetrics(tenants=["a"], alert_priority_itl_p99_s=0.002)
    return exported_metric_names(metrics) | CLUSTER_METRIC_NAMES


def alert_exprs() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    for name, value in GRAFANA_VARS.items():
        exprs = [e.replace(name, value) for e in exprs]
    return exprs


def sanity_check_promql(expr: str) -> None:
    """Brackets balance outside strings, strings close, selectors hold `label op "value"`."""
    stack, pairs, i = [], {")": "(", "]": "[", "}": "{"}, 0
    while i < len(expr):
        ch = expr[i]
        if ch == '"':
            end = expr.find('"', i + 1)
            assert end > 0, f"unclosed string in {expr!r}"
            i = end
        elif ch in "([{":
            stack.append(ch)
        elif ch in ")]}":
            assert stack and stack.pop() == pairs[ch], f"unbalanced {ch!r} in {expr!r}"
        i += 1
    assert not stack, f"unclosed {stack} in {expr!r}"
    for selector in re.findall(r"\{([^{}]*)\}", expr):
        for matcher in filter(None, (m.strip() for m in selector.split(","))):
            assert re.fullmatch(r'[a-zA-Z_][a-zA-Z0-9_]*\s*(=~|!~|!=|=)\s*"[^"]*"', matcher), (
                f"bad matcher {matcher!r} in {expr!r}"
            )
    for window in re.findall(r"\[([^\]]*)\]", expr):
        assert re.fullmatch(r"\d+[smhd]", window), f"bad range {window!r} in {expr!r}"


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_queried_metric_is_exported(source):
    exprs = alert_exprs() if source == "alerts" else dashboard_exprs()
    names = {n for e in exprs for n in _NAME.findall(e)}
    assert names, "no ultrafast metrics queried"
    assert names <= exported(), f"not exported: {sorted(names - exported())}"


def test_a_misspelt_metric_would_be_caught():
    assert "ultrafast_inter_token_latency_bucket" not in exported()
    assert "ultrafast_inter_token_latency_seconds_bucket" in exported()


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_promql_sanity(source):
    for expr in alert_exprs() if source == "alerts" else dashboard_exprs():
        sanity_check_promql(expr)
    with pytest.raises(AssertionError):
        sanity_check_promql('sum(rate(x{a="b"}[5m])')


def test_alert_rules_structure():
    rules = yaml.safe_load(ALERTS.read_text())
    names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert len(names) == len(set(names))
    assert "UltrafastPriorityTokenLatencyP99High" in names
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
            assert rule["labels"]["severity"] in ("page", "ticket")
            assert rule["annotations"]["summary"]


def test_dashboard_structure_p99_beside_utilization():
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    by_title = {p["title"]: p for p in panels}
    e2e, util = by_title["p99 end-to-end latency by tier"], by_title["Utilization"]
    assert e2e["gridPos"]["y"] == util["gridPos"]["y"]  # side by side, same row
    assert e2e["gridPos"]["x"] + e2e["gridPos"]["w"] <= util["gridPos"]["x"]
    assert "histogram_quantile(0.99" in e2e["targets"][0]["expr"]
    assert "ultrafast_engine_busy_seconds_total" in util["targets"][0]["expr"]
    for p in panels:
        assert p["targets"] and all(t["refId"] and t["expr"] for t in p["targets"])
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not in .tools/bin nor on PATH (make setup puts it there)"
)
def test_promtool_checks_rules_and_runs_the_alert_unit_test():
    check = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(
        [PROMTOOL, "test", "rules", "alerts_test.yml"],
        cwd=ALERTS.parent,
        capture_output=True,
        text=True,
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not in .tools/bin nor on PATH (make setup puts it there)"
)
def test_promtool_parses_every_dashboard_expression(tmp_path):
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr{i}", "expr": e}
                    for i, e in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    check = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not in .tools/bin nor on PATH (make setup puts it there)"
)
def test_promtool_checks_the_example_scrape_config(tmp_path):
    config = (ALERTS.parent / "prometheus.yml").read_text()
    key_file = tmp_path / "metrics.key"
    key_file.write_text("a-metrics-scope-key\n")
    (tmp_path / "prometheus.yml").write_text(
        config.replace("/etc/prometheus/ultrafast-metrics.key", str(key_file))
    )
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    check = subprocess.run(
        [PROMTOOL, "check", "config", "prometheus.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    scrape = yaml.safe_load(config)["scrape_configs"][0]
    assert scrape["job_name"] == "ultrafast"  # UltrafastDown selects up{job="ultrafast"}
    assert scrape["authorization"]["type"] == "Bearer"
