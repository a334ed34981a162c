"""Issue #9: hostile input and hostile neighbours. Every test attacks omnid through a
public interface (directories, state file, unit files, sockets, health port) with a
real second user (`omnidtest`, created with useradd when missing) and checks the kernel.
"""

from __future__ import annotations

import json
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import socket
import struct
import sys
import time
from pathlib import Path

import pytest

from omnid.base import linux
from tests.harness import Daemon, alive, lingering_tcp_socket, make_stack, repo_pythonpath, run_delay_s, wait_for

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent
OTHER = "omnidtest"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a second user, chown)")


@pytest.fixture(scope="session")
def other_uid() -> int:
    try:
        return pwd.getpwnam(OTHER).pw_uid
    except KeyError:
        subprocess.run(["useradd", "-M", "-r", OTHER], check=True)
        return pwd.getpwnam(OTHER).pw_uid


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=repo_pythonpath())


def omnid(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "omnid", *args], capture_output=True, text=True, timeout=timeout,
                          env=env(), cwd=str(REPO))


SLEEPER = {"a": 'exec = ["sleep", "1000"]\n'}


@pytest.fixture
def daemon():
    made: list[Daemon] = []

    def make(units: dict[str, str] | None = None) -> Daemon:
        d = Daemon(make_stack(units or SLEEPER), env={"PYTHONPATH": repo_pythonpath()})
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()
        shutil.rmtree(d.units_dir, ignore_errors=True)


def expect_refused(d: Daemon, *needles: str) -> str:
    d.start(wait=False)
    rc = d.wait_exit(30)
    log = d.log()
    assert rc != 0, f"daemon accepted it:\n{log}"
    for n in needles:
        assert n in log, f"{n!r} not in:\n{log}"
    return log


# ------------------------------------------------------------------ 1. ownership
def test_control_dir_owned_by_another_user_is_refused_at_daemon_start(daemon, other_uid):
    d = daemon()
    cdir = d.workdir / "ctl"
    cdir.mkdir(mode=0o700)
    os.chown(cdir, other_uid, -1)
    d.control = str(cdir / "c.sock")
    expect_refused(d, str(cdir), OTHER, "0700")
    assert not os.path.exists(d.control)


def test_control_dir_world_writable_is_refused_at_daemon_start(daemon):
    d = daemon()
    cdir = d.workdir / "ctl"
    cdir.mkdir()
    os.chmod(cdir, 0o777)
    d.control = str(cdir / "c.sock")
    expect_refused(d, str(cdir), "0777", "writable")


def test_cli_refuses_a_control_dir_owned_by_another_user(other_uid, tmp_path):
    cdir = tmp_path / "ctl"
    cdir.mkdir(mode=0o700)
    os.chown(cdir, other_uid, -1)
    # The attacker's "daemon": a listening socket in their directory.
    import socket as so
    srv = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    srv.bind(str(cdir / "c.sock"))
    srv.listen(1)
    try:
        r = omnid("--control", str(cdir / "c.sock"), "status")
    finally:
        srv.close()
    assert r.returncode == 1, r
    assert str(cdir) in r.stderr and OTHER in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_state_dir_owned_by_another_user_is_refused_at_daemon_start(daemon, other_uid):
    d = daemon()
    d.state_dir.mkdir(mode=0o700)
    os.chown(d.state_dir, other_uid, -1)
    expect_refused(d, str(d.state_dir), OTHER)


def test_state_dir_group_writable_is_refused_at_daemon_start(daemon):
    d = daemon()
    d.state_dir.mkdir()
    os.chmod(d.state_dir, 0o770)
    expect_refused(d, str(d.state_dir), "0770")


def test_state_file_pid_with_matching_start_time_but_no_token_is_not_killed(daemon):
    victim = subprocess.Popen(["sleep", "1000"])
    try:
        d = daemon()
        d.state_dir.mkdir(mode=0o700)
        st = linux.read_stat(victim.pid)
        (d.state_dir / "state.json").write_text(json.dumps({
            "token": "0123456789abcdef",
            "processes": {"a": {"pid": victim.pid, "start_time": st.start_time, "pgid": st.pgid}}}))
        d.start()
        d.wait_state("a", "active")
        assert alive(victim.pid), f"the daemon killed a process listed in the state file:\n{d.log()}"
    finally:
        victim.kill()
        victim.wait()


