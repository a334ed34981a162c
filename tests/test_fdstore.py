"""The fd store (omnid.unit(5) `fd_store_max`): fds a unit hands to omnid with FDSTORE=1 over
its notify socket come back on its later starts after its held sockets, across a SIGKILL
and `omnid reexec`; the limit, FDSTOREREMOVE=1, hang-ups and FDPOLL=0, and a flood.

What the daemon holds is read from the kernel: the links of /proc/DAEMON/fd."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from omnid.model.units import check_stack
from tests.harness import REPO, free_port, make_stack, repo_pythonpath, wait_for

PY = sys.executable
UNIT = str(REPO / "tests" / "fdstore_unit.py")


def links(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


def memfds(pid: int) -> int:
    return sum(1 for x in links(pid) if x.startswith("/memfd:state"))


def report(path: Path, pid: int, timeout: float = 15.0) -> dict:
    def get():
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return r if r["pid"] == pid and r["stored"] else None

    return wait_for(get, timeout, f"the report of pid {pid} in {path}")


def unit_toml(rep: Path, mode: str, arg: str = "", *, max_: int = 4, restart: str = "always") -> str:
    a = f', "{arg}"' if arg else ""
    return (f'exec = ["{PY}", "{UNIT}", "{rep}", "{mode}"{a}]\nfd_store_max = {max_}\n'
            f'stop_timeout = 5\nrestart = "{restart}"\nrestart_sec = 0\n')


def kill_and_wait_back(d, name: str = "u") -> int:
    """SIGKILL the unit's main process (its pid from omnid's status), until a new one is active."""
    pid = d.wait_state(name, "active")["pid"]
    os.kill(pid, 9)
    return wait_for(lambda: (u := d.unit(name))["state"] == "active" and u["pid"] not in (pid, None) and u["pid"],
                    20, f"{name} back after SIGKILL (log:\n{d.log()[-3000:]})")


def check_given_back(r: dict, pid: int, port: int) -> None:
    assert r["LISTEN_PID"] == str(pid) and r["LISTEN_FDS"] == "2", r
    assert r["LISTEN_FDNAMES"] == "state:listener", r
    state, lst = r["fds"]
    assert state["link"].startswith("/memfd:state") and state["content"].startswith("kept by "), r
    assert lst["link"].startswith("socket:") and lst["listening"], r
    assert not state["cloexec"] and not lst["cloexec"] and not r["fd_after"], r
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.settimeout(5)
        assert c.recv(64) == f"{pid}\n".encode(), "the restarted unit accepts on the socket it stored"


# ------------------------------------------------------------------ the unit file
@pytest.mark.fast
def test_fd_store_max_errors_name_file_and_key():
    d = make_stack({"a": 'exec = ["true"]\nfd_store_max = -1\n', "b": 'exec = ["true"]\nfd_store_max = 249\n',
                    "c": 'exec = ["true"]\nfd_store_max = "many"\n',
                    "e": 'exec = ["true"]\nfd_store_max = 248\nsockets = [{ listen = "127.0.0.1:18091" }]\n',
                    "ok": 'exec = ["true"]\nfd_store_max = 247\nsockets = [{ listen = "127.0.0.1:18092" }]\n'})
    text = "\n".join(str(e) for e in check_stack(d))
    for want in ("a.toml: fd_store_max: expected an integer >= 0", "b.toml: fd_store_max: expected an integer",
                 "c.toml: fd_store_max: expected an integer",
                 "e.toml: fd_store_max: expected at most 247 with 1 sockets"):
        assert want in text, f"missing {want!r} in:\n{text}"
    assert "ok.toml" not in text, text


# ------------------------------------------------------------------ kept and given back
@pytest.mark.parametrize("path", ["compiled", "python"])
def test_memfd_and_socket_given_back_after_sigkill_with_content(daemon_factory, tmp_path, path):
    """The unit (ready = "started": NOTIFY_SOCKET comes with fd_store_max alone) stores a memfd
    and a listening socket, is SIGKILLed, and gets both back on either spawn path: named, the
    memfd's content, the socket accepting. Stored fds stay stored after they are given back:
    a second SIGKILL too."""
    port = free_port()
    rep = tmp_path / "r"
    d = daemon_factory(make_stack({"u": unit_toml(rep, "store", str(port))}),
                       env={"OMNID_SPAWNER_PYTHON": "1" if path == "python" else "0"})
    pid = d.wait_state("u", "active")["pid"]
    first = report(rep, pid)
    assert first["LISTEN_FDS"] is None, first
    wait_for(lambda: memfds(d.pid) == 1, 10, "the daemon holding the stored memfd")
    assert d.unit("u")["fd_store"] == 2, d.unit("u")  # omnid status says so too
    for _ in range(2):
        pid = kill_and_wait_back(d)
        check_given_back(report(rep, pid), pid, port)
    assert memfds(d.pid) == 1, "given back, still stored once"
    d.ok("restart", {"units": ["u"]})  # an operator's restart keeps the store too
    pid = d.wait_state("u", "active")["pid"]
    check_given_back(report(rep, pid), pid, port)
    d.ok("stop", {"units": ["u"]})  # the operator's stop empties it (omnid.unit(5))
    wait_for(lambda: memfds(d.pid) == 0, 10, "the store emptied by omnid stop")
    d.ok("start", {"units": ["u"]})
    pid = d.wait_state("u", "active")["pid"]
    assert report(rep, pid)["LISTEN_FDS"] is None


def test_store_kept_across_reexec(daemon_factory, tmp_path):
    port = free_port()
    rep = tmp_path / "r"
    d = daemon_factory(make_stack({"u": unit_toml(rep, "store", str(port))}),
                       env={"PYTHONPATH": repo_pythonpath()})  # the new program is this tree's
    pid = d.wait_state("u", "active")["pid"]
    report(rep, pid)
    wait_for(lambda: memfds(d.pid) == 1, 10, "the daemon holding the stored memfd")
    before = {x for x in links(d.pid) if x.startswith("/memfd:state")}
    d.reexec()
    assert {x for x in links(d.pid) if x.startswith("/memfd:state")} == before, "the same memfd after the re-exec"
    pid = kill_and_wait_back(d)
    check_given_back(report(rep, pid), pid, port)
    d.reexec()  # given back once, then across a second program
    pid = kill_and_wait_back(d)
    check_given_back(report(rep, pid), pid, port)


# ------------------------------------------------------------------ the protocol's edges
def test_fds_beyond_fd_store_max_are_closed_and_only_max_come_back(daemon_factory, tmp_path):
    rep = tmp_path / "r"
    d = daemon_factory(make_stack({"u": unit_toml(rep, "many", "10", max_=3)}))
    pid = d.wait_state("u", "active")["pid"]
    report(rep, pid)
    # Once the daemon counted the 7 refused, the message is handled: exactly 3 are left open.
    wait_for(lambda: 'omnid_fdstore_fds_total{outcome="refused_over_limit"} 7' in d.http("/metrics")[1], 10,
             "the 7 fds beyond fd_store_max counted")
    assert memfds(d.pid) == 3, links(d.pid)
    pid = kill_and_wait_back(d)
    r = report(rep, pid)
    assert r["LISTEN_FDS"] == "3" and r["LISTEN_FDNAMES"] == "m:m:m", r
    assert [f["content"] for f in r["fds"]] == ["m0", "m1", "m2"], r


def test_fdstoreremove_closes_the_named_fds(daemon_factory, tmp_path):
    rep = tmp_path / "r"
    d = daemon_factory(make_stack({"u": unit_toml(rep, "remove")}))
    pid = d.wait_state("u", "active")["pid"]
    report(rep, pid)
    wait_for(lambda: memfds(d.pid) == 1, 10, "one memfd left in the daemon after FDSTOREREMOVE")
    pid = kill_and_wait_back(d)
    r = report(rep, pid)
    assert r["LISTEN_FDNAMES"] == "b" and r["fds"][0]["content"] == "b", r


def test_a_stored_fd_that_hangs_up_is_dropped_unless_fdpoll_0(daemon_factory, tmp_path):
    rep = tmp_path / "r"
    d = daemon_factory(make_stack({"u": unit_toml(rep, "hup")}))
    pid = d.wait_state("u", "active")["pid"]
    pipes = report(rep, pid)["pipes"]
    wait_for(lambda: pipes["unpolled"] in links(d.pid) and pipes["polled"] not in links(d.pid), 10,
             f"the polled pipe dropped on its hang-up, the FDPOLL=0 one kept: {pipes}")
    pid = kill_and_wait_back(d)
    r = report(rep, pid)
    assert r["LISTEN_FDNAMES"] == "unpolled" and r["fds"][0]["link"] == pipes["unpolled"], r


def test_refused_kinds_and_bad_names_are_closed(daemon_factory, tmp_path):
    """A directory, a file on disk and /dev/null are refused (closed at once); a bad FDNAME
    refuses the message's fds; none is kept."""
    script = tmp_path / "bad.py"
    script.write_text(
        "import os, sys\nsys.path.insert(0, %r)\nfrom tests.fdstore_unit import send, memfd\n"
        "send('FDSTORE=1\\nFDNAME=dir', [os.open('/tmp', os.O_RDONLY)])\n"
        "send('FDSTORE=1\\nFDNAME=file', [os.open(%r, os.O_RDONLY)])\n"
        "send('FDSTORE=1\\nFDNAME=dev', [os.open('/dev/null', os.O_RDONLY)])\n"
        "send('FDSTORE=1\\nFDNAME=a:b', [memfd('x')])\n"
        "send('FDSTORE=1\\nFDNAME=ok', [memfd('ok')])\n"
        "import signal\nwhile True: signal.pause()\n" % (str(REPO), str(script)))
    d = daemon_factory(make_stack({"u": f'exec = ["{PY}", "{script}"]\nfd_store_max = 8\n'}))
    d.wait_state("u", "active")
    wait_for(lambda: memfds(d.pid) == 1, 10, "the one good memfd stored")
    held = links(d.pid)
    assert str(script) not in held and "/tmp" not in held, held

    def refused() -> dict:
        _, m = d.http("/metrics")
        return {k: int(line.rsplit(" ", 1)[1]) for k in ("refused_kind", "refused_name")
                for line in m.splitlines() if f'omnid_fdstore_fds_total{{outcome="{k}"}}' in line}

    wait_for(lambda: refused() == {"refused_kind": 3, "refused_name": 1}, 10, f"the refusals counted: {refused()}")


