"""Real vLLM (CPU build, tiny local model) under omnid, alone, and under supervisord:
what each fault costs. Run by hand from the repository root:

    /work/venv/bin/python -m bench.vllm_faults [--only omnid,alone,supervisord] [--faults ...]

Per fault (SIGKILL of the API server, EngineCore, Worker; the Worker hung by SIGSTOP):
time until every process of the old tree is gone, until omnid's /health says 503, until the
first successful completion again; at the end of the observation window the processes of
the old tree still there (orphans), the memory they hold (RSS) and the /dev/shm objects of
the old tree left. Then an abort storm under omnid. Results: bench/results/vllm-<time>.json
and a Markdown table on stdout.

The engine environment and the model come from tests/engines (cached). supervisord is
pip-installed into bench/.venvs/supervisor; it runs the same argv with `stopasgroup` and
`killasgroup` (its group-kill options, which act when supervisord stops a program - not when
the program's main process dies by itself, as these rows show).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from omnid import linux  # noqa: E402
from tests.engines import vllm_env  # noqa: E402
from tests.engines.vllm_stack import (Load, Tree, abort_storm, full_tree, metrics, serves, signal_proc,  # noqa: E402
                                      unit_toml, vllm_health)
from tests.harness import Daemon, free_port, make_stack  # noqa: E402

VENVS = REPO / "bench" / ".venvs"
RESULTS = REPO / "bench" / "results"
WINDOW_S = 45.0  # how long a fault is watched for the old tree to go (after that: orphans)
HANG_WATCH_S = 60.0  # how long a hang is watched without a detector
START_S = 480.0
STALL_SEC = 8


def now() -> float:
    return time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def unit_argv_env(py: Path, model: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of the omnid unit, for the runs without omnid."""
    import tomllib

    u = tomllib.loads(unit_toml(py, model, port))
    return u["exec"], u["env"]


# ------------------------------------------------------------------ the three ways to run it


class OmnidRun:
    name = "omnid"
    restarts = True

    def __init__(self, py: Path, model: Path) -> None:
        self.port = free_port()
        stack = make_stack({"vllm": unit_toml(py, model, self.port, stall_sec=STALL_SEC)})
        self.d = Daemon(stack, env={"OMNID_TEST_CGROUP": "1", "INVOCATION_ID": ""}).start()

    def api_pid(self) -> int | None:
        u = self.d.unit("vllm")
        return u["pid"] if u["state"] == "active" and u["ready"] else None

    def health(self) -> int | None:
        return self.d.http("/health")[0]

    def close(self) -> None:
        self.d.close()


class AloneRun:
    """vLLM started by hand: nothing restarts it, nothing cleans up after it."""

    name = "alone"
    restarts = False

    def __init__(self, py: Path, model: Path) -> None:
        self.port = free_port()
        argv, env = unit_argv_env(py, model, self.port)
        self.log = open(RESULTS / f"vllm-alone-{self.port}.log", "wb")
        self.proc = subprocess.Popen(argv, env=dict(os.environ, **env), stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def api_pid(self) -> int | None:
        return self.proc.pid if self.proc.poll() is None and vllm_health(self.port) == 200 else None

    def health(self) -> int | None:
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def supervisord_exe() -> Path:
    vdir = VENVS / "supervisor"
    exe = vdir / "bin" / "supervisord"
    if not exe.exists():
        log(f"installing supervisor into {vdir}")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(vdir)], check=True, timeout=300)
        subprocess.run([str(vdir / "bin" / "python"), "-m", "pip", "install", "-q", "supervisor"], check=True,
                       timeout=600)
    return exe


