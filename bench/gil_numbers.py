"""A death seen while the daemon's thread parses a reload, measured on the real daemon.

The control commands that read a stack directory (reload, check) parse it in a thread, so
the loop stays free; but a thread running Python holds the GIL for the switch interval at a
time, and the loop that sees deaths waits for it. Here: a stack of 256 unit files, a
`reload --dry-run` asked, and the unit `victim` SIGKILLed while the parse runs; the figure is
SIGKILL -> the daemon's `failed` event (its own timestamp), against the same with no reload.

Run: .venv/bin/python -m bench.gil_numbers [--rounds 20] [--base DIR]
(--base: another checkout, measured in the same run, round by round beside this one)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.harness import Daemon, make_stack  # noqa: E402

UNIT = 'exec = ["sleep", "100000"]\n'


def failed_after(d: Daemon, sub, pid: int, t_kill: float, timeout: float = 10.0) -> float:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not sub.poll(100):
            continue
        ev = json.loads(sub.recv_multipart()[-1])
        if ev.get("unit") == "victim" and ev.get("to") == "failed" and ev.get("pid") == pid:
            return (ev["ts"] - t_kill) * 1000
    raise AssertionError("no failed event for the victim")


def one(d: Daemon, sub, during_reload: bool) -> tuple[float, float]:
    """(kill -> failed in ms, how long the dry-run reload took in ms, 0 without one)."""
    d.wait_state("victim", "active")
    pid = d.unit("victim")["pid"]
    took = [0.0]
    t = None
    if during_reload:
        def reload() -> None:
            t0 = time.monotonic()
            d.ok("reload", {"dry_run": True})
            took[0] = (time.monotonic() - t0) * 1000

        t = threading.Thread(target=reload)
        t.start()
        time.sleep(0.008)  # the request is in and the parse under way
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    ms = failed_after(d, sub, pid, t_kill)
    if t is not None:
        t.join()
    return ms, took[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--base", default=None, help="another checkout of omnid, measured beside this one")
    a = ap.parse_args()
    units = {f"u{i:03d}": UNIT for i in range(255)}
    units["victim"] = UNIT + 'restart = "always"\nrestart_sec = 0\nstart_limit_burst = 100000\n'
    builds = {"omnid": None, **({"omnid-base": a.base} if a.base else {})}
    daemons = {}
    try:
        for name, cwd in builds.items():
            d = daemons[name] = Daemon(make_stack(units), env={"OMNID_CHECK_INVARIANTS": "0"}, cwd=cwd)
            d.start()
            d.wait_all_active(120)
        subs = {name: d.events_socket() for name, d in daemons.items()}
        res: dict = {name: {"quiet": [], "reload": [], "reload_ms": []} for name in daemons}
        for _ in range(a.rounds):
            for name, d in daemons.items():
                ms, _ = one(d, subs[name], False)
                res[name]["quiet"].append(ms)
                ms, took = one(d, subs[name], True)
                res[name]["reload"].append(ms)
                res[name]["reload_ms"].append(took)
        for name, r in res.items():
            print(f"{name}: kill -> failed, quiet: median {statistics.median(r['quiet']):.2f} ms, "
                  f"max {max(r['quiet']):.2f}; during a reload's parse: median {statistics.median(r['reload']):.2f} ms, "
                  f"max {max(r['reload']):.2f} (the dry-run reload took {statistics.median(r['reload_ms']):.0f} ms)")
        for sub in subs.values():
            sub.close(0)
    finally:
        for d in daemons.values():
            d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
