"""Issue 25: liveness that proves forward progress, and readiness that continues
(omnid.unit(5) `liveness` http/POST and exec forms, `progress`, `ready_interval`).

Real processes: tests/engine_like.py is the unit (an HTTP server with a worker child
whose output is its "generation"), switched between behaviours through a control file;
what the server saw (requests in flight at once, the POST it got) is read from its own
stats file, and processes and fds from /proc. Each test prints what it measured."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from omnid.base import linux
from omnid.base import promtext
from omnid.core.progress import CanaryWatch, StallRule
from omnid.model.unitmodel import Progress
from tests.harness import alive, free_port, make_stack, wait_for

PY = sys.executable
ENGINE = str(Path(__file__).resolve().parent / "engine_like.py")


class Engine:
    """The control file and stats of one engine_like unit."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.port = free_port()
        self.ctl_path = tmp / "ctl.json"
        self.state: dict = {}
        self.set()

    def set(self, **kw) -> float:
        self.state.update(kw)
        tmp = self.dir / "ctl.tmp"
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.ctl_path)
        return time.monotonic()

    def exec_line(self) -> str:
        return "exec = " + json.dumps([PY, ENGINE, str(self.port), str(self.ctl_path), str(self.dir)])

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stats(self) -> dict:
        try:
            return json.loads((self.dir / "stats.json").read_text())
        except (OSError, ValueError):
            return {}

    def worker_pid(self) -> int:
        return int((self.dir / "worker.pid").read_text())


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def idle_fd_count(pid: int, window: float = 1.0) -> int:
    """The daemon's fds between probes: the fewest seen over `window` (a probe that is running
    holds a pidfd and a pipe for its output)."""
    deadline, least = time.monotonic() + window, fd_count(pid)
    while time.monotonic() < deadline:
        least = min(least, fd_count(pid))
        time.sleep(0.005)
    return least


def stays(predicate, duration: float, what: str) -> None:
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        assert predicate(), f"{what} stopped holding"
        time.sleep(0.05)


def send_signal(pid: int, sig: int) -> None:
    fd = os.pidfd_open(pid)
    try:
        signal.pidfd_send_signal(fd, sig)
    finally:
        os.close(fd)


def left_active(d, name: str, pid: int) -> dict | None:
    u = d.unit(name)
    return u if u["state"] != "active" or u["pid"] != pid else None


# ------------------------------------------------------------------ pure parts
@pytest.mark.fast
def test_prometheus_text_sums_over_labels_with_escapes_nan_and_timestamps():
    text = (
        "# HELP c_total Tokens.\n# TYPE c_total counter\n"
        'c_total{a="x \\"quoted\\" {b}, c=1",z="\\\\"} 10.5\n'
        'c_total{a="y"} 2 1700000000000\n'
        'c_created{a="y"} 1.7e9\n'
        "g{a=\"1\"} NaN\n"
        "g{a=\"2\"} 3\n"
        "h +Inf\n"
        "tok_total 7\n"
        '{"my.metric", a="1"} 4\n'
    )
    got = promtext.sums(text, ["c_total", "g", "h", "absent", "tok", "my.metric"])
    assert got == {"c_total": 12.5, "g": 3.0, "h": float("inf"), "absent": None, "tok": 7.0,
                   "my.metric": 4.0}
    with pytest.raises(promtext.MalformedExposition, match="line 2"):
        promtext.sums("ok 1\nbad{a=\"1\" 2\n", ["ok"])


@pytest.mark.fast
def test_stall_rule_fails_only_a_busy_unit_whose_counter_does_not_move():
    rule = StallRule(Progress(metrics="http://127.0.0.1:1/metrics", counter="tok", busy=("run", "wait"),
                              stall_sec=10, interval=1))
    busy = {"run": 2.0, "wait": None}
    idle = {"run": 0.0, "wait": 0.0}
    assert rule.observe(0, 5, idle) is None
    assert rule.observe(100, 5, idle) is None  # idle for ever: never failed
    assert rule.observe(101, 5, busy) is None  # busy from now: the clock starts here
    assert rule.observe(110, 5, busy) is None  # 9 s < 10 s
    why = rule.observe(111, 5, busy)
    assert why == "progress: tok stuck at 5 for 10.0 s while run = 2", why
    # a reset (the counter goes down) is progress; so is a rise
    rule = StallRule(rule.rule)
    assert rule.observe(0, 50, busy) is None
    assert rule.observe(9, 3, busy) is None
    assert rule.observe(18, 3, busy) is None
    assert rule.observe(19, 3, busy) is not None
    # a failed scrape: no progress while work was last seen waiting, nothing while idle
    rule = StallRule(rule.rule)
    assert rule.observe(0, 1, busy) is None
    assert rule.scrape_failed(5, "timed out") is None
    why = rule.scrape_failed(10, "GET x timed out")
    assert why is not None and why.endswith("; metrics unreadable (GET x timed out)"), why
    rule = StallRule(rule.rule)
    assert rule.observe(0, 1, idle) is None
    assert rule.scrape_failed(50, "refused") is None


