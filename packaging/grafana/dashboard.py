"""Writes omnid-dashboard.json, the Grafana dashboard for omnid's /metrics, from the table
of panels below: `python packaging/grafana/dashboard.py > packaging/grafana/omnid-dashboard.json`.
(tests/test_packaging_rules.py checks that the JSON is this script's output, that it holds
to the essentials of Grafana's dashboard schema, and that every query parses and names
metrics omnid exports.)

Rows, top to bottom: is the stack OK (health, units failed, restarts, unkillable), units
(states over time, restarts and failures per unit), latencies (death -> failed, GPU
release), residue and GPU (leftovers, memory per unit, GPU conditions), resources, and
worker groups across hosts (generations, fencing, etcd)."""

from __future__ import annotations

import json
import sys

SCHEMA_VERSION = 39  # Grafana 11
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance"'
USEL = 'instance=~"$instance", unit=~"$unit"'

# Numbers for states, so that a state timeline and a stat can colour them.
UNIT_STATES = ("inactive", "starting", "active", "stopping", "failed")
UNIT_STATE_COLOURS = ("text", "blue", "green", "yellow", "red")
HEALTH = (("ok", "green"), ("starting", "blue"), ("draining", "blue"), ("stopping", "blue"),
          ("degraded", "orange"), ("failed", "red"))


def _encode(metric: str, label: str, values: tuple[str, ...], sel: str, by: str) -> str:
    """max by (by) of: the series that is 1, times its index in `values` (a number per state)."""
    parts = [f'(({metric}{{{sel}, {label}="{v}"}} == 1) * {i})' for i, v in enumerate(values)]
    return f"max by ({by}) (" + " or ".join(parts) + ")"


def _mappings(values: tuple[str, ...], colours: tuple[str, ...]) -> list[dict]:
    return [{"type": "value", "options": {str(i): {"text": v, "color": c, "index": i}
                                          for i, (v, c) in enumerate(zip(values, colours))}}]


def target(expr: str, legend: str = "", instant: bool = False) -> dict:
    return {"expr": expr, "legendFormat": legend, "instant": instant, "range": not instant, "datasource": DS}


def stat(title: str, expr: str, *, legend: str = "", unit: str = "none", thresholds: list | None = None,
         mappings: list | None = None, desc: str = "") -> dict:
    return {"type": "stat", "title": title, "description": desc, "targets": [target(expr, legend, instant=True)],
            "fieldConfig": {"defaults": {"unit": unit, "mappings": mappings or [],
                                         "thresholds": {"mode": "absolute", "steps": thresholds or [
                                             {"color": "green", "value": None}, {"color": "red", "value": 1}]}},
                            "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "background", "graphMode": "none", "textMode": "auto",
                        "justifyMode": "auto", "orientation": "auto"}}


def series(title: str, targets: list[dict], *, unit: str = "short", desc: str = "", stack: bool = False) -> dict:
    return {"type": "timeseries", "title": title, "description": desc, "targets": targets,
            "fieldConfig": {"defaults": {"unit": unit, "custom": {"drawStyle": "line", "lineWidth": 1,
                                                                  "fillOpacity": 10 if stack else 0,
                                                                  "stacking": {"mode": "normal" if stack else "none"},
                                                                  "showPoints": "never"}},
                            "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def timeline(title: str, expr: str, values: tuple[str, ...], colours: tuple[str, ...], desc: str = "") -> dict:
    return {"type": "state-timeline", "title": title, "description": desc,
            "targets": [target(expr, "{{instance}} {{unit}}")],
            "fieldConfig": {"defaults": {"mappings": _mappings(values, colours), "color": {"mode": "thresholds"},
                                         "thresholds": {"mode": "absolute", "steps": [{"color": "text", "value": None}]}},
                            "overrides": []},
            "options": {"showValue": "never", "mergeValues": True, "rowHeight": 0.9,
                        "legend": {"showLegend": False, "displayMode": "list", "placement": "bottom"}}}


def bars(title: str, expr: str, legend: str, desc: str = "") -> dict:
    return {"type": "bargauge", "title": title, "description": desc,
            "targets": [target(expr, legend, instant=True)],
            "fieldConfig": {"defaults": {"unit": "none", "min": 0, "thresholds": {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "orange", "value": 1}, {"color": "red", "value": 4}]}},
                            "overrides": []},
            "options": {"orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True,
                        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}}


HEALTH_VALUES = tuple(h for h, _ in HEALTH)
HEALTH_COLOURS = tuple(c for _, c in HEALTH)