def test_flood_of_fdstore_datagrams_keeps_the_daemon_bounded_and_responsive(daemon_factory, tmp_path):
    """5000 FDSTORE datagrams with an fd each: the store keeps fd_store_max (2; all the same
    eventfd kind, never deduplicated), the daemon's fd count stays bounded, /health answers
    fast and another unit's SIGKILL is seen promptly meanwhile."""
    rep = tmp_path / "r"
    st = make_stack({"u": unit_toml(rep, "flood", "5000", max_=2, restart="no"),
                     "other": 'exec = ["sleep", "1000"]\nrestart = "no"\n'})
    d = daemon_factory(st)
    d.wait_state("other", "active")
    base = len(links(d.pid))
    peak = 0
    health_worst = 0.0
    u = d.wait_state("u", "active")
    Path(str(rep) + ".go").touch()
    t_end = time.monotonic() + 30
    while time.monotonic() < t_end:
        peak = max(peak, len(links(d.pid)))
        t0 = time.monotonic()
        code, _ = d.http("/health")
        health_worst = max(health_worst, time.monotonic() - t0)
        try:
            if json.loads(rep.read_text())["pid"] == u["pid"]:
                break
        except (OSError, ValueError):
            pass
    flood = report(rep, u["pid"])["flood"]
    other = d.unit("other")["pid"]
    t0 = time.monotonic()
    os.kill(other, 9)
    d.wait_state("other", "failed", timeout=10)
    seen = time.monotonic() - t0
    after = len(links(d.pid))
    print(f"\nflood: {flood}, daemon fds base {base} peak {peak} after {after}, "
          f"/health worst {health_worst * 1000:.0f} ms, SIGKILL seen in {seen * 1000:.0f} ms")
    assert flood["sent"] >= 1000, flood
    assert peak <= base + 2 + 300, (base, peak)  # the store's 2, and one datagram's worth at most in hand
    assert after <= base + 2 + 4, (base, after, links(d.pid))  # + 4: a health or control connection
    assert health_worst < 2.0 and seen < 2.0, (health_worst, seen)
    _, m = d.http("/metrics")
    assert "omnid_fdstore_fds 2" in m.splitlines(), m[-3000:]
    dropped = [int(x.rsplit(" ", 1)[1]) for x in m.splitlines() if 'outcome="dropped_rate"' in x]
    assert dropped and dropped[0] > 1000, m[-3000:]  # the unit's rate limit, fds closed with the datagrams


