"""The shipped Prometheus and Grafana files: promtool accepts the config and the rules, every
alert fires on its own test case, the dashboard JSON is what panels.py generates, and every
dashboard query is one of panels.py's (the live test runs them all against a real cluster)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.grafana import dashboards, panels

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
COMPARISON = re.compile(r"\s*(>|<|==|!=|>=|<=)\s*[0-9.e+-]+\s*$")


def _promtool(*args: str) -> str:
    promtool = shutil.which("promtool")
    assert promtool, "no promtool: scripts/test.sh installs Debian's prometheus package"
    done = subprocess.run([promtool, *args], cwd=PROMETHEUS, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def alert_rules() -> list[dict]:
    """Every alerting rule of alerts.yml."""
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def alert_query(rule: dict) -> str:
    """The rule's expression without its trailing comparison (what the live test runs)."""
    query, count = COMPARISON.subn("", rule["expr"].strip())
    assert count == 1, f"{rule['alert']}: expected `<query> <op> <number>`, got {rule['expr']}"
    return query


def test_promtool_checks_the_config_and_the_rules():
    assert "SUCCESS" in _promtool("check", "config", "prometheus.yml")
    out = _promtool("check", "rules", "alerts.yml")
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


def test_every_alert_fires_in_promtool_test_rules():
    assert "SUCCESS" in _promtool("test", "rules", "alerts_test.yml")
    tested = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tested
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert fired == {rule["alert"] for rule in alert_rules()}
    for rule in alert_rules():
        alert_query(rule)  # each has the `<query> <op> <number>` shape


def test_the_recompute_alert_counts_only_remote_kv_that_was_recomputed():
    [rule] = [r for r in alert_rules() if r["alert"] == "PdserveDecodeRecomputingPrompts"]
    assert 'cause="fallback"' in rule["expr"]
    assert "preemption" not in rule["expr"] and "local_prefill" not in rule["expr"]


def test_the_committed_dashboard_is_what_panels_py_generates():
    assert dashboards.main(["--check"]) == 0, "run: python -m deploy.grafana.dashboards"
    board = json.loads(dashboards.OUT.read_text())
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets", ())]
    assert exprs == [q.expr for row in panels.ROWS for p in row.panels for q in p.queries]
    names = {v["name"] for v in board["templating"]["list"]}
    assert names == {"datasource", "model", "role", "worker", "ttft_slo", "tpot_slo"}
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p.title for row in panels.ROWS for p in row.panels}
    for wanted in ("TTFT", "TPOT", "ITL", "E2E latency", "TTFT SLO attainment", "Serving path"):
        assert wanted in titles


@pytest.mark.parametrize("slo", dashboards.TTFT_SLOS + dashboards.TPOT_SLOS)
def test_every_slo_choice_is_a_bucket_boundary(slo):
    from services.common.metrics import LATENCY_BUCKETS

    assert float(slo) in LATENCY_BUCKETS
    # prometheus-client writes le="0.5", "1.0": the variable's value must match it exactly
    assert slo == repr(float(slo))


def test_provisioning_files_name_the_datasource_and_the_dashboards():
    root = PROMETHEUS.parent / "grafana" / "provisioning"
    datasources = yaml.safe_load((root / "datasources" / "prometheus.yml").read_text())
    assert datasources["datasources"][0]["type"] == "prometheus"
    providers = yaml.safe_load((root / "dashboards" / "pdserve.yml").read_text())
    assert providers["providers"][0]["type"] == "file"


def test_the_docs_show_every_panel_and_a_figure_per_row():
    docs = PROMETHEUS.parents[1] / "docs"
    text = (docs / "observability.md").read_text()
    for row in panels.ROWS:
        slug = panels.slug(row.title)
        assert (
            f"(observability/{slug}.png)" in text
            and (docs / "observability" / f"{slug}.png").exists()
        )
        for panel in row.panels:
            assert f"| {panel.title} | {panel.answers} |" in text, panel.title
    for rule in alert_rules():
        assert rule["alert"] in text
