"""Starting the spawner process (omnid/process/spawner.py), and nothing else: light on purpose (the
standard library's os, socket, select, signal only), so that
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

SOCKET_BUFFER = 4 << 20
# The package's parent directory (this file is omnid/process/spawnstart.py): where this daemon's own omnid is imported from.
OMNID_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# -I -S leaves neither site-packages nor the working directory on sys.path: the daemon
# passes the entries the spawner needs (this omnid; setproctitle's site-packages).
BOOT = "import sys; sys.path[:0] = sys.argv[3:]; from omnid.process.spawner import main; sys.exit(main(sys.argv[1:3]))"


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
        waiter = select.poll()  # not select(): it refuses fds from 1024 on
        waiter.register(self.pidfd, select.POLLIN)
        if not waiter.poll(int(timeout * 1000)):
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        os.close(self.pidfd)
        self.pidfd = -1


def _extra_paths() -> list[str]:
    """Where the spawner finds what it imports besides omnid and the standard library: the
    sys.path entry that holds setproctitle (a package, or a module such as
    setproctitle.cpython-311-x86_64-linux-gnu.so), looked up without importlib."""
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        if "setproctitle" in names or any(n.startswith("setproctitle.") and n.endswith(".so") for n in names):
            return [os.path.abspath(entry or ".")]
    return []


def _start_time(pid: int) -> int:
    """Field 22 of /proc/PID/stat (clock ticks since boot), as omnid.base.linux reads it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def launch() -> SpawnerProcess:
    """Start the spawner by exec, connected by a SOCK_SEQPACKET socketpair."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (ours, theirs):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    theirs.set_inheritable(True)
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    # Without site and user environment (-I -S): the interpreter is up in a few ms instead of
    # tens, and every fork copies a smaller process. It imports omnid from where this daemon
    # did (its bytecode cached, unlike a script's) and setproctitle where this daemon would.
    argv = [sys.executable, "-I", "-S", "-c", BOOT, str(theirs.fileno()), str(os.getpid()), OMNID_PARENT,
            *_extra_paths()]
    try:
        # Its own session: a SIGTERM or Ctrl+C to the daemon's process group must reach the
        # daemon only, which then stops the stack in order.
        pid = os.posix_spawn(sys.executable, argv, env, setsid=True)
    finally:
        theirs.close()
    pidfd = os.pidfd_open(pid)
    ours.setblocking(False)
    return SpawnerProcess(pid, pidfd, _start_time(pid), ours)