def test_each_instance_has_its_own_store_and_a_reload_that_removes_one_closes_it(daemon_factory, tmp_path):
    rep = tmp_path / "r"
    st = make_stack({"w": unit_toml(rep, "many", "1").replace(
                         f'"{rep}"', f'"{rep}-%i"') + "instances = 3\n"})
    d = daemon_factory(st)
    for i in (0, 1, 2):
        report(Path(f"{rep}-{i}"), d.wait_state(f"w@{i}", "active")["pid"])
    wait_for(lambda: memfds(d.pid) == 3, 10, "one memfd stored by each instance")
    pid = kill_and_wait_back(d, "w@1")
    r = report(Path(f"{rep}-1"), pid)
    assert r["LISTEN_FDS"] == "1" and r["LISTEN_FDNAMES"] == "m", r  # its own only, not its sibling's
    assert memfds(d.pid) == 3
    (st / "w.toml").write_text((st / "w.toml").read_text().replace("instances = 3", "instances = 2"))
    res = d.ok("reload", timeout=60)
    assert "w@2" in json.dumps(res), res
    wait_for(lambda: memfds(d.pid) == 2, 10, "the removed instance's memfd closed by the reload")
    pid = kill_and_wait_back(d, "w@0")
    assert report(Path(f"{rep}-0"), pid)["LISTEN_FDS"] == "1"


