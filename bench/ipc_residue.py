"""IPC residue removal against death detection (omnid.unit(5) remove_ipc): does the
/proc scan that proves nobody holds a /dev/shm entry (a thread, after a unit is gone)
slow the daemon's detection of another unit's death? A `maker` unit (POSIX shm,
semaphore, SysV segment) and a `victim` (sleep) are SIGKILLed together N times; the
victim's pidfd -> `failed` time is read from omnid's own histogram
(omnid_death_detection_seconds), and the maker's cleanup time from the log.
Run as root from the repository root: python bench/ipc_residue.py [N]"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.harness import Daemon, make_stack, wait_for  # noqa: E402
from tests.test_residue import MAKER, cleanup_objects, made_all, script  # noqa: E402

PY = sys.executable


def sigkill(pid: int) -> None:
    fd = os.pidfd_open(pid)
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


def victim_detect(d: Daemon) -> tuple[float, int]:
    _, text = d.http("/metrics")
    s = float(re.search(r'omnid_death_detection_seconds_sum\{unit="victim"\} (\S+)', text).group(1))
    c = int(re.search(r'omnid_death_detection_seconds_count\{unit="victim"\} (\S+)', text).group(1))
    return s, c


def run(n: int, remove_ipc: bool) -> dict:
    prog = script(MAKER, "maker.py")
    tag = f"ombench{os.getpid()}"
    restart = 'restart = "on-failure"\nrestart_sec = 0.1\nrestart_max_sec = 0.2\nstart_limit_burst = 1000\n'
    stack = make_stack({
        "maker": f'exec = {json.dumps([PY, prog, "make", tag])}\n{restart}remove_ipc = {str(remove_ipc).lower()}\n',
        "victim": f'exec = ["sleep", "1000"]\n{restart}',
    })
    d = Daemon(stack).start()
    seen: list[int] = []
    try:
        for i in range(n):
            m = wait_for(lambda: (u := d.unit("maker"))["state"] == "active" and u["pid"] not in seen and u["pid"],
                         30, "maker")
            v = wait_for(lambda: (u := d.unit("victim"))["state"] == "active" and u["pid"], 30, "victim")
            seen.append(m)
            wait_for(lambda: made_all(m, tag), 20, "the maker's objects")
            sigkill(m)
            time.sleep(0.02)  # the victim dies while the maker's removal scans /proc
            sigkill(v)
            wait_for(lambda: victim_detect(d)[1] == i + 1, 20, "the victim's death counted")
        s, c = victim_detect(d)
        scans = [e["ms"] for e in d.log_events() if e.get("event") == "IPC residue"]
        return {"remove_ipc": remove_ipc, "kills": c, "victim_detect_ms_mean": round(1000 * s / c, 2),
                "cleanup_ms": sorted(scans)}
    finally:
        d.close()
        cleanup_objects(tag, seen)  # what remove_ipc = false kept


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    print(f"processes on this host: {sum(1 for p in os.listdir('/proc') if p.isdigit())}")
    for ri in (False, True):
        print(json.dumps(run(n, ri)))
