"""Starting the spawner process (omnid/spawner.py), and nothing else: light on purpose, so that
`omnid daemon` can start it first, before it loads the rest of itself, and the spawner's
interpreter comes up while the daemon's imports run (the first unit waits for neither alone).

posix_spawn (vfork + exec) is safe from any process, threaded or not; it is called here while
the daemon has no thread yet anyway.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys

from omnid import linux

SOCKET_BUFFER = 4 << 20


class SpawnerProcess:
    """A spawner just started: its pid, pidfd and start time, and our end of its socketpair.
    SpawnerClient takes it over (`adopted`); until then `close` ends it."""

    __slots__ = ("pid", "pidfd", "start_time", "sock", "adopted")

    def __init__(self, pid: int, pidfd: int, start_time: int, sock: socket.socket) -> None:
        self.pid, self.pidfd, self.start_time, self.sock = pid, pidfd, start_time, sock
        self.adopted = False

    def close(self, timeout: float = 2.0) -> None:
        """End a spawner nobody took over (the daemon stopped before its loop ran): closing our
        end is its signal to go; SIGKILL if it has not gone within `timeout`; reap it."""
        if self.adopted or self.pidfd < 0:
            return
        self.sock.close()
        if not select.select([self.pidfd], [], [], timeout)[0]:
            linux.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        os.close(self.pidfd)
        self.pidfd = -1


def _extra_paths() -> list[str]:
    """Where the spawner finds what it imports besides omnid and the standard library."""
    import importlib.util

    spec = importlib.util.find_spec("setproctitle")
    if spec is None or not spec.origin:
        return []
    # setproctitle/__init__.py (a package) or setproctitle*.so (a module): the directory that
    # holds it (site-packages) goes on the spawner's sys.path.
    origin = os.path.dirname(spec.origin)
    return [os.path.dirname(origin) if spec.submodule_search_locations else origin]


def launch() -> SpawnerProcess:
    """Start the spawner by exec, connected by a SOCK_SEQPACKET socketpair."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (ours, theirs):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    theirs.set_inheritable(True)
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    # The spawner's file, run without site and user environment (-I -S): the interpreter is up
    # in a few ms instead of tens, and every fork copies a smaller process. It finds omnid
    # beside its file (this daemon's own copy) and setproctitle where this daemon would.
    argv = [sys.executable, "-I", "-S", os.path.join(os.path.dirname(os.path.abspath(linux.__file__)), "spawner.py"),
            str(theirs.fileno()), str(os.getpid()), *_extra_paths()]
    try:
        # Its own session: a SIGTERM or Ctrl+C to the daemon's process group must reach the
        # daemon only, which then stops the stack in order.
        pid = os.posix_spawn(sys.executable, argv, env, setsid=True)
    finally:
        theirs.close()
    pidfd = linux.pidfd_open(pid)
    ours.setblocking(False)
    return SpawnerProcess(pid, pidfd, linux.start_time_of(pid) or 0, ours)
