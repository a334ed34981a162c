"""The stop path's timings before and after a change of omnid's centre, side by side in
one run (interleaved rounds, so both see the same machine):

- death -> `failed`: SIGKILL of a unit's process to the `failed` state change in the
  daemon's log (its timestamps and this process's clock are the same wall clock);
- stop of 256 units: the request to the first unit's `stopping`, and to the last
  unit's `inactive`;
- escalation error: a unit that ignores SIGTERM with stop_timeout = 1: how late SIGKILL
  came (the stop summary's seconds minus 1).

Run: .venv/bin/python -m bench.centre_numbers --base REV [--rounds 3]
(REV is checked out into a temporary worktree; the working tree is "new").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.harness import REPO, Daemon, make_stack, wait_for  # noqa: E402

SLEEP = 'exec = ["sleep", "100000"]\nstop_timeout = 5\n'
STUBBORN = 'exec = ["sh", "-c", "trap \\"\\" TERM; sleep 100000 & wait; wait"]\nstop_timeout = 1\n'


def ts(e: dict) -> float:
    return datetime.fromisoformat(e["timestamp"]).timestamp()


def states(d: Daemon) -> list[dict]:
    text = getattr(d, "closed_log", None) or d.log()  # after close() the log file is gone
    out = []
    for line in text.splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "unit state":
            out.append(e)
    return out


def daemon(tree: Path, units: dict[str, str]) -> Daemon:
    env = {"PYTHONPATH": str(tree), "OMNID_CHECK_INVARIANTS": "0"}
    d = Daemon(make_stack(units), env=env, cwd=tree)
    d.start()
    return d


def death_to_failed(tree: Path, kills: int) -> list[float]:
    d = daemon(tree, {"v": SLEEP + 'restart = "on-failure"\nrestart_sec = 0.05\nrestart_max_sec = 0.05\n'
                                   "start_limit_burst = 100000\n"})
    out = []
    try:
        for _ in range(kills):
            u = wait_for(lambda: (x := d.unit("v"))["state"] == "active" and x, 30, "v active")
            before = len(states(d))
            fd = os.pidfd_open(u["pid"])
            t0 = time.time()
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
            ev = wait_for(lambda: next((e for e in states(d)[before:] if e["unit"] == "v" and e["to"] == "failed"),
                                       None), 30, "v failed")
            out.append((ts(ev) - t0) * 1000)
    finally:
        d.close()
    return out


def stop_256(tree: Path) -> tuple[float, float]:
    d = daemon(tree, {"w": SLEEP + "instances = 256\n"})
    try:
        wait_for(lambda: all(u["state"] == "active" for u in d.units().values()), 120, "256 active")
        before = len(states(d))
        t0 = time.time()
        d.ok("shutdown", timeout=120)
        d.wait_exit(60)
    finally:
        d.close()
    evs = [e for e in states(d)[before:]]
    first = min(ts(e) for e in evs if e["to"] == "stopping")
    last = max(ts(e) for e in evs if e["to"] == "inactive")
    return (first - t0) * 1000, (last - t0) * 1000


def escalation(tree: Path) -> float:
    d = daemon(tree, {"s": STUBBORN})
    try:
        d.wait_all_active()
        rec = d.ok("stop", {"units": ["s"]})["summary"][0]
    finally:
        d.close()
    return (rec["seconds"] - 1.0) * 1000


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f}" if xs else "-"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="13352a8", help="the revision to compare with (default: before the centre)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kills", type=int, default=30)
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="omnid-base-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(base), a.base], check=True)
    trees = {"base": base, "new": REPO}
    res: dict[str, dict[str, list[float]]] = {k: {"death": [], "stop_first": [], "stop_all": [], "esc": []}
                                              for k in trees}
    try:
        for _ in range(a.rounds):
            for name, tree in trees.items():
                res[name]["death"] += death_to_failed(tree, a.kills)
                first, last = stop_256(tree)
                res[name]["stop_first"].append(first)
                res[name]["stop_all"].append(last)
                res[name]["esc"].append(escalation(tree))
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(res))
    print("| | death -> failed, median / p95 ms | stop 256: request -> first stopping, median ms | "
          "stop 256: request -> all inactive, median ms | escalation error, median ms |")
    print("|---|---|---|---|---|")
    for name in trees:
        r = res[name]
        p95 = sorted(r["death"])[int(0.95 * (len(r["death"]) - 1))] if r["death"] else 0
        print(f"| {name} ({a.base if name == 'base' else 'this tree'}) | {med(r['death'])} / {p95:.1f} | "
              f"{med(r['stop_first'])} | {med(r['stop_all'])} | {med(r['esc'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
