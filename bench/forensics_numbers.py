"""Hang forensics figures: how long a capture takes and how many bytes it keeps, for the
processes of tests/hung.py (a 16-thread Python process spinning, a 64-process unit of
`sleep`, 64 idle Python processes, one process in D state), with the default budget
(capture_timeout = 3 s) and max_bytes (1 MiB). Run by hand, as root:

    .venv/bin/python bench/forensics_numbers.py [--runs 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnid import helperproc  # noqa: E402
from omnid.forensics.capture import DEFAULT_BUDGET_S, DEFAULT_MAX_BYTES, capture, find_py_spy, json_size  # noqa: E402
from tests import hung  # noqa: E402
from tests.harness import wait_for  # noqa: E402


def measure(name: str, make, runs: int) -> dict:
    times, sizes, complete = [], [], 0
    with make() as h:
        for _ in range(runs):
            t0 = time.monotonic()
            cap = asyncio.run(capture("bench", h.members, why="bench", budget_s=DEFAULT_BUDGET_S,
                                      max_bytes=DEFAULT_MAX_BYTES))
            times.append((time.monotonic() - t0) * 1000)
            wait_for(lambda: helperproc.reap_pending() == 0, 5, "py-spy reaped")
            sizes.append(json_size(cap))
            complete += not cap.missing
    return {"name": name, "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "bytes": int(statistics.median(sizes)), "complete": f"{complete}/{runs}",
            "processes": len(cap.processes), "python": sum(1 for p in cap.processes if p.python)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    cases = [("16-thread Python process, spinning", lambda: hung.spinning_python(16)),
             ("64-process unit (leader + 63 sleep)", lambda: hung.process_group(64)),
             ("64-process unit, all Python", lambda: hung.process_group(64, python=True))]
    if hung.fuse_available() is None:
        cases.append(("1 Python process in D state (FUSE)", hung.in_d_state))
    print(f"# {platform.node()}: {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()},"
          f" py-spy {find_py_spy()}, {a.runs} runs each, budget {DEFAULT_BUDGET_S:g} s")
    print("| case | processes (with Python stacks) | capture ms median (min-max) | JSON bytes | complete |")
    print("|---|---|---|---|---|")
    for name, make in cases:
        r = measure(name, make, a.runs)
        print(f"| {r['name']} | {r['processes']} ({r['python']}) | {r['median_ms']:.0f} ({r['min_ms']:.0f}-"
              f"{r['max_ms']:.0f}) | {r['bytes']} | {r['complete']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
