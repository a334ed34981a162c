"""A process whose memory lock (mmap_lock) is held for as long as a test wants: the case where
reading its /proc/PID/environ or cmdline waits in the kernel, whoever reads it.

How a process gets there on its own: one of its threads faults on a page of a file whose
FUSE server never answers the read, with the lock held (a read of /proc/self/mem at that
page: the kernel's remote access cannot drop the lock to wait for the I/O, as a plain fault
does), and another thread calls mmap, which waits for the lock as a writer. From then on every
reader of the lock queues behind the writer: environ, cmdline, anyone's.

`ReadStallFs` is a FUSE server (a thread of the test process) that answers the mount, a
lookup, getattr and open of one file, `weights.bin`, and never answers a READ. `held_mm_lock`
starts a process that maps the file and does the above, and returns once it waits;
`release()` aborts the FUSE connection (every waiter gets ENOTCONN), so the process can be
killed and the mount goes. Never leave one behind: every process scan on the host (a leak
check that reads each process's environment) would wait on it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

from omnid.base import linux
from tests.harness import wait_for
from tests.hung import fuse_available

_libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2

# FUSE opcodes (linux/fuse.h)
LOOKUP, FORGET, GETATTR, OPEN, READ, STATFS, RELEASE, FLUSH, INIT = 1, 2, 3, 14, 15, 17, 18, 25, 26
OPENDIR, READDIR, RELEASEDIR, ACCESS, INTERRUPT, DESTROY, BATCH_FORGET = 27, 28, 29, 34, 36, 38, 42
IN_HEADER = struct.Struct("=IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
OUT_HEADER = struct.Struct("=IiQ")  # len error unique
ATTR = struct.Struct("=QQQQQQIIIIIIIIII")  # ino size blocks a/m/ctime, nsecs, mode nlink uid gid rdev blksize flags
FILE_NAME = "weights.bin"
FILE_INO = 2
FILE_SIZE = 1 << 20


def _attr(ino: int) -> bytes:
    mode = 0o40755 if ino == 1 else 0o100644
    size = 0 if ino == 1 else FILE_SIZE
    return ATTR.pack(ino, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


class ReadStallFs:
    """One directory with one file; every READ is read from the device and never answered."""

    def __init__(self) -> None:
        why = fuse_available()
        if why:
            raise RuntimeError(f"cannot mount FUSE: {why}")
        self.mnt = tempfile.mkdtemp(prefix="omnid-mmlock-")
        self.dev = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        self.reads = 0  # READs taken and left unanswered
        self._aborted = False
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        opts = f"fd={self.dev},rootmode=40000,user_id=0,group_id=0".encode()
        if _libc.mount(b"omnid-mmlock", self.mnt.encode(), b"fuse", ctypes.c_ulong(MS_NOSUID | MS_NODEV), opts):
            err = ctypes.get_errno()
            self._close_fds()
            os.rmdir(self.mnt)
            raise RuntimeError(f"cannot mount FUSE on {self.mnt}: {os.strerror(err)}")
        self._thread = threading.Thread(target=self._serve, name="mmlock-fuse", daemon=True)
        self._thread.start()

    @property
    def path(self) -> str:
        return os.path.join(self.mnt, FILE_NAME)

    def _reply(self, unique: int, error: int = 0, body: bytes = b"") -> None:
        try:
            os.write(self.dev, OUT_HEADER.pack(OUT_HEADER.size + len(body), -error, unique) + body)
        except OSError:
            pass  # the request was interrupted, or the connection is gone

    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.dev, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                msg = os.read(self.dev, 1 << 21)
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                return  # ENODEV: aborted
            _len, op, unique, node, *_ = IN_HEADER.unpack_from(msg)
            arg = msg[IN_HEADER.size:]
            if op == INIT:
                major, minor, readahead, flags = struct.unpack_from("=IIII", arg)
                out = struct.pack("=IIIIHHIIHHII", 7, min(minor, 31), readahead, 0, 16, 12, 1 << 17, 1,
                                  0, 0, 0, 0) + b"\0" * 24
                self._reply(unique, body=out)
            elif op == LOOKUP:
                name = arg.split(b"\0", 1)[0].decode()
                if node == 1 and name == FILE_NAME:
                    self._reply(unique, body=struct.pack("=QQQQII", FILE_INO, 0, 3600, 3600, 0, 0) + _attr(FILE_INO))
                else:
                    self._reply(unique, errno.ENOENT)
            elif op == GETATTR:
                self._reply(unique, body=struct.pack("=QII", 3600, 0, 0) + _attr(node))
            elif op in (OPEN, OPENDIR):
                self._reply(unique, body=struct.pack("=QII", 1, 0, 0))
            elif op == READ:
                self.reads += 1  # never answered: the stall
            elif op in (FORGET, BATCH_FORGET, INTERRUPT):
                pass  # no reply (an INTERRUPT of a READ is ignored: the READ stays out)
            elif op in (RELEASE, RELEASEDIR, FLUSH):
                self._reply(unique)
            else:
                self._reply(unique, errno.ENOSYS)

    def _close_fds(self) -> None:
        for fd in (self.dev, self._stop_r, self._stop_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def abort(self) -> None:
        """Abort the connection (every waiting request ends with ENOTCONN) and unmount (once)."""
        if self._aborted:
            return
        self._aborted = True
        os.write(self._stop_w, b"x")
        self._thread.join(5)
        _libc.umount2(self.mnt.encode(), MNT_DETACH)
        self._close_fds()
        try:
            os.rmdir(self.mnt)
        except OSError:
            pass


# argv: the FUSE file, the go file, the pid file, "setsid" or "stay". Once the READ is out (the
# test sees it at the server), the test writes 1 to the go file and the writer thread starts.
HOLDER = textwrap.dedent("""
    import ctypes, mmap, os, sys, threading, time
    path, go, pidfile, how = sys.argv[1:5]
    if how == "setsid":
        os.setsid()  # an escaped orphan: its own session, its parent gone
    with open(pidfile + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pidfile + ".tmp", pidfile)
    f = open(path, "rb")
    m = mmap.mmap(f.fileno(), 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    mem = os.open("/proc/self/mem", os.O_RDONLY)

    def load_weights():  # the fault that holds the memory lock while the READ is out
        os.pread(mem, 1, addr)

    def grow_heap():  # waits for the lock as a writer: every reader queues behind it
        mmap.mmap(-1, 1 << 20)

    threading.Thread(target=load_weights, daemon=True).start()
    while open(go).read().strip() != "1":
        time.sleep(0.01)
    threading.Thread(target=grow_heap, daemon=True).start()
    while True:
        time.sleep(3600)
""")


def holder_script(directory: str) -> str:
    """The holder program, written to `directory` (readable by every user)."""
    path = os.path.join(directory, "holder.py")
    with open(path, "w") as f:
        f.write(HOLDER)
    os.chmod(path, 0o644)
    return path


def holder_argv(fs: ReadStallFs, directory: str, setsid: bool = False) -> tuple[list[str], str, str]:
    """(argv, go file, pid file) of a holder of fs's file whose files live in `directory`."""
    go, pidfile = os.path.join(directory, "go"), os.path.join(directory, "holder.pid")
    with open(go, "w") as f:
        f.write("0")
    return [sys.executable, holder_script(directory), fs.path, go, pidfile, "setsid" if setsid else "stay"], go, pidfile


def _task_states(pid: int) -> list[tuple[str, str]]:
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                wchan = f.read().strip()
        except OSError:
            continue
        out.append((state, wchan))
    return out


_readers: list[threading.Thread] = []  # reads of the test's own that wait on a held lock


def join_readers(timeout: float = 10.0) -> list[str]:
    """Wait (after release) for the test's own reads that waited on the lock; the names of
    those still out (each holds an fd the leak check would count)."""
    deadline = time.monotonic() + timeout
    for t in _readers:
        t.join(max(0.0, deadline - time.monotonic()))
    left = [t.name for t in _readers if t.is_alive()]
    _readers[:] = [t for t in _readers if t.is_alive()]
    return left


def _timed_read(path: str, within: float) -> float | None:
    """Seconds a read of `path` took, None when it did not return within `within` (the read
    goes on, on a thread join_readers waits for)."""
    done = threading.Event()
    took: list[float] = []

    def read() -> None:
        t0 = time.monotonic()
        try:
            with open(path, "rb") as f:
                f.read()
        except OSError:
            pass
        took.append(time.monotonic() - t0)
        done.set()

    t = threading.Thread(target=read, name=f"read {path}", daemon=True)
    _readers.append(t)
    t.start()
    return took[0] if done.wait(within) else None


def environ_blocks(pid: int, within: float = 0.3) -> bool:
    """Does a read of pid's /proc/PID/environ not return within `within`?"""
    return _timed_read(f"/proc/{pid}/environ", within) is None


def wait_held(fs: ReadStallFs, pid: int, go_file: str, timeout: float = 15.0) -> None:
    """Wait until pid's fault is out (the server took its READ), let its writer go, and wait
    until a reader of its memory lock waits (an environ read that does not return)."""
    wait_for(lambda: fs.reads > 0, timeout, lambda: f"a READ from pid {pid} (tasks {_task_states(pid)})")
    with open(go_file, "w") as f:
        f.write("1")
    wait_for(lambda: any(s == "D" and ("mmap" in w or "down_write" in w) for s, w in _task_states(pid)),
             timeout, lambda: f"a thread of pid {pid} waiting in mmap (tasks {_task_states(pid)})")
    assert environ_blocks(pid), f"pid {pid}: its environ is readable: the memory lock is not held"


def read_timings(pid: int, names: list[str], within: float = 0.5) -> dict[str, float | None]:
    """Seconds each /proc/PID/<name> read took, None when it did not return within `within`."""
    return {name: _timed_read(f"/proc/{pid}/{name}", within) for name in names}
