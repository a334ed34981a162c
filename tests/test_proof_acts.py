"""Proof before touch, for every act on a host object outside IPC (omnid.process.proof; IPC
objects are tests/test_ipc_proof.py's): a unit's socket file, its cgroup directory, its private
tmp directory, a process group, a helper child, the daemon's own files. Each rule checked on
real objects and with its verdict written by hand: what is omnid's goes, what is not stays,
and the reason names the object.

The socket file is the case that was no proof: "nothing listens" was read as "a leftover of
ours", and another service's socket file, at a unit's listen path while that service is down,
was unlinked. Now only the file omnid bound (its device, inode and change time, recorded in
the state directory) is replaced; a daemon SIGKILLed still has its own leftover replaced by
the next one.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from omnid.model.unitmodel import ListenSocket, Unit
from omnid.process import cgroupfs, proof
from tests.harness import Daemon, cgroup2_for_tests, make_stack, remove_cgroup_tree, temp_dir, wait_for

PY = sys.executable
LISTEN_UNIT = str(Path(__file__).resolve().parent / "listen_unit.py")


def _unit(tmp_path: Path, path: Path) -> Unit:
    return Unit(name="web", template="web", instance=0, instances=1, file=tmp_path / "web.toml", exec=("true",),
                sockets=(ListenSocket(listen=str(path), name="ctl", mode=0o600),))


def _stranger_socket(path: Path) -> int:
    """Another program's socket file, its program down: nothing listens. Its inode."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return os.lstat(path).st_ino


# ------------------------------------------------------------------ unit socket files
@pytest.mark.fast
def test_a_strangers_socket_file_where_nothing_listens_is_refused_never_unlinked(tmp_path):
    from omnid.process.sockets import BindError, HeldSockets

    path = tmp_path / "web.sock"
    ino = _stranger_socket(path)
    held = HeldSockets(tmp_path / "state")
    (tmp_path / "state").mkdir()
    try:
        with pytest.raises(BindError) as err:
            held.fds_for(_unit(tmp_path, path))
    finally:
        held.close_all()
    msg = str(err.value)
    assert f"sockets[0]: cannot listen on {path}" in msg and "no record of binding" in msg \
        and "not removed" in msg, msg
    assert os.lstat(path).st_ino == ino, "another program's socket file was removed"


@pytest.mark.fast
def test_omnids_own_leftover_socket_is_replaced_by_the_next_program(tmp_path):
    """The first HeldSockets stands for a daemon SIGKILLed: its socket closed by the kernel,
    the file left. The next one, with the same state directory, proves it its own."""
    from omnid.process.sockets import HeldSockets

    state = tmp_path / "state"
    state.mkdir()
    path = tmp_path / "web.sock"
    first = HeldSockets(state)
    first.fds_for(_unit(tmp_path, path))
    for held in first.units.values():
        for h in held:
            h.sock.close()  # what the kernel does for a SIGKILLed daemon: the file stays
    assert (state / "sockets.json").is_file()
    with socket.socket(socket.AF_UNIX) as c, pytest.raises(ConnectionRefusedError):
        c.connect(str(path))  # a leftover: nothing listens
    second = HeldSockets(state)
    try:
        fds, _ = second.fds_for(_unit(tmp_path, path))
        # Listening: a new socket is there (the inode number may be the same one, reused at once).
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(path))
    finally:
        second.close_all()
    assert not path.exists(), "the daemon removes the socket file it made"


@pytest.mark.fast
def test_a_socket_file_replaced_under_a_held_socket_is_left_at_close(tmp_path):
    from omnid.process.sockets import HeldSockets

    path = tmp_path / "web.sock"
    held = HeldSockets()
    try:
        held.fds_for(_unit(tmp_path, path))
        path.unlink()
        ino = _stranger_socket(path)  # another program took the name meanwhile
    finally:
        held.close_all()
    assert os.lstat(path).st_ino == ino, "a socket file omnid did not bind was removed at close"


def _inherit(old, state: Path, unit: Unit):
    """What `omnid reexec` does with a held socket: the next program gets the fd and the
    handover's line, and the state directory (here without a record: an older program's)."""
    from omnid.process.sockets import HeldSockets

    ho = old.handover()
    for items in ho.values():
        for it in items:
            it["fd"] = os.dup(it["fd"])
    for held in old.units.values():
        for h in held:
            h.sock.close()  # the old program's copy, closed without a word: it exec'd
    new = HeldSockets(state)
    new.take_over(ho, {unit.name: unit})
    return new


