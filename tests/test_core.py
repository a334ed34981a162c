"""Issue 2 behaviours on real processes, checked in /proc: ordered stop, escalation,
grandchildren, daemon signals, spawn errors, the fork rule."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from omnid.base import linux
from tests.harness import REPO, alive, make_stack, wait_for

PY = sys.executable

# A unit that records when it got SIGTERM (CLOCK_MONOTONIC) and exits after a delay.
RECORDER = """
import os, signal, sys, time
out, delay = sys.argv[1], float(sys.argv[2])
def term(*_):
    with open(out, "a") as f:
        f.write(f"{os.environ['OMNID_UNIT']} TERM {time.monotonic()}\\n")
    time.sleep(delay)
    with open(out, "a") as f:
        f.write(f"{os.environ['OMNID_UNIT']} EXIT {time.monotonic()}\\n")
    os._exit(0)
signal.signal(signal.SIGTERM, term)
import socket
addr = os.environ["NOTIFY_SOCKET"]
addr = "\\0" + addr[1:] if addr.startswith("@") else addr
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    s.sendto(b"READY=1", addr)
while True:
    time.sleep(3600)
"""


def three_tier(tmp, delay: float = 0.2):
    rec = tmp / "recorder.py"
    rec.write_text(RECORDER)
    out = tmp / "events.txt"
    cmd = f'exec = ["{PY}", "{rec}", "{out}", "{delay}"]\nready = "notify"'
    stack = make_stack({
        "worker": f"{cmd}\ninstances = 2\nrole = \"worker\"\n",
        "engine": f"{cmd}\nrequires = [\"worker\"]\nrole = \"engine\"\n",
        "serve": f"{cmd}\nrequires = [\"engine\"]\nrole = \"serve\"\n",
    })
    return stack, out


def read_events(path):
    evs = []
    for line in path.read_text().splitlines():
        unit, what, t = line.split()
        evs.append((unit, what, float(t)))
    return evs


def test_ordered_stop_serve_then_engine_then_workers(tmp_path, daemon_factory):
    stack, out = three_tier(tmp_path)
    d = daemon_factory(stack)
    units = d.wait_all_active()
    pids = {n: u["pid"] for n, u in units.items()}
    d.call("shutdown", timeout=60)
    assert d.wait_exit(30) == 0
    evs = read_events(out)
    t = {(u, w): ts for u, w, ts in evs}
    # serve first; engine only after serve exited; workers only after engine exited.
    assert t[("serve", "EXIT")] <= t[("engine", "TERM")]
    assert t[("engine", "EXIT")] <= min(t[("worker@0", "TERM")], t[("worker@1", "TERM")])
    # Workers of one tier are signalled together, not one after the other.
    assert abs(t[("worker@0", "TERM")] - t[("worker@1", "TERM")]) < 0.1
    for pid in pids.values():
        assert not alive(pid)


def test_unit_ignoring_sigterm_is_sigkilled_at_stop_timeout(daemon_factory):
    stack = make_stack({"stubborn": """
        exec = ["sh", "-c", "trap '' TERM; while :; do sleep 0.05; done"]
        stop_timeout = 1
        """})
    d = daemon_factory(stack)
    pid = d.wait_state("stubborn", "active")["pid"]
    rec = d.ok("stop", {"units": ["stubborn"]}, timeout=30)["summary"][0]
    assert rec["escalated"] is True and rec["signal"] == "SIGTERM"
    # Killed at stop_timeout, not before and not much after (the bench measures precisely).
    assert 1.0 <= rec["seconds"] < 3.0, rec
    assert not alive(pid)
    assert d.unit("stubborn")["state"] == "inactive"


GRANDCHILDREN = """
import os, sys, time
out = sys.argv[1]
pids = []
for _ in range(2):                      # two grandchildren in the unit's process group
    pid = os.fork()
    if pid == 0:
        os.execvp("sleep", ["sleep", "1000"])
    pids.append(pid)
r, w = os.pipe()
if os.fork() == 0:                      # double fork + setsid: escapes the group and session
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        os.execvp("sleep", ["sleep", "1001"])
    os._exit(0)
os.close(w)
escaped = int(os.read(r, 64))
with open(out, "w") as f:
    f.write(" ".join(map(str, pids + [escaped])))
while True:
    time.sleep(3600)
