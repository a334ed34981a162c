"""Closing fds that came from outside without letting a close stop the event loop, and
without letting a sender fill the daemon's fd table.

`close()` is a system call that can wait as long as someone else decides. An fd received
over a socket (the notify socket takes datagrams from any local process; the fd store keeps
what units hand over) may be:

- a file on a FUSE filesystem whose server never answers the FLUSH that close() sends;
- a TCP socket with SO_LINGER set and unsent data towards a peer that does not read: close()
  waits up to the linger time (hours, if the sender asked);
- a Unix socket whose receive queue holds such fds in flight (they are released, and waited
  for, by the thread that drops the socket).

Closed on the daemon's loop, any of these would stop death detection, /health and the
control socket for as long as the sender likes. So an fd of foreign origin is closed here:
at once, on the spot, when it is a kind whose close cannot wait, otherwise by a small pool
of closer threads. A close that takes over a second is logged with what the fd was. The
pool grows to MAX_THREADS while every thread is busy (one stuck close must not hold up the
others); past that, fds wait in the queue, counted.

Closed at once: what holds no peer, no filesystem and no fd in flight, judged by what the
sender cannot change after it sent the fd: its /proc link, our own fdinfo (flags, mount
id), F_GET_SEALS and, on a local filesystem only, fstat. A pipe, any anonymous inode
(eventfd, timerfd, pidfd, epoll, ...), a memory file (memfd, tmpfs, hugetlbfs), an O_PATH
fd, a regular file, directory or FIFO on a local filesystem (ext4, xfs, btrfs, tmpfs, ...),
a UDP, raw, netlink or packet socket. A TCP socket is never closed on the spot: whoever
still holds a copy can set SO_LINGER between our look and our close.

The queue is the fd table's exposure: a thread's close() takes the number out of the table
before it waits, but a queued fd holds its number. Once every thread is stuck (16 lingering
sockets do it) the queue only grows, so it is capped: `room()` says how many more fds may
be taken, and the notify socket stops reading (the senders wait in the kernel) while a
datagram's worth of fds would not fit under MAX_WAITING. What is already received is never
dropped unclosed: `close()` always takes the fd.

Not done: TCP_REPAIR on a received TCP socket (root may set it; its close is then an abort,
0.1 ms instead of the linger, bench/tcp_repair_close.py). A local user gets round it at no
cost: a socket of its own user and network namespace (it clears TCP_REPAIR again), or one
inside a Unix socket it sends instead (2 s either way for a 2 s linger); and it would change
a socket whose sender may still use it. So the cap and the pause stay, and what the pause
costs units is answered where they are judged.

While the reader is stopped, what it would have read is unheard: a unit's watchdog ping or
READY=1 waits in the kernel behind a stranger's datagrams. `unheard` records when the reader
stopped and read again, so that a deadline judged on what a unit says (the watchdog, the
start's ready_timeout) is not judged on a silence a stranger made.

Only fds the daemon received from outside go through here; its own (pipes it made, the
spawner's socket, listening sockets it bound) are closed directly.
"""

from __future__ import annotations

import collections
import fcntl
import os
import socket
import stat
import threading
import time

import structlog

log = structlog.get_logger("omnid.base.closer")

MAX_THREADS = 16
MAX_WAITING = 1024  # fds from outside waiting for a closer thread: past this, nothing more is read
SLOW_S = 1.0
# Kinds whose close releases a kernel object and nothing else: no filesystem, no peer, no
# fd in flight inside them.
_QUICK = ("pipe:[", "anon_inode:", "pidfd:")
# Filesystems whose flush and release ask no server and wait on no peer.
_LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs", "ramfs", "hugetlbfs",
                       "devtmpfs", "proc", "sysfs", "cgroup2"})
_QUICK_SOCKETS = {(socket.AF_INET, socket.SOCK_DGRAM), (socket.AF_INET6, socket.SOCK_DGRAM),
                  (socket.AF_INET, socket.SOCK_RAW), (socket.AF_INET6, socket.SOCK_RAW)}