@pytest.mark.fast
def test_a_socket_inherited_without_a_record_is_proven_by_the_kernel(tmp_path):
    """An upgrade by `omnid reexec` from a program that kept no record: the kernel says which
    file the inherited socket was bound to (sock_diag), so the new program proves it and
    removes it at close; a file another program put at the path meanwhile is left."""
    from omnid.process.sockets import HeldSockets

    state = tmp_path / "state"
    state.mkdir()
    ours, theirs = tmp_path / "ours.sock", tmp_path / "theirs.sock"
    old = HeldSockets()
    old.fds_for(_unit(tmp_path, ours))
    new = _inherit(old, state, _unit(tmp_path, ours))
    assert str(ours) in (state / "sockets.json").read_text()
    new.close_all()
    assert not ours.exists(), "the inherited socket's own file was left"

    old = HeldSockets()
    old.fds_for(_unit(tmp_path, theirs))
    theirs.unlink()
    ino = _stranger_socket(theirs)  # another program's file at the path, the held socket still bound
    new = _inherit(old, state, _unit(tmp_path, theirs))
    new.close_all()
    assert os.lstat(theirs).st_ino == ino, "a file the held socket was not bound to was removed"


@pytest.mark.fast
def test_unit_socket_verdicts_by_hand(tmp_path):
    path = tmp_path / "s.sock"
    _stranger_socket(path)
    st = os.lstat(path)
    made = proof.MadeSocket(st.st_dev, st.st_ino, st.st_ctime_ns)
    assert proof.unit_socket(str(path), st, made)
    assert not proof.unit_socket(str(path), st, None)
    v = proof.unit_socket(str(path), st, proof.MadeSocket(st.st_dev, st.st_ino + 1, st.st_ctime_ns))
    assert not v and "another socket file" in v.reason, v
    v = proof.unit_socket(str(path), st, proof.MadeSocket(st.st_dev, st.st_ino, st.st_ctime_ns - 1))
    assert not v and "changed since" in v.reason, v
    (tmp_path / "f").write_text("x")
    assert not proof.unit_socket(str(tmp_path / "f"), os.lstat(tmp_path / "f"), made)


def test_a_sigkilled_daemons_socket_file_is_replaced_a_strangers_is_refused(tmp_path):
    """Real daemons: one SIGKILLed leaves its unit's socket file; the next, with the same state
    directory, replaces it and the unit is active on a new socket. A second unit's listen path
    holds another program's socket file (nothing listens): that unit fails, naming the path and
    why, and the file is still there."""
    socks = temp_dir("proof-socks-")
    web, other = socks / "web.sock", socks / "other.sock"

    def toml(path: Path, name: str) -> str:
        return (f'exec = ["{PY}", "{LISTEN_UNIT}", "{tmp_path / name}", "--ignore"]\n'
                f'sockets = [{{ listen = "{path}", name = "ctl" }}]\nstop_timeout = 5\n')

    d1 = Daemon(make_stack({"web": toml(web, "r1")})).start()
    d2 = None
    try:
        pid = d1.wait_state("web", "active")["pid"]
        ino = os.lstat(web).st_ino
        wait_for(lambda: (d1.state_dir / "sockets.json").exists(), 5, "the sockets record")
        d1.proc.send_signal(signal.SIGKILL)
        d1.proc.wait(10)
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10, "the unit to die with the spawner")
        assert os.lstat(web).st_ino == ino, "the file a SIGKILLed daemon leaves"
        with socket.socket(socket.AF_UNIX) as c, pytest.raises(ConnectionRefusedError):
            c.connect(str(web))  # nothing listens
        stranger = _stranger_socket(other)
        d2 = Daemon(make_stack({"web": toml(web, "r2"), "other": toml(other, "r3")}))
        d2.state_dir = d1.state_dir
        d2.start(wait=False)
        d2.wait_state("web", "active")
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(web))  # replaced: listening again (the inode number may be reused at once)
        o = d2.wait_state("other", "failed")
        assert str(other) in o["reason"] and "no record of binding" in o["reason"], (o, d2.log()[-3000:])
        assert os.lstat(other).st_ino == stranger, "another program's socket file was removed"
        assert "Traceback" not in d2.log()
    finally:
        for d in (d2, d1):
            if d is not None:
                d.close()


