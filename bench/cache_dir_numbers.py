"""What `cache_dir` saves a restart (omnid.unit(5)): the demo worker with `--compile`
(its step torch.compile'd before READY=1), `private_tmp` on (the default), started twice
in a row under a real daemon:

- before: no `cache_dir`: inductor's cache follows TMPDIR into the private directory,
  which goes at the stop, so the second start compiles again;
- after: `cache_dir = true`: TORCHINDUCTOR_CACHE_DIR is in the unit's cache directory,
  which the stop keeps, so the second start loads what the first compiled.

A third case, after + TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0 in the unit's env: on the
CPU inductor precompiles its C++ header under TMPDIR/torchinductor_USER whatever
TORCHINDUCTOR_CACHE_DIR says (torch's default_cache_dir), so a restart in a fresh private
TMPDIR compiles that header again even when every kernel is cached; without the header
the cached kernels' .so files are all a restart needs (GPU kernels are Triton's, cached in
TRITON_CACHE_DIR, and use no such header).

Each figure is spawn -> active (READY=1) from the daemon's own log (`unit state` events),
the worker's own "compiled its step in" line, and the CPU seconds its process group had
used at READY=1 (its processes' and their reaped children's: the C++ compiler's), which a
host loaded by others inflates far less than the wall clock. Each case starts from an empty cache
(a fresh cache root, a fresh TMPDIR).

Run: .venv/bin/python -m bench.cache_dir_numbers [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import datetime

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.harness import Daemon, free_port, make_stack, temp_dir, wait_for  # noqa: E402

WORKER = """exec = ["python3", "-m", "omnid.demo.worker", "--compile"]
ready = "notify"
ready_timeout = 600
stop_timeout = 10
restart = "no"
env = {{ OMNID_DEMO_DEVICE = "cpu", OMNID_DEMO_MODEL_MIB = "8", OMNID_DEMO_WORKER_PORT = "{port}"{more} }}
{extra}
"""


def ts(e: dict) -> float:
    return datetime.fromisoformat(e["timestamp"]).timestamp()


def starts(d: Daemon) -> list[float]:
    """spawn -> active of each start of `w`, in order, from the daemon's log."""
    out, since = [], None
    for e in d.log_events():
        if e.get("event") != "unit state" or e.get("unit") != "w":
            continue
        if e.get("to") == "starting":
            since = ts(e)
        elif e.get("to") == "active" and since is not None:
            out.append(ts(e) - since)
            since = None
    return out


def group_cpu_s(pgid: int) -> float:
    """utime + stime of every process in the group, + the reaped children's of each."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the comm: state ppid pgrp ...
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / tick


def compiles(d: Daemon) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"compiled its step in ([0-9.]+) s", d.log())]


def case(with_cache: bool, no_pch: bool = False) -> dict:
    root = temp_dir("omb-cache-")
    os.chmod(root, 0o755)
    extra = "cache_dir = true" if with_cache else ""
    more = ', TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS = "0"' if no_pch else ""
    d = Daemon(make_stack({"w": WORKER.format(port=free_port(), extra=extra, more=more)},
                          f"cache_root = {json.dumps(str(root))}\n")).start()
    try:
        cpu = [group_cpu_s(d.wait_state("w", "active", timeout=600)["pid"])]
        tmp1 = d.unit("w")["private_tmp"]
        d.ok("stop", {"units": ["w"]}, timeout=60)
        assert not os.path.lexists(tmp1), "the private TMPDIR outlived the stop"
        d.ok("start", {"units": ["w"]}, timeout=600)
        cpu.append(group_cpu_s(d.wait_state("w", "active", timeout=600)["pid"]))
        d.ok("stop", {"units": ["w"]}, timeout=60)
        wait_for(lambda: len(starts(d)) == 2 and len(compiles(d)) == 2, 10, "both starts in the log")
        kept = sorted(os.listdir(root / "w" / "torchinductor")) if with_cache else []
        return {"cache_dir": with_cache, "precompiled_header": not no_pch, "start_to_ready_s": [round(x, 2) for x in starts(d)],
                "cpu_s_at_ready": [round(x, 2) for x in cpu],
                "compile_s": compiles(d), "private_tmp": True, "cache_kept": kept}
    finally:
        d.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    for _ in range(args.rounds):
        for with_cache, no_pch in ((False, False), (True, False), (True, True)):
            print(json.dumps(case(with_cache, no_pch)), flush=True)


if __name__ == "__main__":
    main()
