"""Time from `omnid start` (a fresh daemon) to its first progress line, and to
"ready", on a three-tier stack of `sleep` units (issue #12). Run by hand from the
repository root:

    .venv/bin/python bench/cli_start.py [--runs 5]

Each run launches `python -m omnid start -u STACK` on a private control socket and
state directory, reads its stdout line by line with timestamps, then `omnid stop`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.harness import free_port, make_stack  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    stack = make_stack({"worker": 'exec = ["sleep", "100000"]\ninstances = 2\n',
                        "engine": 'exec = ["sleep", "100000"]\nrequires = ["worker"]\n',
                        "serve": 'exec = ["sleep", "100000"]\nrequires = ["engine"]\n'})
    env = dict(os.environ, PYTHONPATH=str(REPO))
    first, first_unit, ready = [], [], []
    for _ in range(a.runs):
        work = Path(tempfile.mkdtemp(prefix="omd-bench-", dir="/tmp"))
        control = str(work / "c.sock")
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "omnid", "--control", control, "start", "-u", str(stack),
                              "--state-dir", str(work / "state"), "--health-listen", f"127.0.0.1:{free_port()}"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(REPO))
        f = fu = r = None
        for line in p.stdout:  # type: ignore[union-attr]
            if f is None and line.startswith("  ["):
                f = time.monotonic() - t0
            if fu is None and line.startswith("  [") and "] daemon:" not in line:
                fu = time.monotonic() - t0
            if "ready in" in line:
                r = time.monotonic() - t0
        p.wait(60)
        p.stdout.close()  # type: ignore[union-attr]
        subprocess.run([sys.executable, "-m", "omnid", "--control", control, "stop"], capture_output=True,
                       env=env, timeout=60)
        shutil.rmtree(work, ignore_errors=True)
        if f is not None:
            first.append(f)
        if fu is not None:
            first_unit.append(fu)
        if r is not None:
            ready.append(r)
    print(f"{a.runs} runs of `omnid start` (fresh daemon, 4 sleep units in 3 tiers), {os.cpu_count()} CPUs")
    for name, xs in (("first progress line", first), ("first unit state line", first_unit), ("ready", ready)):
        if xs:
            print(f"  {name}: median {statistics.median(xs) * 1000:.0f} ms, min {min(xs) * 1000:.0f} ms, "
                  f"max {max(xs) * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
