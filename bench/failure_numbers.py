"""Issue-3 figures for omnid alone: death -> /health 503 as seen by a client polling
/health (100 kills), READY=1 -> /health 200, and the daemon's CPU while a crash
loop backs off.

Run: .venv/bin/python -m bench.failure_numbers   (about a minute; prints JSON)
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.harness import Daemon, make_stack, wait_for  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def health_code(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/health")
    r = conn.getresponse()
    r.read()
    return r.status


def death_to_503(n: int = 100) -> dict:
    stack = make_stack({"victim": 'exec = ["sleep", "100000"]\nrestart = "always"\nrestart_sec = 0.05\n'
                                  'restart_max_sec = 0.05\nstart_limit_burst = 100000\n'})
    d = Daemon(stack)
    lat = []
    try:
        d.start()
        conn = http.client.HTTPConnection("127.0.0.1", d.health_port, timeout=5)
        for _ in range(n):
            wait_for(lambda: health_code(conn) == 200, 10, "200", interval=0.005)
            pid = d.unit("victim")["pid"]
            fd = os.pidfd_open(pid)
            t0 = time.monotonic()
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
            while health_code(conn) != 503:  # a client polling as fast as it can
                pass
            lat.append((time.monotonic() - t0) * 1000)
        conn.close()
        return {"death_to_503_ms_median": round(statistics.median(lat), 3), "death_to_503_ms_p99": round(pct(lat, 99), 3),
                "kills": n}
    finally:
        d.close()


READY_AFTER = """
import os, socket, sys, time
time.sleep(float(sys.argv[1]))
addr = os.environ["NOTIFY_SOCKET"]
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    t = time.monotonic()
    s.sendto(b"READY=1", "\\0" + addr[1:])
open(sys.argv[2], "w").write(repr(t))
time.sleep(100000)
"""


def ready_to_200(n: int = 20) -> dict:
    import tempfile

    tmp = tempfile.mkdtemp()
    prog = os.path.join(tmp, "ready.py")
    open(prog, "w").write(READY_AFTER)
    stamp = os.path.join(tmp, "t")
    stack = make_stack({"svc": f'exec = ["{sys.executable}", "{prog}", "0.3", "{stamp}"]\nready = "notify"\n'})
    d = Daemon(stack)
    lat = []
    try:
        d.start()
        conn = http.client.HTTPConnection("127.0.0.1", d.health_port, timeout=5)
        for _ in range(n):
            d.ok("stop", {"units": ["svc"]}, timeout=30)
            if os.path.exists(stamp):
                os.unlink(stamp)
            d._sock.send(json.dumps({"id": "s", "cmd": "start", "args": {"units": ["svc"]}}).encode())
            while health_code(conn) != 200:
                pass
            t200 = time.monotonic()
            d._sock.recv()
            t_ready = float(open(stamp).read())
            lat.append((t200 - t_ready) * 1000)
        conn.close()
        return {"ready_to_200_ms_median": round(statistics.median(lat), 3), "ready_to_200_ms_max": round(max(lat), 3),
                "samples": n}
    finally:
        d.close()


def crash_loop_cpu() -> dict:
    stack = make_stack({"crasher": 'exec = ["sh", "-c", "exit 3"]\nrestart = "on-failure"\nrestart_sec = 1\n'
                                   'restart_max_sec = 8\nstart_limit_burst = 1000\nstart_limit_interval = 600\n'})
    d = Daemon(stack)
    try:
        d.start()
        wait_for(lambda: d.unit("crasher")["restarts"] >= 2, 30, "two restarts")

        def cpu() -> float:
            f = open(f"/proc/{d.pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

        c0, t0, r0 = cpu(), time.monotonic(), d.unit("crasher")["restarts"]
        time.sleep(20)
        c1, t1, r1 = cpu(), time.monotonic(), d.unit("crasher")["restarts"]
        return {"crash_loop_daemon_cpu_percent": round((c1 - c0) / (t1 - t0) * 100, 3),
                "crash_loop_restarts_in_window": r1 - r0, "window_s": round(t1 - t0, 1)}
    finally:
        d.close()


if __name__ == "__main__":
    os.environ.pop("OMNID_CHECK_INVARIANTS", None)
    print(json.dumps({"machine": f"{os.cpu_count()} cores, {os.uname().release}", **death_to_503(), **ready_to_200(),
                      **crash_loop_cpu()}, indent=2))
