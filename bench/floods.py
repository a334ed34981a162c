"""Issue #9 floods: /health latency (p50/p99), death -> 503 and the daemon's RSS/CPU
while (a) nothing, (b) a unit floods the notify socket with READY=1, (c) another
user floods the notify socket (root only), (d) 1,100 connections are held open
on the health port. Run by hand from the repository root:

    .venv/bin/python -m bench.floods [--seconds 4] [--out bench/results/floods.json]

Numbers are measured, not asserted (tests/test_hostile.py checks the behaviour).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

FLOODER = r'''
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
addr = "\0" + os.environ["NOTIFY_SOCKET"][1:]
s.sendto(b"READY=1", addr)
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.01)
for _ in range(int(sys.argv[2])):
    s.sendto(b"READY=1", addr)
time.sleep(100000)
'''

SENDER = r'''
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
addr = "\0" + sys.argv[1][1:]
for _ in range(int(sys.argv[2])):
    s.sendto(b"READY=1\nSTATUS=x", addr)
'''


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class Run:
    def __init__(self, workdir: Path, flood_n: int) -> None:
        self.dir = workdir
        self.units = workdir / "units"
        self.units.mkdir()
        self.go = workdir / "go"
        (workdir / "flood.py").write_text(FLOODER)
        (self.units / "flood.toml").write_text(
            f'exec = ["{PY}", "{workdir / "flood.py"}", "{self.go}", "{flood_n}"]\nready = "notify"\n')
        (self.units / "victim.toml").write_text('exec = ["sleep", "100000"]\nrestart = "always"\nrestart_sec = 0.3\n'
                                           'start_limit_burst = 1000\nrestart_max_sec = 0.5\n')
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.control = str(workdir / "ctl" / "c.sock")
        self.log = open(workdir / "daemon.log", "wb")
        self.proc = subprocess.Popen(
            [PY, "-m", "omnid", "--control", self.control, "daemon", "-u", str(self.units), "--state-dir",
             str(workdir / "state"), "--health-listen", f"127.0.0.1:{self.port}", "--log-format", "json"],
            stdout=self.log, stderr=self.log, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.health()[0] == 200:
                return
            time.sleep(0.05)
        raise RuntimeError("daemon did not become healthy; see " + str(workdir / "daemon.log"))

    def health(self, path: str = "/health", timeout: float = 2.0) -> tuple[int, float]:
        t0 = time.perf_counter()
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
            c.request("GET", path)
            code = c.getresponse().status
            c.close()
        except OSError:
            code = -1
        return code, time.perf_counter() - t0

    def units_json(self) -> dict:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        c.request("GET", "/units")
        body = json.loads(c.getresponse().read())
        c.close()
        return {u["name"]: u for u in body["units"]}

    def measure(self, seconds: float) -> dict:
        lat, errors = [], 0
        cpu0 = sum(self.ps.cpu_times()[:2])
        t0 = time.monotonic()
        rss = 0
        while time.monotonic() - t0 < seconds:
            code, dt = self.health("/health/live")
            if code == 200:
                lat.append(dt * 1000)
            else:
                errors += 1
            rss = max(rss, self.ps.memory_info().rss)
        cpu = (sum(self.ps.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0)
        deaths = []
        for _ in range(3):
            try:
                pid = self.units_json()["victim"]["pid"]
            except OSError:
                break
            if not pid:
                time.sleep(0.5)
                continue
            os.kill(pid, signal.SIGKILL)
            k = time.perf_counter()
            while time.perf_counter() - k < 5:
                if self.health(timeout=5)[0] == 503:
                    deaths.append((time.perf_counter() - k) * 1000)
                    break
            end = time.monotonic() + 10
            while time.monotonic() < end and self.health()[0] != 200:
                time.sleep(0.05)
        return {"health_live_p50_ms": pct(lat, 50), "health_live_p99_ms": pct(lat, 99), "requests": len(lat),
                "errors": errors, "death_to_503_ms": deaths, "daemon_rss_mib": round(rss / 2**20, 1),
                "daemon_cpu": round(cpu, 2)}

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--flood", type=int, default=200000)
    ap.add_argument("--out")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="omnid-floods-"))
    results: dict = {}
    run = Run(work, a.flood)
    try:
        results["baseline"] = run.measure(a.seconds)
        # (b) a unit's own READY=1 flood
        run.go.write_text("go")
        time.sleep(0.2)
        results["notify_flood_own_unit"] = run.measure(a.seconds)
        # (c) another user's flood (root only: needs a second user and setpriv)
        addr = None
        for p in psutil.Process(run.proc.pid).children(recursive=True):
            try:
                addr = p.environ().get("NOTIFY_SOCKET") or addr
            except psutil.Error:
                pass
        if os.geteuid() == 0 and addr and shutil.which("setpriv"):
            try:
                pwd.getpwnam("omnidtest")
                (work / "sender.py").write_text(SENDER)
                os.chmod(work, 0o755)
                senders = [subprocess.Popen(["setpriv", "--reuid=omnidtest", "--regid=omnidtest", "--clear-groups",
                                             PY, str(work / "sender.py"), addr, str(a.flood)], cwd="/")
                           for _ in range(2)]
                results["notify_flood_other_user"] = run.measure(a.seconds)
                for s in senders:
                    s.kill()
                    s.wait()
            except KeyError:
                pass
        # (d) 1,100 connections held open on the health port
        conns = []
        for _ in range(1100):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", run.port))
            conns.append(c)
        time.sleep(0.2)
        results["health_connection_flood"] = run.measure(a.seconds)
        results["health_connection_flood"]["daemon_fds"] = run.ps.num_fds()
        for c in conns:
            c.close()
        try:
            results["notify_counters"] = json.loads(subprocess.run(
                [PY, "-m", "omnid", "--control", run.control, "status", "--json"], capture_output=True, text=True,
                cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO))).stdout)["daemon"].get("notify")
        except (ValueError, KeyError):
            pass
    finally:
        run.close()
        shutil.rmtree(work, ignore_errors=True)
    results["machine"] = {"cpus": os.cpu_count(), "load": os.getloadavg()}
    text = json.dumps(results, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
