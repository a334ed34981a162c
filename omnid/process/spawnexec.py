"""From fork to exec: the spawner's two paths behind one door, and the one spawn result.

`Launcher.start` takes one spawn request (its stdout/stderr and listening fds already split
out by the spawner's loop, omnid/process/spawner.py) and starts the child by one of two paths:

- compiled (omnid.process._spawnc, where it was built): a vfork child in C does the setup and the
  exec; when vfork returns the outcome is known, so the result goes out in this turn.
- forked (no extension, OMNID_SPAWNER_PYTHON=1, or a cwd/program on a filesystem that may
  hang: omnid/process/spawnplan.py): a forked Python child does the same steps
  (omnid/process/spawnchild.py) and tells its outcome through a close-on-exec pipe: EOF once it has
  exec'd, "ERRNO\\nTEXT" if a step failed. The loop polls that pipe (`exec_report`), and
  `expire` SIGKILLs a child that has not exec'd within SPAWN_EXEC_TIMEOUT_S.

Either way the child ends in `_settle`, the one place that answers a spawn that forked:
"spawned" with its pidfd, or "spawn_failed" with the failed step's words (the same on both
paths). A spawn refused before any fork is answered at once (`answer_now`).

Every child the spawner holds has one record, a `Child`, in one table (`Children`): while it
launches (forked path) and, once spawned, as a unit's main process, until it is reaped. A
child with no record when reaped (a failed spawn, a double-forked grandchild) is reported as
adopted.

Runs in the spawner: light (see omnid/base/linux.py), single-threaded (checked before each fork).
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable

from omnid.base import linux
from omnid.process.spawnchild import compiled_failure, setup_and_exec
from omnid.process.spawnplan import Refused, compiled_args, may_hang, placement_args

try:
    from omnid.process import _spawnc
except ImportError:  # not compiled on this host: the Python path
    _spawnc = None

# From fork to exec, at most (a chdir or execve on a hung mount): then SIGKILL and spawn_failed.
SPAWN_EXEC_TIMEOUT_S = 10.0


class SpawnerInvariantError(RuntimeError):
    """The spawner found itself with more than one thread: forking now is unsafe."""


def assert_single_threaded() -> None:
    n = linux.thread_count()
    if n != 1:
        raise SpawnerInvariantError(f"refusing to fork: spawner has {n} threads, must have exactly 1")


def kill_child(pid: int) -> None:
    """SIGKILL our unreaped child and its session's group (it called setsid): the pid is still
    ours to signal, as only the spawner's loop reaps."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Child:
    """One child the spawner holds. (A plain class: no dataclasses import in the spawner.)"""

    __slots__ = ("rid", "unit", "pid", "pidfd", "start_time", "pipe", "error", "status", "deadline", "answered")

    def __init__(self, rid: int, unit: str, pid: int) -> None:
        self.rid, self.unit, self.pid = rid, unit, pid
        self.pidfd = -1
        self.start_time = 0
        self.pipe = -1  # the read end of its exec report pipe while it launches (forked path), else -1
        self.error = b""  # what came through that pipe
        self.status: int | None = None  # set if it was reaped before its exec report went out
        self.deadline = time.monotonic() + SPAWN_EXEC_TIMEOUT_S  # no exec by then: SIGKILL, spawn_failed
        self.answered = False  # spawn_failed went out at the deadline; the exec report only cleans up

    @property
    def launching(self) -> bool:
        return self.pipe >= 0


class Children:
    """The children the spawner holds, one `Child` each: by pid, and those launching also by
    their pipe's fd (what the poll loop sees). Both indexes change here and only here."""

    def __init__(self) -> None:
        self._by_pid: dict[int, Child] = {}
        self._by_pipe: dict[int, Child] = {}

    def hold(self, child: Child) -> None:
        self._by_pid[child.pid] = child
        if child.pipe >= 0:
            self._by_pipe[child.pipe] = child

    def launched(self, child: Child) -> None:
        """Its exec outcome is known: it no longer launches (the pipe is the caller's to close)."""
        self._by_pipe.pop(child.pipe, None)
        child.pipe = -1

    def drop(self, child: Child) -> None:
        if self._by_pid.get(child.pid) is child:
            del self._by_pid[child.pid]

    def get(self, pid: int) -> Child | None:
        return self._by_pid.get(pid)

    def at_pipe(self, fd: int) -> Child | None:
        return self._by_pipe.get(fd)

    def launching(self) -> list[Child]:
        return list(self._by_pipe.values())

    def any_launching(self) -> bool:
        return bool(self._by_pipe)

    def clear(self) -> None:
        self._by_pid.clear()
        self._by_pipe.clear()