"""


@pytest.mark.parametrize("how", ["stop", "failure"])
def test_grandchildren_and_double_forked_escapee_do_not_survive(tmp_path, daemon_factory, how):
    prog = tmp_path / "gc.py"
    prog.write_text(GRANDCHILDREN)
    out = tmp_path / "pids.txt"
    stack = make_stack({"parent": f'exec = ["{PY}", "{prog}", "{out}"]\nstop_timeout = 2\n'})
    d = daemon_factory(stack)
    main_pid = d.wait_state("parent", "active")["pid"]
    pids = wait_for(lambda: out.exists() and out.read_text().strip() and [int(p) for p in out.read_text().split()],
                    10, "the unit to report its grandchildren")
    escaped = pids[-1]
    assert linux.read_stat(escaped).sid != main_pid  # it really left the session
    if how == "stop":
        d.ok("stop", {"units": ["parent"]}, timeout=30)
    else:
        os.kill(main_pid, signal.SIGKILL)
        d.wait_state("parent", "failed")
    wait_for(lambda: not any(alive(p) for p in [main_pid, *pids]), 5, "grandchildren to be gone")


def test_sigkill_to_daemon_takes_every_unit_down_within_1s(tmp_path, daemon_factory):
    prog = tmp_path / "gc.py"
    prog.write_text(GRANDCHILDREN)
    out = tmp_path / "pids.txt"
    stack = make_stack({
        "worker": 'exec = ["sleep", "1000"]\ninstances = 2\n',
        "parent": f'exec = ["{PY}", "{prog}", "{out}"]\nrequires = ["worker"]\n',
    })
    d = daemon_factory(stack)
    units = d.wait_all_active()
    pids = [u["pid"] for u in units.values()]
    pids += wait_for(lambda: out.exists() and out.read_text().strip() and
                     [int(p) for p in out.read_text().split()], 10, "grandchildren")
    spawner = d.ok("status")["daemon"]["spawner_pid"]
    os.kill(d.pid, signal.SIGKILL)
    d.wait_exit(5)
    wait_for(lambda: not any(alive(p) for p in [spawner, *pids]), 1.0, "every unit process to die with the daemon")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_sigint_to_daemon_is_an_ordered_stop_then_exit_0(tmp_path, daemon_factory, sig):
    stack, out = three_tier(tmp_path, delay=0.05)
    d = daemon_factory(stack)
    pids = [u["pid"] for u in d.wait_all_active().values()]
    os.kill(d.pid, sig)
    assert d.wait_exit(30) == 0
    t = {(u, w): ts for u, w, ts in read_events(out)}
    assert t[("serve", "EXIT")] <= t[("engine", "TERM")] <= t[("engine", "EXIT")] <= t[("worker@0", "TERM")]
    assert not any(alive(p) for p in pids)
    assert not os.path.exists(d.control)


def test_bad_exec_path_fails_that_unit_with_a_clear_reason_while_others_run(daemon_factory):
    stack = make_stack({
        "good": 'exec = ["sleep", "1000"]\n',
        "typo": 'exec = ["/usr/bin/vlm", "serve"]\n',
    })
    d = daemon_factory(stack)
    typo = d.wait_state("typo", "failed")
    assert "exec failed" in typo["reason"] and "No such file or directory" in typo["reason"]
    assert "/usr/bin/vlm" in typo["reason"]
    good = d.wait_state("good", "active")
    assert alive(good["pid"])
    code, body = d.http("/health")
    assert code == 503 and "exec failed" in body["units"]["typo"]["reason"]


@pytest.mark.parametrize("files, needle", [
    ({"a.toml": "exec = [\"x\"\n"}, "a.toml"),                                   # bad TOML
    ({"a.toml": "exec = [\"x\"]\nexce = 1\n"}, "exce"),                           # unknown key
    ({"a.toml": "exec = [\"x\"]\nstop_timeout = \"soon\"\n"}, "stop_timeout"),   # wrong type
    ({"a.toml": "role = \"serve\"\n"}, "exec"),                                  # missing exec
    ({"a.toml": "exec = [\"x\"]\nrequires = [\"nope\"]\n"}, "nope"),             # unknown dependency
    ({"a.toml": "exec = [\"x\"]\nrequires = [\"b\"]\n",
      "b.toml": "exec = [\"x\"]\nrequires = [\"a\"]\n"}, "cycle"),               # cycle
])
def test_malformed_stack_is_exit_2_naming_the_file(tmp_path, files, needle):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    for argv in (["check", "-u", str(tmp_path)],
                 ["--control", str(tmp_path / "c.sock"), "daemon", "-u", str(tmp_path),
                  "--state-dir", str(tmp_path / "st")]):
        r = subprocess.run([PY, "-m", "omnid", *argv], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        assert "a.toml" in r.stderr and needle in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_check_reports_every_error_at_once(tmp_path):
    (tmp_path / "a.toml").write_text("exec = 3\n")
    (tmp_path / "b.toml").write_text("exec = [\"x\"]\nrestart = \"sometimes\"\n")
    r = subprocess.run([PY, "-m", "omnid", "check", "-u", str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "a.toml" in r.stderr and "b.toml" in r.stderr and "restart" in r.stderr


AUDITED_DAEMON = """
import sys
def hook(event, args):
    if event in ("os.fork", "os.forkpty"):
        with open(sys.argv[1], "a") as f:
            f.write(event + "\\n")
        raise RuntimeError("the daemon must never fork")
