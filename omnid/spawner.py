"""The spawner: the only process of omnid that forks (ARCHITECTURE.md, "Processes").

The daemon has threads (libzmq, aiohttp), and forking a threaded process copies
locks held by threads that do not exist in the child. So the daemon starts this
small program once, by exec, and asks it over a SOCK_SEQPACKET socketpair to
spawn every unit. The spawner stays single-threaded for life (checked before
every fork), is a child subreaper (double-forked grandchildren come back to it),
reaps every child and reports each exit, and dies with the daemon.

Protocol, one JSON object per datagram, fds by SCM_RIGHTS:
  daemon -> spawner  {"op": "kill", "pid"}  (a child whose pidfd the daemon could not take)
                     {"op": "spawn", "id", "unit", "argv", "env", "cwd", "user",
                      "group", "rlimits", "cgroup"} + [output pipe write end]
                     {"op": "shutdown"}
  spawner -> daemon  {"op": "spawned", "id", "pid", "start_time"} + [pidfd]
                     {"op": "spawn_failed", "id", "error", "errno"}
                     {"op": "exit", "pid", "status", "adopted"}

Run as: python -m omnid.spawner FD DAEMON_PID
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import resource
import select
import signal
import socket
import sys
import time

from omnid import linux

MAX_MESSAGE = 1 << 20
CLEANUP_DEADLINE_S = 3.0


class SpawnerInvariantError(RuntimeError):
    """The spawner found itself with more than one thread: forking now is unsafe."""


def assert_single_threaded() -> None:
    n = linux.thread_count()
    if n != 1:
        raise SpawnerInvariantError(f"refusing to fork: spawner has {n} threads, must have exactly 1")


def _child_setup_and_exec(req: dict, out_fd: int, errout_fd: int, err_w: int, spawner_pid: int) -> None:
    """Runs in the forked child; never returns."""
    stage = "setup"
    try:
        stage = "setsid"
        os.setsid()
        stage = "prctl(PR_SET_PDEATHSIG)"
        linux.set_pdeathsig(signal.SIGKILL)
        if os.getppid() != spawner_pid:
            # The spawner died between fork and prctl: PDEATHSIG will never fire.
            os._exit(1)
        stage = "signal reset"
        signal.set_wakeup_fd(-1)
        for sig in signal.valid_signals():
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass  # signals the kernel reserves (32, 33)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        stage = "stdio"
        devnull = os.open("/dev/null", os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(errout_fd, 2)
        # Close everything else (the error pipe is close-on-exec and must stay open).
        os.closerange(3, err_w)
        os.closerange(err_w + 1, 1 << 20)
        for res, soft, hard in req.get("rlimits") or []:
            stage = f"setrlimit({res})"
            resource.setrlimit(res, (soft, hard))
        if req.get("cgroup"):
            stage = f"join cgroup {req['cgroup']}"
            with open(os.path.join(req["cgroup"], "cgroup.procs"), "w") as f:
                f.write("0")
        if req.get("cwd"):
            stage = f"chdir {req['cwd']!r}"
            os.chdir(req["cwd"])
        if req.get("group"):
            stage = f"group {req['group']!r}"
            os.setgid(grp.getgrnam(req["group"]).gr_gid)
        if req.get("user"):
            stage = f"user {req['user']!r}"
            pw = pwd.getpwnam(req["user"])
            if not req.get("group"):
                os.setgid(pw.pw_gid)
            os.initgroups(pw.pw_name, os.getgid())
            os.setuid(pw.pw_uid)
        if req.get("user") or req.get("group"):
            # The kernel clears PDEATHSIG when credentials change: arm it again now,
            # then make sure the spawner did not die in between (issue #9).
            stage = "prctl(PR_SET_PDEATHSIG) after the uid/gid switch"
            linux.set_pdeathsig(signal.SIGKILL)
            if os.getppid() != spawner_pid:
                os._exit(1)
        stage = "exec"
        argv = req["argv"]
        os.execvpe(argv[0], argv, req["env"])
    except BaseException as exc:  # noqa: BLE001 - everything must reach the daemon
        detail = str(exc)
        if stage == "exec" and isinstance(exc, OSError) and exc.filename is None:
            detail = f"{exc}: {req['argv'][0]!r}"
        # First line: the errno of a failed exec(2) (the restart policy tells a missing
        # program from a passing fault by it), or 0; then the text for people.
        code = exc.errno if stage == "exec" and isinstance(exc, OSError) and exc.errno else 0
        try:
            os.write(err_w, f"{code}\n{stage} failed: {detail}".encode()[:4000])
        finally:
            os._exit(127)


class Launch:
    """A child forked but not yet known to have exec'd. (A plain class: no dataclasses
    import in the spawner, see omnid/linux.py.)"""

    __slots__ = ("rid", "unit", "pid", "pidfd", "start_time", "err_r", "error", "status")

    def __init__(self, rid: int, unit: str, pid: int, pidfd: int, start_time: int, err_r: int) -> None:
        self.rid, self.unit, self.pid, self.pidfd = rid, unit, pid, pidfd
        self.start_time, self.err_r = start_time, err_r
        self.error = b""
        self.status: int | None = None  # set if it was reaped before its exec report went out


class Spawner:
    def __init__(self, sock: socket.socket, daemon_pid: int) -> None:
        self.sock = sock
        self.daemon_pid = daemon_pid
        self.pid = os.getpid()
        self.units: dict[int, str] = {}  # pid of a unit main process -> unit name
        self.launching: dict[int, Launch] = {}
        self.by_errfd: dict[int, int] = {}
        self.poller = select.poll()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stopping = False

    # -- messages -------------------------------------------------------------
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

    # -- spawning -------------------------------------------------------------
    def spawn(self, req: dict, fds: list[int]) -> None:
        """Fork and set up one child; its exec outcome is reported from the poll loop,
        so many spawns overlap instead of each waiting for the previous exec."""
        # fds: the unit's stdout pipe, then its stderr pipe (the same pipe when only one came).
        out_fd = fds[0] if fds else os.open("/dev/null", os.O_WRONLY | os.O_CLOEXEC)
        errout_fd = fds[1] if len(fds) > 1 else out_fd
        for extra in fds[2:]:
            os.close(extra)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            assert_single_threaded()
            pid = os.fork()
        except Exception as exc:
            os.close(err_r)
            os.close(err_w)
            os.close(out_fd)
            if errout_fd != out_fd:
                os.close(errout_fd)
            self.send({"op": "spawn_failed", "id": req["id"], "error": f"fork failed: {exc}", "errno": 0})
            return
        if pid == 0:
            _child_setup_and_exec(req, out_fd, errout_fd, err_w, self.pid)
        os.close(err_w)
        os.close(out_fd)
        if errout_fd != out_fd:
            os.close(errout_fd)
        # Open the pidfd before anything can reap the child: the pid is pinned
        # (at worst a zombie) until this loop calls waitpid.
        pidfd = linux.pidfd_open(pid)
        os.set_blocking(err_r, False)
        self.launching[pid] = Launch(req["id"], req.get("unit", "?"), pid, pidfd,
                                     linux.start_time_of(pid) or 0, err_r)
        self.by_errfd[err_r] = pid
        self.poller.register(err_r, select.POLLIN)

    def exec_report(self, err_r: int) -> None:
        """The child's close-on-exec error pipe is readable: an error text, or EOF (exec done)."""
        pid = self.by_errfd[err_r]
        launch = self.launching[pid]
        while True:
            try:
                chunk = os.read(err_r, 4096)
            except BlockingIOError:
                return  # more to come
            if not chunk:
                break
            launch.error += chunk
        self.poller.unregister(err_r)
        os.close(err_r)
        del self.by_errfd[err_r]
        del self.launching[pid]
        if launch.error:
            os.close(launch.pidfd)
            # It never became a unit process: its exit (127) is reported as adopted.
            code, _, text = launch.error.decode(errors="replace").partition("\n")
            self.send({"op": "spawn_failed", "id": launch.rid, "pid": pid, "error": text,
                       "errno": int(code) if code.isdigit() else 0})
            adopted = True
        else:
            self.units[pid] = launch.unit
            self.send({"op": "spawned", "id": launch.rid, "pid": pid, "start_time": launch.start_time},
                      [launch.pidfd])
            os.close(launch.pidfd)
            adopted = False
        if launch.status is not None:
            # It exited before its exec report went out: report the exit after it.
            self.units.pop(pid, None)
            self.send({"op": "exit", "pid": pid, "status": launch.status, "adopted": adopted})

    # -- reaping --------------------------------------------------------------
    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.launching:
                self.launching[pid].status = status
                continue
            adopted = self.units.pop(pid, None) is None
            self.send({"op": "exit", "pid": pid, "status": status, "adopted": adopted})

    # -- life -----------------------------------------------------------------
    def handle_request(self) -> None:
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 16)
        except (ConnectionResetError, OSError):
            data, fds = b"", []
        if not data:
            self.stopping = True  # the daemon closed its end or died
            return
        try:
            req = json.loads(data)
        except ValueError:
            for fd in fds:
                os.close(fd)
            return
        op = req.get("op")
        if op == "spawn":
            self.spawn(req, fds)
        elif op == "kill":
            # The daemon could not take the pidfd (EMFILE): the child must not run unowned.
            # Still our unreaped child, so its pid (and group: it called setsid) is its own.
            pid = req.get("pid")
            if isinstance(pid, int) and self.units.pop(pid, None) is not None:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
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
        linux.set_child_subreaper()
        linux.set_pdeathsig(signal.SIGHUP)
        if os.getppid() != self.daemon_pid:
            return self.cleanup()  # the daemon died before PDEATHSIG was armed
        self.send({"op": "hello", "pid": self.pid})
        self.poller.register(self.sock, select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)
        while not self.stopping:
            for fd, _ev in self.poller.poll():
                if fd == self.wake_r:
                    sigs = os.read(self.wake_r, 512)
                    if signal.SIGHUP in sigs:
                        self.stopping = True
                    self.reap()
                elif fd in self.by_errfd:
                    self.exec_report(fd)
                else:
                    self.handle_request()
            self.reap()
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
            self.units.clear()
            self.launching.clear()
            self.reap()
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