class Launcher:
    """Starts each child by its path and answers its spawn. `tell(event, fd)` queues an event
    for this turn's answer (fd: a pidfd to pass, or -1); `answer_now(event)` sends at once."""

    def __init__(self, children: Children, poller: select.poll, spawner_pid: int,
                 tell: Callable[[dict, int], None], answer_now: Callable[[dict], None]) -> None:
        self.children = children
        self.poller = poller
        self.spawner_pid = spawner_pid
        # OMNID_SPAWNER_PYTHON=1 forces the forked path where the compiled one exists (a test
        # hook: the tests run both).
        self.compiled = _spawnc is not None and os.environ.get("OMNID_SPAWNER_PYTHON") != "1"
        self.tell = tell
        self.answer_now = answer_now
        # What a child resets before exec (every signal not at its default in the spawner):
        # set once by the spawner's run, so that no child walks all 64.
        self.reset_signals: tuple[int, ...] = ()
        self.devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)

    def start(self, req: dict, out_fd: int, errout_fd: int, listen: list[int],
              mounts: Callable[[], list[tuple[str, str]]]) -> None:
        """Start one child; out_fd and errout_fd are closed here (the child has its copies).
        A path on a filesystem that may hang: a vfork would hold the spawner's loop until the
        child execs, so such a spawn is forked instead (and bounded: `expire`). `mounts`: the
        spawner's mount table of this turn, read only when a vfork is possible."""
        if self.compiled and may_hang(req, mounts()) is None:
            self._start_compiled(req, out_fd, errout_fd, listen)
        else:
            self._start_forked(req, out_fd, errout_fd, listen)

    def _start_compiled(self, req: dict, out_fd: int, errout_fd: int, listen: list[int]) -> None:
        """Through omnid.process._spawnc: when it returns the child has exec'd or failed."""
        placement = req.get("placement")
        try:
            if isinstance(placement, dict) and placement.get("error"):
                raise ValueError(f"NUMA placement: {placement['error']}")
            args = placement_args(placement) if isinstance(placement, dict) else None
            plan = compiled_args(req, out_fd, errout_fd, self.devnull, self.spawner_pid, self.reset_signals, args)
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
            self.answer_now({"op": "spawn_failed", "id": req["id"], "error": error, "errno": 0})
            return
        child = Child(req["id"], req.get("unit", "?"), pid)
        if stage != _spawnc.ST_OK:
            self._settle(child, compiled_failure(req, stage, err, index, [os.fsdecode(c) for c in plan[0]]))
            return
        # Open the pidfd before anything can reap the child: the pid is pinned (at worst a
        # zombie) until this loop calls waitpid.
        child.pidfd = self._pidfd_or_kill(pid, child.rid)
        if child.pidfd < 0:
            return
        child.start_time = linux.start_time_of(pid) or 0
        self._settle(child, None)

    def _start_forked(self, req: dict, out_fd: int, errout_fd: int, listen: list[int]) -> None:
        """Fork a Python child (omnid/process/spawnchild.py); its outcome comes back through the poll
        loop (`exec_report`), so many spawns overlap instead of each waiting for an exec."""
        placement = req.get("placement")
        err_r = err_w = -1
        try:
            if isinstance(placement, dict) and placement.get("error"):
                raise ValueError(f"NUMA placement: {placement['error']}")
            args = placement_args(placement) if isinstance(placement, dict) else None
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            assert_single_threaded()
            pid = os.fork()
        except Exception as exc:
            for fd in {err_r, err_w, out_fd, errout_fd} - {-1}:
                os.close(fd)
            what = "spawn refused" if isinstance(exc, ValueError) else "fork failed"
            self.answer_now({"op": "spawn_failed", "id": req["id"], "error": f"{what}: {exc}", "errno": 0})
            return
        if pid == 0:
            setup_and_exec(req, out_fd, errout_fd, err_w, self.spawner_pid, self.reset_signals, self.devnull, args,
                           listen)
        os.close(err_w)
        os.close(out_fd)
        if errout_fd != out_fd:
            os.close(errout_fd)
        # Open the pidfd now, before anything can reap the child: it may die before its exec
        # report is read, and the pid is pinned (at worst a zombie) until this loop calls waitpid.
        child = Child(req["id"], req.get("unit", "?"), pid)
        child.pidfd = self._pidfd_or_kill(pid, child.rid)
        if child.pidfd < 0:
            os.close(err_r)
            return
        os.set_blocking(err_r, False)
        child.start_time = linux.start_time_of(pid) or 0
        child.pipe = err_r
        self.children.hold(child)
        self.poller.register(err_r, select.POLLIN)

    def exec_report(self, fd: int) -> None:
        """A launching child's close-on-exec pipe is readable: an error text, or EOF (exec done)."""
        child = self.children.at_pipe(fd)
        if child is None:
            return
        while True:
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                return  # more to come
            if not chunk:
                break
            child.error += chunk
        self.poller.unregister(fd)
        self.children.launched(child)
        os.close(fd)
        failure = None
        if child.error:
            # First line: exec(2)'s errno (0 when something else failed), then the text.
            code, _, text = child.error.decode(errors="replace").partition("\n")
            failure = (int(code) if code.isdigit() else 0, text)
        self._settle(child, failure)

    def _settle(self, child: Child, failure: tuple[int, str] | None) -> None:
        """The spawn result, the same for both paths once the exec outcome is known: "spawned"
        with the pidfd (the event carries it; it is closed once sent), or "spawn_failed" with
        (exec's errno or 0, the words). A failed child never became a unit's process: its exit
        (127) is reported as adopted. A child reaped before its result went out has its exit
        told right after it."""
        if failure is None and not child.answered:
            self.children.hold(child)  # a unit's main process now
            self.tell({"op": "spawned", "id": child.rid, "pid": child.pid, "start_time": child.start_time},
                      child.pidfd)
            adopted = False
        else:
            if child.pidfd >= 0:
                os.close(child.pidfd)
            self.children.drop(child)
            if failure is not None and not child.answered:  # else it went out at its deadline (`expire`)
                code, text = failure
                self.tell({"op": "spawn_failed", "id": child.rid, "pid": child.pid, "error": text,
                           "errno": code}, -1)
            adopted = True
        if child.status is not None:
            self.children.drop(child)
            self.tell({"op": "exit", "pid": child.pid, "status": child.status, "adopted": adopted}, -1)

    def expire(self) -> float | None:
        """SIGKILL each child that has not exec'd within SPAWN_EXEC_TIMEOUT_S (stuck in chdir or
        execve on a hung mount) and answer its spawn as failed now; the exec report (EOF once
        it dies) then only cleans up. Returns the poll timeout in ms until the next deadline."""
        now = time.monotonic()
        nearest = None
        for child in self.children.launching():
            if child.answered:
                continue
            if child.deadline <= now:
                child.answered = True
                kill_child(child.pid)  # its own session's group (setsid), then itself
                self.tell({"op": "spawn_failed", "id": child.rid, "pid": child.pid, "errno": 0,
                           "error": f"spawn timed out: no exec within {SPAWN_EXEC_TIMEOUT_S:g} s "
                                    f"(chdir or execve blocked: a hung filesystem?); the child was killed"}, -1)
            elif nearest is None or child.deadline < nearest:
                nearest = child.deadline
        return None if nearest is None else max(1.0, (nearest - now) * 1000)

    def _pidfd_or_kill(self, pid: int, rid: int) -> int:
        """A pidfd for our unreaped child `pid`, or -1 with the child (and its session's group:
        it called setsid) SIGKILLed and spawn `rid` answered as failed: nothing may run that
        the daemon cannot hold."""
        try:
            return linux.pidfd_open(pid)
        except OSError:
            kill_child(pid)
            self.tell({"op": "spawn_failed", "id": rid, "pid": pid, "errno": 0,
                       "error": "pidfd_open failed (out of fds?): the child was killed"}, -1)
            return -1

    def _refuse(self, req: dict, out_fd: int, errout_fd: int, text: str) -> None:
        """A spawn that never forked: its fds closed, its failure told at once (as the forked path)."""
        for fd in {out_fd, errout_fd}:
            os.close(fd)
        self.answer_now({"op": "spawn_failed", "id": req["id"], "error": text, "errno": 0})