_QUICK_FAMILIES = (socket.AF_NETLINK, socket.AF_PACKET)
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
MOUNTS_REREAD_S = 1.0  # an unknown mount id re-reads mountinfo at most this often


class _Mounts:
    """mount id -> filesystem type, from our own /proc/self/mountinfo (no other process's
    lock). An id not listed (a mount made since, or the kernel's internal ones) re-reads it,
    at most once a second; still unknown, the fd goes to a thread."""

    def __init__(self) -> None:
        self._types: dict[int, str] = {}
        self._read_at = -MOUNTS_REREAD_S

    def fstype(self, mnt_id: int) -> str | None:
        fs = self._types.get(mnt_id)
        now = time.monotonic()
        if fs is None and now - self._read_at >= MOUNTS_REREAD_S:
            self._read_at = now
            types: dict[int, str] = {}
            try:
                with open("/proc/self/mountinfo", "rb") as f:
                    for line in f:
                        head, _, tail = line.partition(b" - ")
                        if tail:
                            types[int(head.split(b" ", 1)[0])] = tail.split(b" ", 1)[0].decode(errors="replace")
            except (OSError, ValueError):
                return None
            self._types = types
            fs = types.get(mnt_id)
        return fs


_mounts = _Mounts()


def _fdinfo(fd: int) -> tuple[int, int] | None:
    """(flags, mnt_id) of our own fd: read from the fd table, no filesystem is asked."""
    flags = mnt = -1
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f.read().splitlines():
                if line.startswith(b"flags:"):
                    flags = int(line.split()[1], 8)
                elif line.startswith(b"mnt_id:"):
                    mnt = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return (flags, mnt) if flags >= 0 and mnt >= 0 else None


def _file_quick(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, _F_GET_SEALS)  # answers for shmem and hugetlbfs only; calls no filesystem
        return True
    except OSError:
        pass
    info = _fdinfo(fd)
    if info is None:
        return False
    flags, mnt = info
    if flags & os.O_PATH:  # an O_PATH file is never flushed nor released by its filesystem
        return True
    if _mounts.fstype(mnt) not in _LOCAL_FS:
        return False
    try:
        mode = os.fstat(fd).st_mode  # a local filesystem: its getattr asks nobody
    except OSError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISFIFO(mode)  # a device's release may wait


def _socket_quick(fd: int) -> bool:
    try:
        s = socket.socket(fileno=fd)  # family and type by getsockopt: no peer asked
    except OSError:
        return False
    try:
        return (s.family, s.type) in _QUICK_SOCKETS or s.family in _QUICK_FAMILIES
    finally:
        s.detach()


