"""Real vLLM (CPU build, tiny local model) under omnid (one instance, and two instances on
one held socket), alone, and under supervisord: what each fault costs. Run by hand from the
repository root:

    .venv/bin/python -m bench.vllm_faults [--only omnid,omnid2,alone,supervisord] [--faults ...]

Per fault (SIGKILL of the API server, EngineCore, Worker; the Worker hung by SIGSTOP; `stop`,
the supervisor's own stop under load): time until every process of the old tree is gone,
until omnid's /health says 503, until the first successful completion again; what the 4
clients sending completions back to back felt from the fault to serving again: requests
failed (an error status, fewer tokens, a reset; the ones in flight at the fault included)
and connections refused (a refused client tries again after 50 ms); at the end of the
observation window the processes of the old tree still there (orphans), the memory they hold
(RSS) and the /dev/shm objects of the old tree left. With two instances the fault hits
instance 0 (vllm@0) and the survivor keeps serving. Then an abort storm under omnid.
Results: bench/results/vllm-<time>.json and a Markdown table on stdout, with the load average.

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

from omnid.base import linux  # noqa: E402
from tests.engines import vllm_env  # noqa: E402
from tests.engines.vllm_stack import (Load, Tree, abort_storm, full_tree, metrics, port_with_free_probes,  # noqa: E402
                                      serves, signal_proc, unit_toml, vllm_health)
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
    """The argv and environment of the omnid unit, for the runs without omnid: vLLM binding
    its port itself, as it is run without a supervisor that holds it (no launcher)."""
    import tomllib

    u = tomllib.loads(unit_toml(py, model, port, held_socket=False))
    return u["exec"], u["env"]


# ------------------------------------------------------------------ the three ways to run it


class OmnidRun:
    """`omnid example vllm`'s unit: vLLM on a socket omnid holds (issue 35)."""

    name = "omnid"
    restarts = True
    instances = 1

    def __init__(self, py: Path, model: Path) -> None:
        self.port = port_with_free_probes(self.instances) if self.instances > 1 else free_port()
        stack = make_stack({"vllm": unit_toml(py, model, self.port, stall_sec=STALL_SEC, instances=self.instances)})
        self.units = [f"vllm@{i}" for i in range(self.instances)] if self.instances > 1 else ["vllm"]
        self.d = Daemon(stack, env={"OMNID_TEST_CGROUP": "1", "INVOCATION_ID": ""}).start()

    def api_pid(self) -> int | None:
        """The faulted instance's API server, once every instance is ready."""
        us = [self.d.unit(n) for n in self.units]
        return us[0]["pid"] if all(u["state"] == "active" and u["ready"] for u in us) else None

    def health(self) -> int | None:
        return self.d.http("/health")[0]

    def stop(self) -> None:
        self.d.ok("stop", {"units": self.units}, timeout=180)

    def close(self) -> None:
        self.d.close()