# ------------------------------------------------------------------ the notify socket itself
_CTRUNC = r"""
import os, resource, socket, array, sys
from omnid.api.notify import NotifyServer
got = []
srv = NotifyServer(os.urandom(8).hex(), lambda pid, f: None, attribute=lambda pid: "u",
                   on_fds=lambda unit, fields, fds: got.append(fds))
c = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
c.connect("\0" + srv.address[1:])
r, w = os.pipe()
anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r] * 10).tobytes())]
c.sendmsg([b"FDSTORE=1"], anc)
os.close(r); os.close(w)
before = sorted(int(x) for x in os.listdir("/proc/self/fd"))
# Room for 3 more fds only: the kernel installs what fits and says MSG_CTRUNC.
resource.setrlimit(resource.RLIMIT_NOFILE, (before[-1] + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
srv._readable()
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
after = sorted(int(x) for x in os.listdir("/proc/self/fd"))
c.sendmsg([b"FDSTORE=1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [c.fileno()]).tobytes())])
srv._readable()
print(srv.counters["dropped_truncated"], before == after, len(got), len(got[0]) if got else -1)
"""


def test_a_message_whose_fds_were_cut_is_dropped_with_the_fds_that_arrived():
    """MSG_CTRUNC (the receiver's fd table full): the fds that did arrive are closed, the
    message is not stored; the next message is."""
    import subprocess

    out = subprocess.run([PY, "-c", _CTRUNC], capture_output=True, text=True, timeout=30, cwd=str(REPO),
                         env=dict(os.environ, PYTHONPATH=repo_pythonpath()))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split() == ["1", "True", "1", "1"], out.stdout + out.stderr


_LINGER = r"""
import socket, struct, time
from omnid.base import closer
from omnid.process.fdstore import FdStore
from tests.harness import lingering_tcp_socket

store = FdStore(lambda unit: 4)
c, srv, peer = lingering_tcp_socket(30)
store.offer("u", {"FDSTORE": "1", "FDNAME": "s"}, [c.detach()])  # the store's fd is the only one now
stored = store.count("u")
t0 = time.monotonic()
store.offer("u", {"FDSTOREREMOVE": "1", "FDNAME": "s"}, [])
took = time.monotonic() - t0
threaded = closer.status()["threaded"]
peer.close()  # the peer gone: the lingering close ends
deadline = time.monotonic() + 10
while closer.status()["threads"] and time.monotonic() < deadline and closer.status()["stuck"]:
    time.sleep(0.05)
print(stored, store.count("u"), threaded, round(took, 3))
"""


def test_removing_a_stored_socket_whose_close_lingers_does_not_wait():
    """A unit stores a TCP socket with SO_LINGER and unsent data, then removes it: the store
    closes it off the loop (closer thread), not in the call (it would wait 30 s)."""
    import subprocess

    out = subprocess.run([PY, "-c", _LINGER], capture_output=True, text=True, timeout=60, cwd=str(REPO),
                         env=dict(os.environ, PYTHONPATH=repo_pythonpath()))
    assert out.returncode == 0, out.stderr
    stored, left, threaded, took = out.stdout.splitlines()[-1].split()
    assert (stored, left, threaded) == ("1", "0", "1"), out.stdout + out.stderr
    assert float(took) < 1.0, f"FDSTOREREMOVE took {took} s: the lingering close ran in the call"


def test_a_reload_that_lowers_fd_store_max_restarts_the_unit_with_the_first_fds_only(daemon_factory, tmp_path):
    rep = tmp_path / "r"
    st = make_stack({"u": unit_toml(rep, "many", "3", max_=3)})
    d = daemon_factory(st)
    pid = d.wait_state("u", "active")["pid"]
    report(rep, pid)
    wait_for(lambda: memfds(d.pid) == 3, 10, "3 stored memfds")
    (st / "u.toml").write_text(unit_toml(rep, "many", "3", max_=1))
    d.ok("reload", timeout=60)
    pid2 = wait_for(lambda: (u := d.unit("u"))["state"] == "active" and u["pid"] != pid and u["pid"], 20,
                    "u restarted by the reload")
    r = report(rep, pid2)
    assert r["LISTEN_FDS"] == "1" and r["fds"][0]["content"] == "m0", r
    assert memfds(d.pid) == 1, links(d.pid)
