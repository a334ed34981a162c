"""A unit writing to stdout as fast as it can: /health latency and the lines per
second the daemon takes in (issue #12). Run by hand from the repository root:

    .venv/bin/python bench/log_flood.py [--requests 1000] [--mode lines|chunks|both]

Starts a real `omnid daemon` (tests/harness.py) on a stack of one flooding unit
(`yes`-like: b"y\\n" written in 64 KiB blocks; or 64 KiB blocks without a newline)
plus one idle unit, fires N sequential GET /health requests, reads the daemon's
line counters from /metrics before and after, and prints p50/p99/max latency,
lines/s read, daemon RSS before/after and dropped/truncated counts.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from tests.harness import Daemon, make_stack  # noqa: E402

FLOOD = """
import os, sys
chunk = (b"y" * 65536) if sys.argv[1] == "chunks" else b"y\\n" * 32768
while True:
    os.write(1, chunk)
"""


def counter(text: str, name: str, unit: str) -> float:
    m = re.search(rf'^{name}{{unit="{re.escape(unit)}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--mode", choices=["lines", "chunks", "both"], default="lines")
    a = ap.parse_args()
    work = make_stack({})
    prog = work / "flood.py"
    prog.write_text(FLOOD)
    units = {"idle": 'exec = ["sleep", "100000"]\n'}
    modes = ["lines", "chunks"] if a.mode == "both" else [a.mode]
    for m in modes:
        (work / f"flood-{m}.toml").write_text(f'exec = ["{sys.executable}", "{prog}", "{m}"]\n')
    for name, text in units.items():
        (work / f"{name}.toml").write_text(text)
    d = Daemon(work, env={"OMNID_CHECK_INVARIANTS": "0"})
    d.start()
    try:
        d.wait_all_active()
        base = f"http://127.0.0.1:{d.health_port}"
        me = psutil.Process(d.pid)
        rss0 = me.memory_info().rss
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            m0 = r.read().decode()
        t0 = time.monotonic()
        lat = []
        for _ in range(a.requests):
            t = time.perf_counter()
            with urllib.request.urlopen(base + "/health", timeout=30) as r:
                r.read()
            lat.append(time.perf_counter() - t)
        elapsed = time.monotonic() - t0
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            m1 = r.read().decode()
        rss1 = me.memory_info().rss
        lat.sort()
        p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000  # noqa: E731
        print(f"host: {os.cpu_count()} CPUs; {a.requests} sequential GET /health during {elapsed:.1f} s of flood")
        print(f"/health latency ms: p50 {p(0.50):.2f}  p99 {p(0.99):.2f}  max {lat[-1] * 1000:.2f}  "
              f"mean {statistics.mean(lat) * 1000:.2f}")
        for m in modes:
            u = f"flood-{m}"
            lines = counter(m1, "omnid_unit_log_lines_total", u) - counter(m0, "omnid_unit_log_lines_total", u)
            dropped = counter(m1, "omnid_unit_log_lines_dropped_total", u)
            trunc = counter(m1, "omnid_unit_log_lines_truncated_total", u)
            print(f"{u}: {lines / elapsed:,.0f} lines/s taken in; not echoed (counted) {dropped:,.0f}; "
                  f"truncated at 16 KiB {trunc:,.0f}")
        print(f"daemon RSS: {rss0 / 2**20:.1f} MiB -> {rss1 / 2**20:.1f} MiB")
    finally:
        d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
