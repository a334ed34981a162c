"""Run the failure matrix N times in a row and print a pass table.

    python -m tests.failure_matrix --repeat 20 [--out results.json] [-k EXPR]

Each repetition is one pytest run of tests/failure_matrix (fresh daemons and
stacks every row); a row passes only if it passed in every repetition. The
figures the rows report (time to `failed`, worst end of an in-flight request
after the fault) are summarised per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.failure_matrix")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("-k", default=None, help="pytest -k expression to pick rows")
    ap.add_argument("--out", default=None, help="write the table and figures as JSON here")
    a = ap.parse_args()
    results: dict[str, list[str]] = defaultdict(list)
    figures: dict[str, list[dict]] = defaultdict(list)
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="omfm-run-") as tmp:
        for i in range(1, a.repeat + 1):
            xml = Path(tmp) / f"run{i}.xml"
            report = Path(tmp) / f"fig{i}.jsonl"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "tests/failure_matrix"),
                   f"--junitxml={xml}"]
            if a.k:
                cmd += ["-k", a.k]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMNID_MATRIX_REPORT=str(report)),
                                  capture_output=True, text=True)
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = case.get("name", "?")
                bad = case.find("failure") is not None or case.find("error") is not None
                skipped = case.find("skipped") is not None
                results[name].append("skip" if skipped else "FAIL" if bad else "pass")
            if report.exists():
                for line in report.read_text().splitlines():
                    fig = json.loads(line)
                    figures[fig.pop("row")].append(fig)
            print(f"run {i}/{a.repeat}: {proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.returncode}"
                  f" ({time.monotonic() - t0:.0f} s)", flush=True)
    print()
    print(f"| test | passed | of |")
    print("|---|---|---|")
    all_ok = True
    for name in sorted(results):
        r = results[name]
        ok = r.count("pass")
        all_ok &= ok == len(r) or r.count("skip") == len(r)
        print(f"| {name} | {ok} | {len(r)} |")
    print()
    print("| row | samples | time to failed, ms (median / max) | worst in-flight end after fault, s (max) |")
    print("|---|---|---|---|")
    for row in sorted(figures):
        fs = figures[row]
        failed = [f["failed_ms"] for f in fs if "failed_ms" in f]
        worst = [f["worst_end_s"] for f in fs if "worst_end_s" in f]
        fm = f"{statistics.median(failed):.1f} / {max(failed):.1f}" if failed else "-"
        print(f"| {row} | {len(fs)} | {fm} | {max(worst):.3f} |" if worst else f"| {row} | {len(fs)} | {fm} | - |")
    print(f"\n{a.repeat} repetition(s) in {time.monotonic() - t_all:.0f} s: {'ALL PASS' if all_ok else 'FAILURES'}")
    if a.out:
        Path(a.out).write_text(json.dumps({"results": results, "figures": figures}, indent=1))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
