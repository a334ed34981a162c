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

A `Target` is how the policy acts on one thing: a process group proven ours by its
leader's pidfd (`ProcessGroupTarget`), a unit's cgroup (omnid.cgroup.CgroupTarget), a
list of proven leftovers (`LeftoverTarget`). Whether anything of it is left -- the main
process reaped, the group or cgroup empty -- is its `procs`' answer (omnid.process.unitprocs, the
one definition of gone), never the policy's own.

This module owns the order of the steps and the StopRecord they fill in; what a signal
reaches is the target's, what counts as gone is omnid.process.unitprocs'.
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
from omnid.process import proof
from omnid.process.handle import ProcessHandle, Survivor, kill_survivors
from omnid.process.unitprocs import MAX_BACKOFF_S, POLL_S, GroupProcesses, HeldProcesses, UnitProcesses

log = structlog.get_logger("omnid.process.termination")

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
    # The removal of what the processes left (omnid.core.cleanup), a step of its own after the
    # exit, on its own clock: never part of `seconds`, never a reason to escalate.
    cleanup_seconds: float | None = None  # None: no removal ran for this stop
    tmp_entries: int | None = None  # entries removed from the private tmp directory (None: it was empty)
    tmp_left: str = ""  # why the private tmp directory is not (fully) removed

    def to_json(self) -> dict:
        # Not dataclasses.asdict: it deep-copies, and a 256-unit summary is on the stop path.
        return {"unit": self.unit, "signal": self.signal, "seconds": self.seconds, "escalated": self.escalated,
                "residue": list(self.residue), "unkillable": list(self.unkillable),
                "gpu_release_ms": self.gpu_release_ms, "gpu_held": list(self.gpu_held), "was": self.was,
                "to": self.to, "rest": self.rest, "main_seconds": self.main_seconds,
                "ipc_removed": list(self.ipc_removed), "cleanup_seconds": self.cleanup_seconds,
                "tmp_entries": self.tmp_entries, "tmp_left": self.tmp_left}

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
                   ipc_removed=[str(x) for x in d.get("ipc_removed", [])],
                   # absent in the record of a daemon from before the removal was its own step
                   cleanup_seconds=None if d.get("cleanup_seconds") is None else float(d["cleanup_seconds"]),
                   tmp_entries=None if d.get("tmp_entries") is None else int(d["tmp_entries"]),
                   tmp_left=str(d.get("tmp_left", "")))


class Target(Protocol):
    """Everything that belongs to one thing, as the kill policy acts on it: how to signal it,
    and `procs`, what of it is left (omnid.process.unitprocs: the one definition of gone)."""

    name: str

    @property
    def procs(self) -> UnitProcesses:
        """What of the target is left: the one definition of gone (omnid.process.unitprocs)."""

    def signal_all(self, sig: int) -> None:
        """Send sig to every process of the target (first signal, SIGCONT)."""

    def signal_main(self, sig: int) -> bool:
        """Send sig to the main process only, through its pidfd (kill_mode mixed / process);
        False if it has exited. A target without a main process signals everything."""

    def kill_all(self) -> None:
        """SIGKILL every process of the target, escaped ones included."""

    async def wait_gone(self, deadline: float) -> bool:
        """procs.wait_gone, and what the target does once it is gone (a cgroup's rmdir)."""

    def members(self) -> list[Survivor]:
        """procs.members(): what of the target still lives, described for the operator."""


class ProcessGroupTarget:
    """A unit's main process, its process group and its tagged escaped orphans.

    The group is signalled by number only while the leader's pidfd proves it is
    still ours (ProcessHandle.signal_group); escaped orphans are children of the
    subreaper spawner carrying the unit's tag, each signalled through a pidfd."""

    def __init__(self, unit: str, h: ProcessHandle, spawner_pid: int, token: str | None, *,
                 mains: Container[int] = (), orphans: Callable[[], list[int] | None] | None = None) -> None:
        self.name = unit
        self.h = h
        self.token = token
        self.procs = GroupProcesses(unit, h, spawner_pid, token, mains=mains)
        self._orphans = orphans
        self._extra: list[Survivor] | None = None

    def _stack(self) -> list[linux.ProcStat]:
        """Where the group's members are once the leader is gone: the spawner's descendants
        (but other units' subtrees), not the host's whole process table."""
        return linux.descendants(self.procs.spawner_pid, frozenset(self.procs.mains))

    def _signal_group(self, sig: int) -> None:
        """The group by number while its leader or, once the leader is reaped (the rest of a
        unit under kill_mode mixed / process, the leftovers of a dead main process), a member
        held by pidfd proves the number ours: one killpg, where the tagged members' scan of
        /proc took 0.3-0.7 s on a loaded 2-core host with 2,000 processes."""
        if self.h.reaped.is_set() and (fd := self.procs.member_pidfd()) is not None:
            try:
                if proof.process_group(self.h.pgid, member_held=True):
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
            self._extra = self.procs.residue(members=False, children=self._orphans() if self._orphans else None)
        kill_survivors(self._extra, sig)

    def signal_main(self, sig: int) -> bool:
        return self.h.signal(sig)

    def kill_all(self) -> None:
        self.h.signal(signal.SIGKILL)
        self._signal_group(signal.SIGKILL)
        kill_survivors(self.procs.residue(members=False))

    async def wait_gone(self, deadline: float) -> bool:
        return await self.procs.wait_gone(deadline)

    def members(self) -> list[Survivor]:
        return self.procs.members()