class OmnidTwoRun(OmnidRun):
    """Two instances of the unit on one held socket; faults hit vllm@0."""

    name = "omnid2"
    instances = 2


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

    def stop(self) -> None:
        """What a user does: SIGTERM to the API server, then wait for it."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(180)

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

    def stop(self) -> None:
        ctl = supervisord_exe().parent / "supervisorctl"
        subprocess.run([str(ctl), "-c", str(self.dir / "supervisord.conf"), "stop", "vllm"], check=True,
                       timeout=180, stdout=subprocess.DEVNULL)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


RUNS = {"omnid": OmnidRun, "omnid2": OmnidTwoRun, "alone": AloneRun, "supervisord": SupervisordRun}


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


def felt(load: Load, t0: float, t1: float | None) -> dict:
    """What the clients felt from the fault at t0 to serving again at t1 (the end of the
    load without one): requests failed (those in flight at t0 included) and refused."""
    end = now() if t1 is None else t1
    refused = answered = 0
    failed: dict[str, int] = {}  # by outcome: an HTTP status, short (200 with fewer tokens), an exception
    for s, e, outcome, tokens in load.snapshot():
        if e < t0 or s > end:
            continue
        if outcome in ("ConnectionRefusedError",):
            refused += 1
        elif outcome == 200 and tokens == load.max_tokens:
            answered += 1
        else:
            key = "short" if outcome == 200 else str(outcome)
            failed[key] = failed.get(key, 0) + 1
    return {"requests_failed": sum(failed.values()), "failed_by": failed, "connections_refused": refused,
            "answered_meanwhile": answered}


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
        t1 = None
        if run.restarts:
            new = wait_up(run, not_pid=tree.api.pid)
            t1 = None if new is None else now()
            out["serving_again_s"] = None if new is None else round(t1 - t0, 1)
        # Read once the old tree's supervisor has had its chance (omnid removes a dead tree's
        # IPC after the tree is gone, within a second): serving again, or the window's end.
        while now() - t0 < WINDOW_S and not run.restarts:
            time.sleep(0.1)
        shm_left = sorted(p for p in shm_before if os.path.exists(p))
        out["shm_left"] = len(shm_left)
        out["shm_left_mib"] = round(sum(os.stat(p).st_blocks * 512 for p in shm_left if os.path.exists(p)) / 2**20, 1)
        out["shm_left_apparent_mib"] = round(sum(os.path.getsize(p) for p in shm_left if os.path.exists(p)) / 2**20)
        load.stop(WINDOW_S + HANG_WATCH_S + 30)
        out.update(felt(load, t0, t1))
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
        t1 = None
        if run.restarts:
            new = wait_up(run, not_pid=tree.api.pid)
            t1 = None if new is None else now()
            out["serving_again_s"] = None if new is None else round(t1 - t0, 1)
        load.stop(HANG_WATCH_S + 120)
        out.update(felt(load, t0, t1))
    cleanup(tree)
    return out


def stop_under_load(run, tree: Tree) -> dict:
    """The supervisor's own stop (omnid stop of the unit(s), supervisorctl stop, SIGTERM to
    vLLM alone) while 4 clients send 64-token completions: the requests in flight at the
    stop, answered in full or failed, and how long the stop took."""
    out: dict = {"fault": "stop under load"}
    with Load(run.port, clients=4, max_tokens=64, timeout=120) as load:
        deadline = now() + 60
        while not (load.ok_after(0) >= 2 and metrics(run.port).get("vllm:num_requests_running", 0) > 0) \
                and now() < deadline:
            time.sleep(0.05)
        load._stop.set()  # no client sends another: what is in flight now is what the stop meets
        t0 = now()
        run.stop()
        out["stop_s"] = round(now() - t0, 1)
        load.stop(150)
    in_flight = [r for r in load.snapshot() if r[0] < t0 < r[1]]
    out["in_flight"] = len(in_flight)
    out["in_flight_answered"] = sum(1 for _s, _e, o, n in in_flight if o == 200 and n == 64)
    out["requests_failed"] = out["in_flight"] - out["in_flight_answered"]
    gone_deadline = now() + WINDOW_S
    while tree.left() and now() < gone_deadline:
        time.sleep(0.05)
    out["orphans"] = len(tree.left())
    cleanup(tree)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="omnid,omnid2,alone,supervisord")
    ap.add_argument("--faults", default="api,engine,worker,hang,stop", help="stop comes last in a run (it ends it)")
    ap.add_argument("--no-storm", action="store_true")
    a = ap.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    py = vllm_env.ensure_venv()
    model = vllm_env.ensure_model(py)
    results: dict = {"machine": f"{os.cpu_count()} CPUs, {os.uname().release}", "rows": [],
                     "load_before": os.getloadavg()}
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
            if f == "stop":
                row = stop_under_load(run, tree)
            else:
                row = hang(run, tree) if f == "hang" else fault(run, f, tree)
            row["supervisor"] = name
            row["load_1min"] = round(os.getloadavg()[0], 1)
            log(f"  {row}")
            results["rows"].append(row)
            if not run.restarts or f == "stop":
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
    results["load_after"] = os.getloadavg()
    out = RESULTS / f"vllm-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1))
    print(table(results))
    log(f"results: {out}")
    return 0


def table(results: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v}"

    lines = ["| supervisor | fault | old tree gone (ms) | omnid /health 503 (ms) | serving again (s) | requests "
             "failed | connections refused | orphans (RSS MiB) | /dev/shm left (objects, MiB used / apparent) | "
             "hang detected (s) | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        load = r.get("load_1min", "-")
        if r["fault"] == "stop under load":
            lines.append(f"| {r['supervisor']} | stop under load (took {r['stop_s']} s) | - | - | - | "
                         f"{r['requests_failed']} of {r['in_flight']} in flight | - | {r['orphans']} | - | - | {load} |")
        elif r["fault"].startswith("hang"):
            lines.append(f"| {r['supervisor']} | {r['fault']} | {ms(r.get('tree_gone_s') and r['tree_gone_s'] * 1000)}"
                         f" | - | {ms(r.get('serving_again_s'))} | {r.get('requests_failed', '-')} | "
                         f"{r.get('connections_refused', '-')} | - | - | "
                         f"{'never (watched %d s)' % HANG_WATCH_S if r['detected_s'] is None else r['detected_s']} "
                         f"| {load} |")
        else:
            lines.append(f"| {r['supervisor']} | {r['fault']} | {ms(r['tree_gone_ms']) if r['orphans'] == 0 else 'never'}"
                         f" | {ms(r['health_503_ms'])} | {ms(r.get('serving_again_s'))} | {r['requests_failed']} | "
                         f"{r['connections_refused']} | {r['orphans']} "
                         f"({r['orphan_rss_mib']}) | {r['shm_left']} ({r['shm_left_mib']} / "
                         f"{r['shm_left_apparent_mib']}) | - | {load} |")
    if "storm" in results:
        s = results["storm"]
        lines.append(f"\nAbort storm (omnid): {s['requests']} streaming requests in {s['seconds']} s: {s['outcomes']}; "
                     f"afterwards vLLM running {s['running_after']}, waiting {s['waiting_after']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
