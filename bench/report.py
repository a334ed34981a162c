"""Render a results JSON as a Markdown table with omnid / peer ratios.

    python -m bench.report bench/results/2026-11-22T0100.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ORDER = [
    "start_1", "start_16", "start_64", "start_256", "first_1", "first_16", "first_64", "first_256",
    "ready_1", "ready_16", "ready_64", "ready_256",
    "death_notify", "death_replace", "death_health", "death_event_norestart",
    "stop_16", "stop_64", "stop_256", "stop_first_term_16", "stop_first_term_64", "stop_first_term_256",
    "stop_kill_error", "stop_term_delivery",
    "residue_setsid", "residue_sigkill",
    "idle_cpu", "idle_rss", "idle_pss",
    "control_status", "health_load",
]
PEERS = ["supervisord", "circus", "runit", "omnid-base"]


def _num(x: float | None) -> str:
    if x is None:
        return "–"
    ax = abs(x)
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "–"
    if b == 0:
        return "–" if a == 0 else "∞"
    r = a / b
    return f"{r:.2f}" if r >= 0.1 else f"{r:.3f}"


def cell(fig: dict, r: dict | None) -> str:
    if not r:
        return "–"
    kind = fig["kind"]
    if kind == "latency":
        if not r.get("n"):
            return "failed" if r.get("errors") else "–"
        s = f"{_num(r['median'])} / {_num(r['p95'])}"
        if r.get("target") and r["n"] < r["target"]:
            s += f" (n={r['n']})"
        if r.get("errors"):
            s += " ⚠"
        return s
    if kind == "count":
        if r.get("value") is None:
            return "failed"
        s = f"{r['value']} of {r['of']}"
        if r.get("helpers_left"):
            s += f" (+{r['helpers_left']} helper)"
        elif "children_left" in r and "grandchildren_left" in r:
            s += f" ({r['children_left']} ch + {r['grandchildren_left']} gch)"
        return s
    if kind == "value":
        return _num(r.get("value")) if r.get("value") is not None else "failed"
    if kind == "load":
        parts = []
        for k, v in r.items():
            if not isinstance(v, dict):
                continue
            if v.get("error"):
                parts.append(f"{k}: {v['error']}")
                continue
            parts.append(f"{k.replace('_', ' ')}: {_num(v.get('rps'))} req/s, "
                         f"p50 {_num(v.get('p50_ms'))} ms, p99 {_num(v.get('p99_ms'))} ms")
        return "<br>".join(parts) or "–"
    return str(r)


def ratios(fig: dict, om: dict | None, peer: dict | None) -> str:
    if not om or not peer:
        return "–"
    kind = fig["kind"]
    if kind == "latency":
        if not om.get("n") or not peer.get("n"):
            return "–"
        return f"{_ratio(om['median'], peer['median'])} / {_ratio(om['p95'], peer['p95'])}"
    if kind == "value":
        return _ratio(om.get("value"), peer.get("value"))
    if kind == "count":
        return "–"
    return "–"


def render(res: dict) -> str:
    meta = res.get("meta", {})
    sups = meta.get("supervisors", ["omnid", *PEERS])
    m = meta.get("machine", {})
    lines = []
    lines.append(f"Run {meta.get('started', '?')} on {m.get('cpu', '?')} "
                 f"({m.get('cpus_usable', '?')} usable cores), {m.get('mem_gib', '?')} GiB, "
                 f"Linux {m.get('kernel', '?')}, Python {m.get('python', '?')}; "
                 f"child: {meta.get('child', '?')}; "
                 + ", ".join(f"{s} {v.get('version', '?')}" for s, v in meta.get("versions", {}).items())
                 + f"; {meta.get('samples', '?')} samples per latency"
                 + (" (--quick)" if meta.get("quick") else "")
                 + f"; took {meta.get('duration_s', 0):.0f} s"
                 + (f"; load average (1/5/15 min) at start {meta['loadavg'].get('start')}, after each "
                    "scenario " + ", ".join(f"{k[6:]} {v}" for k, v in meta["loadavg"].items()
                                            if k.startswith("after_"))
                    if meta.get("loadavg") else "")
                 + ".")
    lines.append("")
    lines.append("Latencies: median / p95 in ms. Ratios: omnid / peer (< 1: omnid is faster / "
                 "smaller), median / p95.")
    lines.append("")
    peers = [p for p in PEERS if p in sups]
    head = ["figure", *sups, *[f"omnid / {p}" for p in peers if "omnid" in sups]]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    figs = res.get("figures", {})
    keys = [k for k in ORDER if k in figs] + [k for k in figs if k not in ORDER]
    for k in keys:
        fig = figs[k]
        rs = fig.get("results", {})
        row = [f"{fig['title']} [{fig['unit']}]"]
        for s in sups:
            if fig.get("only") and fig["only"] != s:
                row.append("n/a")
            else:
                row.append(cell(fig, rs.get(s)))
        if "omnid" in sups:
            for p in peers:
                row.append("n/a" if fig.get("only") else ratios(fig, rs.get("omnid"), rs.get(p)))
        lines.append("| " + " | ".join(row) + " |")
    notes = meta.get("notes") or []
    unavailable = meta.get("unavailable") or {}
    if unavailable or notes or meta.get("leftovers"):
        lines.append("")
        for s, why in unavailable.items():
            lines.append(f"- {s} not measured: {why}")
        for n in notes:
            lines.append(f"- {n}")
        for lo in meta.get("leftovers") or []:
            lines.append(f"- WARNING: processes left after a {lo['supervisor']} run: {lo['pids']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    if len(argv) != 1:
        print("usage: python -m bench.report RESULTS.json", file=sys.stderr)
        return 2
    print(render(json.loads(Path(argv[0]).read_text())), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
