"""The spawner: the only process of omnid that forks (ARCHITECTURE.md, "Processes").

The daemon has threads (libzmq, aiohttp), and forking a threaded process copies
locks held by threads that do not exist in the child. So the daemon starts this
small program once, by exec, and asks it over a SOCK_SEQPACKET socketpair to
spawn every unit. The spawner stays single-threaded for life (checked before
every fork), is a child subreaper (double-forked grandchildren come back to it),
reaps every child and reports each exit, and dies with the daemon.

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
(`_child_setup_and_exec`) and reports through a close-on-exec pipe. The hello says which
("exec_path": "compiled" | "python"). OMNID_SPAWNER_PYTHON=1 in the spawner's environment
forces the Python path (a test hook: the tests run both).

A vfork suspends the spawner until the child execs: a chdir or execve on a hung network or
FUSE mount would stop every spawn, reap and exit report of the stack. So a request whose cwd
or program lies on such a filesystem (by /proc/self/mountinfo, which touches no mount) takes
the fork path even where the compiled one exists, and every forked child has a bound from
fork to exec (SPAWN_EXEC_TIMEOUT_S): past it, the child is SIGKILLed and the spawn answered
as failed, while the loop goes on serving the others.

Run as: python -m omnid.spawner FD DAEMON_PID. The daemon runs it without site and the
user's environment (python -I -S -c BOOT, omnid/process/spawnstart.py): the interpreter is up in a
few ms and every fork copies a smaller process.
"""

from __future__ import annotations

import errno
import fcntl
import gc
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

from omnid.base import linux

try:
    from omnid.process import _spawnc
except ImportError:  # not compiled on this host: the Python path
    _spawnc = None

MAX_MESSAGE = 1 << 20
MAX_FDS = 250  # per datagram; the kernel's SCM_MAX_FD is 253
MAX_BATCH_BYTES = 1 << 19  # flush an answer datagram beyond this
RECV_RETRY_S = 0.01  # after a transient receive error (ENOBUFS, ENOMEM), before the next poll
GONE_ERRNOS = (errno.ECONNRESET, errno.ENOTCONN, errno.EPIPE, errno.EBADF)  # the daemon's end is closed
CLEANUP_DEADLINE_S = 3.0


class SpawnerInvariantError(RuntimeError):
    """The spawner found itself with more than one thread: forking now is unsafe."""


def assert_single_threaded() -> None:
    n = linux.thread_count()
    if n != 1:
        raise SpawnerInvariantError(f"refusing to fork: spawner has {n} threads, must have exactly 1")


