"""Changing a running stack (omnid reload, omnid reexec), measured:

- re-exec: the handover (exec -> every unit taken over, the daemon's own handover_ms),
  the request -> the new program answering, and /health during it: 1,000+ probes on
  fresh connections while the daemon re-executes, the longest answer and any failure;
- reload of a 256-unit stack changing one unit: the `reload` request -> applied
  (the changed unit active again), and how many pids changed.

Run: .venv/bin/python -m bench.change_numbers [--reexecs 10]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.harness import Daemon, make_stack, wait_for  # noqa: E402

SLEEP = 'exec = ["sleep", "100000"]\nstop_timeout = 2\n'


def probe_loop(port: int, stop: threading.Event, out: list[tuple[float, str]]) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                line = s.recv(64).split(b"\r\n", 1)[0].decode(errors="replace")
        except OSError as exc:
            line = f"{type(exc).__name__}: {exc}"
        out.append((time.monotonic() - t0, line or "closed without an answer"))


def reexec_round(d: Daemon) -> float:
    t0 = time.monotonic()
    d.reexec()
    return (time.monotonic() - t0) * 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reexecs", type=int, default=10)
    a = ap.parse_args()
    out: dict = {}
    d = Daemon(make_stack({"u": SLEEP + "instances = 16\n"}), env={"OMNID_CHECK_INVARIANTS": "0"})
    d.start()
    try:
        d.wait_all_active(60)
        probes: list[tuple[float, str]] = []
        stop = threading.Event()
        t = threading.Thread(target=probe_loop, args=(d.health_port, stop, probes))
        t.start()
        answered, handover = [], []
        try:
            for _ in range(a.reexecs):
                answered.append(reexec_round(d))
                handover.append(d.ok("status")["daemon"]["handover_ms"])
            wait_for(lambda: len(probes) >= 1000, 120, "1,000 probes")
        finally:
            stop.set()
            t.join(30)
        bad = [line for _s, line in probes if " 200 " not in line + " "]
        out["reexec"] = {"rounds": a.reexecs, "handover_ms_median": statistics.median(handover),
                         "handover_ms_max": max(handover), "answered_ms_median": round(statistics.median(answered)),
                         "probes": len(probes), "probe_failures": len(bad),
                         "longest_probe_ms": round(max(s for s, _l in probes) * 1000),
                         "probe_p99_ms": round(sorted(s for s, _l in probes)[int(0.99 * (len(probes) - 1))] * 1000, 1)}
    finally:
        d.close()
    units = {f"u{i:03d}": SLEEP for i in range(256)}
    stack = make_stack(units)
    d = Daemon(stack, env={"OMNID_CHECK_INVARIANTS": "0"})
    d.start()
    try:
        wait_for(lambda: all(u["state"] == "active" for u in d.units().values()), 180, "256 active")
        before = {n: u["pid"] for n, u in d.units().items()}
        (stack / "u100.toml").write_text(SLEEP.replace("100000", "100001"))
        t0 = time.monotonic()
        r = d.ok("reload", timeout=120)
        took = (time.monotonic() - t0) * 1000
        after = {n: u["pid"] for n, u in d.units().items()}
        out["reload_256"] = {"ms": round(took), "restarted": r["restarted"],
                             "pids_changed": sorted(n for n in before if before[n] != after[n])}
    finally:
        d.close()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
