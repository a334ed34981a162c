"""Issue-10 figures: omnid with and without a cgroup v2 root.

- residue: N units each leave an escaped grandchild (setsid + double fork + env -i);
  after `omnid stop`, how many grandchildren survive, per backend;
- stop of 64 and 256 units (`stop` request wall time, median of --runs), per backend;
- cgroup.kill -> `populated 0` (inotify event) for a cgroup of 10 processes (--kills times);
- daemon RSS and CPU while idle with 256 units, per backend (--idle seconds).

Needs root and a writable cgroup2 mount (here /sys/fs/cgroup/unified). Each daemon gets
its own cgroup root below the mount, removed afterwards.

Run: .venv/bin/python -m bench.cgroup_numbers [--runs 3] [--idle 10]   (prints JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from omnid.process import cgroupfs, cgrouproot  # noqa: E402
from tests.harness import Daemon, make_stack, remove_cgroup_tree, wait_for  # noqa: E402

MOUNT = cgroupfs.cgroup2_mounts()[0] if cgroupfs.cgroup2_mounts() else None


def new_root() -> str:
    p = os.path.join(MOUNT, f"omnid-bench-{uuid.uuid4().hex[:10]}")
    os.mkdir(p)
    return p


def daemon(units: dict[str, str], cgroup: bool) -> tuple[Daemon, str | None]:
    root = new_root() if cgroup else None
    return Daemon(make_stack(units), cgroup_root=root, env={"OMNID_CHECK_INVARIANTS": "0"}).start(), root


def close(d: Daemon, root: str | None) -> None:
    d.close()
    remove_cgroup_tree(root)


def escaper(pidfile: str) -> str:
    code = (f"import os,sys,time\n"
            f"if os.fork()==0:\n"
            f"  os.setsid()\n"
            f"  if os.fork()==0:\n"
            f"    os.execve('/usr/bin/env',['env','-i','/bin/sh','-c','echo $$ > {pidfile}.tmp; "
            f"mv {pidfile}.tmp {pidfile}; exec sleep 300'],{{}})\n"
            f"  os._exit(0)\n"
            f"time.sleep(300)\n")
    return f"exec = {json.dumps(['python3', '-c', code])}\nstop_timeout = 5\n"


def pidfd_alive(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return not p.poll(0)


def residue(cgroup: bool, n: int = 16) -> dict:
    tmp = tempfile.mkdtemp(prefix="omb-")
    units = {f"e{i:02d}": escaper(f"{tmp}/gc{i}") for i in range(n)}
    d, root = daemon(units, cgroup)
    fds = []
    try:
        d.wait_all_active(60)
        for i in range(n):
            wait_for(lambda i=i: os.path.exists(f"{tmp}/gc{i}"), 20, "grandchild pid")
            fds.append(os.pidfd_open(int(open(f"{tmp}/gc{i}").read())))
        d.ok("stop", {"units": list(units)}, timeout=60)
        # Survivors: alive 1 s after the stop returned.
        time.sleep(1.0)
        survivors = sum(pidfd_alive(fd) for fd in fds)
    finally:
        for fd in fds:  # clean up by the pidfds of pids we recorded
            if pidfd_alive(fd):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        close(d, root)
    return {"escaped_grandchildren": n, "survivors": survivors}


def stop_time(n: int, cgroup: bool, runs: int) -> dict:
    units = {f"u{i:03d}": 'exec = ["sleep", "100000"]\n' for i in range(n)}
    xs = []
    for _ in range(runs):
        d, root = daemon(units, cgroup)
        try:
            d.wait_all_active(180)
            t0 = time.monotonic()
            d.ok("stop", {"units": list(units)}, timeout=180)
            xs.append(time.monotonic() - t0)
            if root:
                left = [x for x in os.listdir(root) if os.path.isdir(os.path.join(root, x))]
                assert not left, f"cgroups left after stop: {left[:5]}"
        finally:
            close(d, root)
    return {"units": n, "median_s": round(statistics.median(xs), 4), "runs_s": [round(x, 4) for x in xs]}


def kill_to_empty(kills: int, procs: int = 10) -> dict:
    root = cgrouproot.CgroupRoot(new_root(), "bench")
    xs = []
    try:
        for k in range(kills):
            cg = root.create(f"k{k}")

            def join(path=cg.path) -> None:  # bench helper only; the daemon never uses preexec_fn
                with open(os.path.join(path, "cgroup.procs"), "w") as f:
                    f.write("0")

            ps = [subprocess.Popen(["sleep", "300"], preexec_fn=join) for _ in range(procs)]
            wait_for(lambda: len(cg.pids()) == procs, 10, "processes in the cgroup")
            t0 = time.perf_counter()
            cg.kill()
            ok = root.watch.wait_empty_sync(cg.path, time.monotonic() + 10)
            xs.append((time.perf_counter() - t0) * 1000)
            assert ok
            for p in ps:
                p.wait(5)
            root.release(f"k{k}")
    finally:
        path = root.path
        root.close()
        remove_cgroup_tree(path)
    xs.sort()
    return {"processes": procs, "kills": kills, "median_ms": round(statistics.median(xs), 3),
            "p95_ms": round(xs[int(0.95 * (len(xs) - 1))], 3), "max_ms": round(xs[-1], 3)}


def idle(cgroup: bool, seconds: float, n: int = 256) -> dict:
    units = {f"u{i:03d}": 'exec = ["sleep", "100000"]\n' for i in range(n)}
    d, root = daemon(units, cgroup)
    try:
        d.wait_all_active(180)
        time.sleep(2.0)  # let start-up settle before measuring idle
        p = psutil.Process(d.pid)
        c0 = p.cpu_times()
        t0 = time.monotonic()
        time.sleep(seconds)
        c1 = p.cpu_times()
        wall = time.monotonic() - t0
        cpu = max(0.0, (c1.user + c1.system - c0.user - c0.system) / wall * 100)  # 10 ms ticks
        cgs = len([x for x in os.listdir(root) if os.path.isdir(os.path.join(root, x))]) if root else 0
        return {"units": n, "cgroups": cgs, "daemon_rss_mib": round(p.memory_info().rss / 2**20, 1),
                "daemon_cpu_percent": round(cpu, 3), "seconds": round(wall, 1)}
    finally:
        close(d, root)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cgroup_numbers")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--idle", type=float, default=10.0)
    a = ap.parse_args()
    if MOUNT is None or os.geteuid() != 0:
        print(json.dumps({"skipped": "needs root and a cgroup2 mount"}))
        return 0
    out: dict = {"machine": {"cpus": os.cpu_count(), "kernel": os.uname().release, "cgroup2": MOUNT}}
    for backend, cg in (("cgroup", True), ("process-group", False)):
        out[backend] = {"residue": residue(cg),
                        "stop_64": stop_time(64, cg, a.runs),
                        "stop_256": stop_time(256, cg, a.runs),
                        "idle_256": idle(cg, a.idle)}
    out["cgroup_kill_to_populated_0"] = kill_to_empty(a.kills)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
