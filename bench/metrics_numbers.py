"""What one /metrics page costs the daemon's loop, for a stack of N units (default 64).

The page is rendered on the loop that sees deaths (the process figures come from a
thread, health.UsageCache), so its rendering time is time a death waits. Measured here:
omnid.health.HealthServer.metrics on a stand-in supervisor (every per-unit family filled:
states, counters, exit figures, GPU release, residue, log lines, process and cgroup figures,
the death-detection histogram), and, for comparison, the same families built with
prometheus_client's GaugeMetricFamily / CounterMetricFamily / HistogramMetricFamily and
written by its generate_latest (skipped when prometheus_client is not installed).

Run: .venv/bin/python -m bench.metrics_numbers [--units 64] [--rounds 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnid.process.cgroup import CgroupRoot  # noqa: E402
from omnid.core.lifecycle import Goal, UnitState  # noqa: E402
from omnid.api.health import HEALTH_VERDICTS, HealthServer  # noqa: E402
from omnid.api.metrics import DaemonMetrics  # noqa: E402

CGROUP = {"memory_current": 123456789, "memory_peak": 223456789, "cpu_usage_usec": 98765432, "pids_current": 7}


class _Cgroups:
    """Stands in for omnid.cgroup.CgroupRoot: fixed figures, no cgroup files read."""

    def __init__(self, names: list[str]) -> None:
        self.units = {n: SimpleNamespace(figures=lambda: dict(CGROUP)) for n in names}

    def __bool__(self) -> bool:
        return True

    # The real rendering over the stand-in figures (metrics_lines: its name before
    # omnid.base.promtext, when this file is copied into an older checkout to compare).
    write_metrics = getattr(CgroupRoot, "write_metrics", None)
    metrics_lines = getattr(CgroupRoot, "metrics_lines", None)


def stand_in(n: int):
    units = {}
    for i in range(n):
        name = f"worker@{i}"
        units[name] = SimpleNamespace(
            name=name, state=UnitState.ACTIVE, ready=True, restarts=i, deaths=i, last_exit_code=1,
            last_signal=9, gpu_release_ms=12.5 + i, gpu_held=False, dead=False, goal=Goal.ACTIVE,
            last_stop=SimpleNamespace(residue=[1, 2], unkillable=[]), proc=None, reason="",
            output=SimpleNamespace(lines_total=1000 + i, echo_dropped=i, lines_truncated=0))
    sup = SimpleNamespace(units=units, shutting_down=False, invariant_violations=[], gpu=None, crosshost=None,
                          draining=lambda: False)
    return sup


def make_server(n: int, with_cgroups: bool) -> HealthServer:
    sup = stand_in(n)
    srv = HealthServer(sup, "127.0.0.1:0")
    dm = DaemonMetrics()
    for name in sup.units:
        for k in range(5):
            dm.death_detection.observe(name, 0.002 * (k + 1))
    srv.daemon_metrics = dm
    # The process figures as a finished walk left them: no walk is started during the rounds.
    srv.usage.figures = {name: (200 << 20, 12.345678, 3) for name in sup.units}
    srv.usage.at = time.monotonic() + 1e9
    if with_cgroups:
        sup.cgroups = _Cgroups(list(sup.units))
    else:
        sup.cgroups = None
    return srv


def prometheus_client_page(srv: HealthServer) -> bytes:
    """The same families as srv.metrics, through prometheus_client (the process, cgroup and
    histogram figures from the same stand-ins)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.exposition import generate_latest

    sup = srv.sup
    units = list(sup.units.values())
    fams = []
    g = GaugeMetricFamily("omnid_unit_state", "1 for the state the unit is in", labels=["unit", "state"])
    for u in units:
        for st in UnitState:
            g.add_metric([u.name, st.value], int(u.state is st))
    fams.append(g)
    for name, kind, help_, get in (
            ("omnid_unit_ready", "g", "1 when the unit is active and ready", lambda u: int(u.ready)),
            ("omnid_unit_restarts", "c", "automatic restarts", lambda u: u.restarts),
            ("omnid_unit_failures", "c", "unrequested exits and failed starts", lambda u: u.deaths),
            ("omnid_unit_last_exit_code", "g", "exit code", lambda u: u.last_exit_code),
            ("omnid_unit_last_exit_signal", "g", "signal", lambda u: u.last_signal or 0),
            ("omnid_unit_gpu_release_seconds", "g", "release", lambda u: u.gpu_release_ms / 1000),
            ("omnid_unit_gpu_held", "g", "held", lambda u: int(bool(u.gpu_held))),
            ("omnid_unit_residue_processes", "g", "residue", lambda u: len(u.last_stop.residue)),
            ("omnid_unit_unkillable_processes", "g", "unkillable", lambda u: len(u.last_stop.unkillable)),
            ("omnid_unit_log_lines", "c", "lines", lambda u: u.output.lines_total),
            ("omnid_unit_log_lines_dropped", "c", "dropped", lambda u: u.output.echo_dropped),
            ("omnid_unit_log_lines_truncated", "c", "truncated", lambda u: u.output.lines_truncated),
    ):
        f = (GaugeMetricFamily if kind == "g" else CounterMetricFamily)(name, help_, labels=["unit"])
        for u in units:
            f.add_metric([u.name], get(u))
        fams.append(f)
    g = GaugeMetricFamily("omnid_stack_health", "verdict", labels=["status"])
    for v in HEALTH_VERDICTS:
        g.add_metric([v], int(v == "ok"))
    fams.append(g)
    h = HistogramMetricFamily("omnid_death_detection_seconds", "pidfd wake-up to failed", labels=["unit"])
    hist = srv.daemon_metrics.death_detection
    for unit, (counts, total) in hist.series.items():
        cum, buckets = 0, []
        for bound, c in zip(hist.buckets, counts):
            cum += c
            buckets.append((repr(bound), cum))
        buckets.append(("+Inf", cum + counts[-1]))
        h.add_metric([unit], buckets, total[0])
    fams.append(h)
    usage = srv.usage.figures
    for name, kind, help_, i in (("omnid_unit_rss_bytes", "g", "rss", 0), ("omnid_unit_cpu_seconds", "c", "cpu", 1),
                                 ("omnid_unit_processes", "g", "processes", 2)):
        f = (GaugeMetricFamily if kind == "g" else CounterMetricFamily)(name, help_, labels=["unit"])
        for unit, fig in usage.items():
            f.add_metric([unit], fig[i])
        fams.append(f)
    if sup.cgroups:
        figs = {u: cg.figures() for u, cg in sorted(sup.cgroups.units.items())}
        for key, name, kind in (("memory_current", "omnid_unit_cgroup_memory_bytes", "g"),
                                ("memory_peak", "omnid_unit_cgroup_memory_peak_bytes", "g"),
                                ("cpu_usage_usec", "omnid_unit_cgroup_cpu_usage_usec", "c"),
                                ("pids_current", "omnid_unit_cgroup_pids", "g")):
            f = (GaugeMetricFamily if kind == "g" else CounterMetricFamily)(name, key, labels=["unit"])
            for unit, fig in figs.items():
                f.add_metric([unit], fig[key])
            fams.append(f)
    return generate_latest(SimpleNamespace(collect=lambda: fams))


