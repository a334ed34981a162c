"""What the event loop pays for scans on a busy host (issue 26), measured on the real daemon.

Three figures, each with EXTRA idle processes on the host (`sleep`, started here and
killed here by the pids this script holds):

- stop: loop lag while 100 units in process-group mode are stopped, each leaving a member
  of its group that lingers ~1.5 s after SIGTERM (the leader dies at once). Loop lag is the
  round trip of `GET /health/live` (answered on the loop, no work of its own) sent by one
  client every 5 ms over a kept-alive connection: max and p99 over the stop.
- scrape: `GET /metrics` wall time with 32 and 64 `sleep` units (median, max of 20).
- death: SIGKILL of one unit of 32 -> `GET /health` 503 (a client asking every 2 ms), with no
  other client, and with four clients scraping `/metrics` in a loop (median, max).

Run: /work/venv/bin/python -m bench.hotpath_numbers [--extra 2000] [--tree DIR] [--only stop,scrape,death]
(--tree: the checkout whose omnid runs, e.g. an export of an older commit for "before").
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.harness import Daemon, make_stack, wait_for  # noqa: E402

LINGER = ("exec = [\"/bin/sh\", \"-c\", \"sh -c 'trap \\\"sleep 1.5; exit 0\\\" TERM; while :; do sleep 1; done' "
          "& exec sleep 100000\"]\nstop_timeout = 10\n")
SLEEPER = 'exec = ["sleep", "100000"]\n'


def extra_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["sleep", "100000"], stdin=subprocess.DEVNULL) for _ in range(n)]


def end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def daemon(units: dict[str, str], tree: str | None) -> Daemon:
    d = Daemon(make_stack(units), env={"PYTHONPATH": tree or ""}, cwd=tree)
    d.start()
    d.wait_all_active(120)
    # The health API loads its HTTP stack lazily, in a thread: its first answer takes seconds
    # on 2 cores. Measure from the second on.
    d.http("/health/live")
    return d


def get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes]:
    """One request on a kept-alive connection; once more on a new one if the daemon closed
    it (its keep-alive timeout is 5 s)."""
    for attempt in (0, 1):
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read()
        except (http.client.RemoteDisconnected, ConnectionError, http.client.CannotSendRequest,
                http.client.ResponseNotReady):
            conn.close()
            if attempt:
                raise
    raise AssertionError("unreachable")


def reads(pid: int) -> int:
    """read() calls the daemon (all its threads) has made: the kernel's count, load-proof."""
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("syscr:")).split()[1])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def stop_lag(tree: str | None) -> dict:
    d = daemon({f"g{i:03d}": LINGER for i in range(100)}, tree)
    try:
        lags: list[float] = []
        done = threading.Event()

        def probe() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", d.health_port, timeout=30)
            while not done.is_set():
                t0 = time.monotonic()
                get(conn, "/health/live")
                lags.append((time.monotonic() - t0) * 1000)
                time.sleep(0.005)
            conn.close()

        t = threading.Thread(target=probe)
        t.start()
        time.sleep(0.3)
        lags.clear()
        names = sorted(d.units())
        t0, r0 = time.monotonic(), reads(d.pid)
        d.ok("stop", {"units": names}, timeout=120)
        took, nreads = time.monotonic() - t0, reads(d.pid) - r0
        done.set()
        t.join()
        return {"stop_s": round(took, 2), "daemon_reads": nreads, "probes": len(lags), "lag_max_ms": round(max(lags), 1),
                "lag_p99_ms": round(pct(lags, 0.99), 1), "lag_median_ms": round(statistics.median(lags), 1)}
    finally:
        d.close()


def scrape(tree: str | None, n: int) -> dict:
    d = daemon({f"s{i:03d}": SLEEPER for i in range(n)}, tree)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", d.health_port, timeout=60)
        times = []
        r0 = reads(d.pid)
        for _ in range(20):
            t0 = time.monotonic()
            code, _ = get(conn, "/metrics")
            assert code == 200
            times.append((time.monotonic() - t0) * 1000)
        conn.close()
        return {"units": n, "reads_per_scrape": round((reads(d.pid) - r0) / 20), "median_ms": round(statistics.median(times), 1), "max_ms": round(max(times), 1)}
    finally:
        d.close()


def death(tree: str | None, scrapers: int, rounds: int) -> dict:
    units = {f"s{i:03d}": SLEEPER for i in range(31)}
    units["victim"] = 'exec = ["sleep", "100000"]\nrestart = "no"\n'
    d = daemon(units, tree)
    stop = threading.Event()

    def scrape_loop() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", d.health_port, timeout=600)
        while not stop.is_set():
            get(conn, "/metrics")
        conn.close()

    threads = [threading.Thread(target=scrape_loop) for _ in range(scrapers)]
    for t in threads:
        t.start()
    try:
        out = []
        conn = http.client.HTTPConnection("127.0.0.1", d.health_port, timeout=600)
        for _ in range(rounds):
            wait_for(lambda: get(conn, "/health")[0] == 200, 600, "health 200")
            pid = d.ok("status", timeout=600)["units"]
            pid = next(u["pid"] for u in pid if u["name"] == "victim")
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while get(conn, "/health")[0] == 200:
                time.sleep(0.002)
            out.append((time.monotonic() - t0) * 1000)
            print(f"  {scrapers} scrapers: kill -> 503 {out[-1]:.1f} ms", flush=True)
            wait_for(lambda: next(u for u in d.ok("status", timeout=600)["units"] if u["name"] == "victim")["state"]
                     == "failed", 600, "victim failed")
            d.ok("start", {"units": ["victim"]}, timeout=600)
        conn.close()
        return {"scrapers": scrapers, "median_ms": round(statistics.median(out), 1), "max_ms": round(max(out), 1),
                "samples": [round(x, 1) for x in out]}
    finally:
        stop.set()
        for t in threads:
            t.join()
        d.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--extra", type=int, default=2000)
    ap.add_argument("--tree", default=None)
    ap.add_argument("--only", default="stop,scrape,death")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    tree = os.path.abspath(a.tree) if a.tree else None
    only = a.only.split(",")
    extra = extra_processes(a.extra)
    res: dict = {"tree": tree or "this checkout", "extra_processes": a.extra}
    try:
        if "stop" in only:
            res["stop"] = stop_lag(tree)
            print(json.dumps(res["stop"]), flush=True)
        if "scrape" in only:
            res["scrape"] = [scrape(tree, n) for n in (32, 64)]
            print(json.dumps(res["scrape"]), flush=True)
        if "death" in only:
            res["death"] = []
            for n in (0, 4):
                res["death"].append(death(tree, n, a.rounds))
                print(json.dumps(res["death"][-1]), flush=True)
    finally:
        end(extra)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
