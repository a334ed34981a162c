"""Issue-2 figures for omnid alone (the side-by-side bench is bench/run.py):
spawn time for 64 children, SIGKILL -> state change latency (100 kills),
escalation accuracy with stop_timeout = 1 (20 stops), idle cost with 64 children.

Run: .venv/bin/python -m bench.core_numbers   (about a minute; prints JSON)
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.harness import Daemon, make_stack, wait_for  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def spawn_64() -> dict:
    stack = make_stack({"w": 'exec = ["sleep", "100000"]\ninstances = 64\nstop_timeout = 2\n'})
    d = Daemon(stack)
    try:
        d.start()
        d.wait_all_active(60)
        evs = [e for e in d.log_events() if e.get("event") == "unit state"]
        from datetime import datetime

        ts = [datetime.fromisoformat(e["timestamp"]).timestamp() for e in evs]
        first_start = min(t for t, e in zip(ts, evs) if e["to"] == "starting")
        last_active = max(t for t, e in zip(ts, evs) if e["to"] == "active")
        spawn_ms = (last_active - first_start) * 1000
        # idle cost over 10 s
        procs = [psutil.Process(d.pid), psutil.Process(d.ok("status")["daemon"]["spawner_pid"])]
        c0 = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
        t0 = time.monotonic()
        time.sleep(10)
        c1 = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
        wall = time.monotonic() - t0
        t_stop = time.monotonic()
        d.ok("shutdown", timeout=60)
        stop_ms = (time.monotonic() - t_stop) * 1000
        return {"spawn_64_ms": round(spawn_ms, 1), "stop_64_ms": round(stop_ms, 1),
                "idle_cpu_percent_64": round((c1 - c0) / wall * 100, 3),
                "daemon_rss_mb": round(procs[0].memory_info().rss / 1e6, 1),
                "spawner_rss_mb": round(procs[1].memory_info().rss / 1e6, 1)}
    finally:
        d.close()


def death_latency(n: int = 100) -> dict:
    stack = make_stack({"victim": 'exec = ["sleep", "100000"]\nrestart = "always"\nrestart_sec = 0.01\n'
                                  'start_limit_burst = 100000\nrestart_max_sec = 0.01\n'})
    d = Daemon(stack)
    lat = []
    try:
        d.start()
        sub = d.events_socket()
        time.sleep(0.3)  # let the SUB connect (a slow joiner loses the first events)
        for _ in range(n):
            u = d.wait_state("victim", "active")
            pid = u["pid"]
            while sub.poll(0):
                sub.recv()
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while True:
                assert sub.poll(5000), "no event"
                ev = json.loads(sub.recv())
                if ev["unit"] == "victim" and ev["to"] == "failed":
                    lat.append((time.monotonic() - t0) * 1000)
                    break
        sub.close(0)
        return {"death_to_event_ms_median": round(statistics.median(lat), 3),
                "death_to_event_ms_p99": round(pct(lat, 99), 3), "kills": n}
    finally:
        d.close()


def escalation(n: int = 20) -> dict:
    # READY only once SIGTERM is ignored, so no stop can race the trap.
    stack = make_stack({"stubborn": 'exec = ["sh", "-c", "trap \'\' TERM; systemd-notify --ready; '
                                    'while :; do sleep 1; done"]\nready = "notify"\nstop_timeout = 1\n'})
    d = Daemon(stack)
    errs = []
    try:
        d.start()
        for _ in range(n):
            d.ok("start", {"units": ["stubborn"]}, timeout=30)
            rec = d.ok("stop", {"units": ["stubborn"]}, timeout=30)["summary"][0]
            assert rec["escalated"]
            errs.append((rec["seconds"] - 1.0) * 1000)
        return {"escalation_error_ms_median": round(statistics.median(errs), 2),
                "escalation_error_ms_max": round(max(errs), 2), "stops": n}
    finally:
        d.close()


if __name__ == "__main__":
    os.environ.pop("OMNID_CHECK_INVARIANTS", None)
    out = {"machine": f"{os.cpu_count()} cores, {os.uname().release}", **spawn_64(), **death_latency(),
           **escalation()}
    print(json.dumps(out, indent=2))