def test_state_file_write_does_not_follow_a_planted_symlink(tmp_path):
    from omnid.daemon.statefile import StateFile

    victim = tmp_path / "victim"
    victim.write_text("precious")
    sdir = tmp_path / "state"
    sdir.mkdir(mode=0o700)
    for planted in ("state.tmp", ".state.tmp", "state.json.tmp"):
        os.symlink(victim, sdir / planted)
    sf = StateFile(sdir)
    sf.write({"token": "0123456789abcdef", "processes": {}})
    assert victim.read_text() == "precious"
    assert json.loads((sdir / "state.json").read_text())["token"] == "0123456789abcdef"
    assert not [p for p in os.listdir(sdir) if p.endswith(".tmp") and not os.path.islink(sdir / p)]
    # A symlink planted at the state file itself is not read through either.
    (sdir / "state.json").unlink()
    os.symlink(victim, sdir / "state.json")
    assert sf.read() is None


MALFORMED = {
    "processes_is_a_list": json.dumps({"token": "0123456789abcdef", "processes": []}),
    "entry_is_a_string": json.dumps({"token": "0123456789abcdef", "processes": {"a": "pid 1"}}),
    "bad_json": '{"token": "0123',
    "not_an_object": "[1, 2, 3]",
    "deeply_nested": "[" * 100000 + "]" * 100000,
    "huge_file": json.dumps({"token": "0123456789abcdef", "pad": "x" * (2 << 20)}),
    "pid_is_a_string": json.dumps({"token": "0123456789abcdef", "processes": {"a": {"pid": "1", "start_time": 1}}}),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_state_file_is_ignored_and_the_daemon_starts(daemon, case):
    d = daemon()
    d.state_dir.mkdir(mode=0o700)
    (d.state_dir / "state.json").write_text(MALFORMED[case])
    d.start()
    d.wait_state("a", "active")
    log = d.log()
    assert "Traceback" not in log, log
    warnings = [e for e in d.log_events() if "state file" in str(e.get("event", ""))]
    assert len(warnings) == 1, f"expected one log line about the state file, got {warnings}"


def test_unit_file_world_writable_is_refused_by_check_and_daemon(daemon):
    d = daemon()
    f = d.units_dir / "a.toml"
    os.chmod(f, 0o666)
    r = omnid("check", "-u", str(d.units_dir))
    assert r.returncode == 2, r
    assert str(f) in r.stdout + r.stderr and "0666" in r.stdout + r.stderr, r
    expect_refused(d, str(f), "0666")


def test_units_dir_owned_by_another_user_is_refused_by_check(other_uid):
    stack = make_stack(SLEEPER)
    try:
        os.chown(stack, other_uid, -1)
        r = omnid("check", "-u", str(stack))
        out = r.stdout + r.stderr
        assert r.returncode == 2, r
        assert str(stack) in out and OTHER in out and "Traceback" not in out, out
        os.chown(stack, 0, -1)
        os.chown(stack / "a.toml", other_uid, -1)
        r = omnid("check", "-u", str(stack))
        assert r.returncode == 2 and OTHER in r.stdout + r.stderr, r
    finally:
        shutil.rmtree(stack)


# ------------------------------------------------------------------ 2. user= units die with the spawner
def test_user_unit_dies_when_daemon_and_spawner_are_sigkilled(daemon, other_uid):
    d = daemon({"a": f'exec = ["sleep", "1000"]\nuser = "{OTHER}"\n'})
    d.start()
    u = d.wait_state("a", "active")
    pid = u["pid"]
    st = linux.read_stat(pid)
    assert st is not None and os.stat(f"/proc/{pid}").st_uid == other_uid
    spawner = st.ppid
    # SIGKILL both: no cleanup path runs, only the kernel's PDEATHSIG can take the unit down.
    os.kill(spawner, signal.SIGKILL)
    os.kill(d.pid, signal.SIGKILL)
    d.wait_exit(10)
    t0 = time.monotonic()
    try:
        wait_for(lambda: not alive(pid), 1.0, f"user unit pid {pid} to die with its spawner")
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert time.monotonic() - t0 < 1.0


# ------------------------------------------------------------------ 3. notify socket
def notify_address(pid: int) -> str:
    addr = linux.read_environ_var(pid, "NOTIFY_SOCKET")
    assert addr and addr.startswith("@"), addr
    return addr


FLOODER = r'''
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
addr = "\0" + os.environ["NOTIFY_SOCKET"][1:]
s.sendto(b"READY=1", addr)
for i in range(int(sys.argv[1])):
    s.sendto(b"READY=1\nSTATUS=%d" % i, addr)
open(sys.argv[2], "w").write("done")
time.sleep(1000)
'''


SENDER = r'''
import os, socket, sys
addr, n, msg = "\0" + sys.argv[1][1:], int(sys.argv[2]), sys.argv[3].encode()
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
for _ in range(n):
    s.sendto(msg, addr)
'''


def test_notify_from_another_users_process_is_dropped_counted_and_not_logged(daemon, other_uid, tmp_path):
    prog = tmp_path / "flood.py"
    prog.write_text(FLOODER)
    d = daemon({"a": f'exec = ["{PY}", "{prog}", "0", "{tmp_path / "done"}"]\nready = "notify"\n'})
    d.start()
    u = d.wait_state("a", "active")
    addr = notify_address(u["pid"])
    log_before = len(d.log())
    accepted_before = d.ok("status")["daemon"]["notify"]["accepted"]  # the unit's own READY=1
    n = 5000
    subprocess.run(["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", PY, "-c", SENDER,
                    addr, str(n), "STATUS=pwned\nREADY=1"], check=True, timeout=60, cwd="/")
    counters = wait_for(lambda: (c := d.ok("status")["daemon"]["notify"])["dropped_foreign"] >= n and c, 10,
                        f"{n} foreign datagrams to be counted (log:\n{d.log()[-2000:]})")
    assert counters["accepted"] == accepted_before, counters
    assert d.unit("a")["status_text"] != "pwned", d.unit("a")
    grown = len(d.log()) - log_before
    assert grown < 2000, f"the daemon logged {grown} bytes for {n} foreign datagrams:\n{d.log()[-3000:]}"
    code, text = d.http("/metrics")
    assert f'omnid_notify_datagrams_total{{outcome="dropped_foreign"}} {counters["dropped_foreign"]}' in text




def test_notify_flood_from_a_unit_is_rate_limited_and_death_still_detected(daemon, tmp_path):
    prog = tmp_path / "flood.py"
    prog.write_text(FLOODER)
    done = tmp_path / "done"
    d = daemon({"flood": f'exec = ["{PY}", "{prog}", "50000", "{done}"]\nready = "notify"\n',
                "victim": 'exec = ["sleep", "1000"]\n'})
    d.start()
    victim = d.wait_state("victim", "active")
    d.wait_state("flood", "active")
    # Mid-flood: kill the victim; the loop must see its death promptly.
    wait_for(lambda: d.ok("status")["daemon"]["notify"]["received"] > 1000, 20, "the flood to start")
    os.kill(victim["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: d.http("/health")[0] == 503, 5, "/health to say 503 after a death during a notify flood")
    seen = time.monotonic() - t0
    wait_for(done.exists, 120, "the flood to end")
    c = wait_for(lambda: (c := d.ok("status")["daemon"]["notify"])["received"] >= 50000 and c, 60,
                 "all datagrams to be read")
    assert c["dropped_rate"] > 40000, c
    assert c["dropped_foreign"] == 0, c
    assert seen < 1.0, f"death during the notify flood took {seen:.3f} s to show on /health"


def test_fds_whose_close_waits_sent_to_the_notify_socket_do_not_stop_the_loop(daemon, tmp_path):
    """Any local user can send fds to the notify socket (its abstract name is listed in
    /proc/net/unix). A TCP socket with SO_LINGER and unsent data makes close() wait the linger
    time: closed on the loop, it would stop death detection and the control socket for that
    long. The daemon closes it off the loop; a death is still on /health within a second."""
    prog = tmp_path / "flood.py"
    prog.write_text(FLOODER)
    d = daemon({"a": f'exec = ["{PY}", "{prog}", "0", "{tmp_path / "done"}"]\nready = "notify"\n',
                "victim": 'exec = ["sleep", "1000"]\n'})
    d.start()
    addr = "\0" + notify_address(d.wait_state("a", "active")["pid"])[1:]
    victim = d.wait_state("victim", "active")
    linger, socks = 20, []
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # The daemon stopped while the datagrams are sent and our copies closed: otherwise, under
        # load, it could receive and close its copy first, and then ours would be the last one
        # (whose close lingers) and its close would take no time (seen twice in parallel runs).
        os.kill(d.pid, signal.SIGSTOP)
        try:
            for _ in range(3):  # more than one: one stuck close must not hold up the next
                c, srv, peer = lingering_tcp_socket(linger)
                socks += [srv, peer]
                s.sendmsg([b"FDSTORE=1\nREADY=1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                      struct.pack("i", c.fileno()))], socket.MSG_DONTWAIT, addr)
                c.close()  # the copy in the datagram is the last one now: the daemon's close() lingers
        finally:
            os.kill(d.pid, signal.SIGCONT)
        s.close()
        wait_for(lambda: d.ok("status")["daemon"]["notify"]["dropped_foreign"] >= 3, 5, "the datagrams dropped")
        delay0, t0 = run_delay_s(), time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: d.http("/health")[0] == 503, 5, "/health to say 503 while the closes linger")
        # The bound is the daemon's: less the time this test itself waited for a CPU (2.4 and
        # 3.0 s in two parallel runs at load 26; a close on the loop would hold it 20 s).
        seen, waited = time.monotonic() - t0, run_delay_s() - delay0
        print(f"death on /health after {seen:.3f} s, of them {waited:.3f} s this test waited for a CPU")
        closes = wait_for(lambda: (c := d.ok("status")["daemon"]["foreign_fd_closes"])["stuck"] >= 3 and c, 10,
                          lambda: f"three closes under way in closer threads: {d.ok('status')['daemon']}")
        assert closes["threads"] >= 3, closes
        assert seen - waited < 1.0, (f"a death took {seen:.3f} s to show on /health while sent fds lingered "
                                     f"({waited:.3f} s of it this test waited for a CPU)")
        _, text = d.http("/metrics")
        assert "omnid_foreign_fd_closes_stuck 3" in text, [x for x in text.splitlines() if "foreign" in x]
    finally:
        for x in socks:
            x.close()  # the peer gone: the lingering closes end at once


# ------------------------------------------------------------------ 4. health connection flood
def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def accept_queue(port: int) -> int:
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout.split()
    return int(out[1]) if len(out) > 1 else 0


def poll_queue(port: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if accept_queue(port) == 0:
            return True
        time.sleep(0.05)
    return False


def test_health_connection_flood_neither_kills_the_daemon_nor_stops_omnid_status(daemon):
    import resource
    import socket as so

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    d = daemon({"a": 'exec = ["sleep", "1000"]\n', "b": 'exec = ["sleep", "1000"]\n'})
    # The attack as reported: the daemon starts with the usual soft limit of 1024.
    d.argv = (lambda argv: lambda: ["prlimit", f"--nofile=1024:{hard}", "--", *argv()])(d.argv)
    d.start()
    d.wait_all_active()
    pids = {n: u["pid"] for n, u in d.units().items()}
    conns = []
    try:
        for _ in range(1100):
            c = so.socket(so.AF_INET, so.SOCK_STREAM)
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", d.health_port))
            conns.append(c)
        # Let the daemon accept (or refuse) every queued connection: the listener's queue drains.
        drained = poll_queue(d.health_port)
        peak = daemon_fds(d.pid)
        # An evicted connection's fd is closed a loop turn after its abort, so right after a
        # burst of accepts the count can overshoot the cap by up to one accept batch (the
        # listen backlog); what must hold is the steady state under the flood.
        fds = wait_for(lambda: (n := daemon_fds(d.pid)) < 400 and n, 10,
                       f"the daemon's fds under 400 during the flood (cap 256 connections; peak {peak})")
        print(f"accept queue drained: {drained}; daemon fds during the flood: peak {peak}, then {fds}")
        probe = d.http("/health/live")[0]  # a prober's connection evicts an idle one held by the flood
        r = omnid("--control", d.control, "status", timeout=30)
        assert d.proc.poll() is None, f"daemon died during the flood (rc {d.proc.returncode}):\n{d.log()[-3000:]}"
        assert r.returncode == 0, f"omnid status failed during the flood: {r}\n{d.log()[-3000:]}"
        assert probe == 200, f"/health/live answered {probe} during the connection flood"
        assert fds < 400, f"the daemon holds {fds} fds during a health connection flood (cap: 256 connections)"
    finally:
        for c in conns:
            c.close()
    assert all(alive(p) for p in pids.values())
    wait_for(lambda: d.http("/health")[0] == 200, 15, "/health to answer again after the flood")
    code, text = d.http("/metrics")
    assert "omnid_health_connections_refused_total" in text


# ------------------------------------------------------------------ 6. check runs off the loop
def test_check_request_runs_off_the_event_loop(daemon, tmp_path):
    import threading
    import urllib.request

    big = tmp_path / "big"
    big.mkdir()
    for i in range(3000):
        dep = f'requires = ["u{i - 1}"]\nafter = ["u{max(i - 2, 0)}"]\n' if i > 1 else ""
        (big / f"u{i}.toml").write_text(f'exec = ["x"]\ndescription = "unit {i}"\n{dep}')
    d = daemon()
    d.start()
    d.wait_state("a", "active")
    worst = [0.0]
    answers = [0]
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            t0 = time.monotonic()
            with urllib.request.urlopen(f"http://127.0.0.1:{d.health_port}/health/live", timeout=30) as r:
                r.read()
            worst[0] = max(worst[0], time.monotonic() - t0)
            answers[0] += 1

    th = threading.Thread(target=probe)
    th.start()
    try:
        t0 = time.monotonic()
        wait_for(lambda: answers[0] > 3, 10, "the /health/live probe to run")
        base, worst[0], answers[0] = worst[0], 0.0, 0
        res = d.ok("check", {"units_dir": str(big)}, timeout=60)
        took = time.monotonic() - t0
        during = answers[0]
    finally:
        stop.set()
        th.join()
    assert res["ok"], res["errors"][:3]
    print(f"check took {took:.2f} s; {during} /health/live answers during it, worst {worst[0] * 1000:.0f} ms "
          f"(before the check: {base * 1000:.0f} ms)")
    # In the loop, a check answers no health request until it is done (/health/live took 7.7 s).
    assert during >= 5 and worst[0] < took / 2, \
        f"{during} /health/live answers, worst {worst[0]:.2f} s, while a {took:.2f} s check ran"


# ------------------------------------------------------------------ 7. fd exhaustion at spawn
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def nofile_limit_leaving(daemon_pid: int, unit_pid: int, free: int) -> tuple[int, str]:
    """The RLIMIT_NOFILE for daemon_pid that leaves it exactly `free` fds once unit_pid's death
    has freed the daemon's fds for it (its pidfd, its output pipe's read end). The limit caps
    fd numbers, not their count, and a new fd takes the lowest free number: the fds free are
    the numbers below the limit that nothing holds, holes included (the daemon's fds are not
    dense: under load a run found one more free than `count - 2 + free` assumed)."""
    pipes = set()
    for n in (1, 2):
        with contextlib.suppress(OSError):
            pipes.add(os.readlink(f"/proc/{unit_pid}/fd/{n}"))
    held, freed = set(), set()
    for name in os.listdir(f"/proc/{daemon_pid}/fd"):
        try:
            target = os.readlink(f"/proc/{daemon_pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        fd = int(name)
        if target in pipes:
            freed.add(fd)
        elif target == "anon_inode:[pidfd]":
            with contextlib.suppress(OSError):
                if f"Pid:\t{unit_pid}\n" in Path(f"/proc/{daemon_pid}/fdinfo/{name}").read_text():
                    freed.add(fd)
        held.add(fd)
    assert len(freed) >= 2, f"the unit's pidfd and output pipe not found among the daemon's fds: {sorted(freed)}"
    after = held - freed
    limit = next(n for n in range(1, max(held) + free + 2) if n - len([f for f in after if f < n]) == free)
    return limit, f"{len(held)} fds held, {sorted(freed)} freed by the death, highest {max(held)}"


@pytest.mark.parametrize("free", [1, 2])
def test_fd_exhaustion_at_spawn_fails_cleanly_backs_off_and_recovers(daemon, free):
    d = daemon({"a": 'exec = ["sleep", "1000"]\nrestart = "always"\nrestart_sec = 0.2\nrestart_max_sec = 1\n'
                     'start_limit_burst = 1000\n'})
    d.start()
    a = d.wait_state("a", "active")
    d.ok("status")  # the control connection is open before the limit drops
    wait_for(lambda: d.http("/health/live")[0] == 200, 20, "the health API")
    spawner = linux.read_stat(a["pid"]).ppid
    soft, hard = map(int, subprocess.run(["prlimit", "-p", str(d.pid), "--nofile", "-o", "SOFT,HARD", "--noheadings"],
                                         capture_output=True, text=True, check=True).stdout.split())
    # The unit's death frees its pidfd and output pipe: then exactly `free` fds are left for the restart.
    limit, seen = nofile_limit_leaving(d.pid, a["pid"], free)
    print(f"limit {limit}: {seen}")
    subprocess.run(["prlimit", "-p", str(d.pid), f"--nofile={limit}:{hard}"], check=True)
    try:
        os.kill(a["pid"], signal.SIGKILL)
        u = wait_for(lambda: (u := d.unit("a")) and "EMFILE" in f"{u.get('reason')} {u.get('last_exit')}" and u,
                     60, lambda: f"a restart to fail with EMFILE (limit {limit}, the daemon's fds now "
                                 f"{daemon_fds(d.pid)}; unit {d.unit('a')}; log:\n{d.log()[-2500:]})")
        print("unit while fds are exhausted:", u["state"], u["reason"])
        c0, t0 = cpu_seconds(d.pid), time.monotonic()
        time.sleep(2.0)  # measuring CPU over an interval: the interval is the measurement
        cpu = (cpu_seconds(d.pid) - c0) / (time.monotonic() - t0)
        assert cpu < 0.5, f"the daemon used {cpu:.0%} CPU while spawns failed with EMFILE"
        units = {p for p in linux.children_of(spawner) if (st := linux.read_stat(p)) and st.state not in ("Z", "X")}
        pid_now = d.unit("a")["pid"]
        assert units <= ({pid_now} if pid_now else set()), f"children of the spawner no unit owns: {units}"
    finally:
        subprocess.run(["prlimit", "-p", str(d.pid), f"--nofile={soft}:{hard}"], check=True)
    d.wait_state("a", "active", timeout=20)
    d.close()
    assert d.proc.returncode == 0, d.closed_log[-3000:]


# ------------------------------------------------------------------ 5. parser and control input
@pytest.mark.parametrize("text", ["v = " + "[" * 5000 + "]" * 5000 + "\n", "instances = 9223372036854775807\n",
                                  "instances = 1000000\n", "stop_timeout = 1e300\n",
                                  'limits = { nofile = 99999999999999999999 }\n'])
def test_check_never_tracebacks_and_exits_2_naming_the_file(tmp_path, text):
    (tmp_path / "a.toml").write_text('exec = ["x"]\n' + text if not text.startswith("v") else text)
    r = omnid("check", "-u", str(tmp_path), timeout=15)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in out and str(tmp_path / "a.toml") in out, out[-2000:]


def test_control_timeout_that_is_negative_nan_string_or_huge_gets_bad_request_naming_it(daemon):
    d = daemon()
    d.start()
    d.wait_state("a", "active")
    for bad in (-1, 0, "5", 1e300, 86401, True):
        for cmd in ("start", "stop", "restart"):
            rep = d.call(cmd, {"units": ["a"], "timeout": bad})
            assert not rep["ok"] and rep["error"]["code"] == "bad_request", (cmd, bad, rep)
            assert "timeout" in rep["error"]["message"], rep
    rep = d.raw(b'{"cmd": "start", "args": {"units": ["a"], "timeout": NaN}}')
    assert not rep["ok"] and rep["error"]["code"] == "bad_request" and "timeout" in rep["error"]["message"], rep
    assert d.unit("a")["state"] == "active"


def test_kill_accepts_a_numeric_signal(daemon):
    d = daemon({"a": 'exec = ["sleep", "1000"]\n'})
    d.start()
    pid = d.wait_state("a", "active")["pid"]
    rep = d.call("kill", {"unit": "a", "signal": int(signal.SIGUSR1)})
    assert rep["ok"] and rep["result"]["signal"] == "SIGUSR1", rep
    wait_for(lambda: not alive(pid), 5, "sleep to die of SIGUSR1")
    for bad in (0, -9, 65, 10**20):
        rep = d.call("kill", {"unit": "a", "signal": bad})
        assert not rep["ok"] and rep["error"]["code"] == "bad_request" and "signal" in rep["error"]["message"], rep


# ------------------------------------------------------------------ 8. unit files: checked where read
SWAPPER = """
import os, sys, time
d = sys.argv[1]
end = time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < end:
    # The root-owned stack out, the attacker's in; then back, so root's checks see it too.
    os.rename(d + "/stack", d + "/good")
    os.rename(d + "/evil", d + "/stack")
    os.rename(d + "/stack", d + "/evil")
    os.rename(d + "/good", d + "/stack")
    n += 1
print(n)
"""


def test_unit_file_swap_by_the_owner_of_a_parent_directory_never_reaches_root(other_uid):
    """A user who owns a directory above a root-owned stack swaps the stack for her own
    between root's ownership check and its read (TOCTOU), running as that user (setpriv).
    Every load must be refused, naming the directory she owns, and never return her exec."""
    from omnid.model.units import StackInvalid, load_stack

    base = make_stack({"x": SLEEPER["a"]})  # a root-owned temporary directory
    os.chmod(base, 0o755)
    hers = base / "hers"
    hers.mkdir()
    stack = hers / "stack"
    stack.mkdir(mode=0o755)
    (stack / "a.toml").write_text('exec = ["sleep", "1000"]\n')
    evil = hers / "evil"
    evil.mkdir()
    (evil / "a.toml").write_text('exec = ["/bin/touch", "/tmp/omnid-owned-by-attacker"]\n')
    for p in (hers, evil, evil / "a.toml"):
        os.chown(p, other_uid, -1)
    attacker = subprocess.Popen(["setpriv", f"--reuid={other_uid}", f"--regid={other_uid}", "--clear-groups",
                                 PY, "-c", SWAPPER, str(hers), "3"], stdout=subprocess.PIPE, text=True)
    outcomes: dict[str, int] = {}
    try:
        end = time.monotonic() + 2.5
        while time.monotonic() < end and attacker.poll() is None:
            try:
                s = load_stack(stack)
                key = "loaded " + " ".join(s.units["a"].exec)
            except StackInvalid as exc:
                text = str(exc)
                key = "refused, naming her directory" if str(hers) in text and OTHER in text else f"refused: {text[:300]}"
            except Exception as exc:  # noqa: BLE001 - what root's loader must never do, recorded
                import traceback
                key = f"raised {traceback.format_exc()[-600:]}"
            outcomes[key] = outcomes.get(key, 0) + 1
    finally:
        out, _ = attacker.communicate(timeout=30)
        shutil.rmtree(base, ignore_errors=True)
    assert attacker.returncode == 0 and int(out) > 0, (attacker.returncode, out)
    assert not any("touch" in k for k in outcomes), f"root loaded the attacker's unit file: {outcomes}"
    assert set(outcomes) == {"refused, naming her directory"}, outcomes
