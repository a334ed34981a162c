"""The spawner: the only process of omnid that forks (ARCHITECTURE.md, "Processes"). This module
is its loop: requests in, reports out.

The daemon has threads (libzmq, aiohttp), and forking a threaded process copies
locks held by threads that do not exist in the child. So the daemon starts this
small program once, by exec, and asks it over a SOCK_SEQPACKET socketpair to
spawn every unit. The spawner stays single-threaded for life (checked before
every fork), is a child subreaper (double-forked grandchildren come back to it),
reaps every child and reports each exit, and dies with the daemon.

Where the rest lives (all of it runs in this process, so all of it is light):
  omnid/process/spawnexec.py   from fork to exec: the two paths behind one door, the one spawn
                       result, and the one record per child the spawner holds
  omnid/process/spawnchild.py  the child's steps from fork to exec (Python path), and their words
  omnid/process/spawnplan.py   what is decided before the fork: which path, which program, arguments
  omnid/process/spawnclient.py the daemon's side; omnid/process/spawnwire.py the protocol's typed messages

Protocol, one JSON object per datagram, fds by SCM_RIGHTS:
  daemon -> spawner  {"op": "kill", "pid"}  (a child whose pidfd the daemon could not take)
                     {"op": "spawn", "env": BASE, "batch": [SPAWN, ...]} + [each SPAWN's fds, in order]
                        SPAWN = {"id", "unit", "argv", "env": {changed vars}, "unset": [vars],
                                 "cwd", "user", "group", "rlimits", "cgroup", "placement", "nfds",
                                 "path"?: the program to execve, else argv[0] through PATH,
                                 "nlisten"?: how many of its fds, the last ones, the child gets as
                                 fds 3, 4, ... with LISTEN_PID = its own pid (omnid/process/sockets.py)}
                        (a tier's spawns in one datagram, or a few for a big tier: one wake-up,
                         one read, one decode for many)
                     {"op": "spawn", "id", "unit", "argv", "env", ...} + [stdout, stderr]  (one spawn)
                     {"op": "shutdown"}
  spawner -> daemon  {"op": "batch", "events": [EVENT, ...]} + [the pidfds of its "spawned" events]
                        EVENT = {"op": "spawned", "id", "pid", "start_time"}
                              | {"op": "spawn_failed", "id", "error", "errno"}
                              | {"op": "exit", "pid", "status", "adopted"}
                        (what one turn of the loop learnt, in order: a pid's exit after its spawn)
                     {"op": "spawn_failed", "id", "error", "errno"}  (refused before any fork)
                     {"op": "hello", "pid"}

"placement" (omnid/process/numa.py) is {"cpus": [...], "mempolicy": MODE, "nodes": [...]} or
{"error": TEXT}: the CPU affinity and memory policy the child sets before exec.

From fork to exec: where omnid/process/_spawnc.c was compiled (the package's one C extension, built
when a compiler is there), a vfork child in C does the setup and the exec, and the spawner knows
the outcome when vfork returns; else a forked Python child does the same steps
(omnid/process/spawnchild.py) and reports through a close-on-exec pipe. The hello says which
("exec_path": "compiled" | "python"). OMNID_SPAWNER_PYTHON=1 in the spawner's environment
forces the Python path (a test hook: the tests run both).

A vfork suspends the spawner until the child execs: a chdir or execve on a hung network or
FUSE mount would stop every spawn, reap and exit report of the stack. So a request whose cwd
or program lies on such a filesystem (by /proc/self/mountinfo, which touches no mount) takes
the fork path even where the compiled one exists, and every forked child has a bound from
fork to exec (SPAWN_EXEC_TIMEOUT_S): past it, the child is SIGKILLed and the spawn answered
as failed, while the loop goes on serving the others.

Run as: python -m omnid.process.spawner FD DAEMON_PID. The daemon runs it without site and the
user's environment (python -I -S -c BOOT, omnid/process/spawnstart.py): the interpreter is up in a
few ms and every fork copies a smaller process.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import select
import signal
import socket
import sys
import time

from omnid.base import linux
from omnid.process.spawnexec import Children, Launcher, kill_child
from omnid.process.spawnplan import mounts

MAX_MESSAGE = 1 << 20
MAX_FDS = 250  # per datagram; the kernel's SCM_MAX_FD is 253
MAX_BATCH_BYTES = 1 << 19  # flush an answer datagram beyond this
RECV_RETRY_S = 0.01  # after a transient receive error (ENOBUFS, ENOMEM), before the next poll
GONE_ERRNOS = (errno.ECONNRESET, errno.ENOTCONN, errno.EPIPE, errno.EBADF)  # the daemon's end is closed
CLEANUP_DEADLINE_S = 3.0


class Spawner:
    """The loop: a poll over the daemon's socket, the signal wake-up pipe and the launching
    children's exec report pipes; each turn's events go out as one answer (`flush`)."""

    def __init__(self, sock: socket.socket, daemon_pid: int) -> None:
        self.sock = sock
        self.daemon_pid = daemon_pid
        self.pid = os.getpid()
        self.poller = select.poll()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stopping = False
        # What this turn of the loop learnt, sent as one datagram at its end: (event, pidfd or -1).
        self.outbox: list[tuple[dict, int]] = []
        self.children = Children()  # every child we hold, one record each (omnid/process/spawnexec.py)
        self.launcher = Launcher(self.children, self.poller, self.pid, self.tell, self.send)
        self._mounts: list[tuple[str, str]] | None = None  # the mount table as last read (may_hang)
        # The kernel says when the mount table changed: /proc/self/mountinfo polls POLLPRI once
        # per change (per open file). The table is read again only then (a read and its parse
        # cost a restart ~0.1 ms), and at every turn where that cannot be asked.
        self._mount_events: select.poll | None = None
        try:
            self._mountinfo = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
            self._mount_events = select.poll()
            self._mount_events.register(self._mountinfo, select.POLLPRI)
        except OSError:
            self._mountinfo = -1

    def mounts(self) -> list[tuple[str, str]]:
        """The mount table: read again when the kernel says it changed since it was read (or,
        where it cannot say, once per turn of the loop: a tier's spawns share one read)."""
        if self._mounts is None or (self._mount_events is not None and self._mount_events.poll(0)):
            self._mounts = mounts()
        return self._mounts

    # -- messages -------------------------------------------------------------
    def tell(self, event: dict, fd: int = -1) -> None:
        """Queue an event for this turn's answer; fd: a pidfd that goes with it (closed once sent)."""
        self.outbox.append((event, fd))

    def send(self, msg: dict, fds: list[int] | None = None) -> None:
        data = json.dumps(msg).encode()
        try:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.send(data)
        except OSError as exc:
            # The daemon is gone: nothing to report to; the cleanup path will run.
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                raise
            self.stopping = True

    def flush(self) -> None:
        """Send the outbox, in order, as few datagrams as the fd and size limits allow; the
        pidfds are closed here once the kernel has passed copies to the daemon."""
        box, self.outbox = self.outbox, []
        i = 0
        while i < len(box):
            events: list[dict] = []
            fds: list[int] = []
            size = 0
            while i < len(box) and len(fds) < MAX_FDS and size < MAX_BATCH_BYTES:
                ev, fd = box[i]
                events.append(ev)
                size += 64 + len(ev.get("error", ""))
                if fd >= 0:
                    fds.append(fd)
                i += 1
            try:
                self.send({"op": "batch", "events": events}, fds)
            finally:
                for fd in fds:
                    os.close(fd)

    # -- spawning -------------------------------------------------------------
    def spawn_batch(self, msg: dict, fds: list[int]) -> None:
        """A tier's spawns in one request: fork them back to back; each child's exec outcome
        comes back through the poll loop (and out in the batch of that turn)."""
        base = msg.get("env") or {}
        at = 0
        for item in msg.get("batch") or ():
            n = item.get("nfds", 2) if isinstance(item, dict) else 0
            mine, at = fds[at:at + n], at + n
            if not isinstance(item, dict) or not isinstance(base, dict):
                for fd in mine:
                    os.close(fd)
                continue
            env = dict(base)
            env.update(item.get("env") or {})
            for name in item.get("unset") or ():
                env.pop(name, None)
            item["env"] = env
            self.spawn(item, mine)
        for fd in fds[at:]:
            os.close(fd)

    def spawn(self, req: dict, fds: list[int]) -> None:
        """Fork and set up one child; its exec outcome is reported from the poll loop,
        so many spawns overlap instead of each waiting for the previous exec."""
        # fds: the unit's stdout pipe, then its stderr pipe (the same pipe when only one came).
        nlisten = req.get("nlisten") or 0
        if not isinstance(nlisten, int) or not 0 <= nlisten <= len(fds) - 1:
            nlisten = 0  # a malformed count: the fds are closed below, nothing is passed
        listen = fds[len(fds) - nlisten:] if nlisten else []
        fds = fds[:len(fds) - nlisten]
        out_fd = fds[0] if fds else os.open("/dev/null", os.O_WRONLY | os.O_CLOEXEC)
        errout_fd = fds[1] if len(fds) > 1 else out_fd
        for extra in fds[2:]:
            os.close(extra)
        try:
            self.launcher.start(req, out_fd, errout_fd, listen, self.mounts)
        finally:
            for fd in listen:  # the child has its copies (or never ran); the daemon holds its own
                os.close(fd)

    # -- reaping --------------------------------------------------------------
    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.get(pid)
            if child is not None and child.launching:
                child.status = status  # told after its spawn result (omnid/process/spawnexec.py)
                continue
            if child is not None:
                self.children.drop(child)
            # Adopted: no record (a failed spawn, a double-forked grandchild), no unit's.
            self.tell({"op": "exit", "pid": pid, "status": status, "adopted": child is None})

    # -- life -----------------------------------------------------------------
    def handle_request(self) -> None:
        try:
            data, fds, flags = linux.recvmsg_fds(self.sock, MAX_MESSAGE, MAX_FDS + 3)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in GONE_ERRNOS:
                self.stopping = True  # the daemon's end is closed
                return
            # ENOBUFS, ENOMEM: the kernel is short of memory for a moment, and the daemon is
            # still there. Stopping would SIGKILL every unit; the request stays queued.
            print(f"omnid spawner: receiving a request failed ({exc}); trying again", file=sys.stderr, flush=True)
            time.sleep(RECV_RETRY_S)
            return
        if not data:
            self.stopping = True  # the daemon closed its end or died
            return
        try:
            req = json.loads(data)
        except ValueError:
            for fd in fds:
                os.close(fd)
            return
        op = req.get("op") if isinstance(req, dict) else None
        if flags & socket.MSG_CTRUNC and op == "spawn":
            # Some of the request's fds (the units' output pipes) were lost on the way (our fd
            # table was full): answer each of its spawns as failed, never run one half-wired.
            for fd in fds:
                os.close(fd)
            for item in (req.get("batch") or ()) if "batch" in req else (req,):
                if isinstance(item, dict) and "id" in item:
                    self.tell({"op": "spawn_failed", "id": item["id"], "errno": errno.EMFILE,
                               "error": "spawn request lost its file descriptors on the way to the "
                                        "spawner (its fd table is full): not started"})
            return
        if op == "spawn" and "batch" in req:
            self.spawn_batch(req, fds)
        elif op == "spawn":
            self.spawn(req, fds)
        elif op == "kill":
            # The daemon could not take the pidfd (EMFILE): the child must not run unowned.
            # Still our unreaped child, so its pid (and group: it called setsid) is its own.
            pid = req.get("pid")
            child = self.children.get(pid) if isinstance(pid, int) else None
            if child is not None and not child.launching:
                self.children.drop(child)
                kill_child(pid)
            for fd in fds:
                os.close(fd)
        else:
            for fd in fds:
                os.close(fd)
            if op == "shutdown":
                self.stopping = True

    def run(self) -> int:
        for sig in (signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)  # handlers only wake the loop
        # Stopping is the daemon's decision (it stops the stack in order, then
        # tells us); we go when it goes (PDEATHSIG=SIGHUP, or EOF on the socket).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.set_wakeup_fd(self.wake_w)
        # What a child must reset before exec: every signal whose disposition is not the
        # default here (ours, and those ignored since the daemon started us). Decided once,
        # so the child does not walk all 64.
        self.launcher.reset_signals = tuple(sig for sig in signal.valid_signals()
                                   if sig not in (signal.SIGKILL, signal.SIGSTOP)
                                   and signal.getsignal(sig) is not signal.SIG_DFL)
        linux.set_child_subreaper()
        linux.set_pdeathsig(signal.SIGHUP)
        if os.getppid() != self.daemon_pid:
            return self.cleanup()  # the daemon died before PDEATHSIG was armed
        self.send({"op": "hello", "pid": self.pid, "exec_path": "compiled" if self.launcher.compiled else "python"})
        self.poller.register(self.sock, select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)
        # Everything so far lives as long as we do: out of the collector's way, so that no
        # collection in a child (or here) touches and copies those pages after a fork.
        gc.freeze()
        timeout_ms: float | None = None
        while not self.stopping:
            if self._mount_events is None:
                self._mounts = None  # mounts come and go between turns
            for fd, _ev in self.poller.poll(timeout_ms):
                if fd == self.wake_r:
                    sigs = os.read(self.wake_r, 512)
                    if signal.SIGHUP in sigs:
                        self.stopping = True
                    self.reap()
                elif self.children.at_pipe(fd) is not None:
                    self.launcher.exec_report(fd)
                else:
                    self.handle_request()
            self.reap()
            timeout_ms = self.launcher.expire() if self.children.any_launching() else None
            if self.outbox:
                self.flush()
        return self.cleanup()

    def cleanup(self) -> int:
        """The daemon is gone or asked us to go: nothing we started may outlive us.

        The daemon's kill policy (omnid.termination.terminate) with SIGKILL first, as for
        a failed unit's leftovers: SIGKILL, wait (bounded), sweep. A process group is
        signalled by number only while one of our own unreaped children is in it (that
        child holds the number), never from a record of a leader already reaped."""
        deadline = time.monotonic() + CLEANUP_DEADLINE_S
        while time.monotonic() < deadline:
            children = [st for p in linux.children_of(self.pid) if (st := linux.read_stat(p)) is not None]
            for pgid in {p.pgid for p in children}:
                if pgid not in (0, 1, os.getpgid(0)):
                    try:
                        os.killpg(pgid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            for child in children:
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.children.clear()
            self.reap()
            for _ev, fd in self.outbox:  # nobody to tell: the daemon is gone or told us to go
                if fd >= 0:
                    os.close(fd)
            self.outbox.clear()
            if not linux.children_of(self.pid):
                break
            time.sleep(0.01)
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fd, daemon_pid = int(argv[0]), int(argv[1])
    try:
        from setproctitle import setproctitle

        setproctitle("omnid: spawner")
    except ImportError:
        pass
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    os.set_inheritable(fd, False)
    return Spawner(sock, daemon_pid).run()


if __name__ == "__main__":
    sys.exit(main())
