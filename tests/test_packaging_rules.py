"""Issue #28: what operators expect shipped -- Prometheus alerting rules and a Grafana
dashboard for omnid's /metrics (packaging/prometheus, packaging/grafana).

The rules are checked and unit-tested by promtool (Debian package prometheus; .ci/run
installs it) against recorded series. No Grafana installs from the package registries
this project may use, so the dashboard is not loaded by a real Grafana here: it is
checked against the essentials of Grafana's dashboard schema (schemaVersion, unique
panel ids, panel types, a 24-column grid without overlaps, datasource and variables),
and every query in it is parsed by promtool. Every metric a rule or a panel names must
be one omnid exports, and the new stack-level series are read from a real daemon."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, make_stack, wait_for

PROM = REPO / "packaging" / "prometheus"
GRAFANA = REPO / "packaging" / "grafana"
RULES = PROM / "omnid-alerts.yml"
DASHBOARD = GRAFANA / "omnid-dashboard.json"
# Where /metrics is written: every omnid_* name in them is a name omnid can export.
METRIC_SOURCES = [REPO / "omnid" / "api" / "health.py", REPO / "omnid" / "api" / "metrics.py", REPO / "omnid" / "cluster" / "metrics.py",
                  REPO / "omnid" / "process" / "cgroup.py"]
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    return tool


def exported_names() -> set[str]:
    return {m for p in METRIC_SOURCES for m in re.findall(r"\bomnid_[a-z0-9_]+", p.read_text())}


def names_in(expr: str) -> set[str]:
    out = set()
    for name in re.findall(r"\bomnid_[a-z0-9_]+", expr):
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and name[:-len(suffix)] in exported_names():
                name = name[:-len(suffix)]
        out.add(name)
    return out


def dashboard_exprs(d: dict) -> list[str]:
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


# ----------------------------------------------------------------------------- alerting rules
def test_alerting_rules_pass_promtool_check_and_their_unit_tests():
    tool = promtool()
    r = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([tool, "test", "rules", "omnid-alerts.test.yml"], capture_output=True, text=True, timeout=120,
                       cwd=str(PROM))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_rule_unit_tests_can_fail(tmp_path):
    """A wrong expectation is caught: the unit tests compare, they do not just run."""
    tool = promtool()
    shutil.copy(RULES, tmp_path / RULES.name)
    text = (PROM / "omnid-alerts.test.yml").read_text()
    assert "restarted 5 times" in text
    (tmp_path / "t.yml").write_text(text.replace("restarted 5 times", "restarted 4 times"))
    r = subprocess.run([tool, "test", "rules", "t.yml"], capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode != 0 and "OmnidUnitRestartingOften" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.fast
def test_every_alert_has_severity_and_annotations_and_names_only_exported_metrics():
    text = RULES.read_text()
    alerts = re.split(r"\n      - alert: ", text)[1:]
    assert len(alerts) >= 15, len(alerts)
    covered = set()
    for a in alerts:
        name = a.split("\n", 1)[0].strip()
        assert re.search(r"\n          severity: (critical|warning|info)\n", a), name
        assert "\n          summary: " in a and "\n          description: " in a, name
        expr = re.search(r"\n        expr: (.*)\n", a).group(1)
        unknown = names_in(expr) - exported_names()
        assert not unknown, (name, unknown)
        covered |= names_in(expr)
    # What the issue asks alerts for: stack health, unit states, restarts, death->failed
    # latency, GPU release, residue, GPU, generations across hosts, fencing.
    for needed in ("omnid_stack_health", "omnid_unit_state", "omnid_unit_restarts_total",
                   "omnid_death_detection_seconds", "omnid_unit_gpu_release_seconds", "omnid_unit_gpu_held",
                   "omnid_unit_unkillable_processes", "omnid_unit_residue_processes", "omnid_gpu_condition",
                   "omnid_group_generation", "omnid_group_fenced_total", "omnid_cluster_etcd_up"):
        assert needed in covered, needed


# ----------------------------------------------------------------------------- dashboard
PANEL_TYPES = {"row", "stat", "timeseries", "state-timeline", "bargauge", "table", "gauge", "heatmap", "text"}


def test_dashboard_is_its_generators_output():
    r = subprocess.run([sys.executable, str(GRAFANA / "dashboard.py")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(DASHBOARD.read_text()), \
        "packaging/grafana/omnid-dashboard.json is stale: run python packaging/grafana/dashboard.py > it"


@pytest.mark.fast
def test_dashboard_holds_to_the_grafana_schema_essentials():
    """Grafana's dashboard model (schemaVersion 39, Grafana 11): what a load checks or
    silently drops. No Grafana is installable here (not on the registries this project uses)."""
    d = json.loads(DASHBOARD.read_text())
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list), ("templating", dict),
                      ("time", dict), ("editable", bool), ("tags", list), ("refresh", str), ("annotations", dict)):
        assert isinstance(d.get(key), kind), key
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", d["uid"]), d["uid"]
    assert 36 <= d["schemaVersion"] <= 41, d["schemaVersion"]
    assert set(d["time"]) == {"from", "to"}
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids, cells = set(), set()
    for p in d["panels"]:
        assert isinstance(p["id"], int) and p["id"] not in ids, p.get("title")
        ids.add(p["id"])
        assert p["type"] in PANEL_TYPES, p["type"]
        assert p["title"], p["id"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and g["x"] >= 0 and g["y"] >= 0 and g["h"] > 0, p["title"]
        assert 0 < g["w"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            assert p["panels"] == [] and not p["collapsed"] and g["w"] == 24 and g["h"] == 1, p["title"]
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert "defaults" in p["fieldConfig"] and isinstance(p["fieldConfig"]["overrides"], list), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == p["datasource"], p["title"]
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), (p["title"], var)
    # Panels for what the issue names.
    titles = " | ".join(p["title"] for p in d["panels"]).lower()
    for needed in ("stack health", "unit states", "restarts", "failures", "death to failed", "gpu release",
                   "leftovers", "gpu memory per unit", "generation", "fenced"):
        assert needed in titles, needed


def test_every_dashboard_query_parses_and_names_only_exported_metrics(tmp_path):
    tool = promtool()
    d = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(d) + [v["query"]["query"] for v in d["templating"]["list"] if v["type"] == "query"]
    rules = ["groups:", "  - name: dashboard-queries", "    rules:"]
    for i, expr in enumerate(dashboard_exprs(d)):
        # Grafana's variables, as Grafana substitutes them, so that promtool parses PromQL.
        q = expr.replace("$__rate_interval", "5m").replace("$__range", "6h").replace("$instance", ".*")
        q = q.replace("$unit", ".*")
        rules += [f"      - record: dashboard:query:{i}", f"        expr: {json.dumps(q)}"]
        unknown = names_in(expr) - exported_names()
        assert not unknown, (expr, unknown)
    for expr in exprs:
        assert not (names_in(expr) - exported_names()), expr
    (tmp_path / "q.yml").write_text("\n".join(rules) + "\n")
    r = subprocess.run([tool, "check", "rules", str(tmp_path / "q.yml")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ----------------------------------------------------------------------------- the series, from a daemon
def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.rindex("}") + 1]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_series_the_rules_use_come_from_a_real_daemon(daemon_factory):
    d = daemon_factory(make_stack({"a": 'exec = ["sleep", "1000"]\n',
                                   "b": 'exec = ["sleep", "1000"]\nrestart = "no"\n'}))
    units = d.wait_all_active()
    _, text = d.http("/metrics")
    assert _sample(text, "omnid_stack_health", status="ok") == 1, text
    assert _sample(text, "omnid_stack_health", status="failed") == 0
    for u in ("a", "b"):
        assert _sample(text, "omnid_unit_residue_processes", unit=u) == 0
        assert _sample(text, "omnid_unit_unkillable_processes", unit=u) == 0
        assert _sample(text, "omnid_unit_gpu_held", unit=u) == 0
    os.kill(units["b"]["pid"], signal.SIGKILL)
    d.wait_state("b", "failed")
    text = wait_for(lambda: (t := d.http("/metrics")[1]) and _sample(t, "omnid_stack_health", status="failed") == 1
                    and t, 10, "omnid_stack_health failed = 1")
    assert _sample(text, "omnid_stack_health", status="ok") == 0
    assert _sample(text, "omnid_unit_state", unit="b", state="failed") == 1
    tool = shutil.which("promtool")
    if tool:
        r = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
