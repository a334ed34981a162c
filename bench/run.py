"""omnid vs supervisord, Circus and runit: one command, one machine, one child program.

    /work/main/.venv/bin/python -m bench [--quick] [--only omnid,supervisord,circus,runit]
                                         [--out bench/results/NAME.json]

See bench/README.md for what each figure means. Run by hand; never part of
the test suite.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python bench/run.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.run import main as _main
    sys.exit(_main())

import argparse
import datetime as dt
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback

from .adapters import ADAPTERS, Ctx, Unavailable
from .common import (BENCH_DIR, Deadline, Janitor, become_subreaper, build_child, log,
                     machine_info, write_json)
from .report import render
from .scenarios import Bench

SCENARIOS = ["residue", "death", "stop", "idle", "start"]

# Per-supervisor time caps (seconds) of the full run, sized for 2 cores.
FULL = {
    "samples": 30, "ns": [16, 64, 256], "stop_ns": [64, 256], "idle_n": 256, "idle_s": 30.0, "load_s": 5.0,
    "cap_start": {16: 120, 64: 240, 256: 420}, "cap_death": 180, "cap_stop": 100,
    "residue_runs": 1, "deadline": 1200,
}
QUICK = {
    "samples": 5, "ns": [1, 16, 64], "stop_ns": [16, 64], "idle_n": 64, "idle_s": 5.0, "load_s": 2.0,
    "cap_start": {1: 30, 16: 40, 64: 60}, "cap_death": 30, "cap_stop": 30,
    "residue_runs": 1, "deadline": 420,
}


def _loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="omnid,supervisord,circus,runit",
                    help="comma-separated supervisors (default: all four)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 5 samples, N = 1/16/64, 5 s idle")
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON (default bench/results/<UTC time>.json); "
                         "the Markdown table is written next to it (.md)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma-separated subset of {','.join(SCENARIOS)}")
    ap.add_argument("--samples", type=int, default=None, help="samples per latency")
    ap.add_argument("--deadline", type=float, default=None,
                    help="global deadline in seconds (default 1200, --quick 420)")
    ap.add_argument("--child", choices=["auto", "c", "python"], default="auto",
                    help="child program: static C (default when gcc works) or Python")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run directory")
    ap.add_argument("--ns", default=None, help="comma-separated N for the start figures (default 16,64,256)")
    a = ap.parse_args(argv)
    a.sups = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in a.sups if s not in ADAPTERS]
    if bad:
        ap.error(f"unknown supervisor(s) {bad}; known: {list(ADAPTERS)}")
    a.scen = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    bad = [s for s in a.scen if s not in SCENARIOS]
    if bad:
        ap.error(f"unknown scenario(s) {bad}; known: {SCENARIOS}")
    return a


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    prof = dict(QUICK if a.quick else FULL)
    if a.samples:
        prof["samples"] = a.samples
    if a.ns:
        prof["ns"] = [int(x) for x in a.ns.split(",")]
        prof["cap_start"] = {n: prof["cap_start"].get(n, 60 + n) for n in prof["ns"]}
    if a.deadline:
        prof["deadline"] = a.deadline
    deadline = Deadline(prof["deadline"])
    started = dt.datetime.now(dt.timezone.utc)
    out = a.out or (BENCH_DIR / "results" / (started.strftime("%Y-%m-%dT%H%M%SZ") + ".json"))
    out = out.resolve()

    janitor = Janitor()
    if not become_subreaper():
        log("WARNING: could not become a child subreaper; orphans go to init")
    rundir = Path(tempfile.mkdtemp(prefix="ob-", dir="/tmp"))
    results: dict = {"meta": {
        "started": started.isoformat(timespec="seconds"), "quick": a.quick,
        "samples": prof["samples"], "supervisors": [], "machine": machine_info(),
        "args": sys.argv[1:] if argv is None else argv, "profile": {k: v for k, v in prof.items()
                                                                    if not k.startswith("cap")},
        "versions": {}, "unavailable": {}, "notes": [],
        "loadavg": {"start": _loadavg()},
    }, "figures": {}}
    t_start = time.monotonic()
    bench: Bench | None = None
    done = threading.Event()
    extra_notes: list[str] = []

    def save() -> None:
        meta = results["meta"]
        meta["duration_s"] = round(time.monotonic() - t_start, 1)
        if bench is not None:
            results["figures"] = bench.figures
            meta["notes"] = extra_notes + bench.notes
        else:
            meta["notes"] = list(extra_notes)
            meta["leftovers"] = bench.leftovers
        write_json(out, results)
        out.with_suffix(".md").write_text(render(results))

    def watchdog() -> None:
        # last resort if something blocks past the deadline: kill all, save, exit
        if done.wait(timeout=prof["deadline"] + 90):
            return
        log("watchdog: deadline + 90 s passed; killing everything")
        try:
            janitor.sweep(timeout=5)
            extra_notes.append("watchdog fired: run aborted")
            save()
        finally:
            os._exit(124)

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    threading.Thread(target=watchdog, daemon=True).start()
    sys.setswitchinterval(0.001)  # the event threads timestamp promptly
    rc = 0
    try:
        child, child_kind = build_child(a.child, rundir)
        results["meta"]["child"] = child_kind
        ctx = Ctx(child=child, janitor=janitor, max_sec=int(prof["deadline"] + 300),
                  peers_python=getattr(sys, "_base_executable", sys.executable))
        sups = []
        for s in a.sups:
            try:
                results["meta"]["versions"][s] = ADAPTERS[s].prepare(ctx)
                sups.append(s)
            except Unavailable as e:
                log(f"{s} not available: {e}")
                results["meta"]["unavailable"][s] = str(e)
        results["meta"]["supervisors"] = sups
        if not sups:
            log("nothing to measure")
            return 1
        log(f"run dir {rundir}; supervisors {sups}; child {child_kind}; "
            f"deadline {prof['deadline']:.0f} s")
        bench = Bench(sups=sups, ctx=ctx, rundir=rundir, deadline=deadline,
                      samples=prof["samples"], quick=a.quick)
        for scen in SCENARIOS:
            if scen not in a.scen:
                continue
            if deadline.left() < 10:
                bench.notes.append(f"{scen}: skipped, global deadline reached")
                continue
            try:
                if scen == "residue":
                    bench.run_residue(runs=prof["residue_runs"])
                elif scen == "death":
                    bench.run_death(prof["cap_death"])
                elif scen == "stop":
                    bench.run_stop_timeout(prof["cap_stop"])
                elif scen == "idle":
                    bench.run_idle(prof["idle_n"], prof["idle_s"], prof["load_s"])
                elif scen == "start":
                    bench.run_start(prof["ns"], prof["cap_start"], set(prof["stop_ns"]))
            except KeyboardInterrupt:
                raise
            except Exception as e:
                log(f"scenario {scen} failed: {e!r}")
                traceback.print_exc()
                bench.notes.append(f"{scen}: failed: {e!r}"[:500])
            results["meta"]["loadavg"][f"after_{scen}"] = _loadavg()
            save()
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}); cleaning up")
        extra_notes.append(f"interrupted: {e}")
        rc = 130
    finally:
        left = janitor.sweep()
        if left:
            log(f"WARNING: could not kill {left}")
            results["meta"]["leftovers_final"] = left
        save()
        done.set()
        if not a.keep:
            shutil.rmtree(rundir, ignore_errors=True)
        else:
            log(f"kept {rundir}")
    print(render(results), end="")
    log(f"results: {out} (+ .md)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
