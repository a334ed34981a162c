"""Process handles and residue scans (ARCHITECTURE.md, "Processes and how they are held").

A unit's main process is never a bare pid: `ProcessHandle` carries pid, pidfd,
process group and start time together, so nothing can signal a recycled pid.
`find_residue` is the scan of a unit's live processes by group, session and tag; whether a
unit is gone is omnid.process.unitprocs' answer, which reads it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from omnid.base import linux
from omnid.process import proof
from omnid.process.tags import DAEMON_TAG, UNIT_TAG, tags_of  # noqa: F401 - the tags, also imported from here


@dataclass(frozen=True)
class TreeUsage:
    rss: int  # bytes, summed over the tree
    cpu_s: float  # user + system seconds
    processes: int
    threads: int


def tree_usage(pid: int | None) -> TreeUsage | None:
    """Resources of a unit's main process and its descendants, or None when it is not
    running: for /metrics in the daemon and for `omnid status` on the same host. The tree is
    walked down from the main process through /proc/PID/task/*/children, one stat read per
    process: the cost is the unit's own size, whatever else the host runs (psutil's
    children(recursive=True) reads every process on the host, per call)."""
    if not pid:
        return None
    rss, ticks, n, threads = 0, 0, 0, 0
    seen: set[int] = set()
    stack = [pid]
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        fields = linux.read_stat_fields(p)
        if fields is None:
            if p == pid:
                return None
            continue
        # After "(comm)": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
        # utime(11) stime(12) cutime cstime priority nice num_threads(17) itrealvalue
        # starttime vsize rss(21, pages).
        ticks += int(fields[11]) + int(fields[12])
        threads += int(fields[17])
        rss += int(fields[21]) * PAGE_SIZE
        n += 1
        stack.extend(linux.children_of(p))
    return TreeUsage(rss, ticks / linux.CLK_TCK, n, threads)


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class ProcessHandle:
    unit: str
    pid: int
    pidfd: int
    pgid: int
    start_time: int
    exit_status: int | None = None
    exit_seen: float = 0.0  # monotonic time the pidfd turned readable
    # Set when the spawner reports the exit (i.e. after the process was reaped).
    reaped: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the pidfd turned readable (the process exited; maybe not yet reaped).
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    exit_told: bool = False  # its death was fed to its unit as EXITED (omnid.core.exits, once)

    def to_json(self) -> dict:
        """The numbers that name the process (the pidfd as its fd number: kept open across
        the daemon's re-exec)."""
        return {"pid": self.pid, "pidfd": self.pidfd, "pgid": self.pgid, "start_time": self.start_time,
                "exit_status": self.exit_status}

    @classmethod
    def from_json(cls, unit: str, d: dict) -> ProcessHandle:
        for k in ("pid", "pidfd", "pgid", "start_time"):
            if not isinstance(d[k], int) or isinstance(d[k], bool) or d[k] < 0:
                raise ValueError(f"{unit}: process field {k!r} is not a number: {d[k]!r}")
        status = d["exit_status"]
        if status is not None and (not isinstance(status, int) or isinstance(status, bool)):
            raise ValueError(f"{unit}: exit_status is not a number: {status!r}")
        return cls(unit=unit, pid=d["pid"], pidfd=d["pidfd"], pgid=d["pgid"], start_time=d["start_time"],
                   exit_status=status)

    def signal(self, sig: int) -> bool:
        """Signal the main process through its pidfd; False if it has exited."""
        if self.pidfd < 0:
            return False
        return linux.pidfd_send_signal(self.pidfd, sig)

    def leader_alive(self) -> bool:
        """Is the main process (the group leader) still running? A pidfd that is not
        readable proves it, and with it that the group number is still this unit's."""
        return self.pidfd >= 0 and not linux.pidfd_exited(self.pidfd)

    def status_from_pidfd(self) -> bool:
        """Take the exit status from the pidfd once the spawner has reaped the process (the
        kernel keeps it with the pid), without waiting for the spawner's report: True if taken.
        Only when the process group is empty too: the group's other zombies are reaped in the
        same turn of the spawner's loop and its report comes after them; before it, the group
        could not be proven empty (a zombie carries no tag to read)."""
        if group_alive(self.pgid) or (status := linux.pidfd_exit_status(self.pidfd)) is None:
            return False
        self.exit_status = status
        self.reaped.set()
        return True

    def _leader_is_our_zombie(self) -> bool:
        """Exited but not reaped yet: the zombie still holds the pid, so the group number
        cannot have been reused (one stat read, instead of a /proc scan)."""
        if self.pidfd < 0 or self.reaped.is_set():
            return False
        st = linux.read_stat(self.pid)
        return st is not None and st.state == "Z" and st.start_time == self.start_time

    def signal_group(self, sig: int, token: str | None = None,
                     procs: Callable[[], list[linux.ProcStat]] | None = None) -> bool:
        """Signal the unit's whole process group (recorded at spawn: getpgid fails once
        the leader is gone) -- by number only while the leader's pidfd proves the group
        is still ours. After the leader died, a bare pgid may name someone else's group
        (pid reuse): then only members that carry this unit's tag are signalled, each
        through a pidfd, and the main process through its own pidfd."""
        running = self.leader_alive()
        if proof.process_group(self.pgid, leader_running=running,
                               leader_zombie=not running and self._leader_is_our_zombie()):
            try:
                os.killpg(self.pgid, sig)
                return True
            except ProcessLookupError:
                return False
        hit = self.signal(sig)
        members = tagged_group_members(self.unit, self.pgid, token, procs)
        kill_survivors(members, sig)
        return hit or bool(members)

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


def group_alive(pgid: int) -> bool:
    """Is any process (zombies included) still in this process group?"""
    if pgid <= 1:
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def tagged(pid: int, unit: str, daemon_token: str | None, start_time: int | None = None) -> bool:
    """Does pid carry `unit`'s tag (and this daemon's token, or none)? Read off the loop, bounded
    (omnid.process.tags): a process whose environment is not read in time is not proven ours."""
    t = tags_of(pid, start_time)
    return bool(proof.unit_tag(pid, unit, None if t is None else t.unit, None if t is None else t.daemon,
                               daemon_token))


def tagged_group_members(unit: str, pgid: int, daemon_token: str | None = None,
                         procs: Callable[[], list[linux.ProcStat]] | None = None) -> list[Survivor]:
    """Live members of process group / session `pgid` that carry `unit`'s tag: what may
    be signalled once the leader is gone and the number alone proves nothing. `procs`:
    where to look (default: every process on the host; a unit's target passes the
    spawner's descendants, where every member of a unit's group is)."""
    if not group_alive(pgid):
        return []
    out = []
    for p in (procs or linux.scan)():
        if (p.pgid == pgid or p.sid == pgid) and p.state not in ("Z", "X") \
                and tagged(p.pid, unit, daemon_token, p.start_time):
            out.append(Survivor(p.pid, p.comm, p.state, linux.wchan(p.pid), f"process group {pgid}", p.start_time))
    return out


def find_residue(unit: str, pgid: int, spawner_pid: int, daemon_token: str | None = None,
                 *, members: bool = True, mains: Container[int] = (),
                 children: list[int] | None = None, group_ours: bool = True) -> list[Survivor]:
    """Every live process that belongs to `unit`: its group, its session, and
    re-parented orphans (children of the subreaper spawner) tagged with its name.

    Cheap when the unit is gone (the common case): one killpg(0) and one read of
    the spawner's children list; /proc is scanned only while the group lives.
    `members=False` skips the group itself (the caller signals it with killpg);
    `mains` are live unit main processes, never orphans, skipped unread;
    `children` is the spawner's children list when the caller already read it;
    `group_ours=False` (the leader is gone: the pgid number may have been reused)
    counts a group member only if it carries the unit's tag."""
    out: list[Survivor] = []
    seen: set[int] = set()

    def add(p: linux.ProcStat | None, why: str) -> None:
        if p is None or p.pid in seen or p.state in ("Z", "X"):
            # Zombies are dead; the spawner reaps them. They are not residue.
            return
        seen.add(p.pid)
        out.append(Survivor(p.pid, p.comm, p.state, linux.wchan(p.pid), why, p.start_time))

    if members and group_alive(pgid):
        # Every member of a unit's group or session descends from the spawner (its subreaper),
        # and none from another unit's main process (another session): walk that, not /proc.
        skip = frozenset(m for m in mains if m != pgid)
        for p in (linux.descendants(spawner_pid, skip) if spawner_pid > 0 else linux.scan()):
            if not group_ours and (p.pgid == pgid or p.sid == pgid) \
                    and not tagged(p.pid, unit, daemon_token, p.start_time):
                continue
            if p.pgid == pgid:
                add(p, f"process group {pgid}")
            elif p.sid == pgid:
                add(p, f"session {pgid}")
    for pid in linux.children_of(spawner_pid) if children is None else children:
        if pid in seen or pid in mains or pid == pgid:
            continue
        st = linux.read_stat(pid)
        # In another live unit's session (its main process leads one): that unit's, by the
        # kernel's word, whatever its environment says; nothing of it is read (it may hold its
        # mm lock).
        if st is None or any(g != pgid and g in mains for g in (st.sid, st.pgid)):
            continue
        if not tagged(pid, unit, daemon_token, st.start_time):
            continue
        add(st, f"orphan tagged {unit}")
        # Everything below an escaped orphan escaped with it.
        stack = linux.children_of(pid)
        while stack:
            c = stack.pop()
            add(linux.read_stat(c), f"descendant of orphan {pid}")
            stack.extend(linux.children_of(c))
    return out


def kill_survivors(survivors: list[Survivor], sig: int = signal.SIGKILL) -> None:
    """Kill residue found by find_residue, each through a pidfd opened and then
    checked against the start time we saw, so a recycled pid is never hit."""
    for s in survivors:
        fd = linux.pidfd_if(s.pid, lambda s=s: bool(proof.same_process(s.pid, s.start_time,
                                                                         linux.start_time_of(s.pid))))
        if fd is not None:
            try:
                linux.pidfd_send_signal(fd, sig)
            finally:
                os.close(fd)
