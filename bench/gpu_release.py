"""GPU memory release after SIGKILL, on a real NVIDIA GPU (skips, saying why, without one).

A unit `hog` (omnid.demo.gpu_hog SIZE on GPU 0, restart = "on-failure") is SIGKILLed N times
on one running daemon, for each SIZE. Measured per kill:
- exited_ms: SIGKILL -> a pidfd of the pid is readable (the kernel has torn the process down:
  what any supervisor waits for before it can know of the death), seen by a thread blocked
  in select();
- nvml_freed_ms: SIGKILL -> NVML no longer lists the dead pid (polled every ~1 ms; the
  slowest single NVML read is reported too, as it bounds this figure's resolution);
- failed_ms: SIGKILL -> omnid's `failed` event, seen by a thread blocked on its event stream;
- omnid_release_ms: omnid's own figure (status `gpu_release_ms`: from the failure op's wait
  start, just after `failed` is published, to NVML showing the memory free);
- back_ms: SIGKILL -> the restarted hog holds its SIZE again (omnid waits for the release
  before it restarts the unit);
- restart_oom: restarts that failed to allocate (expected 0).
And without a supervisor's wait, the habit of most restart loops: after the killed process is
reaped, start the next one at once and count how often its allocation is refused because the
corpse still holds the memory (`naive_oom`), with SIZE large enough that two copies do not fit.

Run: python -m bench.gpu_release [--sizes 1024,16384,65536] [--repeat 10]   (prints JSON)
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
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from omnid.gpu import NvmlBackend, memory_held_by  # noqa: E402
from tests.harness import REPO, Daemon, make_stack, wait_for  # noqa: E402


def held(nvml: NvmlBackend, pid: int) -> float:
    return sum(p.used_mib for p in memory_held_by(nvml, [pid]))


def summary(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)
    return {"median": round(statistics.median(values), 1), "max": round(values[-1], 1),
            "min": round(values[0], 1), "n": len(values)}


def kill_and_watch(d: Daemon, nvml: NvmlBackend, sub, pid: int) -> tuple[float, float, float, float, float]:
    """SIGKILL pid through a pidfd; three observers, each blocking on its own source so none
    delays another: the pidfd (kernel), omnid's event stream (`failed`), NVML (polled).
    Returns when the signal was sent (monotonic), ms from it to each, and the slowest
    single NVML read (ms)."""
    seen: dict[str, float] = {}

    def on_pidfd(fd: int) -> None:
        select.select([fd], [], [], 60)
        seen["exited"] = time.monotonic()

    def on_event() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not sub.poll(100):
                continue
            ev = json.loads(sub.recv())
            if ev.get("unit") == "hog" and ev.get("to") == "failed":
                seen["failed"] = time.monotonic()
                return

    pidfd = os.pidfd_open(pid)
    watchers = [threading.Thread(target=on_pidfd, args=(pidfd,)), threading.Thread(target=on_event)]
    for t in watchers:
        t.start()
    slowest = 0.0
    try:
        fault = time.monotonic()
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        deadline = fault + 60
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            gone = held(nvml, pid) == 0
            slowest = max(slowest, (time.monotonic() - t0) * 1000)
            if gone:
                seen["freed"] = time.monotonic()
                break
            time.sleep(0.001)
    finally:
        for t in watchers:
            t.join(65)
        os.close(pidfd)
    missing = {"exited", "freed", "failed"} - set(seen)
    if missing:
        raise AssertionError(f"not seen within 60 s of SIGKILL: {sorted(missing)}\n{d.log()[-2000:]}")
    exited, freed, failed = ((seen[k] - fault) * 1000 for k in ("exited", "freed", "failed"))
    return fault, exited, freed, failed, slowest


def under_omnid(nvml: NvmlBackend, mib: int, repeat: int) -> dict:
    stack = make_stack({"hog": f"""