# ------------------------------------------------------------------ liveness: POST
def test_liveness_post_sends_body_and_headers_and_fails_on_an_unexpected_status(tmp_path, daemon_factory):
    eng = Engine(tmp_path)
    body = '{"prompt": "%n", "max_tokens": 1}'
    stack = make_stack({"eng": f"""{eng.exec_line()}
ready = {{ http = "{eng.url('/health')}" }}
ready_interval = 0
liveness = {{ http = "{eng.url('/v1/completions')}", method = "POST", body = '{body}', headers = {{ "Content-Type" = "application/json", "X-Probe" = "%n" }}, expect = [200], interval = 0.3, timeout = 1, failures = 2 }}
stop_timeout = 2
"""})
    d = daemon_factory(stack)
    pid = d.wait_state("eng", "active")["pid"]
    post = wait_for(lambda: eng.stats().get("post"), 10, "the engine to get a POST")
    assert post["body"] == '{"prompt": "eng", "max_tokens": 1}', post
    assert post["headers"]["content-type"] == "application/json" and post["headers"]["x-probe"] == "eng", post
    assert post["headers"]["content-length"] == str(len(post["body"])), post
    stays(lambda: d.unit("eng")["state"] == "active", 1.0, "eng active while its POST answers 200")
    t0 = eng.set(gen="500")
    u = wait_for(lambda: left_active(d, "eng", pid), 10, "eng to fail its POST probe")
    took = time.monotonic() - t0
    u = d.wait_state("eng", "failed")
    assert f"POST {eng.url('/v1/completions')} answered 500 (expected 200)" in u["reason"], u["reason"]
    assert "EngineCore died" in u["reason"] and "(2/2)" in u["reason"], u["reason"]
    assert not alive(pid)
    # failures x (interval + answer) at most, with room for a loaded machine
    assert took < 2 * (0.3 + 1) + 2, took
    print(f"\nliveness POST: 500 -> unit failing in {took:.2f} s (failures 2, interval 0.3 s)")


# ------------------------------------------------------------------ liveness: exec
PROBE = r'''
import os, subprocess, sys, time
mode_file, log = sys.argv[1], sys.argv[2]
mode = open(mode_file).read().strip() if os.path.exists(mode_file) else "ok"
with open(log, "a") as f:
    f.write(f"{os.getpid()} {os.getpgid(0)} {os.getcwd()} {os.environ.get('PROBE_VAR')} "
            f"{os.environ.get('OMNID_PROBE')} {mode}\n")
if mode == "fail":
    print("checking the engine")
    print("engine said: no KV cache left", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    subprocess.Popen(["sleep", "1000"])  # a child in its process group, killed with it
    time.sleep(1000)
'''


def probe_pids(log: Path) -> list[tuple[int, int, str, str, str, str]]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        pid, pgid, cwd, var, tag, mode = line.split()
        out.append((int(pid), int(pgid), cwd, var, tag, mode))
    return out


def group_members(pgid: int) -> list[linux.ProcStat]:
    return [p for p in linux.scan() if p.pgid == pgid]