class SupervisordRun:
    name = "supervisord"
    restarts = True

    def __init__(self, py: Path, model: Path) -> None:
        self.port = free_port()
        argv, env = unit_argv_env(py, model, self.port)
        self.dir = RESULTS / f"supervisord-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        envline = ",".join(f'{k}="{v}"' for k, v in env.items())
        (self.dir / "supervisord.conf").write_text("\n".join([
            "[unix_http_server]", f"file={self.dir}/sv.sock", "",
            "[supervisord]", "nodaemon=true", f"logfile={self.dir}/supervisord.log",
            f"pidfile={self.dir}/supervisord.pid", f"childlogdir={self.dir}", "",
            "[rpcinterface:supervisor]",
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface", "",
            "[supervisorctl]", f"serverurl=unix://{self.dir}/sv.sock", "",
            "[program:vllm]", "command=" + " ".join(argv), f"environment={envline}",
            "autostart=true", "autorestart=true", "startsecs=0", "startretries=100",
            "stopsignal=TERM", "stopwaitsecs=30", "stopasgroup=true", "killasgroup=true",
            f"stdout_logfile={self.dir}/vllm.log", "redirect_stderr=true", "",
        ]))
        self.proc = subprocess.Popen([str(supervisord_exe()), "-n", "-c", str(self.dir / "supervisord.conf")],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def api_pid(self) -> int | None:
        kids = [p for p in linux.children_of(self.proc.pid) if (st := linux.read_stat(p)) and st.state != "Z"]
        return kids[0] if len(kids) == 1 and vllm_health(self.port) == 200 else None

    def health(self) -> int | None:
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


RUNS = {"omnid": OmnidRun, "alone": AloneRun, "supervisord": SupervisordRun}


# ------------------------------------------------------------------ one fault


def wait_up(run, timeout: float = START_S, not_pid: int | None = None) -> int | None:
    deadline = now() + timeout
    while now() < deadline:
        pid = run.api_pid()
        if pid and pid != not_pid and serves(run.port):
            return pid
        time.sleep(0.2)
    return None


def cleanup(tree: Tree) -> None:
    """What a fault left is the bench's own (pids it read from its own child's tree, checked
    by start time): SIGKILL it, and unlink the /dev/shm objects that tree had mapped."""
    for p in tree.left():
        linux.signal_checked(p.pid, p.start, signal.SIGKILL)


def fault(run, role: str, tree: Tree) -> dict:
    shm_before = tree.shm()
    target = {"api": tree.api, "engine": tree.engine, "worker": tree.worker}[role]
    out: dict = {"fault": "hang" if role == "hang" else f"SIGKILL {role}"}
    with Load(run.port, clients=4, max_tokens=32, timeout=WINDOW_S + HANG_WATCH_S) as load:
        deadline = now() + 60
        while load.ok_after(0) < 2 and now() < deadline:
            time.sleep(0.05)
        t0 = now()
        signal_proc(target, signal.SIGKILL)
        gone = h503 = None
        while now() - t0 < WINDOW_S:
            if h503 is None and run.health() == 503:
                h503 = now() - t0
            if gone is None and not tree.left():
                gone = now() - t0
            if gone is not None and (h503 is not None or run.health() is None):
                break
            time.sleep(0.005)
        left = tree.left()
        out.update(tree_gone_ms=None if gone is None else round(gone * 1000),
                   health_503_ms=None if h503 is None else round(h503 * 1000),
                   orphans=len(left), orphan_names=[p.comm for p in left],
                   orphan_rss_mib=round(rss_kib([p.pid for p in left]) / 1024))
        shm_left = sorted(p for p in shm_before if os.path.exists(p))
        out["shm_left"] = len(shm_left)
        out["shm_left_mib"] = round(sum(os.stat(p).st_blocks * 512 for p in shm_left if os.path.exists(p)) / 2**20, 1)
        out["shm_left_apparent_mib"] = round(sum(os.path.getsize(p) for p in shm_left if os.path.exists(p)) / 2**20)
        if run.restarts:
            new = wait_up(run, not_pid=tree.api.pid)
            out["serving_again_s"] = None if new is None else round(now() - t0, 1)
        load.stop(WINDOW_S + HANG_WATCH_S + 30)
    cleanup(tree)
    deadline = now() + 10
    while tree.left() and now() < deadline:
        time.sleep(0.01)
    for p in shm_left:  # names are random per process: a new tree never maps an old one's
        if os.path.exists(p) and not tree.left():
            os.unlink(p)
    return out


def hang(run, tree: Tree) -> dict:
    out: dict = {"fault": "hang (SIGSTOP Worker, requests in flight)"}
    with Load(run.port, clients=4, max_tokens=64, timeout=HANG_WATCH_S + 30) as load:
        deadline = now() + 60
        while not (load.ok_after(0) >= 2 and metrics(run.port).get("vllm:num_requests_running", 0) > 0) \
                and now() < deadline:
            time.sleep(0.05)
        t0 = now()
        signal_proc(tree.worker, signal.SIGSTOP)
        detected = None
        vllm_codes = set()
        while now() - t0 < HANG_WATCH_S:
            if tree.api.alive():
                vllm_codes.add(vllm_health(run.port))
            if not tree.api.alive() or (run.name == "omnid" and run.health() == 503):
                detected = now() - t0
                break
            time.sleep(0.2)
        out["detected_s"] = None if detected is None else round(detected, 1)
        out["vllm_health_meanwhile"] = sorted(str(c) for c in vllm_codes)
        if detected is None:
            # Nothing noticed: end it by hand (the bench's own tree, by pid), like an operator would.
            for p in tree.left():
                linux.signal_checked(p.pid, p.start, signal.SIGKILL)
        gone_deadline = now() + WINDOW_S
        while tree.left() and now() < gone_deadline:
            time.sleep(0.01)
        out["tree_gone_s"] = round(now() - t0, 1) if not tree.left() else None
        if run.restarts:
            new = wait_up(run, not_pid=tree.api.pid)
            out["serving_again_s"] = None if new is None else round(now() - t0, 1)
        load.stop(HANG_WATCH_S + 120)
    cleanup(tree)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="omnid,alone,supervisord")
    ap.add_argument("--faults", default="api,engine,worker,hang")
    ap.add_argument("--no-storm", action="store_true")
    a = ap.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    py = vllm_env.ensure_venv()
    model = vllm_env.ensure_model(py)
    results: dict = {"machine": f"{os.cpu_count()} CPUs, {os.uname().release}", "rows": []}
    for name in a.only.split(","):
        cls = RUNS[name]
        run = None
        for f in a.faults.split(","):
            if run is None:
                log(f"{name}: starting vLLM")
                t0 = now()
                run = cls(py, model)
                if wait_up(run) is None:
                    raise SystemExit(f"{name}: vLLM never served")
                log(f"{name}: serving after {now() - t0:.0f} s")
            tree = full_tree(wait_up(run))
            log(f"{name}: {f}")
            row = hang(run, tree) if f == "hang" else fault(run, f, tree)
            row["supervisor"] = name
            log(f"  {row}")
            results["rows"].append(row)
            if not run.restarts:
                run.close()
                run = None
        if name == "omnid" and not a.no_storm and run is not None:
            wait_up(run)
            t0 = now()
            counts = abort_storm(run.port, 300)
            t_storm = now() - t0
            deadline = now() + 60
            m = metrics(run.port)
            while (m.get("vllm:num_requests_running", 0) or m.get("vllm:num_requests_waiting", 0)) and now() < deadline:
                time.sleep(0.2)
                m = metrics(run.port)
            results["storm"] = {"requests": 300, "seconds": round(t_storm, 1), "outcomes": counts,
                                "running_after": m.get("vllm:num_requests_running"),
                                "waiting_after": m.get("vllm:num_requests_waiting")}
            log(f"  storm {results['storm']}")
        if run is not None:
            run.close()
    out = RESULTS / f"vllm-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1))
    print(table(results))
    log(f"results: {out}")
    return 0


