"""Issue 34, item 6: the smaller holes through which a neighbour could fill or stall a root
daemon, or a test switch reach production. One test per behaviour, each able to fail on the
code before the fix: fds past 1024 (poll, not select), a kernel without /proc children lists,
test switches outside the test suite, the kill of a probe's or an operator's group without a
scan of the host's /proc on the loop, the sweep's wait woken by the kernel, `status --verify`
and a group number reused by a stranger, and a Unix socket's directory and file."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import structlog.testing

from omnid.base import linux, testswitch
from omnid.process.handle import Survivor
from tests.harness import make_stack, wait_for

SLEEP = 'exec = ["sleep", "1000"]\nstop_timeout = 2\nkill_timeout = 1\nrestart = "no"\n'


# --------------------------------------------------------------------------- fds from 1024 on
def test_any_readable_polls_a_pidfd_numbered_past_1024() -> None:
    """select() refuses fds from 1024 on (ValueError), which a daemon holding a pidfd and two
    pipes per unit reaches at ~340 units: the zero-timeout look must use poll."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}: no fd 1500 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    child = subprocess.Popen(["sleep", "1000"])
    pidfd = os.pidfd_open(child.pid)
    high = os.dup2(pidfd, 1500, inheritable=False)
    try:
        assert asyncio.run(linux.any_readable([high], 0)) is False  # alive: not readable
        child.kill()
        child.wait(10)
        assert asyncio.run(linux.any_readable([high], 0)) is True  # exited: readable
    finally:
        os.close(high)
        os.close(pidfd)
        child.kill()
        child.wait(10)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --------------------------------------------------------------------------- no /proc children lists
def test_children_of_falls_back_to_parents_where_the_kernel_has_no_children_lists(monkeypatch) -> None:
    """Without CONFIG_PROC_CHILDREN every children file is missing: a live tree must not read as
    empty (a live group declared gone); the parents in /proc are read instead, and the daemon
    has a sentence to say so at start."""
    tree = subprocess.Popen(["sh", "-c", "sleep 1000 & sleep 1000 & wait"])
    try:
        want = wait_for(lambda: len(kids := linux.children_of(tree.pid)) == 2 and sorted(kids), 10,
                        "the shell's two children")
        assert linux.proc_children_note() is None  # this kernel has them
        monkeypatch.setattr(linux, "PROC_CHILDREN", False)
        assert sorted(linux.children_of(tree.pid)) == want
        assert sorted(p.pid for p in linux.descendants(tree.pid)) == want
        note = linux.proc_children_note()
        assert note is not None and "CONFIG_PROC_CHILDREN" in note, note
    finally:
        for pid in linux.children_of(tree.pid):
            os.kill(pid, signal.SIGKILL)
        tree.wait(10)


# --------------------------------------------------------------------------- test switches
@pytest.mark.parametrize("where, env, says", [
    ("outside the test suite", {testswitch.OPT_IN_ENV: ""}, "only in omnid's own test suite"),
    ("in a Kubernetes pod", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "Kubernetes"),
    ("in a Slurm job", {"SLURM_JOB_ID": "4242"}, "Slurm"),
])
def test_a_fault_injection_switch_is_ignored_outside_the_test_suite(daemon_factory, where, env, says) -> None:
    """OMNID_TEST_INJECT_FAULT makes the victim's spawn raise (its unit fails) in the test
    suite; elsewhere the daemon ignores it and says so once, naming the variable and why."""
    d = daemon_factory(make_stack({"victim": SLEEP}), env={testswitch.INJECT_FAULT_ENV: "spawn:victim", **env})
    d.wait_state("victim", "active")
    ignored = [e for e in d.log_events() if e.get("event") == "test switch ignored"]
    assert [e["env"] for e in ignored] == [testswitch.INJECT_FAULT_ENV], d.log()[-3000:]
    assert says in ignored[0]["reason"] and ignored[0]["level"] == "error", ignored
    assert "internal error" not in json.dumps(d.unit("victim")), d.unit("victim")
    assert not any(e.get("event") == "TEST FAULT INJECTION IS ON: an action will raise" for e in d.log_events())