class LeftoverTarget:
    """Processes of a previous daemon instance, proven ours (pid + start time, or tag),
    each held by a pidfd (omnid.unitprocs.HeldProcesses). `items` are anything with .pid
    and .describe() (statefile.Leftover, Survivor), and .start_time to check the pidfd."""

    def __init__(self, name: str, items: list) -> None:
        self.name = name
        self.procs = HeldProcesses(items)

    def signal_all(self, sig: int) -> None:
        for _s, fd in self.procs.live():
            linux.pidfd_send_signal(fd, sig)

    def signal_main(self, sig: int) -> bool:
        self.signal_all(sig)  # no main process: everything is the target
        return bool(self.procs.held)

    def kill_all(self) -> None:
        self.signal_all(signal.SIGKILL)

    async def wait_gone(self, deadline: float) -> bool:
        return await self.procs.wait_gone(deadline)

    def members(self) -> list[Survivor]:
        return self.procs.members()

    def close(self) -> None:
        self.procs.close()


class Termination:
    """One stop of one target, as steps: `begin` (the first signal), `escalate` (SIGKILL),
    `until_gone`, `sweep` (escaped orphans), with the StopRecord they fill in. The
    lifecycle table calls them one event at a time for a unit; `terminate` in a line."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.rec = StopRecord(unit=target.name, signal="", seconds=None, escalated=False)
        self.t0 = 0.0
        self.proven_gone = False  # until_gone returned True: nothing of the target runs any more

    def begin(self, sig: int, cont: bool, main_only: bool = False) -> None:
        """The first signal (then SIGCONT, so a stopped process can act on it) to everything
        of the target; SIGKILL as the first signal is `kill_all` (cgroup.kill, escapees).
        main_only (kill_mode mixed / process): to the main process alone, through its pidfd;
        the rest waits for `rest` (its exit) or `escalate` (stop_timeout). A main process that
        has exited already cannot be signalled alone: then everything gets it, so nothing
        waits for an exit that has happened."""
        self.t0 = time.monotonic()
        self.rec.signal = linux.signal_name(sig)
        if main_only and sig != signal.SIGKILL and not self.target.procs.main_gone():
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

    def escalate(self, why: str = "stop timeout") -> None:
        """A bound passed (`why`: "stop timeout", "leftover timeout", "abort timeout", the stack
        stop's deadline): SIGKILL everything of the target. Once the kernel has proven it gone
        nothing is sent, and the log says so: a stop is an escalation only if it was one."""
        after_s = round(time.monotonic() - self.t0, 3)
        if self.proven_gone:
            log.info(f"{why}: nothing left to signal", unit=self.target.name, after_s=after_s)
            return
        self.rec.escalated = self.rec.signal != "SIGKILL"
        self.target.kill_all()
        if self.rec.escalated:
            log.warning(f"{why}: sent SIGKILL", unit=self.target.name, after_s=after_s)

    async def until_gone(self, deadline: float | None = None) -> bool:
        """Wait until nothing of the target runs (the kernel's proof); False at the deadline
        (None: no deadline of its own -- the caller's timers bound the wait)."""
        gone = await self.target.wait_gone(time.monotonic() + UNBOUNDED_S if deadline is None else deadline)
        if self.target.procs.main_gone() and self.rec.seconds is None:
            self.rec.seconds = round(time.monotonic() - self.t0, 4)
        self.proven_gone = self.proven_gone or gone
        return gone

    async def sweep(self, kill_timeout: float) -> list[str]:
        """Orphans that escaped the group (double fork + setsid) die too; returns what is
        still alive kill_timeout later (unkillable), recorded as residue / unkillable.

        Each is held by a pidfd opened after its proof (pid + start time), SIGKILLed through
        it, and waited for on the pidfds: the kernel wakes the wait when one dies, where a
        look at the target every 10 ms read /proc on the loop for up to kill_timeout. The
        target is looked at again once every held one is dead (what was not held: a pid
        that could not be proven), with a growing pause between two looks."""
        leftovers = self.target.members()
        if leftovers:
            self.rec.residue = [s.describe() for s in leftovers]
            deadline = time.monotonic() + kill_timeout
            pause = POLL_S
            while True:
                await _kill_and_wait(leftovers, deadline)
                leftovers = self.target.members()
                left = deadline - time.monotonic()
                if not leftovers or left <= 0:
                    break
                await asyncio.sleep(min(pause, left))  # what it holds now, not yet provable
                pause = min(pause * 2, MAX_BACKOFF_S)
        if leftovers:
            self.unkillable(leftovers)
        return self.rec.unkillable

    def unkillable(self, survivors: list[Survivor] | None = None) -> list[str]:
        """What survived SIGKILL and kill_timeout, described, recorded and logged once."""
        left = self.target.members() if survivors is None else survivors
        self.rec.unkillable = [s.describe() for s in left] or ["main process not reaped"]
        log.error("unkillable processes", unit=self.target.name, survivors=self.rec.unkillable)
        return self.rec.unkillable


async def _kill_and_wait(survivors: list[Survivor], deadline: float) -> None:
    """SIGKILL each survivor through a pidfd opened after its proof (pid + start time), then
    wait on those pidfds until every one is dead or the deadline passes."""
    held = HeldProcesses(survivors)
    try:
        for _s, fd in held.held:
            linux.pidfd_send_signal(fd, signal.SIGKILL)
        while (live := [fd for _s, fd in held.live()]) and (left := deadline - time.monotonic()) > 0:
            await linux.any_readable(live, left)
    finally:
        held.close()


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