def _child_setup_and_exec(req: dict, out_fd: int, errout_fd: int, err_w: int, spawner_pid: int,
                          reset_signals: tuple[int, ...] = (), devnull: int = -1,
                          placement: tuple | None = None, listen: list[int] | tuple[int, ...] = ()) -> None:
    """Runs in the forked child; never returns. Every Python operation here copies the pages it
    touches (copy-on-write after fork), so the parent prepared what it could: the signals to
    reset, /dev/null, the placement's arguments."""
    stage = "setsid"
    try:
        os.setsid()
        stage = "prctl(PR_SET_PDEATHSIG)"
        linux.set_pdeathsig(signal.SIGKILL)
        if os.getppid() != spawner_pid:
            # The spawner died between fork and prctl: PDEATHSIG will never fire.
            os._exit(1)
        stage = "signal reset"
        signal.set_wakeup_fd(-1)
        # Handled signals are reset by exec itself; ignored ones would stay ignored in the unit.
        for sig in reset_signals:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        stage = "stdio"
        if devnull < 0:
            devnull = os.open("/dev/null", os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(errout_fd, 2)
        if listen:
            # Fds 3.. become the listening sockets: first every fd in the way (the error pipe,
            # the sockets themselves) is moved above them, then each is put in its place.
            top = 3 + len(listen)
            if err_w < top:
                err_w = fcntl.fcntl(err_w, fcntl.F_DUPFD_CLOEXEC, top)
            moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top) for fd in listen]
            for i, fd in enumerate(moved):
                os.dup2(fd, 3 + i, inheritable=True)
            req["env"]["LISTEN_PID"] = str(os.getpid())  # theirs alone: a grandchild's pid differs
            os.closerange(top, err_w)
        else:
            os.closerange(3, err_w)
        # Close everything else (the error pipe is close-on-exec and must stay open).
        os.closerange(err_w + 1, 1 << 20)
        for res, soft, hard in req.get("rlimits") or ():
            stage = f"setrlimit({res})"
            resource.setrlimit(res, (soft, hard))
        if req.get("cgroup"):
            stage = f"join cgroup {req['cgroup']}"
            with open(os.path.join(req["cgroup"], "cgroup.procs"), "w") as f:
                f.write("0")
        if placement is not None:
            # After the cgroup join: the affinity is set within the cgroup's cpuset.
            cpus, mode, mask, maxnode = placement
            if cpus:
                stage = f"sched_setaffinity(CPUs {req['placement']['cpus']})"
                os.sched_setaffinity(0, cpus)
            if mode:
                stage = f"set_mempolicy(mode {mode}, nodes {req['placement']['nodes']})"
                linux.set_mempolicy(mode, mask, maxnode, many_fallback=True)
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
        path = req.get("path") or argv[0]  # found in PATH by the daemon, or as written
        if "/" in path:
            os.execve(path, argv, req["env"])
        os.execvpe(path, argv, req["env"])
    except BaseException as exc:  # noqa: BLE001 - everything must reach the daemon
        detail = str(exc)
        if stage == "exec" and isinstance(exc, OSError) and exc.filename is None:
            detail = f"{exc}: {req['argv'][0]!r}"
        elif isinstance(exc, OSError) and isinstance(exc.filename, bytes):  # execvpe's PATH walk
            detail = f"[Errno {exc.errno}] {exc.strerror}: {os.fsdecode(exc.filename)!r}"
        # First line: the errno of a failed exec(2) (the restart policy tells a missing
        # program from a passing fault by it), or 0; then the text for people.
        code = exc.errno if stage == "exec" and isinstance(exc, OSError) and exc.errno else 0
        try:
            os.write(err_w, f"{code}\n{stage} failed: {detail}".encode()[:4000])
        finally:
            os._exit(127)


def _placement_args(wire: dict) -> tuple:
    """The child's sched_setaffinity / set_mempolicy arguments, built before fork."""
    cpus = wire.get("cpus") or ()
    mode = int(wire.get("mempolicy") or 0)
    mask, maxnode = linux.nodemask(wire.get("nodes") or ()) if mode else (None, 0)
    return (tuple(cpus), mode, mask, maxnode)


class Refused(Exception):
    """A spawn that cannot start, found before the fork; the text is the reason."""


def _exec_candidates(path: str, env: dict) -> list[str]:
    """What the child tries to execve, in order: `path` itself if it names a file, else each
    directory of the unit's PATH (execvpe's search, made before the fork)."""
    if "/" in path:
        return [path]
    dirs = (env.get("PATH") or os.defpath).split(os.pathsep)
    return [os.path.join(d or ".", path) for d in dirs]