sys.addaudithook(hook)
sys.argv = ["omnid", *sys.argv[2:]]
from omnid.cli.main import main
sys.exit(main())
"""


def test_only_the_spawner_forks_never_the_daemon(tmp_path, daemon_factory):
    wrapper = tmp_path / "audited.py"
    wrapper.write_text(AUDITED_DAEMON)
    forks = tmp_path / "forks.txt"
    stack = make_stack({"w": 'exec = ["sleep", "1000"]\ninstances = 3\n'})
    from tests.harness import Daemon

    class Audited(Daemon):
        def argv(self):
            return [self.python, str(wrapper), str(forks), *super().argv()[3:]]

    d = Audited(stack)
    try:
        d.start()
        units = d.wait_all_active()
        daemon_threads = linux.thread_count(d.pid)
        assert daemon_threads > 1  # libzmq's threads: exactly why it must not fork
        spawner = d.ok("status")["daemon"]["spawner_pid"]
        assert linux.read_stat(spawner).ppid == d.pid
        assert linux.thread_count(spawner) == 1
        for u in units.values():
            assert linux.read_stat(u["pid"]).ppid == spawner
        # The daemon's only child is the spawner.
        assert [p.pid for p in linux.scan() if p.ppid == d.pid] == [spawner]
        d.ok("restart", {"units": ["w"]}, timeout=30)
        d.wait_all_active()
    finally:
        d.close()
    assert not forks.exists(), forks.read_text()


REFUSE = """
import json, os, socket, sys, threading, time
from omnid.process.spawner import Spawner
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()
try:
    sp = Spawner(theirs, os.getppid())
    sp.spawn({"id": 1, "unit": "x", "argv": ["true"], "env": {}}, [])
    print(ours.recv(65536).decode())
finally:
    stop.set()
    t.join()
