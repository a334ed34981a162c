"""A spawn stuck on a hung path fails its unit after its bound and freezes nothing else.

One unit's cwd is under a FUSE mount whose server never answers (its chdir waits in D state);
16 other units start, are SIGKILLed, are seen dead and restart on time while that spawn is
still out; then the stuck spawn fails naming the bound, and nothing is left. Run on the
compiled spawn path (vfork: the case that froze the spawner) and on the Python one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import zmq

from omnid.base import linux
from omnid.process.spawnexec import SPAWN_EXEC_TIMEOUT_S
from tests.harness import alive, make_stack, wait_for
from tests.hung import fuse_available, hung_fuse_mount, hung_fuse_mount_at

N = 16


def d_state_in_fuse(spawner: int) -> list[int]:
    """The spawner's children in D state waiting on FUSE (from /proc; a child that has not
    exec'd yet carries the spawner's environment, not the unit's)."""
    out = []
    for pid in linux.children_of(spawner):
        st = linux.read_stat(pid)
        if st is None or st.state != "D":
            continue
        try:
            with open(f"/proc/{pid}/wchan") as f:
                if f.read().startswith("fuse"):
                    out.append(pid)
        except OSError:
            pass
    return out


@pytest.fixture
def hung_mount():
    why = fuse_available()
    if why:
        pytest.skip(f"needs a FUSE mount: {why}")
    mnt, unmount = hung_fuse_mount()
    yield mnt
    unmount()


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_a_spawn_on_a_hung_mount_fails_after_its_bound_and_freezes_nothing_else(path, hung_mount, daemon_factory):
    units = {f"w{i:02d}": 'exec = ["sleep", "1000"]\nrestart = "always"\nrestart_sec = 0.1\n' for i in range(N)}
    units["stuck"] = f'exec = ["sleep", "1000"]\ncwd = "{hung_mount}/models"\nrestart = "no"\n'
    env = {"OMNID_SPAWNER_PYTHON": "1"} if path == "python" else {}
    t0 = time.monotonic()  # before the daemon: its first tier's spawns go out before its control socket is there
    d = daemon_factory(make_stack(units), env=env)
    ready = wait_for(lambda: next((e for e in d.log_events() if e.get("event") == "daemon ready"), None), 10,
                     "daemon ready")
    spawner = ready["spawner_pid"]
    if path == "compiled" and d.ok("status")["daemon"]["spawner_exec_path"] != "compiled":
        pytest.skip("omnid.process._spawnc is not built here (python setup.py build_ext --inplace)")
    assert d.ok("status")["daemon"]["spawner_exec_path"] == path
    workers = wait_for(lambda: (us := d.units()) and all(us[w]["state"] == "active" for w in us if w != "stuck")
                       and us, 20, "the 16 others active")
    stuck = wait_for(lambda: d_state_in_fuse(spawner), 5, "the stuck unit's child in D state on the mount")
    assert workers["stuck"]["state"] == "inactive", workers["stuck"]
    # every other unit is killed, seen dead and restarted while the stuck spawn is out
    old = {w: workers[w]["pid"] for w in workers if w != "stuck"}
    t_kill = time.monotonic()
    for pid in old.values():
        fd = os.pidfd_open(pid)
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        os.close(fd)
    back = wait_for(lambda: (us := d.units()) and all(us[w]["state"] == "active" and us[w]["pid"] != old[w]
                                                      for w in old) and us, 10, "the 16 restarted")
    took = time.monotonic() - t_kill
    assert back["stuck"]["state"] == "inactive" and d_state_in_fuse(spawner) == stuck, \
        "the restarts must happen while the stuck spawn is still out"
    assert took < 5.0, took
    # a stop of the stuck unit is honoured once its spawn answers: the spawn fails after its
    # bound, naming it (its child is killed), and the stop leaves the unit inactive
    reply = d.call("stop", {"units": ["stuck"]}, timeout=SPAWN_EXEC_TIMEOUT_S + 15)
    failed_after = time.monotonic() - t0
    assert reply["ok"] and d.unit("stuck")["state"] == "inactive", (reply, d.log()[-2000:])
    failed = [e for e in d.log_events() if e.get("event") == "unit state" and e.get("unit") == "stuck"
              and e.get("to") == "failed"]
    assert failed and failed[0]["reason"].startswith("spawn timed out: no exec within 10 s"), failed
    wait_for(lambda: not d_state_in_fuse(spawner), 5, "the stuck child gone")
    assert SPAWN_EXEC_TIMEOUT_S - 1 <= failed_after <= SPAWN_EXEC_TIMEOUT_S + 15, failed_after
    print(f"\n[{path}] 16 killed -> 16 active again: {took * 1000:.0f} ms while the stuck spawn was out; "
          f"stuck failed {failed_after:.1f} s after the daemon's start")


