"""The steps a spawned child takes from fork to exec, and the words for each step's failure.

Two implementations of the same steps (setsid, PR_SET_PDEATHSIG, signal reset, stdio and
listening fds, rlimits, cgroup, placement, cwd, group and user, PDEATHSIG again, exec), in
the same order: `setup_and_exec`, the forked Python child of the spawner's Python path, and
omnid/process/_spawnc.c, the vfork child of the compiled path. A failed step reads the same on either
path: the Python child writes "STEP failed: WHY" into its close-on-exec pipe; for the C child,
which reports a stage number, `compiled_failure` writes the same words in the spawner. A step
added or changed here is changed in _spawnc.c too (tests/test_exec_paths.py runs both).

Imported by the spawner only, and light (see omnid/base/linux.py): every page it touches in the
child is copied after fork.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import pwd
import resource
import signal

from omnid.base import linux

try:
    from omnid.process import _spawnc
except ImportError:  # not compiled on this host: only the Python path runs
    _spawnc = None


class _Failed(Exception):
    """A step's failure whose words were written before the fork (the resolved ids' error)."""


def setup_and_exec(req: dict, out_fd: int, errout_fd: int, err_w: int, spawner_pid: int,
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
        ids = req.get("ids")
        if ids is not None:  # resolved by the daemon when it read the stack (the same as the compiled path)
            if ids["error"]:
                stage, why = ids["error"].split(" failed: ", 1)
                raise _Failed(why)
            if req.get("group"):
                stage = f"group {req['group']!r}"
                os.setgid(ids["gid"])
            if req.get("user"):
                stage = f"user {req['user']!r}"
                os.setgid(ids["gid"])
                os.setgroups(ids["groups"])
                os.setuid(ids["uid"])
        else:
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


def compiled_failure(req: dict, stage: int, err: int, index: int, candidates: list[str]) -> tuple[int, str]:
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
