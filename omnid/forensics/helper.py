"""Running a short-lived helper program (py-spy) from the daemon, bounded in time and output.

The daemon has threads and never forks: the helper is started with os.posix_spawn
(vfork + exec, thread-safe), its stdout and stderr come back through pipes read on the
event loop, its end is seen on a pidfd, and it is reaped with waitpid(pid) of that one pid
(never waitpid(-1), which would steal the spawner's statuses). At its deadline it is
killed through the pidfd. A helper that does not die at once after SIGKILL (blocked in
the kernel) is reaped later, when its pidfd turns readable, instead of being waited for.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

import structlog

from omnid.process import proof

log = structlog.get_logger("omnid.forensics.helper")

STDERR_CAP = 4096  # bytes of a helper's stderr kept: its error message, not a flood
REAP_GRACE_S = 0.1  # after SIGKILL, how long the caller waits before leaving the reap to later

# pid -> pidfd of helpers killed but not yet exited: reaped when their pidfd turns readable
# (loop reader) or by reap_pending() (the next run, or a caller without a loop).
_pending: dict[int, int] = {}


@dataclass(frozen=True)
class HelperResult:
    """What a helper run gave: its output (cut at the cap), and how it ended."""

    out: bytes
    err: bytes
    status: int | None  # waitpid status, None when it had not exited when we stopped waiting
    timed_out: bool  # killed at the deadline
    truncated: bool  # stdout longer than the cap: cut, and the helper killed


def reap_pending() -> int:
    """Reap killed helpers that have exited since (WNOHANG, each by its own pid);
    returns how many are still not reaped."""
    for pid, fd in list(_pending.items()):
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid  # someone reaped it already; nothing left to wait for
        if done:
            _forget(pid)
    return len(_pending)


def _forget(pid: int) -> None:
    fd = _pending.pop(pid, None)
    if fd is None:
        return
    try:
        asyncio.get_running_loop().remove_reader(fd)
    except RuntimeError:
        pass  # no loop here: nothing was registered in one
    os.close(fd)


def _reap_later(pid: int, pidfd: int) -> None:
    _pending[pid] = pidfd
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    loop.add_reader(pidfd, reap_pending)


def spawn(path: str, argv: list[str], env: dict[str, str]) -> tuple[int, int, int, int]:
    """posix_spawn `path` with stdin /dev/null and stdout/stderr on fresh pipes.
    Returns (pid, pidfd, stdout read end, stderr read end), the read ends non-blocking."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_DUP2, out_w, 1),
                   (os.POSIX_SPAWN_DUP2, err_w, 2)]
        # Its own process group: a terminal's Ctrl+C meant for the daemon does not cut
        # a capture short, and the group number is never one of a unit's.
        pid = os.posix_spawn(path, argv, env, file_actions=actions, setpgroup=0)
    except BaseException:
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)
        raise
    os.close(out_w)
    os.close(err_w)
    try:
        # Our own child, not reaped by anyone but us: the pid cannot be reused before this.
        pidfd = os.pidfd_open(pid)
    except OSError:
        os.close(out_r)
        os.close(err_r)
        if proof.own_child(pid):  # not reaped: no one else can have its number
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise
    os.set_blocking(out_r, False)
    os.set_blocking(err_r, False)
    return pid, pidfd, out_r, err_r


async def run(path: str, argv: list[str], env: dict[str, str], *, deadline: float, max_out: int,
              reap_by: float | None = None) -> HelperResult:
    """Run a helper until it exits, its stdout passes `max_out` bytes, or the loop time
    `deadline`; it is killed in the last two cases (and on cancellation), and reaped if it
    is gone by `reap_by` (loop time; default deadline + REAP_GRACE_S), else left to
    reap_pending(). Raises OSError only when it cannot be started."""
    reap_pending()
    loop = asyncio.get_running_loop()
    pid, pidfd, out_r, err_r = spawn(path, argv, env)
    bufs = {out_r: bytearray(), err_r: bytearray()}
    caps = {out_r: max_out, err_r: STDERR_CAP}
    open_fds = {out_r, err_r}
    eof = loop.create_future()
    exited = loop.create_future()
    truncated = False

    def on_read(fd: int) -> None:
        nonlocal truncated
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            room = caps[fd] - len(bufs[fd])
            bufs[fd] += chunk[:max(room, 0)]
            if len(chunk) <= room:
                return
            if fd == out_r:
                truncated = True  # the rest is not read: the helper is killed below
        loop.remove_reader(fd)
        open_fds.discard(fd)
        if (truncated or not open_fds) and not eof.done():
            eof.set_result(None)

    def on_exit() -> None:
        loop.remove_reader(pidfd)
        if not exited.done():
            exited.set_result(None)

    for fd in (out_r, err_r):
        loop.add_reader(fd, on_read, fd)
    loop.add_reader(pidfd, on_exit)
    timed_out = False
    status: int | None = None
    try:
        try:
            await asyncio.wait_for(asyncio.shield(eof), max(deadline - loop.time(), 0.0))
        except TimeoutError:
            timed_out = True
        if not timed_out and not truncated:
            # Output closed: it is exiting. Its status, within what is left of the deadline.
            try:
                await asyncio.wait_for(asyncio.shield(exited), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                timed_out = True
    finally:
        for fd in list(open_fds):
            loop.remove_reader(fd)
        for fd in (out_r, err_r):
            os.close(fd)
        try:
            if not exited.done():
                _kill(pidfd)
                # Cancelled or late: a short, bounded wait for the SIGKILL to land.
                grace = (deadline + REAP_GRACE_S if reap_by is None else reap_by) - loop.time()
                try:
                    await asyncio.wait_for(asyncio.shield(exited), min(max(grace, 0.0), REAP_GRACE_S))
                except TimeoutError:
                    pass
        finally:
            loop.remove_reader(pidfd)
            status = _reap_now_or_later(pid, pidfd)
    return HelperResult(bytes(bufs[out_r]), bytes(bufs[err_r]), status, timed_out, truncated)


def _kill(pidfd: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass  # exited on its own in the meantime


def _reap_now_or_later(pid: int, pidfd: int) -> int | None:
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        os.close(pidfd)
        log.warning("helper was reaped by someone else", pid=pid)
        return None
    if done:
        os.close(pidfd)
        return status
    log.warning("helper did not exit at once after SIGKILL; reaping it when it does", pid=pid)
    _reap_later(pid, pidfd)
    return None