def quick(fd: int, what: str) -> bool:
    """Can this fd (its /proc link `what`) be closed on the spot: no peer, no filesystem
    server and no fd in flight can make the close wait?"""
    if what.startswith(_QUICK):
        return True
    if what.startswith("socket:["):
        return _socket_quick(fd)
    if what.startswith("/"):
        return _file_quick(fd)
    return False


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[tuple[int, str]] = collections.deque()
        self._threads = 0
        self._idle = 0
        self.counters = {"inline": 0, "threaded": 0, "slow": 0, "queued_peak": 0}
        self.busy_since: dict[int, tuple[float, str]] = {}  # thread ident -> (since, what)

    def submit(self, fd: int, what: str) -> None:
        with self._lock:
            self._queue.append((fd, what))
            self.counters["threaded"] += 1
            self.counters["queued_peak"] = max(self.counters["queued_peak"], len(self._queue))
            if self._idle == 0 and self._threads < MAX_THREADS:
                self._threads += 1
                threading.Thread(target=self._run, name="omnid-closer", daemon=True).start()
            else:
                self._wake.notify()

    def waiting(self) -> int:
        return len(self._queue)  # a deque's len needs no lock

    def take_waiting(self) -> list[int]:
        """Empty the queue and hand its fds to the caller (a re-exec: exec would close them
        itself, and a lingering socket's close would hold the new program's start)."""
        with self._lock:
            fds = [fd for fd, _ in self._queue]
            self._queue.clear()
            return fds

    def _run(self) -> None:
        me = threading.get_ident()
        while True:
            with self._lock:
                self._idle += 1
                while not self._queue:
                    self._wake.wait()
                self._idle -= 1
                fd, what = self._queue.popleft()
                t0 = time.monotonic()
                self.busy_since[me] = (t0, what)
                if self._queue and self._idle == 0 and self._threads < MAX_THREADS:
                    # more waiting and nobody free (two woken for one thread): this close
                    # may be the one that never ends, so the next gets a thread of its own
                    self._threads += 1
                    threading.Thread(target=self._run, name="omnid-closer", daemon=True).start()
            try:
                os.close(fd)
            except OSError:
                pass
            took = time.monotonic() - t0
            with self._lock:
                self.busy_since.pop(me, None)
                if took >= SLOW_S:
                    self.counters["slow"] += 1
            if took >= SLOW_S:
                log.warning("closing an fd received from outside took long (off the loop: nothing waited)",
                            fd_was=what, seconds=round(took, 1))

    def status(self) -> dict[str, int]:
        now = time.monotonic()
        with self._lock:
            stuck = sum(1 for since, _ in self.busy_since.values() if now - since >= SLOW_S)
            return {**self.counters, "threads": self._threads, "queued": len(self._queue), "stuck": stuck,
                    "queued_max": MAX_WAITING}


_pool = _Pool()


def close(fd: int) -> None:
    """Close an fd of foreign origin; never waits on a filesystem or a peer. The number stays
    allocated until the close is done (never reused while a thread still holds it). Always
    takes the fd, even past MAX_WAITING: readers of outside fds ask `room()` first."""
    try:
        what = os.readlink(f"/proc/self/fd/{fd}")  # names the object; asks no filesystem
    except OSError:
        what = "?"
    if quick(fd, what):
        _pool.counters["inline"] += 1
        try:
            os.close(fd)
        except OSError:
            pass
        return
    _pool.submit(fd, what)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        close(fd)


def take_waiting() -> list[int]:
    """The fds still waiting for a closer thread, taken off the queue (omnid reexec hands them
    to the next program, whose closer closes them: close-on-exec would make the exec itself do
    every waiting close, one after another, before the next program runs a line)."""
    return _pool.take_waiting()


def room() -> int:
    """How many more fds from outside may be taken before the cap (MAX_WAITING) on those
    waiting for a closer thread; 0 or less: read nothing more from outside."""
    return MAX_WAITING - _pool.waiting()


class Unheard:
    """When the reader of fds from outside (the notify socket) stopped reading at the cap, and
    when it read again. Monotonic seconds."""

    LOOK_S = 0.5  # while stopped: how soon a deadline held back is looked at again

    def __init__(self) -> None:
        self.since: float | None = None  # stopped since; None while read
        self.until = float("-inf")  # read again at, the last time
        self.pauses = 0  # times it stopped (a deadline held back says which pause once)

    def stop(self, now: float) -> None:
        if self.since is None:
            self.since = now
            self.pauses += 1

    def go(self, now: float) -> None:
        if self.since is not None:
            self.since, self.until = None, now

    def hold(self, now: float, grace: float) -> float | None:
        """None: a deadline due now may be judged. Otherwise the seconds to wait before it is
        looked at again: while the reader is stopped, LOOK_S; once it reads again, until
        `grace` after that (what waited in the kernel is read first)."""
        if self.since is not None:
            return self.LOOK_S
        left = self.until + grace - now
        return left if left > 0 else None


unheard = Unheard()


def status() -> dict[str, int]:
    """Counters for status and tests: closes done inline and in threads, closes that took over
    a second, threads, fds waiting (and their cap), closes under way for over a second now."""
    return _pool.status()
