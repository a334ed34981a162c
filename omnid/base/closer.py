"""Closing fds that came from outside without letting a close stop the event loop.

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
at once when it is a kind whose close cannot wait (a pipe; an eventfd, timerfd, signalfd
or pidfd), otherwise by a small pool of closer threads. A close that takes over a second is
logged with what the fd was. The pool grows to MAX_THREADS while every thread is busy (one
stuck close must not hold up the others); past that, fds wait in the queue, counted.

Only fds the daemon received from outside go through here; its own (pipes it made, the
spawner's socket, listening sockets it bound) are closed directly.
"""

from __future__ import annotations

import collections
import os
import threading
import time

import structlog

log = structlog.get_logger("omnid.base.closer")

MAX_THREADS = 16
SLOW_S = 1.0
# Kinds whose close releases a kernel object and nothing else: no filesystem, no peer, no
# fd in flight inside them.
_QUICK = ("pipe:[", "anon_inode:[eventfd]", "anon_inode:[timerfd]", "anon_inode:[signalfd]",
          "anon_inode:[pidfd]", "pidfd:")


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
            return {**self.counters, "threads": self._threads, "queued": len(self._queue), "stuck": stuck}


_pool = _Pool()


def close(fd: int) -> None:
    """Close an fd of foreign origin; never waits on a filesystem or a peer. The number stays
    allocated until the close is done (never reused while a thread still holds it)."""
    try:
        what = os.readlink(f"/proc/self/fd/{fd}")  # names the object; asks no filesystem
    except OSError:
        what = "?"
    if what.startswith(_QUICK):
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


def status() -> dict[str, int]:
    """Counters for status and tests: closes done inline and in threads, closes that took over
    a second, threads, fds waiting, closes under way for over a second now."""
    return _pool.status()
