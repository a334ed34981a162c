"""The supervisor: every unit's runtime record, and the one way they change.

    facts (pidfd readable, spawner replies, timers, probes, operator goals)
        -> feed(unit, event) -> lifecycle.step -> new position + actions
        -> executor carries out the actions -> their outcomes are fed back

It owns the records (`units`, `by_pid`), `feed`, `converge` and the telling of changes
(log, event socket, waiters, snapshots). `feed` is the only place a unit's state or phase
changes, one event at a time (events fed while one is being carried out wait their turn).
`converge` is the only place that compares state with goal across units: after every
change it feeds the stops and starts that the dependency graph and the goals call for.

A readable pidfd is the death event: there is no polling loop for liveness. The death
path, from every sign of a death to the one EXITED it becomes, reads top to bottom in
omnid.core.exits; the parts (executor, monitors, schedule, requests, reload, the GPU
duties in omnid.core.gpus) receive the supervisor as a `Centre` (core/centre.py).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import structlog

from omnid.base import linux
from omnid.core import gpus, groups
from omnid.core.drain import Drains
from omnid.core.executor import Ctx, Executor
from omnid.core.exitbook import ExitBook
from omnid.core.exits import Deaths
from omnid.core.invariants import verify, verify_unit
from omnid.core.lifecycle import Event, Goal, IllegalEvent, Phase, UnitState, View, step
from omnid.core.monitors import Monitors
from omnid.core.reload import Reloader
from omnid.core.requests import OperatorRequests
from omnid.core.runtime import RestartBook, UnitRuntime
from omnid.core.schedule import Schedule
from omnid.process.output import UnitOutput
from omnid.process.handle import ProcessHandle
from omnid.process.fdstore import FdStore
from omnid.process.sockets import HeldSockets
from omnid.process.spawnclient import ExitReport, SpawnerClient
from omnid.base.tasks import report_crash
from omnid.model.units import Stack

if TYPE_CHECKING:  # the types the Centre protocol names (omnid.core.centre)
    from omnid.process.cgroup import CgroupRoot
    from omnid.core.crosshost import CrossHost
    from omnid.gpu.backend import GpuBackend

log = structlog.get_logger("omnid.supervisor")
S, P, E = UnitState, Phase, Event
# Events after which the reason is the one the stop began with (plus what the end adds).
_ENDS = frozenset({E.GONE, E.KILL_TIMEOUT, E.RELEASED})
# Added to the stack stop's derived deadline: the loop's own turns, a spawn answered meanwhile.
STOP_MARGIN_S = 5.0


class UnitNotFound(KeyError):
    pass


class Supervisor:
    def __init__(self, stack: Stack, spawner: SpawnerClient, *, token: str, notify_socket: str | None = None,
                 publish: Callable[[dict], None] | None = None, on_pids_changed: Callable[[], None] | None = None,
                 check_invariants: bool = False, gpu: GpuBackend | None = None, echo_output: bool = True,
                 cgroups: CgroupRoot | None = None) -> None:
        self.stack = stack
        self.spawner = spawner
        self.token = token
        self.notify_socket = notify_socket
        self.publish = publish or (lambda ev: None)
        self.on_pids_changed = on_pids_changed or (lambda: None)
        self.check_invariants = check_invariants
        self.gpu = gpu
        self.echo_output = echo_output
        self.cgroups = cgroups  # omnid.cgroup.CgroupRoot, or None: process groups
        self.order: list[str] = [u.name for tier in stack.tiers() for u in tier]  # start order
        books = {g: RestartBook() for g in stack.groups}  # a worker group restarts as one
        self.units: dict[str, UnitRuntime] = {}
        for name in self.order:
            spec = stack.units[name]
            book = books[spec.worker_group] if spec.worker_group else RestartBook()
            self.units[name] = UnitRuntime(spec=spec, book=book, output=UnitOutput(name, echo=echo_output))
        self.by_pid: dict[int, tuple[UnitRuntime, ProcessHandle]] = {}
        self.exits = ExitBook()  # reports and statuses that do not meet their unit in order
        self.deaths = Deaths(self, self.exits)  # the death path: every sign of a death -> EXITED
        self._in_tier = False  # a converge is feeding stops: the subreaper's children are read once for all
        self._tier_orphans: list[int] | None = None
        self.executor = Executor(self)
        self.executor.drains = Drains(self)
        self.monitors = Monitors(self)
        self.schedule = Schedule(self)
        self.requests = OperatorRequests(self)
        self.reloader = Reloader(self)
        self.crosshost: CrossHost | None = None  # set by the daemon with [cluster]
        self.sockets = HeldSockets()  # units' listening sockets, held across their restarts
        # fds units keep in the daemon (FDSTORE=1), per instance; the daemon starts its watch
        self.fdstore = FdStore(lambda n: self.units[n].spec.fd_store_max if n in self.units else 0)
        self._queue: collections.deque[tuple[UnitRuntime, Event, str]] = collections.deque()
        self._feeding = False
        self._converge_pending = False
        self.frozen = False  # a re-exec is being prepared: converge feeds nothing new
        self._changed = asyncio.Condition()
        self._waker: asyncio.Task | None = None
        self.invariant_violations: list[str] = []
        self.shutting_down = False
        self.draining_until = 0.0  # monotonic: the stack's drain_sec window before its first stop signal
        self.stack_signalled = False  # the stack's stop sent its first stop signal (no longer "draining")
        self.started_at = time.time()
        self.gpu_mib: dict[str, float] = {}  # unit -> GPU memory of its processes (last GPU watch)
        self.degraded: dict[str, str] = {}  # unit -> why (gpu_min_free_mib)

    # ------------------------------------------------------------------ lookup
    def get(self, name: str) -> UnitRuntime:
        try:
            return self.units[name]
        except KeyError:
            raise UnitNotFound(name) from None

    def expand(self, names: Iterable[str], whole_groups: bool = True) -> list[str]:
        """Unit names as the operator typed them: templates mean all instances, and a member of
        a worker group means the whole group (its ranks are one thing)."""
        out: list[str] = []
        for n in names:
            found = [n] if n in self.units else [u for u in self.order if self.units[u].spec.template == n]
            if not found:
                raise UnitNotFound(n)
            for i in found:
                out.extend(self.stack.group_members(i) if whole_groups else (i,))
        return list(dict.fromkeys(out))

    def replace_stack(self, stack: Stack, units: dict[str, UnitRuntime]) -> None:
        """A reload's new stack is in force (omnid.core.reload): its order and graph."""
        gone = set(self.units) - set(units)
        for name in gone:
            rt = self.units[name]
            assert rt.proc is None and not rt.busy, f"{name}: removed while it still runs"
        self.stack = stack
        self.order = [u.name for tier in stack.tiers() for u in tier]
        self.units.clear()
        self.units.update(units)  # the same dict: requests and schedule hold it
        self.schedule = Schedule(self)
        if self.crosshost is not None:
            self.crosshost.restack()
        self.kick()

    # ------------------------------------------------------------------ feed
    def feed(self, rt: UnitRuntime, event: Event, detail: str = "") -> None:
        """The one entry point for a fact about a unit. Processed at once, or after the event
        being carried out now (one at a time, in order)."""
        self._queue.append((rt, event, detail))
        if self._feeding:
            return
        self._feeding = True
        try:
            while self._queue:
                self._step(*self._queue.popleft())
        finally:
            self._feeding = False

    def _view(self, rt: UnitRuntime, leftovers: bool = False) -> View:
        term = self.executor.of(rt).term if rt.state is S.STOPPING else None
        return View(rt.name, rt.state, rt.phase, rt.goal, rt.cause, leftovers=leftovers, gpu=self.gpu_on(),
                    capture=self.executor.captures is not None and getattr(rt.spec, "capture_timeout", 0) > 0,
                    drain=self.executor.drains is not None and getattr(rt.spec, "drain", None) is not None,
                    shutting_down=self.shutting_down, running=rt.proc is not None, kill_mode=rt.spec.kill_mode,
                    rest_pending=term is not None and term.rest_pending,
                    leftover_grace=rt.spec.leftover_timeout > 0,
                    cleanup=self.executor.cleanup is not None and self.executor.cleanup.due(rt.name))

    def _step(self, rt: UnitRuntime, event: Event, detail: str) -> None:
        leftovers = False
        if event is E.EXITED:
            leftovers, note = self.deaths.facts(rt)
            detail = rt.last_exit_what + note
        try:
            out = step(self._view(rt, leftovers), event)
        except IllegalEvent as exc:
            log.error("illegal event ignored (a bug)", unit=rt.name, error=str(exc))
            return
        prev_state, prev_phase = rt.state, rt.phase
        if event is E.INTERNAL_ERROR:  # a bug: the reason names the action and the exception, whatever the position
            rt.stop_reason = f"{detail}; while stopping: {rt.stop_reason}" \
                if prev_state is S.STOPPING and rt.stop_reason else detail
            rt.reason = rt.stop_reason
        if (out.state, out.phase) != (prev_state, prev_phase):
            rt.epoch += 1
            rt.state, rt.phase = out.state, out.phase
            if out.state is S.STOPPING and prev_state is not S.STOPPING:
                self.executor.of(rt).stop_from = prev_state
            self.executor.left(rt, prev_state)
        if out.cause is not None:  # a stop begins (or changes why): the reason it ends with
            if (prev_state is not S.STOPPING or out.cause is not rt.cause) and event is not E.INTERNAL_ERROR:
                rt.stop_reason = rt.last_exit_what if event is E.EXITED else detail
            rt.cause = out.cause
        if prev_state is not out.state or event in (E.SPAWN_FAILED, E.INTERNAL_ERROR):  # failed -> failed is new
            rt.since = time.time()
            if out.state is not S.ACTIVE:
                rt.ready = False
            rt.reason = rt.stop_reason if prev_state is S.STOPPING or event is E.INTERNAL_ERROR \
                else (detail or rt.reason)
        if out.actions:
            self.executor.run(rt, out.actions, Ctx(prev_state, detail, event, rt.proc.pid if rt.proc else None))
        if rt.state in (S.INACTIVE, S.FAILED) and rt.phase is P.IDLE and (prev_state, prev_phase) != (
                rt.state, rt.phase):
            groups.after_end(self, rt)
            self.kick()

    # ------------------------------------------------------------------ processes
    def adopt(self, rt: UnitRuntime, h: ProcessHandle) -> None:
        """A spawned main process is the unit's: its pidfd is the death notification."""
        rt.proc = h
        rt.last_pgid = h.pgid
        self.by_pid[h.pid] = (rt, h)
        self.deaths.adopted(rt, h)  # an exit report that came before the spawn's reply
        for fields in self.monitors.early.pop(h.pgid, []):
            self.monitors.apply(rt, fields)
        asyncio.get_running_loop().add_reader(h.pidfd, self.deaths.pidfd_readable, rt, h)
        self.on_pids_changed()

    def disown(self, rt: UnitRuntime, h: ProcessHandle) -> None:
        h.close()
        self.by_pid.pop(h.pid, None)
        rt.proc = None
        self.on_pids_changed()

    # ------------------------------------------------------------------ deaths (core/exits.py)
    def on_exit_report(self, rep: ExitReport) -> None:
        """The spawner reaped a process: one of the signs of a death (Deaths.exit_report)."""
        self.deaths.exit_report(rep)

    def on_spawner_gone(self) -> None:
        """Every unit died with the spawner (PDEATHSIG); realign state with that."""
        self.deaths.spawner_gone()

    # ------------------------------------------------------------------ converge
    def tier_orphans(self) -> list[int] | None:
        """The subreaper's children but the units' mains (escaped orphans, signalled with their
        unit's group): one read for all the stops of one converge; None outside one."""
        if not self._in_tier:
            return None
        if self._tier_orphans is None:
            self._tier_orphans = [p for p in linux.children_of(self.spawner.pid) if p not in self.by_pid]
        return self._tier_orphans

    def kick(self) -> None:
        if self.frozen:
            return
        if not self._converge_pending:
            self._converge_pending = True
            asyncio.get_running_loop().call_soon(self.converge)

    def converge(self) -> None:
        """Feed the events the goals and the dependency graph call for: stops first
        (reverse start order: dependents before what they require), then starts."""
        self._converge_pending = False
        if self.frozen:
            return
        now = time.monotonic()
        sched = self.schedule
        # Stops are fed as found (the first signal does not wait for the whole walk): a dependent
        # is `stopping` when the walk (reverse start order) reaches what it requires.
        self._in_tier = True
        try:
            for name in reversed(self.order):
                rt = self.units[name]
                if rt.state is S.FAILED and rt.phase is P.IDLE and rt.goal is Goal.INACTIVE:
                    self.feed(rt, E.STOP_REQUESTED, f"stopped by request (was failed: {rt.reason})")
                    continue
                if rt.phase is P.DRAINING:  # a failure under a draining unit cuts its drain short
                    why = sched.failed_under(rt, planned=False)
                    if why is not None:
                        self.feed(rt, *why)
                    continue
                if rt.state not in (S.STARTING, S.ACTIVE) or rt.dead:
                    continue
                why = sched.must_stop(rt)
                if why is not None and not sched.blocked_by_dependents(rt):
                    self.feed(rt, *why)
        finally:
            self._in_tier = False
            self._tier_orphans = None
        for name in self.order:
            rt = self.units[name]
            ev = sched.start_event(rt, now)
            if ev is not None:
                self.feed(rt, ev)
        self.schedule.refresh_waiting_reasons()
        if self.crosshost is not None:
            self.crosshost.converged()

    # ------------------------------------------------------------------ telling
    def published(self, rt: UnitRuntime, frm: UnitState, event: Event | None = None, pid: int | None = None) -> None:
        """A state change is out: the log, the event socket, waiters, the invariant check.
        `pid`: the main process the change concerns (the one that died, for `failed`)."""
        if rt.state is S.ACTIVE:
            rt.rolling = False  # back in service: a roll's exemption ends (also when its waiter timed out)
            rt.ready = True
            rt.active_since = time.monotonic()
            rt.book.ever_up = True
        log.info("unit state", unit=rt.name, **{"from": frm.value, "to": rt.state.value}, reason=rt.reason, pid=pid,
                 on=event.value if event else None)
        self.publish({"ts": time.time(), "unit": rt.name, "pid": pid, "from": frm.value, "to": rt.state.value,
                      "reason": rt.reason})
        if self.check_invariants:
            for problem in verify_unit(rt, self.cgroups, settled=True, spawner_pid=self.spawner.pid,
                                       mains=self.by_pid):
                self.invariant_violations.append(problem)
                log.error("invariant violated", unit=rt.name, problem=problem)
        self.notify_changed()
        self.kick()

    def notify_changed(self) -> None:
        """Wake every wait_until(); coalesced into one task per loop iteration."""
        if self._waker is not None and not self._waker.done():
            return

        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        self._waker = report_crash(asyncio.get_running_loop().create_task(wake()), "wait_until wake-up")

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        async def waiter() -> None:
            async with self._changed:
                await self._changed.wait_for(predicate)

        try:
            await asyncio.wait_for(waiter(), timeout)
            return True
        except asyncio.TimeoutError:
            return predicate()

    def verify(self) -> list[str]:
        return verify(self.units, self.cgroups, spawner_pid=self.spawner.pid, mains=self.by_pid)

    def snapshot(self) -> list[dict]:
        out = []
        degraded = self.degraded_units()
        for n in self.order:
            snap = self.units[n].snapshot()
            if n in self.gpu_mib:
                snap["gpu_mib"] = self.gpu_mib[n]
            if n in degraded:
                snap["degraded"] = degraded[n]
            if self.units[n].spec.fd_store_max > 0:  # fds it keeps in the daemon (omnid.process.fdstore)
                snap["fd_store"] = self.fdstore.count(n)
            if self.crosshost is not None and (group := self.crosshost.status(self.units[n])) is not None:
                snap["group"] = group
            if self.cgroups:
                snap.update(self.cgroups.snapshot(n))  # type: ignore[attr-defined]
            out.append(snap)
        return out

    def degraded_units(self) -> dict[str, str]:
        """Unit -> why the stack is degraded because of it: the GPU watch's findings, and
        units whose readiness probe fails while they are active (core/monitors.py)."""
        return {**self.degraded, **self.monitors.not_ready} if self.monitors.not_ready else self.degraded

    def kill_all(self) -> list[str]:
        """SIGKILL to every unit that holds a process, now (dependents first, though nothing
        waits between them): the stack stop's deadline passed, or a second signal asked for it."""
        hit = []
        for name in reversed(self.order):
            rt = self.units[name]
            if rt.proc is not None:
                self.executor.kill_now(rt)
                hit.append(name)
        return hit

    def stop_budget(self) -> float:
        """How long a stop of the whole stack may take when every unit uses all of its budgets:
        the tiers stop one after another (dependents first), the units of a tier together; a
        unit's budget is its drain_timeout (with a drain hook), stop_timeout (or a longer
        abort_timeout: it may be hung then), kill_timeout for SIGKILL and kill_timeout for the
        sweep of escapees, and kill_timeout more for the GPU's memory where it is checked."""
        total = 0.0
        for tier in self.stack.tiers():
            worst = 0.0
            for u in tier:
                spec = self.units[u.name].spec
                drain = spec.drain_timeout if spec.drain else 0.0
                gpu = spec.kill_timeout if self.gpu_on() and spec.gpus else 0.0
                stop = max(spec.stop_timeout, spec.abort_timeout or 0.0)
                worst = max(worst, drain + stop + 2 * spec.kill_timeout + gpu)
            total += worst
        return total + STOP_MARGIN_S

    def draining(self) -> bool:
        """/health says "draining": a unit is draining, or the stack's drain_sec window is open."""
        if self.shutting_down and not self.stack_signalled:
            return True  # a stop of the stack begins: draining until its first stop signal
        return time.monotonic() < self.draining_until or any(rt.phase is P.DRAINING for rt in self.units.values())

    def idle(self) -> bool:
        return not any(rt.busy for rt in self.units.values())

    # ------------------------------------------------------------------ GPU (core/gpus.py)
    def gpu_fault(self, gpu: int | str, xid: int, meaning: str) -> list[str]:
        """A critical fault (an Xid) on one GPU: every running unit on it fails, naming it.
        Returns the units that were failed."""
        return gpus.fail_units_on(self, gpu, xid, meaning)

    def gpu_on(self) -> bool:
        return self.gpu is not None and bool(getattr(self.gpu, "available", False))

    async def gpu_release(self, name: str, pids: list[int], timeout: float) -> tuple[float | None, list[str]]:
        """Wait (at most `timeout`) until none of a stopped or dead unit's `pids` holds GPU memory."""
        return await gpus.wait_released(self, name, pids, timeout)
