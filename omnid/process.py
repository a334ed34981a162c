"""Process handles and residue scans (DESIGN.md Part 1, "Tracking and signalling").

A unit's main process is never a bare pid: `ProcessHandle` carries pid, pidfd,
process group and start time together, so nothing can signal a recycled pid.
`find_residue` is the kernel's answer to "is anything of this unit left?".
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field

from omnid import linux

# The tag every unit process carries (and inherits to its descendants).
UNIT_TAG = "OMNID_UNIT"
# Names the daemon instance that spawned a process: proof of ownership for leftovers.
DAEMON_TAG = "OMNID_DAEMON"


@dataclass
class ProcessHandle:
    unit: str
    pid: int
    pidfd: int
    pgid: int
    start_time: int
    exit_status: int | None = None
    # Set when the spawner reports the exit (i.e. after the process was reaped).
    reaped: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the pidfd turned readable (the process exited; maybe not yet reaped).
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    def signal(self, sig: int) -> bool:
        """Signal the main process through its pidfd; False if it has exited."""
        if self.pidfd < 0:
            return False
        return linux.pidfd_send_signal(self.pidfd, sig)

    def signal_group(self, sig: int) -> bool:
        """Signal the unit's whole process group (recorded at spawn: getpgid fails once the leader is gone)."""
        try:
            os.killpg(self.pgid, sig)
            return True
        except ProcessLookupError:
            return False

    def close(self) -> None:
        if self.pidfd >= 0:
            try:
                asyncio.get_running_loop().remove_reader(self.pidfd)
            except RuntimeError:
                pass
            os.close(self.pidfd)
            self.pidfd = -1


@dataclass(frozen=True)
class Survivor:
    pid: int
    comm: str
    state: str
    wchan: str
    why: str  # "process group 1234", "session 1234", "orphan tagged worker@1"
    start_time: int = 0

    def describe(self) -> str:
        return f"pid {self.pid} ({self.comm}, state {self.state}, wchan {self.wchan}; {self.why})"


def find_residue(unit: str, pgid: int, spawner_pid: int, daemon_token: str | None = None,
                 table: list[linux.ProcStat] | None = None) -> list[Survivor]:
    """Every live process that belongs to `unit`: its group, its session, and
    re-parented orphans (children of the subreaper spawner) tagged with its name."""
    table = linux.scan() if table is None else table
    out: list[Survivor] = []
    by_parent: dict[int, list[linux.ProcStat]] = {}
    for p in table:
        by_parent.setdefault(p.ppid, []).append(p)
    seen: set[int] = set()

    def add(p: linux.ProcStat, why: str) -> None:
        if p.pid in seen or p.state in ("Z", "X"):
            # Zombies are dead; the spawner reaps them. They are not residue.
            return
        seen.add(p.pid)
        out.append(Survivor(p.pid, p.comm, p.state, linux.wchan(p.pid), why, p.start_time))

    for p in table:
        if pgid > 1 and p.pgid == pgid:
            add(p, f"process group {pgid}")
        elif pgid > 1 and p.sid == pgid:
            add(p, f"session {pgid}")
    for p in by_parent.get(spawner_pid, []):
        if p.pgid == pgid or p.pid in seen:
            continue
        if linux.read_environ_var(p.pid, UNIT_TAG) == unit and (
            daemon_token is None or linux.read_environ_var(p.pid, DAEMON_TAG) in (daemon_token, None)
        ):
            add(p, f"orphan tagged {unit}")
            # Everything below an escaped orphan escaped with it.
            stack = list(by_parent.get(p.pid, []))
            while stack:
                c = stack.pop()
                add(c, f"descendant of orphan {p.pid}")
                stack.extend(by_parent.get(c.pid, []))
    return out


def kill_survivors(survivors: list[Survivor], sig: int = signal.SIGKILL) -> None:
    """Kill residue found by find_residue, each through a pidfd opened and then
    checked against the start time we saw, so a recycled pid is never hit."""
    for s in survivors:
        try:
            pidfd = os.pidfd_open(s.pid)
        except ProcessLookupError:
            continue
        try:
            if linux.start_time_of(s.pid) == s.start_time:
                linux.pidfd_send_signal(pidfd, sig)
        finally:
            os.close(pidfd)
