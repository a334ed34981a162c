"""`omnid reexec`: the daemon replaces its own program with the omnid installed now, same
pid, and keeps every unit running (omnid(8), RE-EXEC). This module is both halves:

- the old program: checks that the new one starts (`omnid --version`, spawned with
  posix_spawn: the daemon never forks), waits until no unit is mid-spawn or mid-stop
  (converge holds new work meanwhile), writes everything a running daemon knows into
  a memfd -- settings, the stack's source texts, the token, every unit's runtime
  record, restart books, recent log lines, the removals of failed units' leftovers
  still under way (their threads end with the exec; the new program does each again,
  omnid.core.cleanup) -- marks the fds to keep inheritable (the
  spawner's socket and pidfd, the notify and health sockets, the state directory's
  lock, each unit's pidfd and output pipes) and execs
  `python -m omnid daemon --takeover FD`;
- the new program: reads it back and takes every fd over where the old one left it
  (omnid.daemon.Daemon.continue_after_reexec), or, when it cannot, falls back (below).

The record's format (every field, its type, the version) is omnid.daemon.record's.

This module is imported when `omnid reexec` is asked, so after an upgrade in place the old
program runs the NEW hand_over: what it calls on the daemon (`sup`, `control._tasks`,
`close_for_exec`, `reopen_after_failed_exec`, the attributes reexecrecord.collect reads)
must stay the same in every program.

With [cluster], the other hosts must not see this host leave: joins under way get a moment
to finish, the cluster session stops its loops without giving its etcd lease back and
renews it once more, and the record carries the lease, the groups (phase, generation, the
generation open here) and the peer heartbeat with its socket (omnid.core.crosshost
handover / read_handover / take_over). The new program takes them over before the
session's loops start and renews the lease at once; fencing counts the handover as a
silence of etcd, so it must be shorter than lease_ttl minus the fencing margin.

Nothing is stopped, restarted or signalled. The health socket stays bound: connections
wait in its backlog while the new program loads (none is refused). The control socket
is bound again (clients reconnect by themselves).

When the new program cannot read what it was handed, it stops every unit it can prove
its own (the state file: pid + start time + token), cleanly (stop signal, then SIGKILL),
says why, and starts the stack afresh -- never a process left unmanaged.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import structlog

from omnid.base import closer, linux
from omnid.daemon import record as reexecrecord

log = structlog.get_logger("omnid.daemon.handover")

CHECK_TIMEOUT_S = 15.0  # the new program's `--version` must answer by then
MAX_CHECK_OUTPUT = 1 << 16  # of what it prints, kept for the answer (the rest is read and dropped)
QUIESCE_TIMEOUT_S = 10.0  # spawns and stops under way must end by then, or the re-exec is refused
JOIN_WAIT_S = 3.0  # (within it) joins of groups across hosts under way get this long to finish


class HandoverError(Exception):
    """The re-exec cannot be done now; nothing was changed."""


@dataclass(frozen=True)
class ProgramCheck:
    argv: tuple[str, ...]
    version: str


def program_argv() -> list[str]:
    """How the omnid installed now is run: this interpreter, `-m omnid`, found on the
    interpreter's path (site-packages, an editable install, PYTHONPATH) -- never in the
    daemon's working directory (`-P`): a root daemon started in a directory others can
    write must not run an `omnid/` someone planted there."""
    return [sys.executable, "-P", "-m", "omnid"]


async def check_new_program(timeout: float = CHECK_TIMEOUT_S) -> ProgramCheck:
    """Run `omnid --version` of the program the daemon will become (posix_spawn, pidfd,
    bounded); HandoverError with what it printed if it does not start."""
    argv = [*program_argv(), "--version"]
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            pid = os.posix_spawn(argv[0], argv, dict(os.environ),
                                 file_actions=[(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, w, 1),
                                               (os.POSIX_SPAWN_DUP2, w, 2)])
        finally:
            os.close(devnull)
    except OSError as exc:
        os.close(r)
        os.close(w)
        raise HandoverError(f"cannot run {' '.join(argv)}: {exc}") from None
    os.close(w)
    pidfd = os.pidfd_open(pid)
    # Its output is read as it comes (a program that prints more than a pipe holds would
    # otherwise block in write and never exit), and nothing here blocks the loop: not the
    # wait for its exit (its pidfd), not the reap after a SIGKILL (done when the pidfd says so).
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    kept = 0

    def drain() -> None:
        nonlocal kept
        for _ in range(64):  # at most 4 MiB a turn: a writer that never stops cannot hold the loop
            try:
                b = os.read(r, 65536)
            except (BlockingIOError, InterruptedError):
                return
            if not b:
                loop.remove_reader(r)
                return
            if kept < MAX_CHECK_OUTPUT:
                chunks.append(b[:MAX_CHECK_OUTPUT - kept])
                kept += len(chunks[-1])

    def reap_later(fd: int) -> None:
        loop.remove_reader(fd)
        try:
            os.waitpid(pid, os.WNOHANG)  # our own child, by its pid; it has exited
        except ChildProcessError:
            pass
        os.close(fd)

    os.set_blocking(r, False)
    done = loop.create_future()
    loop.add_reader(r, drain)
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        try:
            await asyncio.wait_for(done, timeout)
        except asyncio.TimeoutError:
            loop.remove_reader(pidfd)
            linux.pidfd_send_signal(pidfd, signal.SIGKILL)
            loop.add_reader(pidfd, reap_later, pidfd)
            pidfd = -1  # reap_later closes it
            raise HandoverError(f"{' '.join(argv)} did not answer within {timeout:g} s; nothing changed") from None
        drain()
        reaped, status = os.waitpid(pid, os.WNOHANG)  # the pidfd said it exited: at once
        if reaped == 0:  # cannot be: exited means waitable
            status = 0xFF00
    finally:
        loop.remove_reader(r)
        if pidfd >= 0:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        os.close(r)
    out = b"".join(chunks)
    text = out.decode(errors="replace").strip()
    code, sig, what = linux.describe_wait_status(status)
    if code != 0 or not text.startswith("omnid "):
        raise HandoverError(f"the new program does not start ({' '.join(argv)}: {what}; it printed: "
                            f"{text[-500:] or 'nothing'}); nothing changed")
    return ProgramCheck(tuple(argv), text.splitlines()[0].split(" ", 1)[1])


# ------------------------------------------------------------------ the old program's side
def keep_across_exec(fds: list[int]) -> None:
    for fd in fds:
        os.set_inheritable(fd, True)


def exec_takeover(memfd: int, cfg: Any, log_file: str | None) -> None:
    """Become the new program (same pid). Raises OSError if exec failed. The settings go on
    the command line too: a program that cannot read the handover still knows its stack,
    state directory and sockets (and stops what it can prove its own, see the module doc)."""
    argv = [*program_argv(), "--control", cfg.control, "daemon", "-u", cfg.units_dir, "--state-dir", cfg.state_dir,
            "--health-listen", cfg.health_listen, "--log-format", cfg.log_format,
            *(["--log-file", log_file] if log_file else []),
            *(["--cgroup-root", cfg.cgroup_root] if cfg.cgroup_root else []), "--takeover", str(memfd)]
    sys.stdout.flush()
    sys.stderr.flush()
    # An ignored signal stays ignored across exec (a handled one does not): a SIGHUP while
    # the new program loads is not the default, which would kill it and every unit with it.
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        os.execv(argv[0], argv)
    except BaseException:
        signal.signal(signal.SIGHUP, before)
        raise


def fd_alive(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


async def _joins_settled(crosshost: Any, deadline: float) -> None:
    """Give joins of groups across hosts under way until `deadline` to finish (converge is held:
    a join that finishes is handed over as admitted). One still waiting then, for a host that
    is not there, is not an error: the next program joins again and finds its own join key
    (the lease is the same one), so no generation begins for it."""
    while crosshost.joining() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if crosshost.joining():
        log.info("re-exec: joins still waiting for other hosts; the next program joins again, same generation",
                 groups=crosshost.joining())


async def hand_over(daemon: Any, check: ProgramCheck) -> None:
    """Quiesce, write the record, keep the fds, exec. On success this never returns; if it
    cannot be done, everything is put back as it was and the reason logged."""
    sup = daemon.sup
    sup.frozen = True  # converge starts and stops nothing new; deaths are still handled
    cluster_paused = False
    try:
        t0 = time.monotonic()
        if not await sup.wait_until(sup.idle, QUIESCE_TIMEOUT_S):
            busy = [f"{rt.name} ({rt.state.value}/{rt.phase.value})" for rt in sup.units.values() if rt.busy]
            log.error("re-exec abandoned: units still busy", units=busy, after_s=QUIESCE_TIMEOUT_S)
            return
        if sup.crosshost is not None:
            await _joins_settled(sup.crosshost, min(t0 + QUIESCE_TIMEOUT_S, time.monotonic() + JOIN_WAIT_S))
            why = sup.crosshost.exec_refusal()
            if why is not None:
                log.error("re-exec abandoned", reason=why)
                return
        deadline = time.monotonic() + 2.0
        while daemon.control._tasks and time.monotonic() < deadline:  # the reexec reply goes out first
            await asyncio.sleep(0.005)
        await daemon.close_for_exec()
        if sup.crosshost is not None:  # last: the lease is renewed as close to the exec as can be
            from omnid.cluster.session import ExecRefused

            try:
                await sup.crosshost.session.pause_for_exec()
            except ExecRefused as exc:
                raise OSError(str(exc)) from None
            cluster_paused = True
            why = sup.crosshost.exec_refusal()  # a failure heard meanwhile: its members must stop now
            if why is not None:
                raise OSError(why)
        if not sup.idle():  # a death while the front closed: it is handled here, not half-handed over
            raise OSError("a unit became busy while the daemon closed its sockets")
        rec, fds = reexecrecord.collect(daemon, check)
        rec["exec_at"] = time.monotonic()  # the same clock in the next program: it times the handover
        memfd = reexecrecord.write(rec)
        keep_across_exec([*fds, memfd])
        removing = [r["unit"] for r in (rec.get("cleanup") or {}).get("removing", [])]
        log.info("re-executing", program=" ".join(check.argv), to_version=check.version, units=len(sup.units),
                 fds=len(fds), **({"removals_handed_over": removing} if removing else {}))
        try:
            exec_takeover(memfd, daemon.cfg, daemon.log_file)
        finally:
            os.close(memfd)
            for fd in fds:
                if fd_alive(fd):
                    os.set_inheritable(fd, False)
            closer.close_all(rec.get("foreign_fds") or [])  # the exec failed: back to this program's closer
    except OSError as exc:
        log.error("re-exec failed; this program goes on", error=str(exc))
        if cluster_paused:
            sup.crosshost.session.resume_after_failed_exec()
        await daemon.reopen_after_failed_exec()
    finally:
        sup.frozen = False
        sup.kick()


# ------------------------------------------------------------------ the new program's side
def stop_what_is_provably_ours(state_dir: str, units_dir: str, why: str) -> list[str]:
    """The handover could not be read: stop every unit process this daemon can prove its own
    (the state file: pid + start time + this daemon's token), cleanly -- each group gets its
    stop signal, SIGKILL at the stop timeout -- while the spawner still holds them. Returns
    what survived. Runs before the event loop, with the inherited fds still open."""
    from pathlib import Path

    from omnid.daemon.statefile import StateFile, find_leftovers
    from omnid.process.termination import LeftoverTarget, terminate
    from omnid.model.units import StackInvalid, load_stack

    log.error("the handover from the previous program could not be read; stopping every unit this daemon "
              "can prove its own, then starting the stack afresh", why=why)
    previous = StateFile(Path(state_dir)).read()
    if not previous:
        log.error("no state file either: nothing can be proven ours; the previous spawner's units die with it")
        return []
    items = find_leftovers(previous)
    stop_timeout, kill_timeout = 10.0, 10.0
    try:
        stack = load_stack(units_dir)
        stop_timeout = max((u.stop_timeout for u in stack.units.values()), default=stop_timeout)
        kill_timeout = max((u.kill_timeout for u in stack.units.values()), default=kill_timeout)
    except StackInvalid:
        pass
    target = LeftoverTarget("units of the previous program", items)
    try:
        asyncio.run(terminate(target, signal.SIGTERM, stop_timeout, kill_timeout))
        return [s.why for s in target.members()]
    finally:
        target.close()


def forget_inherited_fds(keep: tuple[int, ...] = (0, 1, 2)) -> None:
    """Close every fd the previous program left us (their meaning is lost with the handover):
    the old spawner sees EOF and goes, killing whatever is left of its children."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def reap_old_children(timeout: float = 10.0) -> None:
    """The previous spawner (and any helper the previous program ran) is this process's child:
    wait for each by its pid once it went (they go on EOF of their socket, after the fds
    were forgotten). Never waitpid(-1)."""
    deadline = time.monotonic() + timeout
    while True:
        kids = linux.children_of(os.getpid())
        for pid in kids:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if not linux.children_of(os.getpid()):
            return
        if time.monotonic() >= deadline:
            log.error("children of the previous program did not exit", pids=kids)
            return
        time.sleep(0.01)