def test_the_same_fault_injection_is_obeyed_in_the_test_suite(daemon_factory) -> None:
    """The other side of the gate (so the test above can fail): with the harness's opt-in."""
    d = daemon_factory(make_stack({"victim": SLEEP}), env={testswitch.INJECT_FAULT_ENV: "spawn:victim"})
    wait_for(lambda: d.unit("victim")["state"] == "failed", 20, f"victim failed (log:\n{d.log()[-3000:]})")
    assert not any(e.get("event") == "test switch ignored" for e in d.log_events())


def test_the_handover_corruption_switch_is_ignored_outside_the_test_suite(monkeypatch) -> None:
    from omnid.daemon import record

    monkeypatch.setenv(record.FAULT_ENV, "corrupt")
    for env, corrupt in (({}, True), ({"SLURM_JOB_ID": "7"}, False), ({testswitch.OPT_IN_ENV: "0"}, False)):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            fd = record.write({"format": record.FORMAT})
            try:
                data = os.read(fd, 1 << 16)
            finally:
                os.close(fd)
        assert data.startswith(b"\x00") is corrupt, (env, data[:40])


def test_the_fake_gpu_is_refused_in_a_kubernetes_pod(tmp_path: Path, monkeypatch) -> None:
    from omnid import gpu
    from omnid.gpu.fake import write_fake_gpu_file

    path = tmp_path / "gpu.json"
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "total_mib": 1000}], "processes": []})
    monkeypatch.setenv(gpu.FAKE_GPU_ENV, str(path))
    monkeypatch.delenv("SYSTEMD_EXEC_PID", raising=False)
    monkeypatch.setattr(gpu, "DRIVER_PATHS", ("/nonexistent/omnid-test-no-driver",))
    assert gpu.open_backend().kind == "fake"  # the suite's own opt-in: obeyed
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with structlog.testing.capture_logs() as logs:
        backend = gpu.open_backend()
    assert backend.kind == "none", backend
    [refused] = [e for e in logs if "refused" in e["event"]]
    assert "Kubernetes" in refused["reason"] and refused["log_level"] == "error", logs


# --------------------------------------------------------------------------- no scan of /proc on the loop
def _count_host_scans_on(monkeypatch, thread: threading.Thread) -> list[str]:
    """Every full /proc scan (linux.scan) made on `thread` (the event loop's), named by caller."""
    seen: list[str] = []
    real = linux.scan

    def scan() -> list[linux.ProcStat]:
        if threading.current_thread() is thread:
            seen.append(sys._getframe(1).f_code.co_name)
        return real()

    monkeypatch.setattr(linux, "scan", scan)
    return seen


def test_omnid_kill_of_a_unit_whose_leader_is_reaped_reads_no_host_wide_proc(monkeypatch) -> None:
    """`omnid kill` once a unit's main process exited and was reaped, its group still holding a
    child: the group's members are found among the spawner's descendants (and signalled), the
    host's whole /proc is not scanned on the loop."""
    from tests import insup

    scans = _count_host_scans_on(monkeypatch, threading.current_thread())
    # The child ignores SIGTERM, so the leftovers' SIGTERM leaves it for the kill.
    unit = ('exec = ["sh", "-c", "trap \'\' TERM; sleep 1000 & echo $! > %s; exit 0"]\nrestart = "no"\n'
            'leftover_timeout = 30\nstop_timeout = 2\nkill_timeout = 2\n')
    pidfile = Path(insup.__file__).parent.parent / f".small-holes-{os.getpid()}.pid"
    unit = unit % pidfile

    async def body(sup) -> None:
        rt = sup.units["u"]
        await insup.until(lambda: rt.proc is not None and rt.proc.reaped.is_set() and pidfile.exists()
                          and pidfile.read_text().strip(), 10, "u's leader reaped, its child left", sup)
        child = int(pidfile.read_text())
        assert linux.read_stat(child) is not None and linux.read_stat(child).pgid == rt.proc.pgid
        del scans[:]
        assert sup.requests.kill_unit("u", signal.SIGKILL) == ["u"], rt.reason
        await insup.until(lambda: (st := linux.read_stat(child)) is None or st.state in ("Z", "X"), 5,
                          "the leftover child killed", sup)
        assert scans == [], f"host-wide /proc scans on the loop: {scans}"

    try:
        insup.run({"u": unit}, body)
    finally:
        pidfile.unlink(missing_ok=True)


