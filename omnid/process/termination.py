"""The one termination policy (after trio's single kill policy): first signal,
wait `stop_timeout`, SIGKILL, wait `kill_timeout`, sweep what escaped, report
what could not be killed. Every kill of a unit, a leftover of a previous daemon
or a stale cgroup goes through a `Target` and the steps of `Termination`:

- the lifecycle table drives a unit's stop step by step (omnid.core: the first
  signal, the stop_timeout timer, SIGKILL, the kill_timeout timer, gone);
- `terminate` runs the same steps in a line, for whatever is not a unit.

A unit's `kill_mode` (omnid.unit(5)) decides who gets the first signal: everything
(`control-group`), or the main process alone (`mixed`, `process`: `begin(main_only=True)`),
the rest then getting its own signal once the main process has exited (`rest`: SIGKILL
under `mixed`, stop_signal under `process`). SIGKILL at stop_timeout (`escalate`) always
goes to everything.

A `Target` is everything that belongs to one thing, as far as the kernel can
prove it: a process group proven ours by its leader's pidfd
(`ProcessGroupTarget`), a unit's cgroup (omnid.cgroup.CgroupTarget), a list of
proven leftovers (`LeftoverTarget`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from omnid.base import linux
from omnid.process.handle import ProcessHandle, Survivor, _tagged, find_residue, group_alive, kill_survivors

log = structlog.get_logger("omnid.process.termination")

POLL_S = 0.005
MAX_BACKOFF_S = 0.25  # wait_gone: the longest pause between two scans (off the loop) of a group
SETTLE_S = 0.05  # wait_gone: after a member's exit, how long a killpg(0) waits for the spawner's reap
UNBOUNDED_S = 1e9  # "no deadline" for wait_gone, whose caller bounds it another way


@dataclass
class StopRecord:
    """What `omnid stop` prints for one unit."""

    unit: str
    signal: str
    seconds: float | None  # signal -> main process and group gone
    escalated: bool
    residue: list[str] = field(default_factory=list)  # killed leftovers (orphans)
    unkillable: list[str] = field(default_factory=list)  # survived SIGKILL + kill_timeout
    gpu_release_ms: float | None = None
    gpu_held: list[str] = field(default_factory=list)  # GPU memory still held at the deadline
    was: str = ""  # state before the stop
    # kill_mode mixed / process: the first signal went to the main process only ("main");
    # "" when it went to everything (control-group, a hung unit, leftovers of a dead main).
    to: str = ""
    rest: str = ""  # what the rest of the unit got once the main process had exited ("SIGKILL")
    main_seconds: float | None = None  # first signal -> the main process exited (to == "main")
    ipc_removed: list[str] = field(default_factory=list)  # IPC objects of the unit removed (omnid.process.ipc)

    def to_json(self) -> dict:
        # Not dataclasses.asdict: it deep-copies, and a 256-unit summary is on the stop path.
        return {"unit": self.unit, "signal": self.signal, "seconds": self.seconds, "escalated": self.escalated,
                "residue": list(self.residue), "unkillable": list(self.unkillable),
                "gpu_release_ms": self.gpu_release_ms, "gpu_held": list(self.gpu_held), "was": self.was,
                "to": self.to, "rest": self.rest, "main_seconds": self.main_seconds,
                "ipc_removed": list(self.ipc_removed)}

    @classmethod
    def from_json(cls, d: dict) -> StopRecord:
        return cls(unit=str(d["unit"]), signal=str(d["signal"]),
                   seconds=None if d["seconds"] is None else float(d["seconds"]), escalated=bool(d["escalated"]),
                   residue=[str(x) for x in d["residue"]], unkillable=[str(x) for x in d["unkillable"]],
                   gpu_release_ms=None if d["gpu_release_ms"] is None else float(d["gpu_release_ms"]),
                   gpu_held=[str(x) for x in d["gpu_held"]], was=str(d["was"]),
                   # absent in the record of a daemon from before kill_mode (a re-exec's state)
                   to=str(d.get("to", "")), rest=str(d.get("rest", "")),
                   main_seconds=None if d.get("main_seconds") is None else float(d["main_seconds"]),
                   ipc_removed=[str(x) for x in d.get("ipc_removed", [])])


class Target(Protocol):
    """Everything that belongs to one unit, as far as the kernel can prove it."""

    name: str

    def signal_all(self, sig: int) -> None:
        """Send sig to every process of the target (first signal, SIGCONT)."""

    def signal_main(self, sig: int) -> bool:
        """Send sig to the main process only, through its pidfd (kill_mode mixed / process);
        False if it has exited. A target without a main process signals everything."""

    def kill_all(self) -> None:
        """SIGKILL every process of the target, escaped ones included."""

    def main_gone(self) -> bool:
        """Has the main process exited and been reaped?"""

    async def wait_gone(self, deadline: float) -> bool:
        """Wait (monotonic deadline) until nothing of the target runs; False at the deadline."""

    def members(self) -> list[Survivor]:
        """What of the target still lives (residue), described for the operator."""

    def empty(self) -> bool:
        """The kernel's proof that nothing of the target is left, zombies included (a zombie
        still holds its process group): the main process reaped, the group or cgroup empty,
        no escaped orphan. False when it cannot be proven yet."""


class ProcessGroupTarget:
    """A unit's main process, its process group and its tagged escaped orphans.

    The group is signalled by number only while the leader's pidfd proves it is
    still ours (ProcessHandle.signal_group); escaped orphans are children of the
    subreaper spawner carrying the unit's tag, each signalled through a pidfd."""

    def __init__(self, unit: str, h: ProcessHandle, spawner_pid: int, token: str | None, *,
                 mains: Container[int] = (), orphans: Callable[[], list[int] | None] | None = None) -> None:
        self.name = unit
        self.h = h
        self.spawner_pid = spawner_pid
        self.token = token
        self.mains = mains
        self._orphans = orphans
        self._group_ours = True  # until the leader is reaped
        self._extra: list[Survivor] | None = None

    def _stack(self) -> list[linux.ProcStat]:
        """Where the group's members are once the leader is gone: the spawner's descendants
        (but other units' subtrees), not the host's whole process table."""
        return linux.descendants(self.spawner_pid, frozenset(self.mains))

    def _residue(self, members: bool, children: list[int] | None = None) -> list[Survivor]:
        ours = self._group_ours and not self.h.reaped.is_set()
        return find_residue(self.name, self.h.pgid, self.spawner_pid, self.token, members=members,
                            mains=self.mains, children=children, group_ours=ours)

    def _member_pidfd(self) -> int | None:
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
            if st is None or st.pgid != self.h.pgid or not _tagged(pid, self.name, self.token):
                continue  # untagged: the number may be a stranger's group now
            fd = linux.open_checked_pidfd(pid, st.start_time)
            if fd is None:
                continue
            again = linux.read_stat(pid)
            if again is not None and again.pgid == self.h.pgid:
                return fd
            os.close(fd)
        return None

    def _signal_group(self, sig: int) -> None:
        """The group by number while its leader or, once the leader is reaped (the rest of a
        unit under kill_mode mixed / process, the leftovers of a dead main process), a member
        held by pidfd proves the number ours: one killpg, where the tagged members' scan of
        /proc took 0.3-0.7 s on a loaded 2-core host with 2,000 processes."""
        if self.h.reaped.is_set() and (fd := self._member_pidfd()) is not None:
            try:
                os.killpg(self.h.pgid, sig)
            except ProcessLookupError:
                pass
            finally:
                os.close(fd)
            return
        self.h.signal_group(sig, self.token, self._stack)

    def signal_all(self, sig: int) -> None:
        # The group first: looking up escaped orphans reads /proc, and must not delay it.
        # They are looked up once per stop (from the converge's one read of the subreaper's
        # children when `orphans` gives it): the SIGCONT right after goes to the same ones.
        self._signal_group(sig)
        if self._extra is None:
            self._extra = self._residue(members=False, children=self._orphans() if self._orphans else None)
        kill_survivors(self._extra, sig)

    def signal_main(self, sig: int) -> bool:
        return self.h.signal(sig)

    def kill_all(self) -> None:
        self.h.signal(signal.SIGKILL)
        self._signal_group(signal.SIGKILL)
        kill_survivors(self._residue(members=False))

    def main_gone(self) -> bool:
        return self.h.reaped.is_set()

    def _group_left(self) -> bool:
        if not group_alive(self.h.pgid):
            return False
        if self.h.leader_alive():
            return True
        # The leader is gone: a member held by pidfd proves the group ours and not empty, without
        # a scan of /proc (a unit's leftovers live on for leftover_timeout, polled every POLL_S).
        if (fd := self._member_pidfd()) is not None:
            os.close(fd)
            return True
        # The number alone may name a stranger's group now.
        if any(s for s in find_residue(self.name, self.h.pgid, self.spawner_pid, self.token,
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
            if not _tagged(p.pid, self.name, self.token):
                continue
            left = True
            fd = linux.open_checked_pidfd(p.pid, p.start_time)
            if fd is not None:
                fds.append(fd)
        return left, fds

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
            left, fds = self._hold_members(await stack_walk(self.spawner_pid, self.mains))
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

    def members(self) -> list[Survivor]:
        return self._residue(members=True)

    def empty(self) -> bool:
        if not self.h.reaped.is_set() or self._group_left():
            return False
        return not self._residue(members=False)


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


class LeftoverTarget:
    """Processes of a previous daemon instance, proven ours (pid + start time, or tag):
    each held by a pidfd opened right after the proof, so a recycled pid is never hit.
    `items` are anything with .pid and .describe() (statefile.Leftover, Survivor), and
    optionally .start_time to check the pidfd against."""

    def __init__(self, name: str, items: list) -> None:
        self.name = name
        self._held: list[tuple[Survivor, int]] = []
        for it in items:
            fd = linux.open_checked_pidfd(it.pid, it.start_time)
            st = linux.read_stat(it.pid) if fd is not None else None
            if fd is None or st is None:
                if fd is not None:
                    os.close(fd)
                continue
            self._held.append((Survivor(it.pid, st.comm, st.state, "", it.describe(), st.start_time), fd))

    def _live(self) -> list[tuple[Survivor, int]]:
        return [(s, fd) for s, fd in self._held if not linux.pidfd_exited(fd)]

    def signal_all(self, sig: int) -> None:
        for _s, fd in self._live():
            linux.pidfd_send_signal(fd, sig)

    def signal_main(self, sig: int) -> bool:
        self.signal_all(sig)  # no main process: everything is the target
        return bool(self._held)

    def kill_all(self) -> None:
        self.signal_all(signal.SIGKILL)

    def main_gone(self) -> bool:
        return not self._live()

    async def wait_gone(self, deadline: float) -> bool:
        while self._live():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True

    def members(self) -> list[Survivor]:
        return [s for s, _fd in self._live()]

    def empty(self) -> bool:
        return not self._live()

    def close(self) -> None:
        for _s, fd in self._held:
            os.close(fd)
        self._held.clear()


class Termination:
    """One stop of one target, as steps: `begin` (the first signal), `escalate` (SIGKILL),
    `until_gone`, `sweep` (escaped orphans), with the StopRecord they fill in. The
    lifecycle table calls them one event at a time for a unit; `terminate` in a line."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.rec = StopRecord(unit=target.name, signal="", seconds=None, escalated=False)
        self.t0 = 0.0

    def begin(self, sig: int, cont: bool, main_only: bool = False) -> None:
        """The first signal (then SIGCONT, so a stopped process can act on it) to everything
        of the target; SIGKILL as the first signal is `kill_all` (cgroup.kill, escapees).
        main_only (kill_mode mixed / process): to the main process alone, through its pidfd;
        the rest waits for `rest` (its exit) or `escalate` (stop_timeout). A main process that
        has exited already cannot be signalled alone: then everything gets it, so nothing
        waits for an exit that has happened."""
        self.t0 = time.monotonic()
        self.rec.signal = linux.signal_name(sig)
        if main_only and sig != signal.SIGKILL and not self.target.main_gone():
            self.rec.to = "main"
            if self.target.signal_main(sig) and cont and sig != signal.SIGCONT:
                self.target.signal_main(signal.SIGCONT)
            return
        if sig == signal.SIGKILL:
            self.target.kill_all()
            return
        self.target.signal_all(sig)
        if cont and sig != signal.SIGCONT:
            self.target.signal_all(signal.SIGCONT)

    @property
    def rest_pending(self) -> bool:
        """The first signal went to the main process alone and the rest has had nothing yet."""
        return self.rec.to == "main" and not self.rec.rest and not self.rec.escalated

    def rest(self, sig: int, cont: bool) -> None:
        """The main process has exited (kill_mode mixed / process): the rest of the target gets
        sig -- SIGKILL is `kill_all` (cgroup.kill, escapees), any other signal goes to
        everything left, then SIGCONT. Also the first step of a stop whose main process
        exited before any signal (it drained and exited by itself)."""
        now = time.monotonic()
        if not self.t0:
            self.t0 = now
            self.rec.signal = "-"  # nothing was signalled: the main process exited by itself
        elif self.rec.to == "main" and self.rec.main_seconds is None:
            self.rec.main_seconds = round(now - self.t0, 4)
        self.rec.rest = linux.signal_name(sig)
        if sig == signal.SIGKILL:
            self.target.kill_all()
        else:
            self.target.signal_all(sig)
            if cont and sig != signal.SIGCONT:
                self.target.signal_all(signal.SIGCONT)
        log.info("main process exited: the rest of the unit signalled", unit=self.target.name, signal=self.rec.rest,
                 main_s=self.rec.main_seconds, took_ms=round((time.monotonic() - now) * 1000, 1))

    def escalate(self) -> None:
        """stop_timeout passed: SIGKILL everything of the target."""
        self.rec.escalated = self.rec.signal != "SIGKILL"
        self.target.kill_all()
        if self.rec.escalated:
            log.warning("stop timeout: sent SIGKILL", unit=self.target.name,
                        after_s=round(time.monotonic() - self.t0, 3))

    async def until_gone(self, deadline: float | None = None) -> bool:
        """Wait until nothing of the target runs (the kernel's proof); False at the deadline
        (None: no deadline of its own -- the caller's timers bound the wait)."""
        gone = await self.target.wait_gone(time.monotonic() + UNBOUNDED_S if deadline is None else deadline)
        if self.target.main_gone() and self.rec.seconds is None:
            self.rec.seconds = round(time.monotonic() - self.t0, 4)
        return gone

    async def sweep(self, kill_timeout: float) -> list[str]:
        """Orphans that escaped the group (double fork + setsid) die too; returns what is
        still alive kill_timeout later (unkillable), recorded as residue / unkillable."""
        leftovers = self.target.members()
        if leftovers:
            self.rec.residue = [s.describe() for s in leftovers]
            kill_survivors(leftovers)
            deadline = time.monotonic() + kill_timeout
            while leftovers and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S * 2)
                leftovers = self.target.members()
        if leftovers:
            self.unkillable(leftovers)
        return self.rec.unkillable

    def unkillable(self, survivors: list[Survivor] | None = None) -> list[str]:
        """What survived SIGKILL and kill_timeout, described, recorded and logged once."""
        left = self.target.members() if survivors is None else survivors
        self.rec.unkillable = [s.describe() for s in left] or ["main process not reaped"]
        log.error("unkillable processes", unit=self.target.name, survivors=self.rec.unkillable)
        return self.rec.unkillable


async def terminate(target: Target, stop_signal: int, stop_timeout: float, kill_timeout: float, *,
                    send_cont: bool = True) -> StopRecord:
    """The kill policy in a line, for what is not a unit: stop_signal (+ SIGCONT), wait
    stop_timeout, SIGKILL, wait kill_timeout, sweep; every wait bounded."""
    term = Termination(target)
    term.begin(stop_signal, send_cont)
    if not await term.until_gone(term.t0 + stop_timeout):
        term.escalate()
        await term.until_gone(time.monotonic() + kill_timeout)
    await term.sweep(kill_timeout)
    return term.rec


def terminate_leftovers(items: list, kill_timeout: float = 5.0) -> list[str]:
    """For statefile.kill_leftovers (daemon start, before the event loop runs): the same
    policy with SIGKILL as the first signal. `items`: statefile.Leftover or Survivor.
    Returns the descriptions (item.describe()) of what still lives after kill_timeout."""
    target = LeftoverTarget("leftovers of a previous daemon", items)
    try:
        asyncio.run(terminate(target, signal.SIGKILL, kill_timeout, 0.0, send_cont=False))
        return [s.why for s in target.members()]
    finally:
        target.close()
