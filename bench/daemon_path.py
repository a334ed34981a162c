"""Where the daemon's own start and exit time goes (issue 36, item 1): one `omnid daemon` with
N instances of the bench's static C child (bench/child.c), started and stopped again and
again, each figure split into its steps:

- launch -> the interpreter and omnid's imports: `python -c pass`, `import omnid.cli.main`
  and `import omnid.daemon.command` timed alone (wall and CPU), the part of the start that
  does not depend on N;
- launch -> first child exec'd, -> last child exec'd (the children's own CLOCK_MONOTONIC
  stamps), and the daemon's CPU (utime + stime of all its threads, /proc) at the last exec;
- the same stack with `private_tmp = false` and `remove_ipc = false` in the unit: what the
  per-unit preparation (a private TMPDIR and its record, the IPC book) costs, start and stop;
- stop: SIGTERM -> last child gone (pidfds), -> the daemon exited (its pidfd), and the
  daemon's CPU from the SIGTERM to its exit (read from the zombie before it is reaped).

The load average is recorded at the start and the end of each round, and every round runs
each variant once, interleaved, so that a load that comes and goes hits them alike. CPU
figures move far less with the load of a shared host than the wall clock does.

`--baseline /path/to/bin/omnid` (or OMNID_BENCH_BASELINE) adds another omnid build, run in
the same rounds: before/after under the same load. Its imports are not timed alone.

Run: .venv/bin/python -m bench.daemon_path [--ns 1,16,256] [--rounds 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.common import REPO_DIR, build_child, free_port, write_json

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
VARIANTS = {"default": "", "no-prep": "private_tmp = false\nremove_ipc = false\n"}


def cpu_ms(pid: int) -> float:
    """utime + stime of the process, all its threads (a zombie's too), in ms."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_MS


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall ms, CPU ms) of a short command run to its end."""
    t0 = time.monotonic()
    before = os.times()
    subprocess.run(argv, check=True, cwd="/", capture_output=True)
    after = os.times()
    return ((time.monotonic() - t0) * 1000,
            ((after.children_user - before.children_user) + (after.children_system - before.children_system)) * 1000)


def one_run(exe: list[str], n: int, extra: str, child: list[str], workdir: Path, timeout: float = 60.0) -> dict:
    run = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    stamps = run / "stamps"
    for d in ("stack", "state", "stamps"):
        (run / d).mkdir()
    argv = ", ".join(json.dumps(a) for a in [*child, "-s", str(stamps), "-m", "120"])
    (run / "stack" / "w.toml").write_text(
        f'exec = [{argv}]\ntitle = ""\ninstances = {n}\nstop_timeout = 1\nrestart = "always"\n'
        f"restart_sec = 0\nrestart_max_sec = 0\nstart_limit_burst = 1000000\nstart_limit_interval = 1\n{extra}")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    out = open(run / "daemon.log", "w")
    t0 = time.monotonic_ns()
    p = subprocess.Popen([*exe, "--control", str(run / "ctl.sock"), "daemon", "-u", str(run / "stack"),
                          "--state-dir", str(run / "state"), "--health-listen", f"127.0.0.1:{port}",
                          "--log-format", "json"], env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/")
    pidfd = os.pidfd_open(p.pid)
    child_fds: dict[int, int] = {}
    try:
        end = time.monotonic() + timeout
        seen: list[str] = []
        while len(seen) < n:
            if p.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"daemon exited or timed out before {n} children ({run / 'daemon.log'})")
            time.sleep(0.002)
            seen = [s for s in os.listdir(stamps) if s.startswith("s.")]
        cpu_start = cpu_ms(p.pid)
        starts = sorted(int(s.split(".")[2]) for s in seen)
        pids = [int(s.split(".")[1]) for s in seen]
        # Settled: /health answers (the health API is up, nothing is still being imported).
        while time.monotonic() < end:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                time.sleep(0.02)
        time.sleep(0.3)
        child_fds = {pid: os.pidfd_open(pid) for pid in pids}
        cpu_before_stop = cpu_ms(p.pid)
        t1 = time.monotonic_ns()
        p.send_signal(signal.SIGTERM)
        waiting = dict(child_fds)
        last_gone = t1
        while waiting and time.monotonic() < end:
            ready, _, _ = select.select(list(waiting.values()), [], [], 5)
            now = time.monotonic_ns()
            for fd in ready:
                waiting = {k: v for k, v in waiting.items() if v != fd}
                last_gone = now
        select.select([pidfd], [], [], max(0.0, end - time.monotonic()))
        t2 = time.monotonic_ns()
        cpu_stop = cpu_ms(p.pid) - cpu_before_stop  # a zombie now: its final counts
        rc = p.wait(10)
        return {"first_ms": (starts[0] - t0) / 1e6, "last_ms": (starts[-1] - t0) / 1e6, "cpu_start_ms": cpu_start,
                "stop_gone_ms": (last_gone - t1) / 1e6, "stop_exit_ms": (t2 - t1) / 1e6,
                "gone_to_exit_ms": (t2 - last_gone) / 1e6, "cpu_stop_ms": cpu_stop, "rc": rc}
    finally:
        for fd in child_fds.values():
            os.close(fd)
        os.close(pidfd)
        if p.poll() is None:
            p.kill()
            p.wait()
        out.close()
        shutil.rmtree(run, ignore_errors=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", default="1,16,256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", default=os.environ.get("OMNID_BENCH_BASELINE"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ns = [int(x) for x in a.ns.split(",")]
    exe = os.environ.get("OMNID_BENCH_EXE", str(REPO_DIR / ".venv" / "bin" / "omnid"))
    py = str(Path(exe).parent / "python")
    builds = {"omnid": [exe]} | ({"omnid-base": [a.baseline]} if a.baseline else {})
    subprocess.run([py, "-m", "compileall", "-q", str(REPO_DIR / "omnid")], capture_output=True, cwd="/")
    workdir = Path(tempfile.mkdtemp(prefix="omnid-daemon-path-"))
    child, kind = build_child("auto", workdir)
    result: dict = {"load_at_start": load(), "child": kind, "ns": ns, "rounds": a.rounds, "imports": {}, "runs": {}}
    try:
        imports: dict[str, list[tuple[float, float]]] = {"python -c pass": [], "import omnid.cli.main": [],
                                                         "import omnid.daemon.command": []}
        for _ in range(a.rounds):
            imports["python -c pass"].append(timed([py, "-c", "pass"]))
            imports["import omnid.cli.main"].append(timed([py, "-c", "import omnid.cli.main"]))
            imports["import omnid.daemon.command"].append(timed([py, "-c", "import omnid.cli.main, omnid.daemon.command"]))
        result["imports"] = {k: {"wall_ms": median([w for w, _ in v]), "cpu_ms": median([c for _, c in v])}
                             for k, v in imports.items()}
        runs: dict[str, list[dict]] = {}
        for r in range(a.rounds):
            print(f"[daemon_path] round {r + 1}/{a.rounds}, load {load()}", file=sys.stderr, flush=True)
            for n in ns:
                for variant, extra in VARIANTS.items():
                    for build, argv in builds.items():
                        key = f"{build} N={n} {variant}"
                        try:
                            runs.setdefault(key, []).append(one_run(argv, n, extra, child, workdir))
                        except RuntimeError as exc:
                            print(f"[daemon_path] {key}: {exc}", file=sys.stderr, flush=True)
        result["runs"] = {k: {f: median([x[f] for x in v]) for f in v[0] if f != "rc"} | {"samples": len(v)}
                          for k, v in runs.items() if v}
        result["load_at_end"] = load()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if a.out:
        write_json(Path(a.out), result)
    print(render(result))
    return 0


def render(res: dict) -> str:
    lines = [f"daemon start/exit path: child {res['child']}, {res['rounds']} rounds, medians; "
             f"load average at start {res['load_at_start']}, at end {res.get('load_at_end', '?')}", "",
             "| import step | wall ms | CPU ms |", "|---|---|---|"]
    for k, v in res["imports"].items():
        lines.append(f"| {k} | {v['wall_ms']:.0f} | {v['cpu_ms']:.0f} |")
    lines += ["", "| build, N, units | launch -> first exec | -> last exec | CPU at last exec | SIGTERM -> last "
              "child gone | last gone -> daemon exit | SIGTERM -> exit | stop CPU | n |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k, v in res["runs"].items():
        lines.append(f"| {k} | {v['first_ms']:.0f} | {v['last_ms']:.0f} | {v['cpu_start_ms']:.0f} | "
                     f"{v['stop_gone_ms']:.0f} | {v['gone_to_exit_ms']:.0f} | {v['stop_exit_ms']:.0f} | "
                     f"{v['cpu_stop_ms']:.0f} | {v['samples']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