def test_an_exec_probe_that_leaves_a_child_has_it_killed_without_a_host_wide_scan(monkeypatch, tmp_path) -> None:
    """A liveness exec probe that exits 0 leaving a child in its group: the child is killed
    with it (the probe's group goes with it), and the loop never scans the host's /proc."""
    from tests import insup

    scans = _count_host_scans_on(monkeypatch, threading.current_thread())
    pids = tmp_path / "probe-children"
    unit = (SLEEP + f'liveness = {{ exec = ["sh", "-c", "sleep 1000 & echo $! >> {pids}; exit 0"], '
            'interval = 0.2, timeout = 5, failures = 3 }\n')

    async def body(sup) -> None:
        await insup.until(lambda: pids.exists() and len(pids.read_text().split()) >= 3, 15, "three probes run", sup)
        for pid in [int(p) for p in pids.read_text().split()][:2]:
            await insup.until(lambda: (st := linux.read_stat(pid)) is None or st.state in ("Z", "X"), 5,
                              f"probe child {pid} killed", sup)
        assert sup.units["u"].state.value == "active"
        assert scans == [], f"host-wide /proc scans on the loop: {scans}"

    insup.run({"u": unit}, body)


# --------------------------------------------------------------------------- the sweep waits on the kernel
class _Target:
    """A kill target whose members are what `find` says, counting the looks."""

    name = "sweep-test"

    def __init__(self, find) -> None:
        self.find = find
        self.looks = 0

    def members(self) -> list[Survivor]:
        self.looks += 1
        return self.find()


def _survivor(p: subprocess.Popen, start_time: int | None = None) -> list[Survivor]:
    st = linux.read_stat(p.pid)
    if st is None or st.state in ("Z", "X"):
        return []
    return [Survivor(p.pid, st.comm, st.state, "", "escaped", st.start_time if start_time is None else start_time)]


def test_the_sweep_is_woken_by_the_escapees_death() -> None:
    from omnid.process.termination import Termination

    child = subprocess.Popen(["sleep", "1000"])
    try:
        target = _Target(lambda: _survivor(child))
        term = Termination(target)  # type: ignore[arg-type]
        t0 = time.monotonic()
        left = asyncio.run(term.sweep(5.0))
        took = time.monotonic() - t0
        assert left == [] and term.rec.residue and child.wait(5) == -signal.SIGKILL, (left, term.rec)
        assert took < 1.0 and target.looks == 2, (took, target.looks)
    finally:
        child.kill()
        child.wait(10)


def test_the_sweep_keeps_its_bound_without_a_10ms_poll() -> None:
    """A member that cannot be proven (its start time is not the process's: a pid reused) is
    never signalled; the sweep reports it unkillable at kill_timeout, having looked at the
    target a few times with a growing pause, not every 10 ms (~100 looks in a second)."""
    from omnid.process.termination import Termination

    child = subprocess.Popen(["sleep", "1000"])
    try:
        real = linux.read_stat(child.pid).start_time
        target = _Target(lambda: _survivor(child, start_time=real + 1))
        term = Termination(target)  # type: ignore[arg-type]
        t0 = time.monotonic()
        left = asyncio.run(term.sweep(1.0))
        took = time.monotonic() - t0
        assert left and str(child.pid) in left[0], left
        assert 1.0 <= took < 1.8, took
        assert target.looks <= 15, target.looks
        assert child.poll() is None  # never signalled: not proven
    finally:
        child.kill()
        child.wait(10)