"""


def test_spawner_refuses_to_fork_with_a_second_thread():
    r = subprocess.run([PY, "-c", REFUSE], capture_output=True, text=True, timeout=30, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    reply = json.loads(r.stdout)
    assert reply["op"] == "spawn_failed"
    assert "refusing to fork" in reply["error"] and "2 threads" in reply["error"]


def test_control_socket_survives_bad_requests(daemon_factory):
    d = daemon_factory(make_stack({"a": 'exec = ["sleep", "1000"]\n'}))
    d.wait_state("a", "active")
    cases = [b"not json", b"[1, 2]", json.dumps({"id": 1}).encode(), json.dumps({"id": 2, "cmd": "nope"}).encode(),
             json.dumps({"id": 3, "cmd": "start", "args": {"units": ["ghost"]}}).encode(),
             json.dumps({"id": 4, "cmd": "status", "args": []}).encode(),
             json.dumps({"id": 5, "cmd": "kill", "args": {"unit": "a", "signal": "SIGFOO"}}).encode()]
    for payload in cases:
        reply = d.raw(payload)
        assert reply["ok"] is False and reply["error"]["message"] and reply["error"]["code"], (payload, reply)
    big = json.dumps({"id": 6, "cmd": "status", "args": {"pad": "x" * (1 << 20)}}).encode()
    d._sock.send(big)
    # The contract allows either answer: an error reply naming the limit, or libzmq
    # dropping the oversized peer (then no reply comes). Any other reply is a failure.
    if d._sock.poll(3000):
        reply = json.loads(d._sock.recv())
        assert reply["ok"] is False and "1 MiB" in reply["error"]["message"], reply
    d._sock.close(0)
    d._sock = None
    assert d.ok("status")["units"][0]["state"] == "active"  # alive and well


def test_cli_exit_codes_and_status_json(tmp_path, daemon_factory):
    def omnid(*args, control=None):
        return subprocess.run([PY, "-m", "omnid", "--control", control or str(tmp_path / "none.sock"), *args],
                              capture_output=True, text=True, timeout=60)

    r = omnid("status")
    assert r.returncode == 3 and "no omnid daemon" in r.stderr
    d = daemon_factory(make_stack({"a": 'exec = ["sleep", "1000"]\nrole = "worker"\n'}))
    d.wait_state("a", "active")
    r = omnid("status", "--json", control=d.control)
    assert r.returncode == 0
    unit = json.loads(r.stdout)["units"][0]
    for key in ("name", "role", "state", "pid", "pgid", "restarts", "since", "reason", "ready"):
        assert key in unit
    assert omnid("status", "--verify", control=d.control).returncode == 0
    r = omnid("stop", "ghost", control=d.control)
    assert r.returncode == 2 and "ghost" in r.stderr
    r = omnid("kill", "a", "--signal", "NOPE", control=d.control)
    assert r.returncode == 2 and "NOPE" in r.stderr
    r = omnid("stop", control=d.control)
    assert r.returncode == 0 and "SIGTERM" in r.stdout
    assert d.wait_exit(10) == 0


def test_restarted_daemon_kills_leftovers_it_can_prove_are_its_own(tmp_path, daemon_factory):
    prog = tmp_path / "gc.py"
    prog.write_text(GRANDCHILDREN)
    out = tmp_path / "pids.txt"
    stack = make_stack({"parent": f'exec = ["{PY}", "{prog}", "{out}"]\n'})
    d = daemon_factory(stack)
    d.wait_state("parent", "active")
    escaped = wait_for(lambda: out.exists() and out.read_text().strip() and int(out.read_text().split()[-1]),
                       10, "grandchildren")
    spawner = d.ok("status")["daemon"]["spawner_pid"]
    # Kill daemon and spawner at once: the double-forked escapee has no PDEATHSIG and survives.
    os.kill(spawner, signal.SIGKILL)
    os.kill(d.pid, signal.SIGKILL)
    d.wait_exit(5)
    assert alive(escaped)
    from tests.harness import Daemon

    d2 = Daemon(stack)
    d2.workdir, d2.control, d2.state_dir = d.workdir, d.control, d.state_dir
    d2.log_path = d.workdir / "daemon2.log"
    try:
        d2.start()  # returns at once: the SIGKILLed daemon's control socket file is still there
        # The new daemon kills what it proves its predecessor's before it starts anything; on a
        # loaded machine its own start (imports) takes seconds, which a bound from its launch raced.
        wait_for(lambda: "leftovers of a previous daemon" in d2.log() or d2.proc.poll() is not None, 60,
                 lambda: f"the new daemon to look for leftovers; its log:\n{d2.log()[-2000:]}")
        wait_for(lambda: not alive(escaped), 5,
                 lambda: f"the leftover {escaped} to be killed ({linux.read_stat(escaped)}); log:\n{d2.log()[-2000:]}")
        d2.wait_state("parent", "active")
    finally:
        d2.workdir = d.workdir / "d2"  # d closes the shared workdir
        d2.close()


def test_python_units_are_titled_and_every_unit_carries_its_tag(tmp_path, daemon_factory):
    prog = tmp_path / "idle.py"
    prog.write_text("import time\nwhile True: time.sleep(3600)\n")
    stack = make_stack({
        "worker": f'exec = ["{PY}", "{prog}"]\ninstances = 2\n',
        "plain": 'exec = ["sleep", "1000"]\n',
    })
    d = daemon_factory(stack)
    units = d.wait_all_active()
    wait_for(lambda: open(f"/proc/{units['worker@1']['pid']}/cmdline", "rb").read().startswith(b"omnid: worker@1"),
             10, "the runner to set the title")
    for name, u in units.items():
        assert linux.read_environ_var(u["pid"], "OMNID_UNIT") == name
    assert open(f"/proc/{d.pid}/cmdline", "rb").read().startswith(b"omnid: daemon ")
    spawner = d.ok("status")["daemon"]["spawner_pid"]
    assert open(f"/proc/{spawner}/cmdline", "rb").read().startswith(b"omnid: spawner")


def test_cli_start_runs_a_background_daemon_until_ready_and_stop_leaves_nothing(tmp_path):
    from tests.harness import free_port

    stack, _out = three_tier(tmp_path, delay=0.01)
    control = str(tmp_path / "c.sock")
    base = [PY, "-m", "omnid", "--control", control]
    r = subprocess.run([*base, "start", "-u", str(stack), "--state-dir", str(tmp_path / "state"),
                        "--health-listen", f"127.0.0.1:{free_port()}", "--timeout", "60"],
                       capture_output=True, text=True, timeout=90)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "ready in" in r.stdout and "serve: active" in r.stdout  # progress, then the table
        st = json.loads(subprocess.run([*base, "status", "--json"], capture_output=True, text=True,
                                       timeout=30).stdout)
        pids = [u["pid"] for u in st["units"]]
        assert all(alive(p) for p in pids)
    finally:
        stop = subprocess.run([*base, "stop"], capture_output=True, text=True, timeout=90)
    assert stop.returncode == 0, stop.stderr
    assert "serve" in stop.stdout and "SIGTERM" in stop.stdout
    assert not any(alive(p) for p in pids)
    assert not os.path.exists(control)
