"""Issue 3 behaviours (the failure matrix, omnid(8) "Failure detection and
propagation") on a small stack of test programs: real processes, signalled by the
pids omnid reports, checked against /proc, the health HTTP API and the event stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time

import pytest

from omnid.base import linux
from tests.harness import alive, free_port, make_stack, wait_for

PY = sys.executable

# One test program for every unit of these tests; what it does is chosen by flags.
PROG = r'''
import argparse, os, signal, socket, subprocess, sys, threading, time

ap = argparse.ArgumentParser()
ap.add_argument("--record")          # append "UNIT TERM t" / "UNIT EXIT t" (CLOCK_MONOTONIC) on SIGTERM
ap.add_argument("--delay", type=float, default=0.1)
ap.add_argument("--notify", action="store_true")
ap.add_argument("--status")
ap.add_argument("--watchdog", type=float, default=0.0)
ap.add_argument("--children")        # spawn children, append "MAIN GROUPCHILD ESCAPED" pids to this file
ap.add_argument("--http", type=int, default=0)
ap.add_argument("--trigger")         # file: "500" -> answer 500; "hang" -> stop answering
a = ap.parse_args()
unit = os.environ["OMNID_UNIT"]

def notify(msg):
    addr = os.environ["NOTIFY_SOCKET"]
    addr = "\0" + addr[1:] if addr.startswith("@") else addr
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(msg.encode(), addr)

if a.record:
    def term(*_):
        with open(a.record, "a") as f:
            f.write(f"{unit} TERM {time.monotonic()}\n")
        time.sleep(a.delay)
        with open(a.record, "a") as f:
            f.write(f"{unit} EXIT {time.monotonic()}\n")
        os._exit(0)
    signal.signal(signal.SIGTERM, term)

if a.children:
    # One child in the unit's process group, one escaped into its own session.
    group_child = subprocess.Popen(["sleep", "1000"])
    escaped = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    with open(a.children, "a") as f:
        f.write(f"{os.getpid()} {group_child.pid} {escaped.pid}\n")

if a.http:
    import http.server

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            mode = ""
            if a.trigger and os.path.exists(a.trigger):
                with open(a.trigger) as f:
                    mode = f.read().strip()
            if mode == "hang":
                while True:
                    time.sleep(3600)
            code = 500 if mode == "500" else 200
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", a.http), H).serve_forever()

if a.watchdog:
    def ping():
        while True:
            notify("WATCHDOG=1")
            time.sleep(a.watchdog)
    threading.Thread(target=ping, daemon=True).start()

if a.notify:
    notify("READY=1" + (f"\nSTATUS={a.status}" if a.status else ""))
while True:
    time.sleep(3600)
'''


# ---------------------------------------------------------------------- helpers
def write_prog(tmp) -> str:
    p = tmp / "prog.py"
    p.write_text(PROG)
    return str(p)


def exec_line(prog: str, *args: str) -> str:
    return "exec = " + json.dumps([PY, prog, *args])


def send_signal(pid: int, sig: int) -> None:
    """Signal a pid read from omnid's status, through a pidfd (never a recycled pid)."""
    fd = os.pidfd_open(pid)
    try:
        signal.pidfd_send_signal(fd, sig)
    finally:
        os.close(fd)


def stays(predicate, duration: float, what: str, interval: float = 0.05) -> None:
    """Assert that a condition holds for the whole of `duration` (stability, not waiting)."""
    deadline = time.monotonic() + duration
    while True:
        value = predicate()
        assert value, f"{what} stopped holding"
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)


