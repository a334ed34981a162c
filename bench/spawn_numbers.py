"""The spawn path alone (issue 20), omnid only: the daemon's SpawnerClient and the spawner,
without the supervisor, on the same static child as bench/run.py.

For N in the list: N spawn requests issued in one loop iteration (as the supervisor issues a
tier) -> the N-th child's own start stamp, and -> the N-th `Spawned` answer; the spawner's CPU
time for the batch (its /proc schedstat), per child. Also the spawner's start: posix_spawn ->
first child exec'd when the first request is sent before the spawner's hello.

Run: .venv/bin/python -m bench.spawn_numbers [--ns 16,64,256] [--runs 5]   (prints JSON)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import build_child, cpu_ns  # noqa: E402
from omnid.process.spawnclient import SpawnerClient, SpawnRequest  # noqa: E402


def _starts(stamps: Path) -> list[int]:
    return sorted(int(n.split(".")[2]) for n in os.listdir(stamps) if n.startswith("s."))


async def _one(child: list[str], stamps: Path, n: int) -> dict:
    exits: list = []
    client = SpawnerClient(on_exit=exits.append, on_gone=lambda: None)
    t_launch = time.monotonic_ns()
    client.launch()
    await client.attach()
    if hasattr(client, "wait_ready"):  # attach() no longer waits for the spawner's hello
        await client.wait_ready()
    t_hello = time.monotonic_ns()
    env = dict(os.environ)
    env.update(OMNID_UNIT="w", SPT_NOENV="1")
    pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(n)]
    cpu0 = cpu_ns(client.pid)
    t0 = time.monotonic_ns()
    reqs = [client.spawn(SpawnRequest(unit=f"w@{i}", argv=(*child, "-s", str(stamps), "-m", "60"), env=env),
                         w, None) for i, (_r, w) in enumerate(pipes)]
    answers = await asyncio.gather(*reqs)
    t_answered = time.monotonic_ns()
    for _r, w in pipes:
        os.close(w)
    deadline = time.monotonic() + 30
    while len(_starts(stamps)) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.002)
    starts = _starts(stamps)
    cpu1 = cpu_ns(client.pid)
    for a in answers:
        os.kill(a.pid, 9)
    while len(exits) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    for a in answers:
        os.close(a.pidfd)
    for r, _w in pipes:
        os.close(r)
    await client.shutdown()
    for name in os.listdir(stamps):
        os.unlink(stamps / name)
    return {"hello_ms": (t_hello - t_launch) / 1e6, "first_ms": (starts[0] - t0) / 1e6,
            "last_ms": (starts[-1] - t0) / 1e6, "answered_ms": (t_answered - t0) / 1e6,
            "spawner_cpu_ms_per_child": (cpu1 - cpu0) / 1e6 / n}


async def _cold(child: list[str], stamps: Path) -> float:
    """posix_spawn of the spawner -> first child exec'd, the request sent without waiting
    for the spawner's hello (what the daemon does at start)."""
    client = SpawnerClient(on_exit=lambda _r: None, on_gone=lambda: None)
    r, w = os.pipe2(os.O_CLOEXEC)
    t0 = time.monotonic_ns()
    client.launch()
    attach = asyncio.ensure_future(client.attach())
    await asyncio.sleep(0)
    sp = await client.spawn(SpawnRequest(unit="w", argv=(*child, "-s", str(stamps), "-m", "60"),
                                         env=dict(os.environ)), w, None)
    await attach
    os.close(w)
    deadline = time.monotonic() + 10
    while not _starts(stamps) and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    first = _starts(stamps)[0]
    os.kill(sp.pid, 9)
    os.close(sp.pidfd)
    os.close(r)
    await client.shutdown()
    for name in os.listdir(stamps):
        os.unlink(stamps / name)
    return (first - t0) / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="16,64,256")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ob-spawn-"))
    try:
        child, kind = build_child("auto", work)
        stamps = work / "st"
        stamps.mkdir()
        out: dict = {"child": kind, "loadavg": open("/proc/loadavg").read().split()[:3], "figures": {}}
        cold = [asyncio.run(_cold(child, stamps)) for _ in range(a.runs)]
        out["figures"]["cold_first_child_ms"] = {"median": statistics.median(cold), "samples": cold}
        for n in (int(x) for x in a.ns.split(",")):
            runs = [asyncio.run(_one(child, stamps, n)) for _ in range(a.runs)]
            out["figures"][f"n{n}"] = {k: {"median": round(statistics.median(r[k] for r in runs), 3),
                                           "min": round(min(r[k] for r in runs), 3)} for k in runs[0]}
        out["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
        print(json.dumps(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
