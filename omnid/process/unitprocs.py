"""What of a unit is left: the one definition of "a unit's processes are gone".

A unit is *gone* when the kernel proves it: its main process exited and was reaped
(`main_gone`), and nothing else of it is *left* -- no live member, no escaped orphan, and
no zombie not yet reaped (a zombie still holds its process group's number, so a group with
one is not empty, and cannot be reused by a stranger). Its *members* are the live processes
that are left, described for the operator and for the kill: zombies are dead, never members.

Every question of that kind goes through a `UnitProcesses`: the kill policy's wait and
sweep (omnid.process.termination), the proof that a dead main process left nothing behind
(omnid.core.exits), a previous daemon's leftovers. The backends:

- `GroupProcesses`: a unit without a cgroup -- its main process, its process group (proven
  ours by the leader's pidfd, or once the leader is reaped by a member held by pidfd or by
  the unit's tag) and its tagged orphans that escaped to the subreaper spawner;
- omnid.cgroup.CgroupProcesses: a unit's cgroup (`populated 0` in cgroup.events, seen as an
  event), and its process group until the spawner has reaped its last zombies; also a
  cgroup with no main process of ours (a previous daemon's, or an unkillable instance's);
- `HeldProcesses`: processes proven ours one by one (pid + start time, or tag), each held by
  a pidfd: a previous daemon's leftovers.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Container
from typing import Protocol

from omnid.base import linux
from omnid.process import tags
from omnid.process.handle import ProcessHandle, Survivor, find_residue, group_alive, tagged

POLL_S = 0.005
MAX_BACKOFF_S = 0.25  # wait_gone: the longest pause between two scans (off the loop) of a group
SETTLE_S = 0.05  # wait_gone: after a member's exit, how long a killpg(0) waits for the spawner's reap


class UnitProcesses(Protocol):
    """Everything that belongs to one unit, as far as the kernel can prove it."""

    def main_gone(self) -> bool:
        """Has the main process exited and been reaped? (Without one: does nothing run?)"""

    def left(self) -> bool:
        """Does anything but a reaped main process still hold the unit, zombies included?
        True while it cannot be proven otherwise."""

    def gone(self) -> bool:
        """The kernel's proof that nothing of the unit is left: main_gone() and not left()."""

    def members(self) -> list[Survivor]:
        """The live processes of the unit (residue), described for the operator."""

    async def wait_gone(self, deadline: float) -> bool:
        """Wait (monotonic deadline) until gone(), woken by the kernel; False at the deadline."""