exec = ["python3", "-m", "omnid.demo.gpu_hog", "{mib}"]
gpus = [0]
ready = "notify"
ready_timeout = 60
restart = "on-failure"
restart_sec = 0.1
restart_max_sec = 0.1
start_limit_burst = 1000
kill_timeout = 30
"""})
    d = Daemon(stack).start()
    rows = []
    sub = d.events_socket()
    try:
        pid = d.wait_state("hog", "active", 60)["pid"]
        d.ok("status")  # the subscription (ipc) is connected by the time a round trip is done
        for _ in range(repeat):
            wait_for(lambda: held(nvml, pid) >= mib, 30, f"hog pid {pid} holding {mib} MiB")
            fault, exited, freed, failed, slowest_read = kill_and_watch(d, nvml, sub, pid)
            old = pid
            u = wait_for(lambda: (x := d.unit("hog"))["state"] in ("active", "failed") and x["pid"] not in (None, old)
                         and x, 60, "the hog restarted")
            pid = u["pid"]
            if u["state"] == "failed":
                raise AssertionError(f"restart failed: {u['reason']}\n{d.log()[-2000:]}")
            wait_for(lambda: held(nvml, pid) >= mib, 30, "the restarted hog holding its memory")
            back = (time.monotonic() - fault) * 1000
            rows.append({"exited_ms": exited, "nvml_freed_ms": freed, "failed_ms": failed,
                         "omnid_release_ms": u["gpu_release_ms"], "back_ms": back, "slowest_read_ms": slowest_read})
        oom = sum("out of memory" in line or "CUresult 2" in line for line in d.log().splitlines())
    finally:
        sub.close(0)
        d.close()
    return {"slowest_nvml_read_ms": round(max(r["slowest_read_ms"] for r in rows), 1),
            "exited_ms": summary([r["exited_ms"] for r in rows]),
            "nvml_freed_ms": summary([r["nvml_freed_ms"] for r in rows]),
            "failed_ms": summary([r["failed_ms"] for r in rows]),
            "omnid_release_ms": summary([r["omnid_release_ms"] for r in rows if r["omnid_release_ms"] is not None]),
            "back_ms": summary([r["back_ms"] for r in rows]), "restart_oom": oom}


def naive(mib: int, repeat: int) -> dict:
    """kill -9, reap, start the next at once: how often does the next one find the GPU full?"""
    refused = 0
    for _ in range(repeat):
        first = subprocess.Popen([sys.executable, "-m", "omnid.demo.gpu_hog", str(mib)], cwd=str(REPO),
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert first.stdout is not None
        if not first.stdout.readline().startswith("holding"):
            first.kill()
            first.wait()
            raise AssertionError("the first hog could not take its memory")
        first.kill()
        first.wait()
        first.stdout.close()
        second = subprocess.Popen([sys.executable, "-m", "omnid.demo.gpu_hog", str(mib)], cwd=str(REPO),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert second.stdout is not None and second.stderr is not None
        if not second.stdout.readline().startswith("holding"):
            refused += 1
        second.kill()
        second.wait()
        second.stdout.close()
        second.stderr.close()
    return {"naive_oom": refused, "of": repeat}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,16384,65536", help="MiB held, comma-separated")
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    nvml = NvmlBackend()
    if not nvml.available or not nvml.pids_local:
        print(json.dumps({"skipped": nvml.reason or "NVML reports host pids"}))
        return 0
    try:
        gpu = nvml.gpus()[0]
        out = {"gpu": gpu.name, "total_mib": round(gpu.total_mib), "sizes": {}}
        for mib in (int(x) for x in a.sizes.split(",")):
            row = under_omnid(nvml, mib, a.repeat)
            if 2 * mib > gpu.free_mib:
                row.update(naive(mib, a.repeat))
            out["sizes"][mib] = row
            print(json.dumps({mib: row}), flush=True)
        print(json.dumps(out, indent=1))
    finally:
        nvml.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