# (row title, [(panel, width, height)]); panels are laid out left to right, 24 columns a line.
ROWS = [
    ("Is the stack OK", [
        (stat("Stack health", _encode("omnid_stack_health", "status", HEALTH_VALUES, SEL, "instance"),
              legend="{{instance}}", mappings=_mappings(HEALTH_VALUES, HEALTH_COLOURS),
              thresholds=[{"color": "text", "value": None}],
              desc="What GET /health answers now, per host (omnid_stack_health)."), 6, 5),
        (stat("Units failed", f'count(omnid_unit_state{{{USEL}, state="failed"}} == 1) or vector(0)',
              desc="Units in state failed now. `omnid status` names the one that failed first and why."), 4, 5),
        (stat("Units active", f'count(omnid_unit_state{{{USEL}, state="active"}} == 1) or vector(0)',
              thresholds=[{"color": "green", "value": None}]), 4, 5),
        (stat("Automatic restarts (range)", f"sum(increase(omnid_unit_restarts_total{{{USEL}}}[$__range]))",
              thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 1},
                          {"color": "red", "value": 10}],
              desc="Restarts omnid made by itself (an operator's restart is not counted)."), 4, 5),
        (stat("Unkillable processes", f"sum(omnid_unit_unkillable_processes{{{USEL}}}) or vector(0)",
              desc="Processes that survived SIGKILL at a unit's last stop."), 3, 5),
        (stat("Invariant violations", f"sum(increase(omnid_invariant_violations_total{{{SEL}}}[$__range]))",
              desc="omnid's state disagreed with the kernel after a transition (a bug: report it)."), 3, 5),
    ]),
    ("Units", [
        (timeline("Unit states", _encode("omnid_unit_state", "state", UNIT_STATES, USEL, "instance, unit"),
                  UNIT_STATES, UNIT_STATE_COLOURS, desc="omnid_unit_state over time, one line per unit."), 24, 10),
        (series("Automatic restarts per unit",
                [target(f"sum by (instance, unit) (increase(omnid_unit_restarts_total{{{USEL}}}[$__rate_interval]))",
                        "{{instance}} {{unit}}")], desc="omnid_unit_restarts_total: automatic restarts only."), 8, 8),
        (series("Failures per unit",
                [target(f"sum by (instance, unit) (increase(omnid_unit_failures_total{{{USEL}}}[$__rate_interval]))",
                        "{{instance}} {{unit}}")], desc="Unrequested exits and failed starts."), 8, 8),
        (bars("Restarts in the range, by unit",
              f"sort_desc(sum by (unit) (increase(omnid_unit_restarts_total{{{USEL}}}[$__range])))", "{{unit}}"),
         8, 8),
    ]),
    ("Latencies", [
        (series("Death to failed (pidfd wake-up to state failed)", [
            target(f"histogram_quantile(0.5, sum by (le) (rate(omnid_death_detection_seconds_bucket{{{USEL}}}"
                   f"[$__rate_interval])))", "p50"),
            target(f"histogram_quantile(0.99, sum by (le) (rate(omnid_death_detection_seconds_bucket{{{USEL}}}"
                   f"[$__rate_interval])))", "p99"),
        ], unit="s", desc="omnid_death_detection_seconds: milliseconds on an idle host."), 12, 8),
        (series("GPU release after the last stop or failure", [
            target(f"omnid_unit_gpu_release_seconds{{{USEL}}}", "{{instance}} {{unit}}")], unit="s",
            desc="Until none of the unit's pids held GPU memory (where omnid reads GPU memory)."), 12, 8),
    ]),
    ("Residue and GPU", [
        (series("Leftovers at the last stop", [
            target(f"omnid_unit_residue_processes{{{USEL}}} > 0", "killed: {{instance}} {{unit}}"),
            target(f"omnid_unit_unkillable_processes{{{USEL}}} > 0", "UNKILLABLE: {{instance}} {{unit}}"),
            target(f"omnid_unit_gpu_held{{{USEL}}} > 0", "GPU held: {{instance}} {{unit}}"),
        ], desc="Orphans killed after a unit's last stop, processes that survived SIGKILL, GPU memory still held."),
         8, 8),
        (series("GPU memory per unit", [target(f"omnid_unit_gpu_memory_bytes{{{USEL}}}", "{{instance}} {{unit}}")],
                unit="bytes", stack=True), 8, 8),
        (series("GPU conditions and stuck NVML calls", [
            target(f"omnid_gpu_condition{{{SEL}}} == 1", "{{instance}} {{gpu}} {{status}} {{source}} {{xid}}"),
            target(f"omnid_gpu_stuck_threads{{{SEL}}} > 0", "{{instance}} NVML threads stuck"),
        ], desc="Xid events, memory health, unreadable GPUs (omnid(8), GPU FAULTS)."), 8, 8),
    ]),
    ("Resources", [
        (series("Memory (RSS) per unit", [target(f"omnid_unit_rss_bytes{{{USEL}}}", "{{instance}} {{unit}}")],
                unit="bytes", stack=True), 8, 8),
        (series("CPU per unit", [target(f"rate(omnid_unit_cpu_seconds_total{{{USEL}}}[$__rate_interval])",
                                        "{{instance}} {{unit}}")], unit="percentunit", stack=True), 8, 8),
        (series("The daemon itself", [
            target(f"omnid_daemon_rss_bytes{{{SEL}}}", "{{instance}} RSS"),
            target(f"omnid_unit_processes{{{USEL}}}", "{{instance}} {{unit}} processes"),
        ], unit="short"), 8, 8),
    ]),
    ("Worker groups across hosts", [
        (series("Generation per group and host", [
            target(f"omnid_group_generation{{{SEL}}}", "{{group}} on {{instance}}")],
            desc="The generation each host runs; hosts of one group should agree."), 8, 8),
        (series("Generations started, gone down, fenced", [
            target(f"sum by (group) (increase(omnid_group_generations_total{{{SEL}}}[$__rate_interval]))",
                   "{{group}} started"),
            target(f"sum by (group) (increase(omnid_group_down_total{{{SEL}}}[$__rate_interval]))",
                   "{{group}} down"),
            target(f"sum by (group, instance) (increase(omnid_group_fenced_total{{{SEL}}}[$__rate_interval]))",
                   "{{group}} fenced on {{instance}}"),
        ]), 8, 8),
        (series("etcd", [
            target(f"omnid_cluster_etcd_up{{{SEL}}}", "{{instance}} up"),
            target(f"increase(omnid_cluster_lease_expired_total{{{SEL}}}[$__rate_interval])",
                   "{{instance}} lease expired"),
            target(f"increase(omnid_cluster_etcd_outages_total{{{SEL}}}[$__rate_interval])", "{{instance}} outages"),
            target(f"sum by (instance) (increase(omnid_cluster_datagrams_total{{{SEL}, outcome!=\"accepted\"}}"
                   f"[$__rate_interval]))", "{{instance}} heartbeats dropped"),
        ]), 8, 8),
    ]),
]


