"""Issue-11 figures: a gloo all_reduce job as one worker group (omnid/demo/ranks.py on CPU).

For 2 and 4 ranks, SIGKILL one rank (the same rank each time) N times on one running daemon
and measure, from outside (/proc and the ranks' progress files):
- fault -> every survivor of the old generation gone (how long survivors sat blocked in a
  collective before omnid stopped them), per survivor;
- fault -> group healthy again: every rank all-reducing in the next generation.

Run: .venv/bin/python -m bench.worker_groups [--repeat 10]   (prints JSON; ~2 min for 10 x (2 + 4))
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from omnid.demo import rankprogress  # noqa: E402
from tests.harness import Daemon, alive, free_port, make_stack, wait_for  # noqa: E402




def group_healthy(directory: Path, n: int, generation: int, after: float) -> bool:
    p = rankprogress.read(directory)
    return len(p) == n and all(g == generation and it >= 2 and ts > after for g, it, ts, _pid in p.values())


def run(n: int, repeat: int) -> dict:
    prog = Path(tempfile.mkdtemp(prefix="omranks-"))
    stack = make_stack({"ranks": f"""
exec = ["python3", "-m", "omnid.demo.ranks"]
instances = {n}
worker_group = "job"
torch_distributed = {{ master_port = {free_port()} }}
ready = "notify"
ready_timeout = 60
stop_timeout = 2
restart = "on-failure"
restart_sec = 0.1
restart_max_sec = 0.1
start_limit_burst = 1000
env = {{ OMNID_RANKS_PROGRESS_DIR = "{prog}", OMNID_RANKS_TIMEOUT_S = "120" }}
"""})
    d = Daemon(stack)
    healthy, blocked = [], []
    try:
        d.start()
        for gen in range(1, repeat + 1):
            wait_for(lambda: group_healthy(prog, n, gen, 0), 120, f"generation {gen} all-reducing")
            pids = {name: u["pid"] for name, u in d.units().items()}
            victim = "ranks@1"
            t0 = time.monotonic()
            wall0 = time.time()
            os.kill(pids[victim], signal.SIGKILL)
            gone: dict[str, float] = {}
            while len(gone) < n:
                for name, pid in pids.items():
                    if name not in gone and not alive(pid):
                        gone[name] = time.monotonic()
                if time.monotonic() - t0 > 60:
                    raise AssertionError(f"survivors not stopped: {set(pids) - set(gone)}")
            blocked.extend((t - t0) * 1000 for name, t in gone.items() if name != victim)
            wait_for(lambda: group_healthy(prog, n, gen + 1, wall0), 120, f"generation {gen + 1} all-reducing",
                     interval=0.005)
            healthy.append(time.monotonic() - t0)
    finally:
        d.close()
        shutil.rmtree(prog, ignore_errors=True)
        shutil.rmtree(stack, ignore_errors=True)
    return {"ranks": n, "faults": repeat,
            "fault_to_group_healthy_s_median": round(statistics.median(healthy), 3),
            "fault_to_group_healthy_s_max": round(max(healthy), 3),
            "survivor_blocked_ms_median": round(statistics.median(blocked), 1),
            "survivor_blocked_ms_max": round(max(blocked), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    print(json.dumps([run(n, a.repeat) for n in (2, 4)], indent=1))


if __name__ == "__main__":
    main()