def test_a_mount_made_after_the_spawner_read_the_table_is_seen_at_the_next_spawn(tmp_path, daemon_factory):
    """The spawner keeps the mount table it read until the kernel says it changed (POLLPRI on
    /proc/self/mountinfo). A hung mount made on a unit's cwd after the table was read must
    still send that unit's spawn down the forked path: on the vfork path the spawner would
    wait for the child's chdir for good, and the next unit's restart with it."""
    why = fuse_available()
    if why:
        pytest.skip(f"needs a FUSE mount: {why}")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    d = daemon_factory(make_stack({
        "w": 'exec = ["sleep", "1000"]\nrestart = "always"\nrestart_sec = 0\nstart_limit_burst = 100\n',
        "later": f'exec = ["sleep", "1000"]\ncwd = "{mnt}/models"\nrestart = "no"\n'}))
    w = d.wait_state("w", "active")
    d.wait_state("later", "failed")  # its cwd does not exist yet: the table has been read by now
    if d.ok("status")["daemon"]["spawner_exec_path"] != "compiled":
        pytest.skip("omnid.process._spawnc is not built here (python setup.py build_ext --inplace)")
    unmount = hung_fuse_mount_at(str(mnt))
    try:
        rep = d.call("start", {"units": ["later"], "timeout": 1})
        assert not rep["ok"] or d.unit("later")["state"] != "active", rep
        spawner = w["pid"] and linux.read_stat(w["pid"]).ppid
        wait_for(lambda: d_state_in_fuse(spawner), 5, "later's child in D state on the mount")
        os.kill(w["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: (u := d.unit("w"))["state"] == "active" and u["pid"] != w["pid"], 10,
                 lambda: f"w restarted while later's spawn is out (the spawner vforked onto the mount?); "
                         f"log:\n{d.log()[-3000:]}")
        print(f"\nw restarted {1000 * (time.monotonic() - t0):.0f} ms after its death, beside the stuck spawn")
        d.call("stop", {"units": ["later"]}, timeout=SPAWN_EXEC_TIMEOUT_S + 15)
        wait_for(lambda: not d_state_in_fuse(spawner), 10, "later's child gone")
    finally:
        unmount()


@pytest.mark.fast
def test_which_spawns_are_forked_rather_than_vforked():
    """The mount that holds a path (the longest mount point above it, the last mounted) decides;
    the cwd and every program the child may execve count; a local mount inside a network one
    is local. Read from a mount table written by hand (no path is touched)."""
    from omnid.process.spawnplan import may_hang

    mounts = [("/", "ext4"), ("/mnt/nfs", "nfs4"), ("/mnt/nfs/local", "ext4"), ("/data", "fuse.sshfs"),
              ("/mnt/my dir", "cifs")]
    assert may_hang({"cwd": "/mnt/nfs/x", "argv": ["/bin/sleep"]}, mounts) == "/mnt/nfs/x (nfs4)"
    assert may_hang({"cwd": "/mnt/nfs/local/x", "argv": ["/bin/sleep"]}, mounts) is None
    assert may_hang({"cwd": "/mnt/nfsx", "argv": ["./a"]}, mounts) is None  # a prefix, not a parent
    assert may_hang({"cwd": "/tmp", "argv": ["/data/bin/serve"]}, mounts) == "/data/bin/serve (fuse.sshfs)"
    assert may_hang({"cwd": "/data", "argv": ["/bin/true"]}, mounts) == "/data (fuse.sshfs)"
    # a bare name: every directory of the unit's PATH, unless the daemon found the program already
    path_env = {"PATH": "/usr/bin:/data/bin"}
    assert may_hang({"cwd": "/tmp", "argv": ["serve"], "env": path_env}, mounts) == "/data/bin/serve (fuse.sshfs)"
    assert may_hang({"cwd": "/tmp", "argv": ["serve"], "path": "/usr/bin/serve", "env": path_env}, mounts) is None
    assert may_hang({"cwd": "/mnt/my dir/w", "argv": ["/bin/true"]}, mounts) == "/mnt/my dir/w (cifs)"
    assert may_hang({"cwd": "/tmp", "argv": ["/bin/true"]}, mounts) is None


def test_the_mount_table_is_read_with_its_escapes(tmp_path):
    """A mount point with a space is listed as \\040 by the kernel: read back as written."""
    import ctypes

    from omnid.process.spawnplan import mounts as _mounts

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    libc = ctypes.CDLL(None, use_errno=True)
    where = tmp_path / "my models"
    where.mkdir()
    if libc.mount(b"omnid-test", str(where).encode(), b"tmpfs", 0, b"size=1m") != 0:
        pytest.skip(f"cannot mount a tmpfs here: {os.strerror(ctypes.get_errno())}")
    try:
        assert (str(where), "tmpfs") in _mounts()
    finally:
        libc.umount2(str(where).encode(), 2)


def daemon_threads_on_fuse(pid: int) -> list[int]:
    """The daemon's threads waiting on FUSE (from /proc/PID/task/*/wchan)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                if f.read().startswith("fuse"):
                    out.append(int(tid))
        except OSError:
            pass
    return out


def test_checks_stuck_on_a_hung_mount_hold_threads_of_their_own_and_never_the_daemons_exit(hung_mount, daemon_factory):
    """`check` of a directory on a hung mount leaves a read in the kernel (the request itself
    times out on its own). Before, such reads took the event loop's shared worker threads, and
    after SIGTERM the daemon stopped its units in 4 ms and then never exited (asyncio.run's end,
    then the interpreter's, joined the stuck thread). Now each read has a thread of its own that
    the exit does not wait for, and past two stuck reads a new one is refused at once, naming
    the oldest."""
    d = daemon_factory(make_stack({"a": 'exec = ["sleep", "1000"]\n'}))
    d.wait_all_active(30)
    unit_pid = d.unit("a")["pid"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{d.control}")
        for n in (1, 2):
            sock.send(json.dumps({"id": n, "cmd": "check", "args": {"units_dir": f"{hung_mount}/units{n}"}}).encode())
        stuck = wait_for(lambda: len(daemon_threads_on_fuse(d.pid)) == 2 and daemon_threads_on_fuse(d.pid), 10,
                         "two daemon threads waiting on the mount")
        sock.send(json.dumps({"id": 3, "cmd": "check", "args": {"units_dir": f"{hung_mount}/units3"}}).encode())
        assert sock.poll(10_000), "the third check was not answered at once"
        third = json.loads(sock.recv())
        assert third["id"] == 3 and third["error"]["code"] == "busy", third
        assert f"the oldest, check {hung_mount}/units1, has been out for" in third["error"]["message"], third
        assert daemon_threads_on_fuse(d.pid) == stuck, "the refused check started no read"
        assert d.ok("status")["units"], "the daemon answers beside the stuck reads"
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        try:
            code = d.proc.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the daemon did not exit 60 s after SIGTERM (threads on the mount: "
                                 f"{daemon_threads_on_fuse(d.pid)}); its log ends:\n{d.log()[-3000:]}") from None
    finally:
        sock.close(0)
        ctx.term()
    took = time.monotonic() - t0
    print(f"\nthreads {stuck} stuck on the mount; third check refused: {third['error']['message']}\n"
          f"the daemon exited {took:.1f} s after SIGTERM, code {code}")
    assert code == 0, d.log()[-3000:]
    assert not alive(unit_pid)
    assert not [e for e in d.log_events() if e.get("event") == "exiting without what did not end in time"], \
        d.log()[-3000:]