def build() -> dict:
    panels: list[dict] = []
    y = 0
    pid = 1
    for title, row in ROWS:
        panels.append({"type": "row", "title": title, "id": pid, "collapsed": False, "panels": [],
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}})
        pid += 1
        y += 1
        x, line_h = 0, 0
        for panel, w, h in row:
            if x + w > 24:
                x, y, line_h = 0, y + line_h, 0
            refs = iter("ABCDEFGH")
            p = {"id": pid, "datasource": DS, **panel, "gridPos": {"x": x, "y": y, "w": w, "h": h}}
            p["targets"] = [{**t, "refId": next(refs)} for t in panel["targets"]]
            panels.append(p)
            pid += 1
            x += w
            line_h = max(line_h, h)
        y += line_h
    var = {"type": "query", "datasource": DS, "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
           "current": {"text": "All", "value": "$__all"}, "sort": 1}
    return {
        "title": "omnid", "uid": "omnid", "description": "omnid: stack health, units, restarts and failures, "
        "death-to-failed and GPU-release latencies, residue, GPU memory, worker groups across hosts.",
        "tags": ["omnid", "gpu", "inference"], "timezone": "browser", "editable": True, "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION, "version": 1, "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "timepicker": {}, "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": [],
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            {**var, "name": "instance", "label": "Host", "query": {"query": "label_values(omnid_unit_state, instance)",
                                                                  "refId": "instance"},
             "definition": "label_values(omnid_unit_state, instance)"},
            {**var, "name": "unit", "label": "Unit",
             "query": {"query": 'label_values(omnid_unit_state{instance=~"$instance"}, unit)', "refId": "unit"},
             "definition": 'label_values(omnid_unit_state{instance=~"$instance"}, unit)'},
        ]},
        "panels": panels,
    }


if __name__ == "__main__":
    json.dump(build(), sys.stdout, indent=2)
    sys.stdout.write("\n")
