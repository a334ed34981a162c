"""The supervisor: every unit's runtime record, and the one way they change.

    facts (pidfd readable, spawner replies, timers, probes, operator goals)
        -> feed(unit, event) -> lifecycle.step -> new position + actions
        -> executor carries out the actions -> their outcomes are fed back

`feed` is the only place a unit's state or phase changes; it processes one event at
a time (events fed while one is being carried out wait their turn). `converge` is the
only place that compares state with goal across units: after every change it feeds
the stop and start events that the dependency graph and the goals call for. A
readable pidfd is the death event: there is no polling loop for liveness.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Iterable

import structlog

from omnid import linux
from omnid.core import groups
from omnid.core.drain import Drains
from omnid.core.executor import EXIT_STATUS_WAIT_S, Ctx, Executor
from omnid.core.exits import ExitBook
from omnid.core.invariants import verify, verify_unit
from omnid.core.lifecycle import Cause, Event, Goal, IllegalEvent, Phase, UnitState, View, step
from omnid.core.monitors import Monitors
from omnid.core.reload import Reloader
from omnid.core.requests import OperatorRequests
from omnid.core.runtime import RestartBook, UnitRuntime
from omnid.core.schedule import Schedule
from omnid.output import UnitOutput
from omnid.process import ProcessHandle
from omnid.fdstore import FdStore
from omnid.sockets import HeldSockets
from omnid.spawnclient import ExitReport, SpawnerClient
from omnid.tasks import report_crash
from omnid.units import Stack

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
                 check_invariants: bool = False, gpu: object | None = None, echo_output: bool = True,
                 cgroups: object | None = None) -> None:
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
        self._in_tier = False  # a converge is feeding stops: the subreaper's children are read once for all
        self._tier_orphans: list[int] | None = None
        self.executor = Executor(self)
        self.executor.drains = Drains(self)
        self.monitors = Monitors(self)
        self.schedule = Schedule(self)
        self.requests = OperatorRequests(self)
        self.reloader = Reloader(self)
        self.crosshost = None  # omnid.core.crosshost.CrossHost, set by the daemon with [cluster]
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
                    leftover_grace=rt.spec.leftover_timeout > 0)

    def _step(self, rt: UnitRuntime, event: Event, detail: str) -> None:
        leftovers = False
        if event is E.EXITED:
            leftovers, note = self._exit_facts(rt)
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
        if (early := self.exits.take_early(h)) is not None:
            self.on_exit_report(early)
        for fields in self.monitors.early.pop(h.pgid, []):
            self.monitors.apply(rt, fields)
        asyncio.get_running_loop().add_reader(h.pidfd, self._on_pidfd, rt, h)
        self.on_pids_changed()

    def disown(self, rt: UnitRuntime, h: ProcessHandle) -> None:
        h.close()
        self.by_pid.pop(h.pid, None)
        rt.proc = None
        self.on_pids_changed()

    def _on_pidfd(self, rt: UnitRuntime, h: ProcessHandle) -> None:
        asyncio.get_running_loop().remove_reader(h.pidfd)
        h.exit_seen = time.monotonic()
        h.exited.set()
        if rt.proc is not h:
            return
        rt.ready = False  # /health turns 503 now, before the failure is recorded
        self.notify_changed()
        if not h.reaped.is_set() and h.status_from_pidfd():
            self.exits.read_from_pidfd(h.pid)  # the spawner's report, on its way, is dropped
        if h.reaped.is_set():
            self.feed(rt, E.EXITED)
        else:  # the spawner's exit report is on its way; without it in 2 s: status unknown
            w = self.executor.of(rt)
            w.exit_wait = asyncio.get_running_loop().call_later(EXIT_STATUS_WAIT_S, self._exit_unknown, rt, h)

    def _exit_unknown(self, rt: UnitRuntime, h: ProcessHandle) -> None:
        self.executor.of(rt).exit_wait = None
        if rt.proc is h and not h.reaped.is_set():
            log.error("no exit status from the spawner within 2 s", unit=rt.name, pid=h.pid)
            self.feed(rt, E.EXITED)

    def on_exit_report(self, rep: ExitReport) -> None:
        if self.exits.helper_exit(rep) or self.exits.already_read(rep.pid):
            return
        entry = self.by_pid.get(rep.pid)
        if entry is None:
            if not rep.adopted:  # the exit of a spawn whose reply is still on its way
                self.exits.keep_early(rep)
            return
        rt, h = entry
        h.exit_status = rep.status
        h.reaped.set()
        if h.exited.is_set() and rt.proc is h:
            w = self.executor.of(rt)
            if w.exit_wait is not None:
                w.exit_wait.cancel()
                w.exit_wait = None
                self.feed(rt, E.EXITED)

    def _exit_facts(self, rt: UnitRuntime) -> tuple[bool, str]:
        """The main process is gone: record how. Returns (leftovers, a note for the reason):
        leftovers when the kernel cannot prove the unit empty yet (processes outlived it,
        or zombies of its group are not reaped yet)."""
        h = rt.proc
        if h is None:
            return False, ""
        if h.exit_status is not None:
            code, sig, what = linux.describe_wait_status(h.exit_status)
        else:
            code, sig, what = None, None, "exited (status unknown)"
        rt.last_exit_code, rt.last_signal = code, sig
        if rt.stopping_notified:
            what += " after STOPPING=1"
        rt.last_exit_what = f"{what} (pid {h.pid}, while {rt.state.value})"
        if rt.state not in (S.STARTING, S.ACTIVE):
            return False, ""
        rt.death_detect_ms = (time.monotonic() - (h.exit_seen or time.monotonic())) * 1000
        target = self.executor.target(rt, h)
        # `empty` first: the kernel's proof, without the scan of /proc that listing the
        # leftovers can take (0.3-0.7 s on a loaded host), which would hold the failure's
        # report; the list is read only where the GPU check needs their pids.
        if target.empty():
            # The main process alone held the unit: its GPU memory is what a restart waits for.
            self.executor.of(rt).dead_pids = [h.pid] if self.gpu_on() else []
            return False, ""
        left = target.members() if self.gpu_on() else []
        self.executor.of(rt).dead_pids = [h.pid, *(s.pid for s in left)] if self.gpu_on() else []
        if rt.spec.leftover_timeout > 0:
            return True, (f"; what outlived it gets {linux.signal_name(rt.spec.stop_signal)}, "
                          f"SIGKILL after {rt.spec.leftover_timeout:g} s")
        return True, "; killing what outlived it"

    def on_spawner_gone(self) -> None:
        """Every unit died with the spawner (PDEATHSIG); realign state with that."""
        for rt in self.units.values():
            if rt.proc is not None:
                rt.proc.exited.set()
                rt.proc.reaped.set()

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
        self._refresh_waiting_reasons()
        if self.crosshost is not None:
            self.crosshost.converged()

    def _refresh_waiting_reasons(self) -> None:
        """A unit stopped for a requirement keeps naming the current root cause."""
        for rt in self.units.values():
            if rt.state is not S.INACTIVE or rt.busy or rt.cause is not Cause.REQUIREMENT:
                continue
            for r in rt.spec.requires:
                if self.schedule.down(self.units[r]):
                    why = f"stopped: requires {self.schedule.root_cause(r)}"
                    if why != rt.reason:
                        rt.reason = why
                        self.notify_changed()
                    break

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
            for problem in verify_unit(rt, self.cgroups, settled=True):
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
        return verify(self.units, self.cgroups)

    def snapshot(self) -> list[dict]:
        out = []
        degraded = self.degraded_units()
        for n in self.order:
            snap = self.units[n].snapshot()
            if n in self.gpu_mib:
                snap["gpu_mib"] = self.gpu_mib[n]
            if n in degraded:
                snap["degraded"] = degraded[n]
            if self.units[n].spec.fd_store_max > 0:  # fds it keeps in the daemon (omnid.fdstore)
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
        unit's budget is its drain_timeout (with a drain hook), stop_timeout, kill_timeout for
        SIGKILL and kill_timeout for the sweep of escapees, and kill_timeout more for the GPU's
        memory where it is checked."""
        total = 0.0
        for tier in self.stack.tiers():
            worst = 0.0
            for u in tier:
                spec = self.units[u.name].spec
                drain = spec.drain_timeout if spec.drain else 0.0
                gpu = spec.kill_timeout if self.gpu_on() and spec.gpus else 0.0
                worst = max(worst, drain + spec.stop_timeout + 2 * spec.kill_timeout + gpu)
            total += worst
        return total + STOP_MARGIN_S

    def draining(self) -> bool:
        """/health says "draining": a unit is draining, or the stack's drain_sec window is open."""
        if self.shutting_down and not self.stack_signalled:
            return True  # a stop of the stack begins: draining until its first stop signal
        return time.monotonic() < self.draining_until or any(rt.phase is P.DRAINING for rt in self.units.values())

    def idle(self) -> bool:
        return not any(rt.busy for rt in self.units.values())

    # ------------------------------------------------------------------ GPU
    def gpu_fault(self, gpu: int | str, xid: int, meaning: str) -> list[str]:
        """A critical fault (an Xid) on one GPU: every running unit on it fails, naming it.
        Returns the units that were failed."""
        from omnid.gpu import affects

        hit = []
        for rt in self.units.values():
            if any(affects(self.gpu, gpu, item) for item in rt.spec.gpus) \
                    and rt.state in (S.STARTING, S.ACTIVE) and not rt.dead:
                hit.append(rt.name)
                self.feed(rt, E.GPU_FAULT, f"GPU {gpu} fault: Xid {xid} ({meaning})")
        return hit

    def gpu_on(self) -> bool:
        return self.gpu is not None and bool(getattr(self.gpu, "available", False))

    async def gpu_release(self, name: str, pids: list[int], timeout: float) -> tuple[float | None, list[str]]:
        """Wait (at most `timeout`) until none of a stopped or dead unit's `pids` holds GPU
        memory: (ms, []) once free; (None, what is still held) at the deadline; (None, [])
        when the backend cannot tell. Memory still held is logged as an error, by pid."""
        from omnid import gpu as gpu_mod

        if not pids:
            return None, []
        try:
            ms, left = await gpu_mod.wait_released(self.gpu, pids, timeout, items=self.units[name].spec.gpus or None)
        except Exception as exc:  # noqa: BLE001 - a GPU read error must not break a stop
            log.warning("gpu release check failed", unit=name, error=str(exc))
            return None, []
        held = [f"pid {p.pid} holds {p.used_mib:.0f} MiB on GPU {p.gpu}" for p in left]
        if held:
            log.error("GPU memory still held after the unit's processes were killed", unit=name,
                      timeout_s=timeout, held=held)
        elif ms is not None:
            log.info("gpu memory released", unit=name, ms=round(ms, 1))
        return ms, held