def _compiled_args(req: dict, out_fd: int, errout_fd: int, devnull: int, spawner_pid: int,
                   reset_signals: tuple[int, ...], placement: tuple | None) -> tuple:
    """omnid._spawnc.spawn's arguments for one request. Names are resolved here, before the
    fork (Refused: no such user or group); bad values raise ValueError or TypeError."""
    env = req["env"]
    argv = req["argv"]
    path = req.get("path") or argv[0]
    candidates = [os.fsencode(c) for c in _exec_candidates(path, env)]
    envp = []
    for key, value in env.items():
        if not key or "=" in key:
            raise ValueError(f"illegal environment variable name {key!r}")
        envp.append(os.fsencode(f"{key}={value}"))
    rlimits = [(int(res), int(soft), int(hard)) for res, soft, hard in req.get("rlimits") or ()]
    cgroup = req.get("cgroup")
    procs = os.fsencode(os.path.join(cgroup, "cgroup.procs")) if cgroup else None
    cpus, mode, mask, maxnode = placement if placement is not None else ((), 0, None, 0)
    gid = uid = -1
    groups = None
    if req.get("group"):
        try:
            gid = grp.getgrnam(req["group"]).gr_gid
        except KeyError as exc:
            raise Refused(f"group {req['group']!r} failed: {exc}") from None
    if req.get("user"):
        try:
            pw = pwd.getpwnam(req["user"])
        except KeyError as exc:
            raise Refused(f"user {req['user']!r} failed: {exc}") from None
        if gid < 0:
            gid = pw.pw_gid
        groups = os.getgrouplist(pw.pw_name, gid)
        uid = pw.pw_uid
    return (candidates, [os.fsencode(a) for a in argv], envp, out_fd, errout_fd, devnull, spawner_pid,
            reset_signals, rlimits, procs, list(cpus) or None, mode, bytes(mask) if mode else b"",
            maxnode, True, os.fsencode(req["cwd"]) if req.get("cwd") else None, gid, groups, uid)


def _compiled_failure(req: dict, stage: int, err: int, index: int, candidates: list[str]) -> tuple[int, str]:
    """(exec's errno or 0, the text) for a compiled child that failed at `stage`: the words
    the Python path uses for the same step, so a reason reads the same on either path."""
    c = _spawnc
    why = f"[Errno {err}] {os.strerror(err)}" if err else "failed"
    if stage == c.ST_EXEC:
        return err, f"exec failed: {why}: {candidates[index] if index < len(candidates) else req['argv'][0]!r}"
    if stage == c.ST_RLIMIT:
        res = (req.get("rlimits") or [[index]])[index][0]
        if err == errno.EPERM:
            why = "not allowed to raise maximum limit"
        return 0, f"setrlimit({res}) failed: {why}"
    if stage == c.ST_CGROUP:
        procs = os.path.join(req["cgroup"], "cgroup.procs")
        return 0, f"join cgroup {req['cgroup']} failed: {why}: {procs!r}"
    if stage == c.ST_AFFINITY:
        return 0, f"sched_setaffinity(CPUs {req['placement']['cpus']}) failed: {why}"
    if stage == c.ST_MEMPOLICY:
        placement = req["placement"]
        return 0, f"set_mempolicy(mode {placement['mempolicy']}, nodes {placement['nodes']}) failed: {why}"
    if stage == c.ST_CHDIR:
        return 0, f"chdir {req['cwd']!r} failed: {why}: {req['cwd']!r}"
    if stage == c.ST_GROUP:
        what = f"group {req['group']!r}" if req.get("group") else f"user {req['user']!r}"
        return 0, f"{what} failed: {why}"
    if stage == c.ST_USER:
        return 0, f"user {req['user']!r} failed: {why}"
    if stage == c.ST_ORPHANED:
        return 0, "the spawner died before PR_SET_PDEATHSIG was armed"
    names = {c.ST_SETSID: "setsid", c.ST_PDEATHSIG: "prctl(PR_SET_PDEATHSIG)", c.ST_SIGNALS: "signal reset",
             c.ST_STDIO: "stdio", c.ST_PDEATHSIG_AGAIN: "prctl(PR_SET_PDEATHSIG) after the uid/gid switch",
             getattr(c, "ST_LISTEN", -1): f"listening fd {index + 3}"}
    return 0, f"{names.get(stage, f'stage {stage}')} failed: {why}"


# From fork to exec, at most (a chdir or execve on a hung mount): then SIGKILL and spawn_failed.
SPAWN_EXEC_TIMEOUT_S = 10.0
# Filesystems whose operations can block without bound when their server or network hangs.
_MAY_HANG = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse", "fuseblk", "9p", "ceph", "glusterfs", "afs",
             "lustre", "gpfs", "beegfs", "virtiofs", "davfs", "ncpfs", "coda", "ocfs2", "gfs2", "orangefs")