def timed(fn, rounds: int) -> list[float]:
    """CPU ms of each call (process time: on a shared machine, time spent descheduled is
    someone else's load, not the page's cost)."""
    out = []
    for _ in range(rounds):
        t = time.process_time()
        fn()
        out.append((time.process_time() - t) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--units", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    srv = make_server(args.units, with_cgroups=True)
    loop = asyncio.new_event_loop()

    def omnid_page() -> bytes:
        return loop.run_until_complete(srv.metrics(None)).body

    page = omnid_page()
    rows = [("omnid.api.health /metrics", omnid_page, page)]
    try:
        ours = prometheus_client_page(srv)
        rows.append(("prometheus_client generate_latest", lambda: prometheus_client_page(srv), ours))
    except ImportError:
        print("prometheus_client is not installed: its row is skipped")
    series = sum(1 for ln in page.decode().splitlines() if ln and not ln.startswith("#"))
    print(f"{args.units} units, {series} series, {len(page)} bytes; {args.rounds} rounds each, interleaved")
    times: dict[str, list[float]] = {label: [] for label, _, _ in rows}
    for _ in range(args.rounds // 10):
        for label, fn, _ in rows:
            times[label] += timed(fn, 10)
    for label, _fn, body in rows:
        t = sorted(times[label])
        print(f"  {label:36s} CPU min {t[0]:6.2f} ms  median {statistics.median(t):6.2f} ms  "
              f"p90 {t[int(len(t) * 0.9)]:6.2f} ms  "
              f"({len(body)} bytes)")
    loop.close()


if __name__ == "__main__":
    main()