def read_record(path) -> dict[tuple[str, str], float]:
    """First TERM / EXIT time of each unit in a recorder file."""
    out: dict[tuple[str, str], float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        unit, what, t = line.split()
        out.setdefault((unit, what), float(t))
    return out


def unit_processes(test_id: str, unit: str) -> list[int]:
    """Live processes in /proc tagged with this test and this unit (the residue a kernel sees)."""
    out = []
    for st in linux.scan():
        if st.state in ("Z", "X"):
            continue
        if (linux.read_environ_var(st.pid, "OMNID_TEST_ID") == test_id
                and linux.read_environ_var(st.pid, "OMNID_UNIT") == unit):
            out.append(st.pid)
    return out


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / linux.CLK_TCK  # utime + stime


def health_names(d, unit: str, *words: str):
    """/health is 503 and the unit's entry is failed with a reason containing every word."""
    code, body = d.http("/health")
    if code != 503 or not isinstance(body, dict):
        return None
    entry = body["units"].get(unit, {})
    if entry.get("state") == "failed" and all(w in entry.get("reason", "") for w in words):
        return body
    return None


@contextlib.contextmanager
def subscribed(d):
    """A SUB socket on the daemon's event stream, proven live (the daemon counted it)."""
    sub = d.events_socket()
    try:
        yield sub
    finally:
        sub.close(0)


def collect(sub, until, timeout: float, what: str) -> list[dict]:
    """Receive events until `until(events)` is true."""
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    while not until(events):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for {what}; events: {events}")
        if sub.poll(min(left, 0.5) * 1000):
            events.append(json.loads(sub.recv()))
    return events


def three_tier(tmp, restart: str, restart_sec: float = 0.2):
    """worker@0, worker@1 <- engine <- serve (requires). Workers die on SIGTERM like
    any program without a handler; engine and serve record their SIGTERM."""
    prog = write_prog(tmp)
    rec = tmp / "record.txt"
    common = f'ready = "notify"\nrestart = "{restart}"\nrestart_sec = {restart_sec}\nstop_timeout = 5\n'
    stack = make_stack({
        "worker": f'{exec_line(prog, "--notify")}\n{common}instances = 2\nrole = "worker"\n',
        "engine": f'{exec_line(prog, "--notify", "--record", str(rec))}\n{common}'
                  f'requires = ["worker"]\nrole = "engine"\n',
        "serve": f'{exec_line(prog, "--notify", "--record", str(rec))}\n{common}'
                 f'requires = ["engine"]\nrole = "serve"\n',
    })
    return stack, rec


def kill_and_time_503(d, pid: int, sig: int) -> float:
    """Signal a unit's main process; return the seconds until /health first answered 503."""
    t0 = time.monotonic()
    send_signal(pid, sig)
    wait_for(lambda: d.http("/health")[0] == 503, 10, "/health 503 after the death")
    latency = time.monotonic() - t0
    print(f"\n[{linux.signal_name(sig)}] death -> /health 503: {latency * 1000:.1f} ms")
    return latency


# ----------------------------------------------------------- FM-01 / FM-02
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_fm01_fm02_signalled_worker_fails_and_dependents_stop_in_order(tmp_path, daemon_factory, sig):
    stack, rec = three_tier(tmp_path, restart="no")
    d = daemon_factory(stack)
    before = d.wait_all_active()
    victim = before["worker@0"]["pid"]

    kill_and_time_503(d, victim, sig)
    sig_name = linux.signal_name(sig)
    w = d.wait_state("worker@0", "failed")
    assert w["reason"].startswith(f"killed by {sig_name} (pid {victim}"), w["reason"]
    assert w["last_signal"] == sig_name
    assert not alive(victim)

    # Dependents stopped, serve before engine: the engine got SIGTERM only after the serve exited.
    for name in ("serve", "engine"):
        u = d.wait_state(name, "inactive")
        assert "requires" in u["reason"], u["reason"]
        assert not alive(before[name]["pid"])
    assert "worker@0" in d.unit("engine")["reason"]
    t = read_record(rec)
    assert t[("serve", "EXIT")] <= t[("engine", "TERM")], t
    # The other worker does not require anything that failed: untouched.
    other = d.unit("worker@1")
    assert other["state"] == "active" and other["pid"] == before["worker@1"]["pid"]

    # /health: 503 naming the worker and the signal.
    body = wait_for(lambda: health_names(d, "worker@0", sig_name), 5, "/health naming worker@0 and the signal")
    assert body["status"] == "failed"

    # restart = "no": stable. Still 503 and failed well after a restart would have happened.
    def still_failed():
        u = d.unit("worker@0")
        return (health_names(d, "worker@0", sig_name) and u["state"] == "failed" and u["pid"] is None
                and u["restarts"] == 0 and d.unit("serve")["state"] == "inactive")

    stays(still_failed, 2 * 0.2 + 0.3, "worker@0 failed and /health 503")
    assert unit_processes(os.environ["OMNID_TEST_ID"], "worker@0") == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_fm01_fm02_signalled_worker_with_on_failure_brings_stack_back_by_itself(tmp_path, daemon_factory, sig):
    stack, rec = three_tier(tmp_path, restart="on-failure", restart_sec=0.2)
    d = daemon_factory(stack)
    before = d.wait_all_active()
    victim = before["worker@0"]["pid"]

    kill_and_time_503(d, victim, sig)
    # Back to 200 by itself, every unit on a new process where it had to be restarted.
    wait_for(lambda: d.http("/health")[0] == 200 and d.units()["serve"]["pid"] != before["serve"]["pid"], 20,
             "/health 200 again with a new serve")
    after = d.wait_all_active()
    w = after["worker@0"]
    assert w["pid"] != victim and alive(w["pid"])
    assert w["restarts"] == 1
    assert w["last_exit"].startswith(f"killed by {linux.signal_name(sig)}"), w["last_exit"]
    for name in ("engine", "serve"):
        assert after[name]["pid"] != before[name]["pid"], name  # stopped because of the worker, started again
        assert not alive(before[name]["pid"])
    assert after["worker@1"]["pid"] == before["worker@1"]["pid"]
    t = read_record(rec)
    assert t[("serve", "EXIT")] <= t[("engine", "TERM")], t
    assert not alive(victim)


# ---------------------------------------------------- FM-03 / FM-04 / FM-05
@pytest.mark.parametrize("sig,restart", [(signal.SIGKILL, "no"), (signal.SIGTERM, "on-failure"),
                                         (signal.SIGINT, "on-failure")],
                         ids=["SIGKILL-no", "SIGTERM-on-failure", "SIGINT-on-failure"])
def test_fm03_fm04_fm05_signalled_serve_fails_with_its_children_and_leaves_no_residue(
        tmp_path, daemon_factory, no_leaks, sig, restart):
    prog = write_prog(tmp_path)
    kids = tmp_path / "children.txt"
    stack = make_stack({
        "engine": f'{exec_line(prog, "--notify")}\nready = "notify"\n',
        "serve": f'{exec_line(prog, "--notify", "--children", str(kids))}\nready = "notify"\n'
                 f'requires = ["engine"]\nrestart = "{restart}"\nrestart_sec = 0.2\n',
    })
    d = daemon_factory(stack)
    before = d.wait_all_active()
    serve_pid = before["serve"]["pid"]
    main, group_child, escaped = (int(x) for x in kids.read_text().split("\n")[0].split())
    assert main == serve_pid
    assert alive(group_child) and alive(escaped)

    kill_and_time_503(d, serve_pid, sig)
    sig_name = linux.signal_name(sig)
    # Wait until the failure is recorded (with on-failure the serve is already on its way back).
    u = wait_for(lambda: (s := d.unit("serve"))["last_exit"] and s, 10, "the serve's failure")
    assert u["last_exit"].startswith(f"killed by {sig_name} (pid {serve_pid}"), u["last_exit"]
    # Its children, in its group and escaped into their own session, died with it; /proc agrees.
    wait_for(lambda: not alive(group_child) and not alive(escaped), 5, "the serve's children to be gone")
    assert not alive(serve_pid)
    engine = d.unit("engine")
    assert engine["state"] == "active" and engine["pid"] == before["engine"]["pid"]  # the serve requires it, not the reverse

    if restart == "no":
        u = d.wait_state("serve", "failed")
        assert sig_name in u["reason"]
        wait_for(lambda: health_names(d, "serve", sig_name), 5, "/health naming the serve and the signal")
        stays(lambda: d.unit("serve")["state"] == "failed" and d.http("/health")[0] == 503, 0.5,
              "serve failed and /health 503")
        assert unit_processes(no_leaks, "serve") == []
    else:
        wait_for(lambda: d.http("/health")[0] == 200, 10, "/health 200 again")
        u = d.unit("serve")
        assert u["state"] == "active" and u["restarts"] == 1 and u["pid"] != serve_pid
        lines = kids.read_text().split("\n")
        _main2, child2, escaped2 = (int(x) for x in lines[1].split())
        live = sorted(unit_processes(no_leaks, "serve"))
        assert live == sorted([u["pid"], child2, escaped2]), live  # only the new serve's processes


# ------------------------------------------------------------- exit code 0
def test_unrequested_exit_with_code_0_is_a_failure(tmp_path, daemon_factory):
    prog = write_prog(tmp_path)
    go = tmp_path / "go"
    stack = make_stack({
        # exits 0 once told to (a fixed sleep raced the user's start on a loaded machine)
        "oneshot": f'exec = ["sh", "-c", "while [ ! -e {go} ]; do sleep 0.02; done; exit 0"]\n',
        "user": f'{exec_line(prog, "--notify")}\nready = "notify"\nrequires = ["oneshot"]\n',
    })
    d = daemon_factory(stack)
    d.wait_state("user", "active")
    go.touch()
    u = d.wait_state("oneshot", "failed")
    assert u["reason"].startswith("exited with code 0 (pid "), u["reason"]
    assert u["last_exit_code"] == 0
    wait_for(lambda: health_names(d, "oneshot", "exited with code 0"), 5, "/health naming the exit code")
    # An exit nobody asked for fails the units that require it too.
    wait_for(lambda: d.unit("user")["state"] == "inactive" and "requires oneshot" in d.unit("user")["reason"], 10,
             lambda: f"user stopped because oneshot failed: {d.unit('user')}")


def test_a_unit_whose_requirement_failed_before_it_started_says_so(daemon_factory):
    """The requirement exits (code 0, nobody asked) before the unit that requires it could
    start: that unit stays down, and its reason names the requirement and why (it was empty).
    The requirement waits for READY=1 and exits without it, so the dependent can never have
    been started (a requirement that is up when it exits races the dependent's spawn)."""
    d = daemon_factory(make_stack({"oneshot": 'exec = ["sh", "-c", "exit 0"]\nready = "notify"\n',
                                   "user": 'exec = ["sleep", "1000"]\nrequires = ["oneshot"]\n'}))
    d.wait_state("oneshot", "failed")
    u = wait_for(lambda: (u := d.unit("user"))["reason"] and u, 5, lambda: f"a reason for user: {d.unit('user')}")
    assert u["state"] == "inactive" and u["pid"] is None, u
    assert u["reason"].startswith("not started: requires oneshot, which failed: exited with code 0"), u["reason"]


def test_units_exiting_at_once_fail_even_when_the_exit_report_beats_the_spawn_reply(tmp_path, daemon_factory):
    # /bin/true exits before the daemon has read the spawner's reply for it often
    # enough, over 16 instances restarted a few times, to take the early-exit path.
    stack = make_stack({
        "blink": 'exec = ["/bin/true"]\ninstances = 16\nrestart = "on-failure"\nrestart_sec = 0.01\n'
                 'restart_max_sec = 0.01\nstart_limit_burst = 4\nstart_limit_interval = 30\n',
    })
    d = daemon_factory(stack)

    def all_gave_up():
        us = d.units()
        return all(u["state"] == "failed" and u["gave_up"] for u in us.values()) and us

    us = wait_for(all_gave_up, 20, "every instance to give up")
    for name, u in us.items():
        assert u["reason"].startswith("exited with code 0 (pid "), (name, u["reason"])
        assert "start limit" in u["reason"] and u["restarts"] == 3, (name, u)
    assert "op crashed" not in d.log()


# ------------------------------------------------------------------ notify
@pytest.mark.skipif(shutil.which("systemd-notify") is None, reason="systemd-notify is not installed")
def test_ready_notify_with_real_systemd_notify_waits_for_ready_and_shows_status(tmp_path, daemon_factory):
    go = tmp_path / "go"  # it warms up until the test has seen it starting (a fixed sleep raced the test under load)
    script = (f"systemd-notify --status='warming up'; while [ ! -e {go} ]; do sleep 0.05; done; "
              "systemd-notify --ready --status=serving; exec sleep 1000")
    stack = make_stack({"svc": f'exec = ["sh", "-c", "{script}"]\nready = "notify"\n'})
    d = daemon_factory(stack)
    # Still starting, with the status text it sent, until READY=1 arrives.
    starting = wait_for(lambda: (u := d.unit("svc"))["status_text"] == "warming up" and u, 30,
                        "STATUS=warming up while starting")
    assert starting["state"] == "starting" and not starting["ready"], starting
    code, body = d.http("/health")
    assert code == 503 and body["units"]["svc"]["state"] == "starting"
    go.touch()
    active = d.wait_state("svc", "active", timeout=30)
    assert active["ready"] and active["status_text"] == "serving"
    assert active["since"] > starting["since"], (starting["since"], active["since"])
    assert d.http("/health")[0] == 200


def test_ready_notify_with_plain_python_datagram_and_status_text(tmp_path, daemon_factory):
    prog = write_prog(tmp_path)
    stack = make_stack({"svc": f'{exec_line(prog, "--notify", "--status", "all good")}\nready = "notify"\n'})
    d = daemon_factory(stack)
    u = d.wait_state("svc", "active")
    assert u["ready"] and u["status_text"] == "all good"
    assert d.http("/units/svc")[1]["status_text"] == "all good"


def test_notify_unit_that_never_sends_ready_fails_at_ready_timeout(tmp_path, daemon_factory):
    stack = make_stack({"mute": 'exec = ["sleep", "1000"]\nready = "notify"\nready_timeout = 0.5\n'})
    d = daemon_factory(stack)
    u = d.wait_state("mute", "failed", timeout=10)
    pid = d.logged_pid("mute", "starting")  # its 0.5 s may be over before a first look on a loaded host
    assert u["reason"].startswith("not ready after 0.5 s"), u["reason"]
    assert not alive(pid) and u["pid"] is None
    wait_for(lambda: health_names(d, "mute", "not ready after 0.5 s"), 5, "/health naming the ready timeout")


# ------------------------------------------------------------- FM-18 watchdog
def test_fm18_watchdog_kills_a_sigstopped_unit_and_stops_its_dependents(tmp_path, daemon_factory):
    prog = write_prog(tmp_path)
    rec = tmp_path / "record.txt"
    stack = make_stack({
        # The worker handles SIGTERM (records it), but a stopped process runs no handler.
        "worker": f'{exec_line(prog, "--notify", "--watchdog", "0.2", "--record", str(rec))}\n'
                  'ready = "notify"\nwatchdog_sec = 1\nstop_timeout = 0.5\n',
        "engine": f'{exec_line(prog, "--notify", "--record", str(rec))}\nready = "notify"\nrequires = ["worker"]\n',
    })
    d = daemon_factory(stack)
    before = d.wait_all_active()
    victim = before["worker"]["pid"]
    # The pings keep it alive past its watchdog interval.
    stays(lambda: d.unit("worker")["state"] == "active", 1.3, "worker active while pinging")
    with subscribed(d) as sub:
        t0 = time.time()
        send_signal(victim, signal.SIGSTOP)
        events = collect(sub, lambda evs: any(e["unit"] == "worker" and e["to"] == "failed" for e in evs)
                         and any(e["unit"] == "engine" and e["to"] == "inactive" for e in evs),
                         15, "worker failed and engine inactive")
    w = d.unit("worker")
    assert w["state"] == "failed" and w["reason"].startswith("watchdog:"), w["reason"]
    # Killed: SIGTERM could not be handled while stopped, so SIGKILL at stop_timeout.
    assert w["last_signal"] == "SIGKILL", w
    assert not alive(victim)
    assert ("worker", "TERM") not in read_record(rec)
    ws = [e for e in events if e["unit"] == "worker"]
    stopping = next(e for e in ws if e["to"] == "stopping")
    failed = next(e for e in ws if e["to"] == "failed")
    assert stopping["from"] == "active" and stopping["reason"].startswith("watchdog:")
    assert stopping["pid"] == victim and failed["pid"] == victim
    caught = stopping["ts"] - t0
    assert 0.7 <= caught < 5, caught  # watchdog_sec 1 minus at most one ping interval
    assert failed["ts"] - stopping["ts"] >= 0.5 - 0.02
    print(f"\nwatchdog: SIGSTOP -> caught {caught:.3f} s; stopping -> failed {failed['ts'] - stopping['ts']:.3f} s")
    # Then as FM-01: the dependent is stopped, /health 503 names the worker and why.
    e = d.unit("engine")
    assert e["state"] == "inactive" and "requires worker" in e["reason"]
    assert not alive(before["engine"]["pid"])
    assert ("engine", "TERM") in read_record(rec)
    wait_for(lambda: health_names(d, "worker", "watchdog:"), 5, "/health naming the watchdog")


# ------------------------------------------------------------- liveness
@pytest.mark.parametrize("mode", ["500", "hang"])
def test_liveness_probe_failing_three_times_fails_the_unit(tmp_path, daemon_factory, no_leaks, mode):
    prog = write_prog(tmp_path)
    port = free_port()
    trigger = tmp_path / "trigger"
    url = f"http://127.0.0.1:{port}/"
    stack = make_stack({
        "web": f'{exec_line(prog, "--http", str(port), "--trigger", str(trigger))}\n'
               f'ready = {{ http = "{url}" }}\n'
               f'liveness = {{ http = "{url}", interval = 0.2, timeout = 0.3, failures = 3 }}\n'
               'stop_timeout = 1\n',
    })
    d = daemon_factory(stack)
    u = d.wait_state("web", "active")
    pid = u["pid"]
    stays(lambda: d.unit("web")["state"] == "active", 0.8, "web active while its probe passes")
    trigger.write_text(mode)
    u = d.wait_state("web", "failed", timeout=10)
    assert u["reason"].startswith("liveness:"), u["reason"]
    assert "(3/3)" in u["reason"], u["reason"]
    assert ("answered 500" if mode == "500" else "timed out") in u["reason"], u["reason"]
    assert not alive(pid)
    assert unit_processes(no_leaks, "web") == []
    wait_for(lambda: health_names(d, "web", "liveness:"), 5, "/health naming the liveness failure")


# ------------------------------------------------------------- FM-21 crash loop
def test_fm21_crash_loop_backs_off_then_fails_for_good_and_goes_idle(tmp_path, daemon_factory):
    starts = tmp_path / "starts.txt"
    crash = tmp_path / "crash"
    crash.write_text("")
    script = f"date +%s.%N >> {starts}; [ -e {crash} ] && exit 3; exec sleep 1000"
    stack = make_stack({
        "crashy": f'exec = ["sh", "-c", "{script}"]\nrestart = "on-failure"\nrestart_sec = 0.1\n'
                  'start_limit_burst = 4\nstart_limit_interval = 30\n',
    })
    d = daemon_factory(stack)

    def gave_up():
        u = d.unit("crashy")
        return u["state"] == "failed" and u["gave_up"] and u

    u = wait_for(gave_up, 15, "crashy to give up")
    assert "start limit" in u["reason"], u["reason"]
    assert "exited with code 3" in u["reason"], u["reason"]
    times = [float(x) for x in starts.read_text().split()]
    assert len(times) == 4, times
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(f"\ncrash loop: gaps between starts {[round(g, 3) for g in gaps]}")
    # Backoff: each gap at least its delay (0.1, 0.2, 0.4 s), and they grow.
    for gap, delay in zip(gaps, (0.1, 0.2, 0.4)):
        assert gap >= delay - 0.01, gaps
    # Doubling, seen end to end: the first gap can carry the daemon's own start-up work (the
    # first tier starts before the daemon's heavy imports), so compare the ends.
    assert gaps[2] > gaps[1] + 0.1, gaps  # the last two: after the start-up work
    body = wait_for(lambda: health_names(d, "crashy", "start limit"), 5, "/health saying why")
    assert body["status"] == "failed"

    # Failed for good: the daemon goes idle, no new start, nearly no CPU.
    cpu0 = cpu_seconds(d.pid)
    stays(lambda: len(starts.read_text().split()) == 4 and d.unit("crashy")["pid"] is None, 1.0,
          "no new start after giving up", interval=0.25)
    used = cpu_seconds(d.pid) - cpu0
    print(f"daemon CPU over ~1 s while failed for good: {used:.3f} s")
    assert used < 0.05 + 4 * 0.01, used  # a few status queries are ours
    assert d.http("/health")[0] == 503

    # `start` resets it.
    crash.unlink()
    res = d.ok("start", {"units": ["crashy"]})
    assert res["ok"], res
    u = d.unit("crashy")
    assert u["state"] == "active" and not u["gave_up"] and alive(u["pid"])
    # ready = "started": active at spawn, maybe before the shell wrote its line.
    wait_for(lambda: len(starts.read_text().split()) == 5, 5, "the fifth start")
    wait_for(lambda: d.http("/health")[0] == 200, 5, "/health 200 after start")


# ------------------------------------------------------------- events
def test_every_transition_of_a_failure_is_published_on_the_event_stream(tmp_path, daemon_factory):
    prog = write_prog(tmp_path)
    stack = make_stack({
        "worker": f'{exec_line(prog, "--notify")}\nready = "notify"\n',
        "engine": f'{exec_line(prog, "--notify")}\nready = "notify"\nrequires = ["worker"]\n',
    })
    d = daemon_factory(stack)
    before = d.wait_all_active()
    with subscribed(d) as sub:
        send_signal(before["worker"]["pid"], signal.SIGKILL)
        events = collect(sub, lambda evs: any(e["unit"] == "engine" and e["to"] == "inactive" for e in evs),
                         10, "engine inactive")
    for e in events:
        assert set(e) >= {"ts", "unit", "pid", "from", "to", "reason"}, e
        assert e["reason"], e
    worker = [e for e in events if e["unit"] == "worker"]
    assert [(e["from"], e["to"]) for e in worker] == [("active", "failed")], worker
    assert worker[0]["pid"] == before["worker"]["pid"]
    assert worker[0]["reason"].startswith("killed by SIGKILL"), worker[0]
    engine = [e for e in events if e["unit"] == "engine"]
    assert [(e["from"], e["to"]) for e in engine] == [("active", "stopping"), ("stopping", "inactive")], engine
    assert all(e["pid"] == before["engine"]["pid"] for e in engine), engine
    assert "requires worker" in engine[0]["reason"]
    assert worker[0]["ts"] <= engine[0]["ts"] <= engine[1]["ts"]
    # The event stream and status agree on where each unit ended.
    us = d.units()
    assert us["worker"]["state"] == "failed" and us["engine"]["state"] == "inactive"


# ------------------------------------------------------------- health API
def test_health_api_live_units_and_metrics(tmp_path, daemon_factory):
    prog = write_prog(tmp_path)
    stack = make_stack({
        "worker": f'{exec_line(prog, "--notify")}\nready = "notify"\ninstances = 2\nrole = "worker"\n',
        "serve": f'{exec_line(prog, "--notify")}\nready = "notify"\nrequires = ["worker"]\nrole = "serve"\n',
    })
    d = daemon_factory(stack)
    d.wait_all_active()
    code, body = d.http("/health/live")
    assert code == 200 and body["status"] == "ok"
    code, body = d.http("/health")
    assert code == 200 and body["status"] == "ok"
    assert set(body["units"]) == {"worker@0", "worker@1", "serve"}

    status = d.units()
    code, body = d.http("/units")
    assert code == 200
    http_units = {u["name"]: u for u in body["units"]}
    assert http_units.keys() == status.keys()
    required = {"name", "role", "state", "pid", "pgid", "restarts", "since", "reason", "ready"}
    for name, u in status.items():
        assert required <= set(u) and set(http_units[name]) == set(u), name
        for k in ("name", "role", "state", "pid", "pgid", "restarts", "since", "reason", "ready"):
            assert http_units[name][k] == u[k], (name, k)
        code, one = d.http(f"/units/{name}")
        assert code == 200 and one == http_units[name]
    assert d.http("/units/nope")[0] == 404

    code, text = d.http("/metrics")
    assert code == 200 and isinstance(text, str)
    assert 'omnid_unit_state{unit="serve",state="active"} 1' in text
    assert 'omnid_unit_state{unit="serve",state="failed"} 0' in text
    assert 'omnid_unit_restarts_total{unit="worker@1"} 0' in text

    # After a death the metrics say so.
    send_signal(status["worker@1"]["pid"], signal.SIGKILL)
    d.wait_state("worker@1", "failed")
    d.wait_state("serve", "inactive")
    code, text = d.http("/metrics")
    assert 'omnid_unit_state{unit="worker@1",state="failed"} 1' in text
    assert 'omnid_unit_state{unit="serve",state="inactive"} 1' in text
    assert 'omnid_unit_failures_total{unit="worker@1"} 1' in text
    assert d.http("/health/live")[0] == 200