def test_after_a_reexec_the_daemon_still_proves_its_socket_file_and_removes_it_at_stop(tmp_path):
    """The record crosses `omnid reexec` (the new program reads sockets.json for the sockets it
    inherits): the unit keeps the same socket, and the ordered stop after it removes the file,
    which it would leave if the new program could not prove it its own."""
    socks = temp_dir("proof-socks-")
    web = socks / "web.sock"
    d = Daemon(make_stack({"web": f'exec = ["{PY}", "{LISTEN_UNIT}", "{tmp_path / "r"}", "--ignore"]\n'
                                  f'sockets = [{{ listen = "{web}", name = "ctl" }}]\nstop_timeout = 5\n'}))
    d.start()
    try:
        pid = d.wait_state("web", "active")["pid"]
        ino = os.lstat(web).st_ino
        d.reexec()
        assert d.unit("web")["pid"] == pid and os.lstat(web).st_ino == ino
        d.ok("shutdown")
        assert d.wait_exit(30) == 0, d.log()[-3000:]
        assert not web.exists(), f"the socket file is left after the stop:\n{d.log()[-3000:]}"
    finally:
        d.close()


# ------------------------------------------------------------------ cgroup directories
def test_cgroup_removal_refuses_what_is_not_a_unit_cgroup_under_the_root(tmp_path):
    plain = tmp_path / "unit"
    plain.mkdir()
    assert not cgroupfs.remove_tree(str(plain)), "a directory that is no cgroup was removed"
    assert plain.is_dir()
    v = proof.cgroup_dir(str(plain), str(tmp_path), os.lstat(plain), False)
    assert not v and "no cgroup.events" in v.reason, v
    v = proof.cgroup_dir(str(tmp_path / "daemon"), str(tmp_path), os.lstat(plain), True)
    assert not v and "daemon's own" in v.reason, v
    v = proof.cgroup_dir(str(plain), "/elsewhere", os.lstat(plain), True)
    assert not v and "not directly under" in v.reason, v
    mount, why = cgroup2_for_tests()
    if mount is None:
        pytest.skip(why)
    root = os.path.join(mount, f"omnid-test-{os.urandom(6).hex()}")  # the claimed root
    os.mkdir(root)
    try:
        unit = os.path.join(root, "u1")
        os.mkdir(unit)
        os.mkdir(os.path.join(unit, "sub"))  # a sub-cgroup the unit made
        leaf = os.path.join(root, "daemon")
        os.mkdir(leaf)
        assert not cgroupfs.remove_tree(leaf, root) and os.path.isdir(leaf), "the daemon's leaf was removed"
        assert not cgroupfs.remove_tree(unit, "/sys/fs/cgroup/elsewhere") and os.path.isdir(unit)
        assert cgroupfs.remove_tree(unit, root) and not os.path.exists(unit)
        os.rmdir(leaf)
    finally:
        remove_cgroup_tree(root)


# ------------------------------------------------------------------ private tmp directories
@pytest.mark.fast
def test_tmp_dir_verdicts_by_hand(tmp_path):
    d = tmp_path / "omnid-u-000000000000"
    d.mkdir()
    st = os.lstat(d)
    assert proof.tmp_dir(str(d), st, st.st_dev, st.st_ino, st.st_uid)
    assert proof.tmp_dir(str(d), st, st.st_dev, st.st_ino, -1)  # a record from before the owner was kept
    v = proof.tmp_dir(str(d), st, st.st_dev, st.st_ino + 1, st.st_uid)
    assert not v and "replaced" in v.reason, v
    v = proof.tmp_dir(str(d), st, st.st_dev, st.st_ino, st.st_uid + 1)
    assert not v and "owned by uid" in v.reason, v
    (tmp_path / "f").write_text("x")
    f = os.lstat(tmp_path / "f")
    assert not proof.tmp_dir(str(tmp_path / "f"), f, f.st_dev, f.st_ino, f.st_uid)