def _mounts() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, in mount order. Reads the kernel's table
    only: no path on any mount is touched."""
    out = []
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields = line.split()
                try:
                    sep = fields.index(b"-")
                except ValueError:
                    continue
                point = fields[4].decode(errors="replace")
                for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
                    point = point.replace(esc, ch)
                out.append((point, fields[sep + 1].decode(errors="replace")))
    except OSError:
        return []
    return out


def _fs_type(path: str, mounts: list[tuple[str, str]]) -> str:
    """The type of the filesystem `path` (absolute, taken literally: a symlink is not followed,
    which would touch the mount) lies on: the longest mount point above it, the last mounted."""
    path = os.path.normpath(path)
    best, kind = -1, ""
    for point, fstype in mounts:
        if path == point or path.startswith(point.rstrip("/") + "/"):
            if len(point) >= best:
                best, kind = len(point), fstype
    return kind


def may_hang(req: dict, mounts: list[tuple[str, str]] | None = None) -> str | None:
    """The first path of a spawn (its cwd, each program it may execve) on a filesystem that can
    hang, as "PATH (TYPE)"; None when every one is local."""
    mounts = _mounts() if mounts is None else mounts
    cwd = req.get("cwd") or os.getcwd()
    paths = [cwd]
    argv = req.get("argv") or [""]
    for cand in ([req["path"]] if req.get("path") else _exec_candidates(str(argv[0]), req.get("env") or {})):
        paths.append(cand if os.path.isabs(cand) else os.path.join(cwd, cand))
    for path in paths:
        kind = _fs_type(path, mounts)
        if kind.split(".")[0] in _MAY_HANG:
            return f"{path} ({kind})"
    return None


class Launch:
    """A child forked but not yet known to have exec'd. (A plain class: no dataclasses
    import in the spawner, see omnid/base/linux.py.)"""

    __slots__ = ("rid", "unit", "pid", "pidfd", "start_time", "err_r", "error", "status", "deadline", "answered")

    def __init__(self, rid: int, unit: str, pid: int, pidfd: int, start_time: int, err_r: int) -> None:
        self.rid, self.unit, self.pid, self.pidfd = rid, unit, pid, pidfd
        self.start_time, self.err_r = start_time, err_r
        self.error = b""
        self.status: int | None = None  # set if it was reaped before its exec report went out
        self.deadline = time.monotonic() + SPAWN_EXEC_TIMEOUT_S  # no exec by then: SIGKILL, spawn_failed
        self.answered = False  # spawn_failed went out at the deadline; the exec report only cleans up


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
        # What this turn of the loop learnt, sent as one datagram at its end: (event, pidfd or -1).
        self.outbox: list[tuple[dict, int]] = []
        self.reset_signals: tuple[int, ...] = ()
        self.devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        self.compiled = _spawnc is not None and os.environ.get("OMNID_SPAWNER_PYTHON") != "1"
        self._mounts: list[tuple[str, str]] | None = None  # this turn's mount table (may_hang)

    def mounts(self) -> list[tuple[str, str]]:
        """The mount table, read once per turn of the loop (a tier's spawns share one read)."""
        if self._mounts is None:
            self._mounts = _mounts()
        return self._mounts

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
            self._spawn(req, out_fd, errout_fd, listen)
        finally:
            for fd in listen:  # the child has its copies (or never ran); the daemon holds its own
                os.close(fd)

    def _spawn(self, req: dict, out_fd: int, errout_fd: int, listen: list[int]) -> None:
        placement = req.get("placement")
        # A path on a filesystem that may hang: a vfork would hold this loop until the child
        # execs, so such a spawn forks instead (and is bounded: expire_launches).
        if self.compiled and may_hang(req, self.mounts()) is None:
            self.spawn_compiled(req, out_fd, errout_fd, placement, listen)
            return
        err_r = err_w = -1
        try:
            if isinstance(placement, dict) and placement.get("error"):
                raise ValueError(f"NUMA placement: {placement['error']}")
            args = _placement_args(placement) if isinstance(placement, dict) else None
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            assert_single_threaded()
            pid = os.fork()
        except Exception as exc:
            for fd in {err_r, err_w, out_fd, errout_fd} - {-1}:
                os.close(fd)
            what = "spawn refused" if isinstance(exc, ValueError) else "fork failed"
            self.send({"op": "spawn_failed", "id": req["id"], "error": f"{what}: {exc}", "errno": 0})
            return
        if pid == 0:
            _child_setup_and_exec(req, out_fd, errout_fd, err_w, self.pid, self.reset_signals, self.devnull, args,
                                  listen)
        os.close(err_w)
        os.close(out_fd)
        if errout_fd != out_fd:
            os.close(errout_fd)
        # Open the pidfd before anything can reap the child: the pid is pinned
        # (at worst a zombie) until this loop calls waitpid.
        pidfd = self._pidfd_or_kill(pid, req["id"])
        if pidfd < 0:
            os.close(err_r)
            return
        os.set_blocking(err_r, False)
        self.launching[pid] = Launch(req["id"], req.get("unit", "?"), pid, pidfd,
                                     linux.start_time_of(pid) or 0, err_r)
        self.by_errfd[err_r] = pid
        self.poller.register(err_r, select.POLLIN)

    def spawn_compiled(self, req: dict, out_fd: int, errout_fd: int, placement, listen: list[int] = ()) -> None:
        """One spawn through omnid._spawnc: when it returns the child has exec'd or failed, so
        its "spawned" (with the pidfd) or "spawn_failed" goes out in this turn's answer. A
        failed child exits 127 and is reported as an adopted exit when reaped, as on the
        Python path."""
        try:
            if isinstance(placement, dict) and placement.get("error"):
                raise ValueError(f"NUMA placement: {placement['error']}")
            args = _placement_args(placement) if isinstance(placement, dict) else None
            plan = _compiled_args(req, out_fd, errout_fd, self.devnull, self.pid, self.reset_signals, args)
        except Refused as exc:
            self._refuse(req, out_fd, errout_fd, str(exc))
            return
        except (ValueError, TypeError, OverflowError) as exc:
            self._refuse(req, out_fd, errout_fd, f"spawn refused: {exc}")
            return
        try:
            assert_single_threaded()
            # The listening fds go as trailing arguments: the child sets LISTEN_PID itself.
            pid, stage, err, index = _spawnc.spawn(*plan, *((list(listen),) if listen else ()))
        except (OSError, SpawnerInvariantError) as exc:
            pid, error = -1, f"fork failed: {exc}"
        except (ValueError, TypeError, OverflowError) as exc:
            pid, error = -1, f"spawn refused: {exc}"
        os.close(out_fd)
        if errout_fd != out_fd:
            os.close(errout_fd)
        if pid < 0:
            self.send({"op": "spawn_failed", "id": req["id"], "error": error, "errno": 0})
            return
        rid = req["id"]
        if stage != _spawnc.ST_OK:
            code, text = _compiled_failure(req, stage, err, index, [os.fsdecode(c) for c in plan[0]])
            self.outbox.append(({"op": "spawn_failed", "id": rid, "pid": pid, "error": text, "errno": code}, -1))
            return
        # Open the pidfd before anything can reap the child: the pid is pinned (at worst a
        # zombie) until this loop calls waitpid.
        pidfd = self._pidfd_or_kill(pid, rid)
        if pidfd < 0:
            return
        self.units[pid] = req.get("unit", "?")
        self.outbox.append(({"op": "spawned", "id": rid, "pid": pid, "start_time": linux.start_time_of(pid) or 0},
                            pidfd))

    def _pidfd_or_kill(self, pid: int, rid: int) -> int:
        """A pidfd for our unreaped child `pid`, or -1 with the child (and its session's group:
        it called setsid) SIGKILLed and spawn `rid` answered as failed: nothing may run that
        the daemon cannot hold. The pid is still ours to signal: only this loop reaps."""
        try:
            return linux.pidfd_open(pid)
        except OSError:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self.outbox.append(({"op": "spawn_failed", "id": rid, "pid": pid, "errno": 0,
                                 "error": "pidfd_open failed (out of fds?): the child was killed"}, -1))
            return -1

    def _refuse(self, req: dict, out_fd: int, errout_fd: int, text: str) -> None:
        """A spawn that never forked: its fds closed, its failure told at once (as the Python path)."""
        for fd in {out_fd, errout_fd}:
            os.close(fd)
        self.send({"op": "spawn_failed", "id": req["id"], "error": text, "errno": 0})

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
        if launch.answered:  # spawn_failed went out at its deadline: the child was killed
            os.close(launch.pidfd)
            adopted = True
        elif launch.error:
            os.close(launch.pidfd)
            # It never became a unit process: its exit (127) is reported as adopted.
            # First line: exec(2)'s errno (0 when something else failed), then the text.
            code, _, text = launch.error.decode(errors="replace").partition("\n")
            self.outbox.append(({"op": "spawn_failed", "id": launch.rid, "pid": pid, "error": text,
                                 "errno": int(code) if code.isdigit() else 0}, -1))
            adopted = True
        else:
            self.units[pid] = launch.unit
            # The pidfd goes with the event and is closed once sent (flush).
            self.outbox.append(({"op": "spawned", "id": launch.rid, "pid": pid, "start_time": launch.start_time},
                                launch.pidfd))
            adopted = False
        if launch.status is not None:
            # It exited before its exec report went out: report the exit after it.
            self.units.pop(pid, None)
            self.outbox.append(({"op": "exit", "pid": pid, "status": launch.status, "adopted": adopted}, -1))

    def expire_launches(self) -> float | None:
        """SIGKILL each child that has not exec'd within SPAWN_EXEC_TIMEOUT_S (stuck in chdir or
        execve on a hung mount) and answer its spawn as failed now; the exec report (EOF once
        it dies) then only cleans up. Returns the poll timeout in ms until the next deadline."""
        now = time.monotonic()
        nearest = None
        for launch in self.launching.values():
            if launch.answered:
                continue
            if launch.deadline <= now:
                launch.answered = True
                for kill in (os.killpg, os.kill):  # its own session's group (setsid), then itself
                    try:
                        kill(launch.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                self.outbox.append(({"op": "spawn_failed", "id": launch.rid, "pid": launch.pid, "errno": 0,
                                     "error": f"spawn timed out: no exec within {SPAWN_EXEC_TIMEOUT_S:g} s "
                                              f"(chdir or execve blocked: a hung filesystem?); the child was "
                                              f"killed"}, -1))
            elif nearest is None or launch.deadline < nearest:
                nearest = launch.deadline
        return None if nearest is None else max(1.0, (nearest - now) * 1000)

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
            self.outbox.append(({"op": "exit", "pid": pid, "status": status, "adopted": adopted}, -1))

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
                    self.outbox.append(({"op": "spawn_failed", "id": item["id"], "errno": errno.EMFILE,
                                         "error": "spawn request lost its file descriptors on the way to the "
                                                  "spawner (its fd table is full): not started"}, -1))
            return
        if op == "spawn" and "batch" in req:
            self.spawn_batch(req, fds)
        elif op == "spawn":
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
        # What a child must reset before exec: every signal whose disposition is not the
        # default here (ours, and those ignored since the daemon started us). Decided once,
        # so the child does not walk all 64.
        self.reset_signals = tuple(sig for sig in signal.valid_signals()
                                   if sig not in (signal.SIGKILL, signal.SIGSTOP)
                                   and signal.getsignal(sig) is not signal.SIG_DFL)
        linux.set_child_subreaper()
        linux.set_pdeathsig(signal.SIGHUP)
        if os.getppid() != self.daemon_pid:
            return self.cleanup()  # the daemon died before PDEATHSIG was armed
        self.send({"op": "hello", "pid": self.pid, "exec_path": "compiled" if self.compiled else "python"})
        self.poller.register(self.sock, select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)
        # Everything so far lives as long as we do: out of the collector's way, so that no
        # collection in a child (or here) touches and copies those pages after a fork.
        gc.freeze()
        timeout_ms: float | None = None
        while not self.stopping:
            self._mounts = None  # mounts come and go between turns
            for fd, _ev in self.poller.poll(timeout_ms):
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
            timeout_ms = self.expire_launches() if self.launching else None
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
            self.units.clear()
            self.launching.clear()
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