# --------------------------------------------------------------------------- status --verify and a reused group number
def _inactive(name: str, pgid: int):
    from types import SimpleNamespace

    from omnid.core.lifecycle import UnitState

    return SimpleNamespace(name=name, state=UnitState.INACTIVE, proc=None, last_pgid=pgid,
                           output=SimpleNamespace(attached=False), busy=False)


def test_verify_does_not_take_a_strangers_group_with_a_units_old_number_for_the_unit() -> None:
    """An inactive unit whose last process group number now names a stranger's group (pid
    reuse): not the unit's, not a violation. A group of that number below the spawner, in the
    unit's session, is reported (so the check can still fail)."""
    from omnid.core import invariants

    # The "spawner": a shell whose child made a session of its own, as a unit's main process does.
    spawner = subprocess.Popen(["sh", "-c", "setsid sleep 1000 & wait"])
    stranger = subprocess.Popen(["sleep", "1000"], start_new_session=True)  # not below the spawner
    try:
        [member] = wait_for(lambda: linux.children_of(spawner.pid), 10, "the spawner's child")
        wait_for(lambda: (st := linux.read_stat(member)) and st.sid == member and st.comm == "sleep", 10,
                 "the child in a session of its own")
        assert invariants.verify({"u": _inactive("u", stranger.pid)}, None, spawner_pid=spawner.pid) == []
        [problem] = invariants.verify({"u": _inactive("u", member)}, None, spawner_pid=spawner.pid)
        assert f"process group {member} is not empty" in problem, problem
        # Below another unit's live main process: that unit's, not this one's.
        assert invariants.verify({"u": _inactive("u", member)}, None, spawner_pid=spawner.pid,
                                 mains={member}) == []
    finally:
        stranger.kill()
        stranger.wait(10)
        for pid in linux.children_of(spawner.pid):
            os.kill(pid, signal.SIGKILL)
        spawner.wait(10)


# --------------------------------------------------------------------------- a Unix socket's directory and file
NOBODY = 65534


def _socket_unit(tmp_path: Path, path: Path, user: str | None = None):
    from omnid.model.unitmodel import ListenSocket, Unit

    return Unit(name="web", template="web", instance=0, instances=1, file=tmp_path / "web.toml", exec=("true",),
                user=user, sockets=(ListenSocket(listen=str(path), name="ctl", mode=0o660),))


def test_a_unix_socket_in_a_directory_another_user_can_write_is_refused_naming_unit_key_and_path(tmp_path) -> None:
    from omnid.process.sockets import BindError, HeldSockets, probe

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, NOBODY, NOBODY)  # another user's directory: they could put a link there
    path = shared / "web.sock"
    held = HeldSockets()
    try:
        with pytest.raises(BindError) as err:
            held.fds_for(_socket_unit(tmp_path, path))
    finally:
        held.close_all()
    msg = str(err.value)
    assert "unit web" in msg and "sockets[0]" in msg and str(path) in msg and "owned by nobody" in msg, msg
    assert not path.exists()
    [(index, why)] = probe(_socket_unit(tmp_path, path))  # omnid check says the same
    assert index == 0 and "owned by nobody" in why, why