@pytest.mark.parametrize("mode", ["fail", "hang"])
def test_exec_probe_runs_as_the_unit_passes_on_0_and_fails_or_is_killed_and_reaped(tmp_path, daemon_factory, mode):
    eng = Engine(tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    mode_file, log = tmp_path / "mode", tmp_path / "probes.log"
    work = tmp_path / "work"
    work.mkdir()
    stack = make_stack({"eng": f"""{eng.exec_line()}
cwd = "{work}"
env = {{ PROBE_VAR = "from-the-unit" }}
ready = {{ http = "{eng.url('/health')}" }}
ready_interval = 0
liveness = {{ exec = ["python3", "{probe}", "{mode_file}", "{log}"], interval = 0.2, timeout = 0.8, failures = 2 }}
stop_timeout = 2
"""})
    d = daemon_factory(stack)
    pid = d.wait_state("eng", "active")["pid"]
    wait_for(lambda: len(probe_pids(log)) >= 3, 15, "three probes to have run")
    fds = idle_fd_count(d.pid)
    n = len(probe_pids(log))
    wait_for(lambda: len(probe_pids(log)) >= n + 8, 20, "eight more probes")
    assert d.unit("eng")["state"] == "active" and d.unit("eng")["pid"] == pid
    # every probe ran as the unit: its cwd, its environment, its own process group; none is left
    for ppid, pgid, cwd, var, tag, _ in probe_pids(log):
        assert (cwd, var, tag) == (str(work), "from-the-unit", "liveness") and pgid == ppid
    # no pidfd or pipe kept: a probe running now holds two, so wait for a moment between probes
    wait_for(lambda: fd_count(d.pid) <= fds, 5,
             lambda: f"the daemon's fds back to {fds} between probes: {os.listdir(f'/proc/{d.pid}/fd')}")
    # no probe left but the one that may be running now (zombies count: read_stat sees them)
    assert not [p for p, *_ in probe_pids(log)[:-1] if linux.read_stat(p) is not None and
                linux.read_environ_var(p, "OMNID_PROBE")]
    t0 = time.monotonic()
    mode_file.write_text(mode)
    u = wait_for(lambda: left_active(d, "eng", pid), 15, "eng to fail its exec probe")
    took = time.monotonic() - t0
    u = d.wait_state("eng", "failed")
    if mode == "fail":
        assert "exited with code 3: checking the engine | engine said: no KV cache left (2/2)" in u["reason"], u["reason"]
        assert took < 2 * 0.2 + 2 + 2, took
    else:
        assert "timed out after 0.8 s (killed)" in u["reason"], u["reason"]
        assert took < 2 * (0.2 + 0.8) + 2 + 2, took
    hung = [(p, g) for p, g, *_, m in probe_pids(log) if m == mode]
    assert hung
    # the killed probes and their process groups are gone, reaped (no zombie) by the spawner
    for p, g in hung:
        wait_for(lambda: linux.read_stat(p) is None and not group_members(g), 5,
                 f"probe {p} and its group to be gone and reaped")
    wait_for(lambda: fd_count(d.pid) <= fds, 5, "the daemon's fds back to before the probes")
    print(f"\nexec probe ({mode}): unit failing {took:.2f} s after the probe began to {mode} "
          f"(failures 2, interval 0.2 s, timeout 0.8 s)")


# ------------------------------------------------------------------ progress
def progress_unit(eng: Engine, stall: float, interval: float, canary: str = "") -> str:
    extra = f", canary = {{ http = \"{canary}\", body = '{{\"prompt\": \"%n\", \"max_tokens\": 1}}' }}" if canary else ""
    return f"""{eng.exec_line()}
ready = {{ http = "{eng.url('/health')}" }}
ready_interval = 0
progress = {{ metrics = "{eng.url('/metrics')}", counter = "vllm:generation_tokens_total", busy = ["vllm:num_requests_running", "vllm:num_requests_waiting"], stall_sec = {stall}, interval = {interval}{extra} }}
restart = "on-failure"
restart_sec = 0.2
stop_timeout = 3
capture_timeout = 3
"""


def test_progress_never_fails_an_idle_engine_and_a_counter_reset_is_progress(tmp_path, daemon_factory):
    eng = Engine(tmp_path)
    d = daemon_factory(make_stack({"eng": progress_unit(eng, stall=1.0, interval=0.25)}))
    pid = d.wait_state("eng", "active")["pid"]
    worker = eng.worker_pid()
    active = lambda: d.unit("eng")["state"] == "active" and d.unit("eng")["pid"] == pid  # noqa: E731
    # idle (busy 0), its worker stopped: the counter does not move, and nothing waits for it
    send_signal(worker, signal.SIGSTOP)
    stays(active, 3.0, "an idle engine with a stopped worker stays active")
    send_signal(worker, signal.SIGCONT)
    eng.set(busy=2)
    stays(active, 2.0, "a busy engine whose counter moves stays active")
    for k in range(4):  # the counter drops to 0 again and again: a reset each time, progress
        eng.set(reset=k)
        time.sleep(0.4)
        assert active()
    n = eng.stats()["requests"].get("/metrics", 0)
    assert n >= 20, f"only {n} scrapes"
    eng.set(busy=0)


def test_progress_catches_a_stopped_worker_behind_a_200_captures_kills_and_restarts(tmp_path, daemon_factory):
    eng = Engine(tmp_path)
    stall, interval = 2.0, 0.5
    d = daemon_factory(make_stack({"eng": progress_unit(eng, stall=stall, interval=interval)}))
    pid = d.wait_state("eng", "active")["pid"]
    worker = eng.worker_pid()
    eng.set(busy=3)
    time.sleep(interval * 3)
    t0 = time.monotonic()
    send_signal(worker, signal.SIGSTOP)
    code, _ = d.http("/health")
    assert code == 200  # what a hang looks like from outside: /health says nothing
    u = wait_for(lambda: left_active(d, "eng", pid), stall + interval + 10, "the stall to be caught")
    took = time.monotonic() - t0
    assert stall - interval - 0.1 <= took <= stall + interval + 2.0, took  # bound, with room for load
    u = wait_for(lambda: (x := d.unit("eng"))["pid"] not in (None, pid) and x["state"] == "active" and x,
                 30, "eng restarted and serving")
    back = time.monotonic() - t0
    assert not alive(pid) and not alive(worker)
    caps = d.ok("dump", {"unit": "eng"})["captures"]
    assert caps, "no capture kept"
    text = caps[-1]["text"]
    # the dump names why (the stall) and the stopped worker
    assert "progress: vllm:generation_tokens_total stuck at" in text and "vllm:num_requests_running = 3" in text, text[:3000]
    assert f"pid {worker} T" in text or f"pid {worker} (" in text, text[:3000]
    print("\n" + "\n".join(text.splitlines()[:12]))
    print(f"\nprogress: SIGSTOP of the worker (busy 3) -> caught in {took:.2f} s (stall_sec {stall}, interval "
          f"{interval}); restarted and active again after {back:.2f} s")


@pytest.mark.fast
def test_canary_watch_blames_only_an_accepted_unanswered_canary_with_a_flat_counter_and_live_metrics():
    """The canary's decision, pure: when it goes out, and when its end proves a hang."""
    w = CanaryWatch(stall_sec=10)
    w.observe(0, busy=True)
    assert not w.due(100)  # busy: the stall rule's business
    w.observe(100, busy=False)
    assert not w.due(109) and w.due(110)  # idle for stall_sec first
    w.sent(110, counter=5)
    assert not w.due(200)  # one at a time
    w.observe(115, busy=False)  # the metrics answered while it was out
    assert w.ended(120, hung=True, counter=5)  # accepted, no answer, no token: hung
    assert not w.due(125) and w.due(130)  # the idle clock starts again at its end
    # answered, refused or failed early: nothing judged
    w.sent(130, counter=5)
    w.observe(131, busy=False)
    assert not w.ended(132, hung=False, counter=5)
    # a token came while it was out: progress
    w.sent(142, counter=5)
    w.observe(143, busy=False)
    assert not w.ended(152, hung=True, counter=6)
    # the metrics page stopped answering too: the server in front is down, not the engine
    w.sent(162, counter=6)
    assert not w.ended(172, hung=True, counter=6)
    # a counter not in the page (a misspelt name): nothing is judged, as for the rule itself
    w.sent(182, counter=None)
    w.observe(183, busy=False)
    assert not w.ended(192, hung=True, counter=None)


def test_progress_canary_catches_an_engine_hung_while_idle_and_a_refused_canary_judges_nothing(
        tmp_path, daemon_factory):
    """Idle, the gauges say 0 for ever: the canary (a one-token POST, %n expanded) is what
    sees an engine that hangs then. A canary refused (nobody listens) fails nothing."""
    (tmp_path / "eng").mkdir()
    (tmp_path / "other").mkdir()
    eng, other = Engine(tmp_path / "eng"), Engine(tmp_path / "other")
    stall, interval = 1.0, 0.25
    d = daemon_factory(make_stack({
        "eng": progress_unit(eng, stall=stall, interval=interval, canary=eng.url("/v1/completions")),
        "other": progress_unit(other, stall=stall, interval=interval,
                               canary=f"http://127.0.0.1:{free_port()}/v1/completions")}))
    pid = d.wait_state("eng", "active")["pid"]
    other_pid = d.wait_state("other", "active")["pid"]
    wait_for(lambda: eng.stats()["requests"].get("/v1/completions", 0) >= 3, 15, "three canaries answered")
    assert d.unit("eng")["state"] == "active" and d.unit("eng")["pid"] == pid
    post = eng.stats()["post"]
    assert json.loads(post["body"]) == {"prompt": "eng", "max_tokens": 1}, post
    t0 = eng.set(gen="hang")  # the engine accepts work and never answers; its metrics still do
    u = wait_for(lambda: left_active(d, "eng", pid), 2 * (stall + interval) + 10, "the canary to catch the hang")
    took = time.monotonic() - t0
    eng.set(gen="ok")
    assert u["reason"].startswith("progress: canary POST " + eng.url("/v1/completions") + " timed out after 1 s"), u
    assert "vllm:generation_tokens_total stayed at" in u["reason"], u
    assert took <= 2 * (stall + interval) + 5, took  # idle stall_sec, then stall_sec for the answer; room for load
    assert d.unit("other")["state"] == "active" and d.unit("other")["pid"] == other_pid, d.unit("other")
    print(f"\nprogress canary: an engine hung while idle caught {took:.2f} s after the hang "
          f"(stall_sec {stall}, interval {interval}); a refused canary failed nothing")


# ------------------------------------------------------------------ readiness that continues
def health_of(d, name: str) -> tuple[int, str, str]:
    code, body = d.http("/health")
    return code, body.get("status", ""), body.get("units", {}).get(name, {}).get("reason", "")


def test_readiness_continues_degraded_while_not_ready_then_ok_same_process(tmp_path, daemon_factory):
    eng = Engine(tmp_path)
    every = 0.5
    d = daemon_factory(make_stack({"eng": f"""{eng.exec_line()}
ready = {{ http = "{eng.url('/ready')}" }}
ready_interval = {every}
stop_timeout = 2
"""}))
    pid = d.wait_state("eng", "active")["pid"]
    wait_for(lambda: health_of(d, "eng")[0] == 200, 10, "/health 200")
    bound = every * 1.1 + 2.0  # one jittered interval and one probe's timeout

    def flip(to_code: int, **ctl) -> float:
        t0 = eng.set(**ctl)
        wait_for(lambda: health_of(d, "eng")[0] == to_code, bound + 3, f"/health {to_code}")
        return time.monotonic() - t0

    down = flip(503, ready=503)
    code, status, reason = health_of(d, "eng")
    assert (code, status) == (503, "degraded")
    assert reason == f"not ready: GET {eng.url('/ready')} answered 503", reason
    u = d.unit("eng")
    assert u["state"] == "active" and u["pid"] == pid and u["ready"] is False, u
    assert u["reason"] == reason and u["degraded"] == reason, u
    metrics = d.http("/metrics")[1]
    assert 'omnid_unit_ready{unit="eng"} 0' in metrics, metrics[:500]
    up = flip(200, ready=200)
    u = d.unit("eng")
    assert u["state"] == "active" and u["pid"] == pid and u["ready"] is True and u["reason"] == "ready", u
    assert health_of(d, "eng")[1] == "ok"
    # a probe that hangs: not ready after its 2 s bound; never two probes in flight
    before = eng.stats()["requests"].get("/ready", 0)
    hung = flip(503, ready="hang")
    assert "timed out after 2 s" in health_of(d, "eng")[2]
    wait_for(lambda: eng.stats()["requests"].get("/ready", 0) >= before + 4, 20, "four hung probes")
    assert eng.stats()["max_inflight"]["/ready"] == 1, eng.stats()
    back = flip(200, ready=200)
    assert d.unit("eng")["pid"] == pid and alive(pid)
    assert max(down, up) <= bound + 0.5, (down, up)
    print(f"\nreadiness (ready_interval {every}): 200->503 degraded in {down:.2f} s, 503->200 in {up:.2f} s; "
          f"a hanging probe -> degraded in {hung:.2f} s, back in {back:.2f} s; at most 1 probe in flight")


def test_probes_go_on_across_a_reload_and_a_reexec_of_the_daemon(tmp_path, daemon_factory):
    import subprocess

    from tests.harness import REPO, repo_pythonpath

    eng = Engine(tmp_path)
    unit = f"""{eng.exec_line()}
ready = {{ http = "{eng.url('/ready')}" }}
ready_interval = 0.3
progress = {{ metrics = "{eng.url('/metrics')}", counter = "vllm:generation_tokens_total", busy = ["vllm:num_requests_running"], stall_sec = 3, interval = 0.25 }}
stop_timeout = 2
"""
    stack = make_stack({"eng": unit})
    # the re-executed program runs with -P: it must find this checkout's omnid by PYTHONPATH
    d = daemon_factory(stack, env={"PYTHONPATH": repo_pythonpath()})
    pid = d.wait_state("eng", "active")["pid"]
    eng.set(busy=1)

    def scrapes_go_on(what: str) -> None:
        n = eng.stats()["requests"].get("/metrics", 0)
        wait_for(lambda: eng.stats()["requests"].get("/metrics", 0) >= n + 3, 10,
                 f"scrapes after the {what}: {eng.stats()}, {d.unit('eng')}")

    def flips(what: str) -> None:
        eng.set(ready=503)
        wait_for(lambda: health_of(d, "eng")[1] == "degraded", 10, f"degraded after the {what}")
        eng.set(ready=200)
        wait_for(lambda: health_of(d, "eng")[0] == 200, 10, f"ok after the {what}")

    # not ready across the re-exec: still degraded after it, ready again when the engine is
    eng.set(ready=503)
    wait_for(lambda: health_of(d, "eng")[1] == "degraded", 10, "degraded before the re-exec")
    d.reexec()
    assert d.unit("eng")["pid"] == pid
    code, status, reason = health_of(d, "eng")
    assert (code, status) == (503, "degraded") and reason.startswith("not ready: "), (code, status, reason)
    eng.set(ready=200)
    wait_for(lambda: health_of(d, "eng")[0] == 200, 10, "ok after the re-exec")
    u = d.unit("eng")
    assert u["ready"] is True and u["reason"] == "ready", u
    scrapes_go_on("re-exec")
    flips("re-exec")
    (stack / "eng.toml").write_text(unit.replace("stall_sec = 3", "stall_sec = 4").replace("0.3\n", "0.4\n"))
    r = subprocess.run([PY, "-m", "omnid", "--control", d.control, "reload"], capture_output=True, text=True,
                       timeout=60, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=repo_pythonpath()))
    assert r.returncode == 0 and "updated" in r.stdout, r.stdout + r.stderr
    assert d.unit("eng")["pid"] == pid
    scrapes_go_on("reload")
    flips("reload")
    # one scrape in flight at a time, and one monitor: not two after the restarts
    assert eng.stats()["max_inflight"]["/metrics"] == 1 and eng.stats()["max_inflight"]["/ready"] == 1
    eng.set(busy=0)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_exec_probe_runs_as_the_units_user_and_group(tmp_path, daemon_factory):
    import pwd

    nobody = pwd.getpwnam("nobody")
    from tests.harness import temp_dir

    out = temp_dir("omprobe-")  # pytest's own directories are root's alone
    out.chmod(0o777)
    # (the test's Python lives under /root, out of nobody's reach: the probe is sh, as a user may write)
    d = daemon_factory(make_stack({"eng": f"""exec = ["sleep", "1000"]
user = "nobody"
liveness = {{ exec = ["sh", "-c", "echo $(id -u) $(id -g) >> {out / 'ids'}"], interval = 0.2, timeout = 5, failures = 1 }}
stop_timeout = 2
"""}))
    pid = d.wait_state("eng", "active")["pid"]
    ids = wait_for(lambda: (out / "ids").exists() and (out / "ids").read_text().split(), 15, "a probe to run")
    assert ids[:2] == [str(nobody.pw_uid), str(nobody.pw_gid)], ids
    assert d.unit("eng")["state"] == "active" and d.unit("eng")["pid"] == pid