def table(results: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v}"

    lines = ["| supervisor | fault | old tree gone (ms) | omnid /health 503 (ms) | serving again (s) | orphans "
             "(RSS MiB) | /dev/shm left (objects, MiB used / apparent) | hang detected (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if r["fault"].startswith("hang"):
            lines.append(f"| {r['supervisor']} | {r['fault']} | {ms(r.get('tree_gone_s') and r['tree_gone_s'] * 1000)}"
                         f" | - | {ms(r.get('serving_again_s'))} | - | - | "
                         f"{'never (watched %d s)' % HANG_WATCH_S if r['detected_s'] is None else r['detected_s']} |")
        else:
            lines.append(f"| {r['supervisor']} | {r['fault']} | {ms(r['tree_gone_ms']) if r['orphans'] == 0 else 'never'}"
                         f" | {ms(r['health_503_ms'])} | {ms(r.get('serving_again_s'))} | {r['orphans']} "
                         f"({r['orphan_rss_mib']}) | {r['shm_left']} ({r['shm_left_mib']} / "
                         f"{r['shm_left_apparent_mib']}) | - |")
    if "storm" in results:
        s = results["storm"]
        lines.append(f"\nAbort storm (omnid): {s['requests']} streaming requests in {s['seconds']} s: {s['outcomes']}; "
                     f"afterwards vLLM running {s['running_after']}, waiting {s['waiting_after']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