# ------------------------------------------------------------------ processes and groups
@pytest.mark.fast
def test_process_and_group_verdicts_by_hand():
    assert proof.same_process(10, 500, 500)
    assert not proof.same_process(10, 500, 501), "a reused pid"
    assert not proof.same_process(10, 500, None), "gone"
    assert not proof.process_group(1, leader_running=True), "init's group is never a unit's"
    assert proof.process_group(77, leader_running=True)
    assert proof.process_group(77, leader_zombie=True)
    assert proof.process_group(77, member_held=True)
    v = proof.process_group(77)
    assert not v and "may be another group's" in v.reason, v
    assert proof.unit_tag(5, "web", "web", "tok", "tok")
    assert proof.unit_tag(5, "web", "web", None, "tok"), "a unit's child that dropped the daemon tag"
    assert not proof.unit_tag(5, "web", "web", "other-daemon", "tok")
    assert not proof.unit_tag(5, "web", "db", "tok", "tok")
    assert not proof.unit_tag(5, "web", None, None, "tok"), "tags not read in time prove nothing"
    assert proof.previous_daemons(5, "tok", "tok")
    assert not proof.previous_daemons(5, None, "tok") and not proof.previous_daemons(5, "tok", "")


@pytest.mark.fast
def test_own_child_is_an_unreaped_child_of_this_process_only():
    assert not proof.own_child(1), "init is nobody's child here"
    p = subprocess.Popen(["sleep", "30"])
    try:
        assert proof.own_child(p.pid), "running"
        p.kill()
        wait_for(lambda: open(f"/proc/{p.pid}/stat").read().split(") ")[1][0] == "Z", 5, "the zombie")
        assert proof.own_child(p.pid), "exited, not reaped: the number is still ours"
    finally:
        p.kill()
        p.wait(5)
    assert not proof.own_child(p.pid), "reaped: the number may be anyone's"


def _pending(pid: int) -> int:
    """The signals queued for the whole process (ShdPnd): what a killpg leaves with SIGTERM blocked."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("ShdPnd:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no ShdPnd in /proc/{pid}/status")


def test_a_dead_leaders_group_number_is_signalled_only_through_proven_members():
    """The leader reaped and nothing of the group held: signal_group sends no killpg to the
    number (it may be a stranger's group now). The stranger blocks SIGTERM, so a killpg would
    stay queued in its ShdPnd, where the test reads it (no wait needed: the queueing is done
    when killpg returns)."""
    from omnid.process.handle import ProcessHandle

    stranger = subprocess.Popen([PY, "-c", "import signal, sys, time\n"
                                 "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])\n"
                                 "print('ready', flush=True)\ntime.sleep(30)"],
                                stdout=subprocess.PIPE, start_new_session=True)  # a group of its own
    try:
        assert stranger.stdout.readline() == b"ready\n"
        fields = open(f"/proc/{stranger.pid}/stat").read().rsplit(") ", 1)[1].split()
        pgid, start = int(fields[2]), int(fields[19])
        h = ProcessHandle(unit="web", pid=999_999, pidfd=-1, pgid=pgid, start_time=start)
        assert not h.signal_group(signal.SIGTERM, token="tok", procs=lambda: [])
        assert not _pending(stranger.pid) & (1 << (signal.SIGTERM - 1)), \
            "a group whose leader the handle does not hold was signalled by number"
        h.pid, h.pidfd = stranger.pid, os.pidfd_open(stranger.pid)  # now the leader is held: proven
        try:
            assert h.signal_group(signal.SIGTERM)
            assert _pending(stranger.pid) & (1 << (signal.SIGTERM - 1)), "the proven group got nothing"
        finally:
            os.close(h.pidfd)
    finally:
        stranger.kill()
        stranger.wait(5)
        stranger.stdout.close()


# ------------------------------------------------------------------ the daemon's own files
@pytest.mark.fast
def test_daemon_file_verdicts_and_a_stale_control_socket(tmp_path):
    from omnid.api.control import ControlError, prepare_socket_dir

    f = tmp_path / "x"
    f.write_text("x")
    assert proof.daemon_file(str(f), os.lstat(f), (os.geteuid(),))
    v = proof.daemon_file(str(f), os.lstat(f), (os.geteuid() + 1,))
    assert not v and "owned by uid" in v.reason, v
    (tmp_path / "l").symlink_to(f)
    assert not proof.daemon_file(str(tmp_path / "l"), os.lstat(tmp_path / "l"), (os.geteuid(),))

    ctl = tmp_path / "ctl" / "omnid.sock"
    ctl.parent.mkdir(mode=0o700)
    _stranger_socket(ctl)  # a stale control socket of a daemon that is gone: the daemon's own
    prepare_socket_dir(str(ctl))
    assert not ctl.exists()
    ctl.symlink_to(f)  # a link in its place (root's, in the daemon's directory): never followed nor removed
    with pytest.raises(ControlError) as err:
        prepare_socket_dir(str(ctl))
    assert "symbolic link" in err.value.message and ctl.is_symlink(), err.value.message