def test_a_symlink_raced_into_a_unix_sockets_place_is_never_followed(tmp_path) -> None:
    """Another user swaps the socket's name for a link to a file of root's, as fast as they can,
    while the daemon binds (a directory of theirs, sticky or not): the bind is refused each
    time, and the file the link points at keeps its mode and owner."""
    from omnid.process.sockets import BindError, HeldSockets

    victim = tmp_path / "victim"
    victim.write_text("root's\n")
    victim.chmod(0o644)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    os.chown(shared, NOBODY, NOBODY)
    path = shared / "web.sock"
    stop = threading.Event()

    def attacker() -> None:
        while not stop.is_set():
            try:
                os.unlink(path)
            except OSError:
                pass
            try:
                os.symlink(victim, path)
            except OSError:
                pass

    t = threading.Thread(target=attacker)
    t.start()
    refused = 0
    try:
        for _ in range(50):
            held = HeldSockets()
            try:
                held.fds_for(_socket_unit(tmp_path, path))
            except BindError as exc:
                refused += "owned by nobody" in str(exc)
            finally:
                held.close_all()
    finally:
        stop.set()
        t.join(10)
    st = victim.stat()
    assert (st.st_mode & 0o7777, st.st_uid) == (0o644, 0), (oct(st.st_mode), st.st_uid)
    assert refused == 50, refused


def test_a_unix_socket_gets_its_mode_and_owner_without_a_process_wide_umask(tmp_path, monkeypatch) -> None:
    """The daemon has threads: os.umask changes every thread's mask, so a file another thread
    makes meanwhile would get the wrong mode. The socket's mode is set on the socket before the
    bind instead; the file ends with exactly its mode and the unit's user, whatever the umask."""
    from omnid.process.sockets import HeldSockets

    calls: list[int] = []
    real = os.umask
    monkeypatch.setattr(os, "umask", lambda m: calls.append(m) or real(m))
    path = tmp_path / "web.sock"
    old = real(0o077)  # narrower than the socket's 0660: set exactly all the same
    held = HeldSockets()
    try:
        held.fds_for(_socket_unit(tmp_path, path, user="nobody"))
        st = os.lstat(path)
        assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o660, NOBODY, NOBODY), (oct(st.st_mode), st.st_uid)
    finally:
        held.close_all()
        real(old)
    assert calls == [], f"os.umask called during the bind: {calls}"


# --------------------------------------------------------------------------- users and groups: asked once, off the loop
def test_a_spawn_as_another_user_asks_nss_nothing_on_the_loop(monkeypatch, tmp_path) -> None:
    """NSS may be LDAP and hang: a unit's user and group are resolved when the stack is read,
    and its spawns (the socket file's owner, the spawner's switch) read that answer. The unit
    runs as nobody, its socket file is nobody's, and no lookup ran on the event loop."""
    import grp
    import pwd

    from tests import insup

    sock = tmp_path / "u.sock"
    unit = SLEEP + f'user = "nobody"\nsockets = [{{ listen = "{sock}", name = "ctl" }}]\n'
    asked: list[str] = []

    async def body(sup) -> None:
        loop_thread = threading.current_thread()
        for mod, name in ((pwd, "getpwnam"), (grp, "getgrnam"), (os, "getgrouplist"), (os, "initgroups")):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _n=name, _r=real: (
                asked.append(f"{_n}{a}") if threading.current_thread() is loop_thread else None) or _r(*a))
        rt = sup.units["u"]
        await insup.until(lambda: rt.state.value == "active" and rt.proc is not None, 10, "u active", sup)
        status = Path(f"/proc/{rt.proc.pid}/status").read_text()
        uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
        try:
            assert uid == str(NOBODY) and os.lstat(sock).st_uid == NOBODY, (uid, os.lstat(sock))
            assert asked == [], f"NSS lookups on the loop at the spawn: {asked}"
        finally:
            sup.sockets.close_all()  # insup's supervisor has no daemon to close them

    insup.run({"u": unit}, body)


def test_the_fake_sysfs_switch_is_ignored_outside_the_test_suite(tmp_path: Path, monkeypatch) -> None:
    from omnid.process import numa

    monkeypatch.setenv(numa.SYSFS_ROOT_ENV, str(tmp_path))
    assert numa.sysfs_root() == str(tmp_path)  # the suite's own opt-in
    monkeypatch.setenv(testswitch.OPT_IN_ENV, "")
    assert numa.sysfs_root() == "/"