class GroupProcesses:
    """A unit's main process, its process group and its tagged escaped orphans (no cgroup).
    `mains`: the units' live main processes (a live view), never anyone's orphans."""

    def __init__(self, unit: str, h: ProcessHandle, spawner_pid: int, token: str | None, *,
                 mains: Container[int] = ()) -> None:
        self.unit = unit
        self.h = h
        self.spawner_pid = spawner_pid
        self.token = token
        self.mains = mains

    def main_gone(self) -> bool:
        return self.h.reaped.is_set()

    def left(self) -> bool:
        return self._group_left() or bool(self.residue(members=False))

    def gone(self) -> bool:
        return self.main_gone() and not self.left()

    def members(self) -> list[Survivor]:
        return self.residue(members=True)

    def residue(self, members: bool, children: list[int] | None = None) -> list[Survivor]:
        """Live processes of the unit (process.find_residue): `members=False` leaves out the
        group itself (signalled by number), `children`: the spawner's, when already read."""
        return find_residue(self.unit, self.h.pgid, self.spawner_pid, self.token, members=members,
                            mains=self.mains, children=children, group_ours=not self.h.reaped.is_set())

    def member_pidfd(self) -> int | None:
        """The leader is reaped: a pidfd on a process still in the group, found among the
        subreaper's children (the main process's orphans are re-parented there), checked to
        be in the group once the pidfd pins it. While it is, the group's number names this
        group and no other: the kernel frees a number only once no process uses it as pid,
        process group or session. None when there is none (then the group is signalled by
        its tagged members, a /proc scan)."""
        for pid in linux.children_of(self.spawner_pid):
            if pid in self.mains:
                continue
            st = linux.read_stat(pid)
            if st is None or st.pgid != self.h.pgid or not tagged(pid, self.unit, self.token, st.start_time):
                continue  # untagged: the number may be a stranger's group now
            fd = linux.open_checked_pidfd(pid, st.start_time)
            if fd is None:
                continue
            again = linux.read_stat(pid)
            if again is not None and again.pgid == self.h.pgid:
                return fd
            os.close(fd)
        return None

    def _group_left(self) -> bool:
        if not group_alive(self.h.pgid):
            return False
        if self.h.leader_alive():
            return True
        # The leader is gone: a member held by pidfd proves the group ours and not empty, without
        # a scan of /proc (a unit's leftovers live on for leftover_timeout, polled every POLL_S).
        if (fd := self.member_pidfd()) is not None:
            os.close(fd)
            return True
        # The number alone may name a stranger's group now.
        if any(s for s in find_residue(self.unit, self.h.pgid, self.spawner_pid, self.token,
                                       mains=self.mains, children=[], group_ours=False)):
            return True
        # Zombies of the group not reaped yet carry no tag to read; those that are children of
        # the spawner (which reaps them in a moment) are ours: the group is not empty yet.
        return any(p not in self.mains and (st := linux.read_stat(p)) is not None and st.pgid == self.h.pgid
                   for p in linux.children_of(self.spawner_pid))

    def _hold_members(self, procs: list[linux.ProcStat]) -> tuple[bool, list[int]]:
        """From one walk of the spawner's descendants: (is anything of the group left, pidfds
        of its live tagged members). Once the leader is gone the number may name a stranger's
        group: a live member counts only if it carries the unit's tag; a zombie of the group
        that the spawner has not reaped yet (it carries no tag to read) counts too. Every
        live member is held by a checked pidfd, so its exit wakes the loop, no scan needed."""
        left, fds = False, []
        for p in procs:
            if p.pgid != self.h.pgid and p.sid != self.h.pgid or p.pid in self.mains:
                continue
            if p.state in ("Z", "X"):
                left = left or (p.ppid == self.spawner_pid and p.pgid == self.h.pgid)
                continue
            if not tagged(p.pid, self.unit, self.token, p.start_time) and not self._dying_orphan(p):
                continue
            left = True
            fd = linux.open_checked_pidfd(p.pid, p.start_time)
            if fd is not None:
                fds.append(fd)
        return left, fds

    def _in_group(self, p: linux.ProcStat) -> bool:
        """A live process of the unit's group or session (not a unit's main process)."""
        return (p.pgid == self.h.pgid or p.sid == self.h.pgid) and p.pid not in self.mains \
            and p.state not in ("Z", "X")

    def _dying_orphan(self, p: linux.ProcStat) -> bool:
        """A member the spawner adopted whose tag cannot be read: a SIGKILLed process tearing
        down its memory (a large engine takes a while) has no environment to read and is not
        a zombie yet, but it still maps what the unit's cleanup must find unheld. Readably
        another unit's process is never ours. One whose environment is not read in time (its
        mm lock held) counts too: in the group, adopted by our spawner, and not proven another's,
        it is waited for (to the wait's deadline), never signalled on that count."""
        if p.ppid != self.spawner_pid:
            return False
        t = tags.tags_of(p.pid, p.start_time)
        return t is None or t.unit is None

    async def wait_gone(self, deadline: float) -> bool:
        try:
            await asyncio.wait_for(self.h.reaped.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return False
        # No /proc scan on the loop: a killpg(0) says whether anything (zombies included) is
        # left in the group; while something is, the spawner's descendants (every member of
        # a unit's group is one: the spawner is their subreaper) are walked in a thread, one
        # walk for every unit that waits in the same moment, and the members' pidfds wake the
        # loop when they exit; what no pidfd holds (a zombie the spawner reaps in a moment, a
        # member forked since the walk) is looked at again with back-off.
        delay = POLL_S
        while group_alive(self.h.pgid):
            procs = await stack_walk(self.spawner_pid, self.mains)
            # The members' tags are read while the loop runs: _hold_members then waits on none.
            await tags.reader.prefetch(((p.pid, p.start_time) for p in procs if self._in_group(p)),
                                       min(tags.PREFETCH_S, max(0.0, deadline - time.monotonic())))
            left, fds = self._hold_members(procs)
            try:
                if not left:
                    return True
                if time.monotonic() >= deadline:
                    return False
                woke = await linux.any_readable(fds, min(delay, deadline - time.monotonic()))
            finally:
                for fd in fds:
                    os.close(fd)
            if woke:
                # A member exited: the spawner reaps it in a moment. Cheap checks first.
                settle = min(deadline, time.monotonic() + SETTLE_S)
                while group_alive(self.h.pgid) and time.monotonic() < settle:
                    await asyncio.sleep(POLL_S)
                delay = POLL_S
            else:
                delay = min(delay * 2, MAX_BACKOFF_S)
        return True


class _Walks:
    """One walk of the spawner's descendants, in a thread, shared by every wait_gone that asks
    for one before it starts; a walk asked for while one runs starts after it (so what it
    returns was read after the question)."""

    def __init__(self) -> None:
        self.pending: dict[int, asyncio.Future] = {}
        self.running: dict[int, asyncio.Future] = {}
        self.tasks: set[asyncio.Task] = set()  # held: the loop keeps only weak references
        self.walks = 0

    async def get(self, root: int, skip: frozenset[int]) -> list[linux.ProcStat]:
        fut = self.pending.get(root)
        if fut is None:
            fut = self.pending[root] = asyncio.get_running_loop().create_future()
            task = asyncio.get_running_loop().create_task(self._run(root, skip, fut))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return await asyncio.shield(fut)

    async def _run(self, root: int, skip: frozenset[int], fut: asyncio.Future) -> None:
        before = self.running.get(root)
        if before is not None:
            await asyncio.wait([before])
        self.pending.pop(root, None)
        self.running[root] = fut
        self.walks += 1
        try:
            fut.set_result(await asyncio.to_thread(linux.descendants, root, skip))
        except Exception as exc:  # noqa: BLE001 - handed to every waiter
            fut.set_exception(exc)
        finally:
            if self.running.get(root) is fut:
                del self.running[root]


_walks = _Walks()


async def stack_walk(spawner_pid: int, mains: Container[int] = ()) -> list[linux.ProcStat]:
    """The spawner's descendants but the units' live main processes' subtrees (a thread)."""
    return await _walks.get(spawner_pid, frozenset(mains))


class HeldProcesses:
    """Processes proven ours one by one (pid + start time, or tag): each held by a pidfd
    opened right after the proof, so a recycled pid is never hit. `items` are anything with
    .pid, .start_time and .describe() (statefile.Leftover, Survivor). No main process:
    main_gone() and gone() are both "nothing held still runs"."""

    def __init__(self, items: list) -> None:
        self.held: list[tuple[Survivor, int]] = []
        for it in items:
            fd = linux.open_checked_pidfd(it.pid, it.start_time)
            st = linux.read_stat(it.pid) if fd is not None else None
            if fd is None or st is None:
                if fd is not None:
                    os.close(fd)
                continue
            self.held.append((Survivor(it.pid, st.comm, st.state, "", it.describe(), st.start_time), fd))

    def live(self) -> list[tuple[Survivor, int]]:
        return [(s, fd) for s, fd in self.held if not linux.pidfd_exited(fd)]

    def main_gone(self) -> bool:
        return not self.live()

    def left(self) -> bool:
        return bool(self.live())

    def gone(self) -> bool:
        return not self.live()

    def members(self) -> list[Survivor]:
        return [s for s, _fd in self.live()]

    async def wait_gone(self, deadline: float) -> bool:
        while self.live():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True

    def close(self) -> None:
        for _s, fd in self.held:
            os.close(fd)
        self.held.clear()
