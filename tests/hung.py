"""Real hung processes for the hang-forensics tests and bench/forensics_numbers.py: a
Python process spinning with 16 threads, one blocked in read(2) on a pipe, a SIGSTOPped
one, a 64-process unit (a process group with 63 children), and one in D state (a FUSE
mount whose server never answers: every lookup waits, killable, in fuse_get_req).

Each builder returns a `Hung` with the processes as forensics Members; `close()` kills
them through pidfds and reaps them (and takes the FUSE mount down).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

from omnid.base import linux
from omnid.forensics.capture import Member
from tests.harness import wait_for

SPIN = textwrap.dedent("""
    import threading

    def wait_for_work(ev):
        ev.wait()

    for i in range({idle}):
        threading.Thread(target=wait_for_work, args=(threading.Event(),), name=f"idle-{{i}}", daemon=True).start()

    def engine_step():
        n = 0
        while True:
            n += sum(range(64))

    engine_step()
""")

READ_PIPE = textwrap.dedent("""
    import os

    def wait_for_request():
        return os.read(0, 1)

    wait_for_request()
""")


def _state(pid: int) -> str:
    st = linux.read_stat(pid)
    return st.state if st else "gone"


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass
class Hung:
    procs: list[subprocess.Popen]
    members: list[Member]
    cleanup: list = field(default_factory=list)  # callables run after the processes are gone

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    fd = os.pidfd_open(p.pid)
                except ProcessLookupError:
                    continue
                linux.pidfd_send_signal(fd, signal.SIGKILL)
                os.close(fd)
        # A FUSE reader dies of SIGKILL (its wait is killable); the mount goes after.
        for p in self.procs:
            p.wait(timeout=10)
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    f.close()
        for fn in self.cleanup:
            fn()

    def __enter__(self) -> Hung:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _member(p: subprocess.Popen, why: str) -> Member:
    st = linux.read_stat(p.pid)
    assert st is not None, f"pid {p.pid} exited at once"
    return Member(p.pid, st.start_time, why)


def spinning_python(threads: int = 16) -> Hung:
    """A Python process spinning in engine_step() with `threads` threads in all."""
    p = subprocess.Popen([sys.executable, "-c", SPIN.format(idle=threads - 1)], start_new_session=True)
    wait_for(lambda: len(os.listdir(f"/proc/{p.pid}/task")) >= threads, 10, f"{threads} threads in pid {p.pid}")
    return Hung([p], [_member(p, "main")])


def blocked_in_read() -> Hung:
    """A Python process blocked in read(2) on a pipe nobody writes."""
    p = subprocess.Popen([sys.executable, "-c", READ_PIPE], stdin=subprocess.PIPE, start_new_session=True)
    wait_for(lambda: "pipe" in linux.wchan(p.pid) or _state(p.pid) == "S" and linux.wchan(p.pid) not in ("0", "?"),
             10, f"pid {p.pid} blocked in read")
    return Hung([p], [_member(p, "main")])


def stopped_python() -> Hung:
    """A Python process stopped by SIGSTOP (in its read of a pipe)."""
    h = blocked_in_read()
    os.kill(h.pid, signal.SIGSTOP)
    wait_for(lambda: _state(h.pid) == "T", 10, f"pid {h.pid} stopped")
    return h


def process_group(size: int = 64, python: bool = False) -> Hung:
    """A unit of `size` processes: a leader and size - 1 children in its process group
    (each `sleep`, or an idle Python process with python=True)."""
    argv = ([sys.executable, "-c", "import time\ndef idle():\n    time.sleep(1e6)\nidle()"] if python
            else ["sleep", "1000000"])
    leader = subprocess.Popen(argv, process_group=0)
    procs = [leader]
    try:
        for _ in range(size - 1):
            procs.append(subprocess.Popen(argv, process_group=leader.pid))
        if python:
            # py-spy needs the interpreter up; wait until each is asleep in its sleep().
            wait_for(lambda: all(_state(p.pid) == "S" and linux.wchan(p.pid) not in ("0", "?", "")
                                 for p in procs), 30, f"{size} Python processes idle")
    except BaseException:
        Hung(procs, []).close()
        raise
    members = [_member(leader, "main")] + [_member(p, f"process group {leader.pid}") for p in procs[1:]]
    return Hung(procs, members)


_libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2


def fuse_available() -> str | None:
    """None when a D-state process can be made here, else why not."""
    if os.geteuid() != 0:
        return "mounting FUSE needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    with open("/proc/filesystems") as f:
        if not any(line.split()[-1] == "fuse" for line in f if line.strip()):
            return "the kernel has no fuse filesystem"
    return None


def hung_fuse_mount() -> tuple[str, Callable[[], None]]:
    """A FUSE mount whose server never answers INIT: every lookup under it (a chdir, an execve)
    waits, killable, in fuse_get_req. Returns (mount point, unmount)."""
    mnt = tempfile.mkdtemp(prefix="omnid-fuse-")
    try:
        unmount = hung_fuse_mount_at(mnt)
    except BaseException:
        os.rmdir(mnt)
        raise

    def unmount_and_remove() -> None:
        unmount()
        os.rmdir(mnt)

    return mnt, unmount_and_remove


def hung_fuse_mount_at(mnt: str) -> Callable[[], None]:
    """The same mount on an existing directory `mnt` (as a unit's user could make one with
    fusermount on a directory it owns); returns unmount."""
    why = fuse_available()
    if why:
        raise RuntimeError(f"cannot make a hung mount: {why}")
    dev = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    opts = f"fd={dev},rootmode=40000,user_id=0,group_id=0".encode()
    if _libc.mount(b"omnid-test", mnt.encode(), b"fuse", ctypes.c_ulong(MS_NOSUID | MS_NODEV), opts) != 0:
        err = ctypes.get_errno()
        os.close(dev)
        raise RuntimeError(f"cannot mount FUSE on {mnt}: {os.strerror(err)}")

    def unmount() -> None:
        os.close(dev)  # the last fd of the connection: aborts it, every waiter gets ENOTCONN
        _libc.umount2(mnt.encode(), MNT_DETACH)

    return unmount


def in_d_state() -> Hung:
    """A Python process in D state: it looks up a file on a FUSE mount whose server never
    answers INIT, so the request waits (TASK_KILLABLE, shown as D) in fuse_get_req."""
    why = fuse_available()
    if why:
        raise RuntimeError(f"cannot make a D-state process: {why}")
    mnt, unmount = hung_fuse_mount()
    code = f"import os\ndef load_weights():\n    os.stat({mnt + '/model.bin'!r})\nload_weights()\n"
    try:
        p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    except BaseException:
        unmount()
        raise
    h = Hung([p], [], [unmount])
    try:
        # In D state *in FUSE*: a starting interpreter under load is in D for a moment too
        # (waiting on the disk for its own pages), and would be taken for the hang.
        wait_for(lambda: _state(p.pid) == "D" and _wchan(p.pid).startswith("fuse"), 10,
                 f"pid {p.pid} in D state in FUSE")
        # The interpreter is up once it waits on the mount: py-spy can read it.
        h.members.append(_member(p, "main"))
    except BaseException:
        h.close()
        raise
    return h
