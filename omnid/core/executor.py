"""The executor: carries out the actions `lifecycle.step` returns, one small handler
per action type, and feeds each outcome back to the supervisor as an event
(spawned / spawn failed, gone, timer fired, captured, released). It decides
nothing: which action comes when is the table's business.

What it starts for a unit is scoped (after s6, where leaving a state is what
cancels its timers): timers, drains, captures and GPU-release waits belong to the
unit's position (an outcome of an older position is void: the unit's `epoch`
changed); the readiness check belongs to `starting`, the monitors to `active`,
the wait for the kernel's proof of an empty unit to `stopping`. A spawn is never
cancelled (the child would be lost): its outcome is always fed.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from omnid.base import linux
from omnid.process.cgroup import CgroupTarget
from omnid.core import groups, launch, policy
from omnid.core.lifecycle import (Action, ArmTimer, Capture, CountStart, Ctx, DecideRestart, Drain, Event, Phase,
                                  Publish, RecordFailure, Release, ReportUnkillable, Signal, Spawn, StartMonitors,
                                  UnitState, WaitRelease, WatchGone, WatchReady)
from omnid.core.runtime import UnitRuntime
from omnid.process.handle import ProcessHandle
from omnid.base.tasks import unit_task
from omnid.process.termination import ProcessGroupTarget, Target, Termination
from omnid.core.centre import Centre

if TYPE_CHECKING:  # set by the supervisor and the daemon after the executor is made
    from omnid.forensics.store import CaptureStore
    from omnid.core.cleanup import UnitCleanup
    from omnid.core.drain import Drains
    from omnid.core.faults import Faults


log = structlog.get_logger("omnid.supervisor")
S, P, E = UnitState, Phase, Event

# Which event each timer feeds when it fires, and how long it runs.
TIMER_EVENTS = {"ready_timeout": E.NOT_READY, "stop_timeout": E.STOP_TIMEOUT, "kill_timeout": E.KILL_TIMEOUT,
                "capture_timeout": E.CAPTURED, "capture_due": E.CAPTURE_DUE, "drain_timeout": E.DRAINED,
                "leftover_timeout": E.STOP_TIMEOUT, "abort_timeout": E.STOP_TIMEOUT}
EXIT_STATUS_WAIT_S = 2.0  # pidfd readable -> the spawner's exit report; then "status unknown"


@dataclass
class Works:
    """What runs for one unit right now. Position-scoped things die with the position."""

    timers: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)  # "ready", "gone", "drain", "release", ...
    term: Termination | None = None  # the current stop's kill-policy steps and StopRecord
    start_reason: str = ""
    exit_wait: asyncio.TimerHandle | None = None
    dead_pids: list[int] = field(default_factory=list)  # whose GPU memory must be freed
    stop_from: UnitState = UnitState.ACTIVE  # the state the current stop began in
    bound: str = "stop_timeout"  # the stop's bound armed last: what a STOP_TIMEOUT's SIGKILL says it was


# What a SIGKILL in the middle of a stop says it was, by the event that brought it (a stop's
# bound that passed says which: Works.bound).
_WHY_SIGKILL = {E.GROUP_FENCED: "fenced from its group", E.INTERNAL_ERROR: "internal error",
                E.EXITED: "main process exited"}

# Tasks that live as long as a state, not a phase.
_STATE_TASKS = {"ready": S.STARTING, "liveness": S.ACTIVE, "progress": S.ACTIVE, "ready-probe": S.ACTIVE,
                "gone": S.STOPPING}


class Executor:
    def __init__(self, sup: Centre) -> None:
        self.sup = sup
        self.works: dict[str, Works] = {}
        self._handlers: dict[type, Callable[[UnitRuntime, Any, Ctx], None]] = {
            CountStart: self._count_start, Spawn: self._spawn, Signal: self._signal, ArmTimer: self._arm_timer,
            WatchGone: self._watch_gone, WatchReady: self._watch_ready, StartMonitors: self._start_monitors,
            Capture: self._capture, Drain: self._drain, RecordFailure: self._record_failure,
            DecideRestart: self._decide_restart, ReportUnkillable: self._report_unkillable,
            WaitRelease: self._wait_release, Release: self._release, Publish: self._publish,
        }
        self.captures: CaptureStore | None = None  # when the daemon keeps captures
        self.drains: Drains | None = None
        self.faults: Faults | None = None  # the test-only injection hook, never set in production
        self.cleanup: UnitCleanup | None = None  # private tmp and IPC residue, when the daemon runs
        # Units whose spawn is asked for and whose request is not with the spawner client yet
        # (the daemon's start waits for the first tier's before its heavy imports).
        self.unsent: set[str] = set()

    def of(self, rt: UnitRuntime) -> Works:
        w = self.works.get(rt.name)
        if w is None:
            w = self.works[rt.name] = Works()
        return w

    def forget(self, name: str) -> None:
        """A unit left the stack (reload): nothing may run for it any more."""
        w = self.works.pop(name, None)
        if w is not None:
            for t in w.timers.values():
                t.cancel()
            for task in w.tasks.values():
                task.cancel()

    # ------------------------------------------------------------ entry points
    def run(self, rt: UnitRuntime, actions: tuple[Action, ...], ctx: Ctx) -> None:
        """Carry out `actions` for rt in order. A handler that raises is a bug: the unit's
        position decides what that means (INTERNAL_ERROR), the daemon goes on. A bug while the
        way out of a bug is carried out is logged and not fed again (no loop): the rest of that
        way out is still carried out (the unit is failed, published, its fds closed)."""
        for action in actions:
            try:
                if self.faults is not None:
                    self.faults.check_action(rt.name, type(action).__name__)
                self._handlers[type(action)](rt, action, ctx)
            except Exception as exc:  # noqa: BLE001 - a bug in a handler fails the unit, never the daemon
                log.exception("action failed", unit=rt.name, action=type(action).__name__)
                if ctx.event is E.INTERNAL_ERROR:
                    continue
                self.sup.feed(rt, E.INTERNAL_ERROR, f"internal error in {type(action).__name__}: "
                                                    f"{type(exc).__name__}: {exc}")
                return

    def left(self, rt: UnitRuntime, old_state: UnitState) -> None:
        """rt's position changed: what belonged to the old one stops."""
        w = self.of(rt)
        for t in w.timers.values():
            t.cancel()
        w.timers.clear()
        for kind in list(w.tasks):
            keep_in = _STATE_TASKS.get(kind)
            if keep_in is not None and keep_in is rt.state:
                continue
            task = w.tasks.pop(kind)
            if task is not asyncio.current_task():
                task.cancel()
        if old_state is S.ACTIVE and rt.state is not S.ACTIVE:
            self.sup.monitors.stop(rt)

    def run_for(self, rt: UnitRuntime, kind: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run coro as rt's task of this kind (the monitors' probes, the executor's own waits):
        one per kind, a newer one cancels the older; it ends with rt's position, or with its
        state for the kinds in _STATE_TASKS; a crash is rt's INTERNAL_ERROR (omnid.base.tasks)."""
        epoch = rt.epoch

        def crashed(exc: BaseException) -> None:
            if rt.epoch == epoch or kind in _STATE_TASKS:
                self.sup.feed(rt, E.INTERNAL_ERROR, f"internal error in {kind}: {type(exc).__name__}: {exc}")

        w = self.of(rt)
        old = w.tasks.pop(kind, None)
        if old is not None and not old.done():
            old.cancel()
        w.tasks[kind] = unit_task(coro, unit=rt.name, kind=kind, on_crash=crashed)

    def _feed_if_current(self, rt: UnitRuntime, epoch: int, event: Event, detail: str = "") -> None:
        if rt.epoch == epoch:
            self.sup.feed(rt, event, detail)

    # ------------------------------------------------------------ start
    def _count_start(self, rt: UnitRuntime, a: CountStart, ctx: Ctx) -> None:
        w = self.of(rt)
        w.start_reason = groups.count_start(self.sup, rt, time.monotonic())

    def _spawn(self, rt: UnitRuntime, a: Spawn, ctx: Ctx) -> None:
        w = self.of(rt)
        w.term = None
        self.unsent.add(rt.name)
        self.run_for(rt, "spawn", launch.launch(launch.Launch(self.sup, rt, w.start_reason, self.unsent,
                                                              self.cleanup, self.faults)))

    def _watch_ready(self, rt: UnitRuntime, a: WatchReady, ctx: Ctx) -> None:
        self.run_for(rt, "ready", self.sup.monitors.readiness(rt))

    def _start_monitors(self, rt: UnitRuntime, a: StartMonitors, ctx: Ctx) -> None:
        self.sup.monitors.start(rt)

    # ------------------------------------------------------------ stop
    def target(self, rt: UnitRuntime, h: ProcessHandle) -> Target:
        """What of this unit the kill policy acts on: its cgroup, or its process group."""
        sup = self.sup
        cg = sup.cgroups.get(rt.name) if sup.cgroups else None
        if cg is not None:
            return CgroupTarget(rt.name, h, sup.token, cg)
        # mains: a live view of the main processes (never orphans), not a copy per stop.
        return ProcessGroupTarget(rt.name, h, sup.spawner.pid, sup.token, mains=sup.by_pid.keys(),
                                  orphans=sup.tier_orphans)

    def _termination(self, rt: UnitRuntime, ctx: Ctx) -> Termination:
        w = self.of(rt)
        if w.term is None:
            assert rt.proc is not None, f"{rt.name}: a stop without a process"
            w.term = Termination(self.target(rt, rt.proc))
            w.term.rec.was = w.stop_from.value
            if self.sup.gpu_on():
                w.dead_pids = [rt.proc.pid, *(s.pid for s in w.term.target.members())]
        return w.term

    def _signal(self, rt: UnitRuntime, a: Signal, ctx: Ctx) -> None:
        term = self._termination(rt, ctx)
        sig = rt.spec.stop_signal if a.sig == "stop_signal" else int(getattr(signal, a.sig))
        if a.to == "rest":
            term.rest(sig, a.cont)
        elif term.t0 and sig == signal.SIGKILL:
            term.escalate(self.of(rt).bound.replace("_", " ") if ctx.event is E.STOP_TIMEOUT
                          else _WHY_SIGKILL.get(ctx.event, "a stop under way") if ctx.event is not None
                          else "a stop under way")
        else:
            term.begin(sig, a.cont, main_only=a.to == "main")
        if self.sup.shutting_down:
            self.sup.stack_signalled = True

    def kill_now(self, rt: UnitRuntime) -> None:
        """SIGKILL everything of the unit now, through the termination policy, outside the
        table's order: the stack stop's deadline passed, or a second SIGTERM/SIGINT came. The
        deaths come back as events as usual (EXITED, GONE)."""
        if rt.proc is None:
            return
        w = self.of(rt)
        term = w.term if w.term is not None and rt.state is S.STOPPING else Termination(self.target(rt, rt.proc))
        if term.t0:
            term.escalate("the stack stop's deadline or a second signal")
        else:
            term.begin(signal.SIGKILL, False)

    def _arm_timer(self, rt: UnitRuntime, a: ArmTimer, ctx: Ctx) -> None:
        spec = rt.spec
        if a.which == "ready_timeout":
            delay = max(0.0, rt.ready_deadline - time.monotonic())
            detail = f"not ready after {spec.ready_timeout:g} s"
        elif a.which == "stop_timeout":
            delay, detail = spec.stop_timeout, ""
        elif a.which == "abort_timeout":  # a hung unit's stop: its own bound, or stop_timeout
            delay, detail = spec.abort_timeout if spec.abort_timeout is not None else spec.stop_timeout, ""
        elif a.which == "kill_timeout":
            delay, detail = spec.kill_timeout, ""
        elif a.which == "leftover_timeout":  # the main process exited: its leftovers' grace
            delay, detail = spec.leftover_timeout, f"leftovers still alive {spec.leftover_timeout:g} s after the stop signal"
        elif a.which == "capture_timeout":  # the capture bounds itself; this is the backstop
            delay, detail = capture_budget(spec) + 0.5, "capture bound reached"
        elif a.which == "capture_due":  # early enough that the capture ends by stop_timeout
            delay, detail = spec.stop_timeout - min(capture_budget(spec), spec.stop_timeout / 2), ""
        elif a.which == "drain_timeout":
            delay, detail = getattr(spec, "drain_timeout", 30.0), "drain_timeout reached"
        else:
            raise ValueError(f"unknown timer {a.which!r}")
        epoch = rt.epoch
        loop = asyncio.get_running_loop()
        w = self.of(rt)
        if TIMER_EVENTS[a.which] is E.STOP_TIMEOUT:
            w.bound = a.which
        w.timers[a.which] = loop.call_later(delay, self._timer_fired, rt, epoch, a.which, detail)

    def _timer_fired(self, rt: UnitRuntime, epoch: int, which: str, detail: str) -> None:
        """A timer's event; a ready_timeout the monitors hold back (a `ready = notify` unit's
        READY=1 could not be read: the notify socket was not read) is looked at again later."""
        if which == "ready_timeout" and rt.epoch == epoch and (wait := self.sup.monitors.ready_held(rt)) is not None:
            self.of(rt).timers[which] = asyncio.get_running_loop().call_later(
                wait, self._timer_fired, rt, epoch, which, detail)
            return
        self._feed_if_current(rt, epoch, TIMER_EVENTS[which], detail)

    def _watch_gone(self, rt: UnitRuntime, a: WatchGone, ctx: Ctx) -> None:
        self.run_for(rt, "gone", self._gone_task(rt, self._termination(rt, ctx)))

    async def _gone_task(self, rt: UnitRuntime, term: Termination) -> None:
        """GONE the moment the kernel proves the processes gone: the stop's timers end with the
        position (the exit is the exit). What they left is removed after it, as its own step
        (stopping/releasing: WaitRelease), never inside the stop's bounds."""
        await term.until_gone()  # bounded by the stop_timeout / kill_timeout timers
        await term.sweep(rt.spec.kill_timeout)
        if self.sup.cgroups:
            self.sup.cgroups.release(rt.name)
        self.sup.feed(rt, E.GONE)

    def _capture(self, rt: UnitRuntime, a: Capture, ctx: Ctx) -> None:
        if self.captures is None or rt.proc is None:
            if a.feed:
                self.sup.feed(rt, E.CAPTURED, "no capture")
            return
        epoch = rt.epoch
        term = self._termination(rt, ctx)
        from omnid.forensics import capture as forensics

        others = [s for s in term.target.members() if s.pid != rt.proc.pid]
        if not a.feed and not others and rt.proc.exited.is_set():
            # Capture due in a stop whose processes have all exited, the kernel's proof (GONE)
            # not read yet (a loop behind on a loaded host, 256 units stopping): nothing to
            # capture, and a capture's /proc reads and its file would slow every other stop.
            return
        members = forensics.member_list(rt.proc.pid, rt.proc.start_time, others)
        why = ctx.detail or rt.stop_reason or "stop_timeout is near"
        self.run_for(rt, "capture" if a.feed else "capture-beside",
                     self._capture_task(rt, epoch, members, why, a.feed, self.captures))

    async def _capture_task(self, rt: UnitRuntime, epoch: int, members: list, why: str, feed: bool,
                            store: CaptureStore) -> None:
        """The stacks of a hung unit, bounded by capture_timeout: fed back as CAPTURED (the stop
        signal goes out at once), then kept in the state directory (omnid dump)."""
        from omnid.forensics import capture as forensics

        budget = capture_budget(rt.spec) if feed else min(capture_budget(rt.spec), rt.spec.stop_timeout / 2)
        cap = await forensics.capture(rt.name, members, why=why, budget_s=budget, max_bytes=forensics.DEFAULT_MAX_BYTES)
        rt.capture_summary = cap.summary
        if feed and rt.epoch == epoch:
            rt.stop_reason = f"{rt.stop_reason}; stacks: {cap.summary}"
            rt.reason = rt.stop_reason
            self.sup.feed(rt, E.CAPTURED, cap.summary)
        await store.save_async(cap)

    def _drain(self, rt: UnitRuntime, a: Drain, ctx: Ctx) -> None:
        if self.drains is None:
            self.sup.feed(rt, E.DRAINED, "no drain hook")
            return
        epoch = rt.epoch
        self.run_for(rt, "drain", self._drain_task(rt, epoch, self.drains))

    async def _drain_task(self, rt: UnitRuntime, epoch: int, drains: Drains) -> None:
        detail = await drains.drain(rt)
        log.info("drain over", unit=rt.name, how=detail)
        self._feed_if_current(rt, epoch, E.DRAINED, detail)

    # ------------------------------------------------------------ failure and end
    def _record_failure(self, rt: UnitRuntime, a: RecordFailure, ctx: Ctx) -> None:
        what = ctx.detail
        rt.last_exit = what
        rt.cause_text = groups.without_pid(what)
        rt.deaths += 1
        if rt.spec.worker_group:
            groups.member_failed(self.sup, rt, what)

    def _decide_restart(self, rt: UnitRuntime, a: DecideRestart, ctx: Ctx) -> None:
        sup, spec = self.sup, rt.spec
        now = time.monotonic()
        ran_for = (now - rt.active_since) if rt.active_since else None
        rt.active_since = 0.0
        f = policy.Failure(now=now, wanted=rt.goal.value == "active" and not sup.shutting_down, ran_for=ran_for,
                           exec_errno=rt.spawn_errno, first_start=not rt.book.ever_up)
        d = policy.decide(spec, rt.book, f)
        if spec.worker_group:
            groups.decided(sup, rt, d)
        if d.note:
            rt.reason = f"{rt.reason}; {d.note}" if d.outcome is not policy.Outcome.COUNTED \
                else f"{rt.reason} ({d.note})"
        if d.outcome is policy.Outcome.AGAIN:
            if d.delay > 0:
                asyncio.get_running_loop().call_later(d.delay, sup.kick)
            else:  # restart_sec = 0: the converge of this turn's end, not a timer's turn after it
                sup.kick()

    def _report_unkillable(self, rt: UnitRuntime, a: ReportUnkillable, ctx: Ctx) -> None:
        w = self.of(rt)
        survivors = w.term.unkillable() if w.term is not None else ["main process not reaped"]
        rt.reason = f"{rt.reason}; UNKILLABLE: {'; '.join(survivors)}"

    def _wait_release(self, rt: UnitRuntime, a: WaitRelease, ctx: Ctx) -> None:
        w = self.of(rt)
        pids, w.dead_pids = w.dead_pids, []
        epoch = rt.epoch
        self.run_for(rt, "release", self._release_task(rt, epoch, pids))

    async def _release_task(self, rt: UnitRuntime, epoch: int, pids: list[int]) -> None:
        """What the unit's processes held, released after they are gone, each on its own
        clock and bounded: their GPU memory (where it is checked) and what they left in the
        filesystem and IPC namespaces (omnid.core.cleanup), side by side."""
        w = self.of(rt)
        rec = w.term.rec if w.term is not None else None

        async def gpu() -> None:
            ms, held = await self.sup.gpu_release(rt.name, pids, rt.spec.kill_timeout)
            rt.gpu_release_ms, rt.gpu_held = ms, held
            if rec is not None:
                rec.gpu_release_ms, rec.gpu_held = ms, list(held)

        steps: list[Coroutine[Any, Any, object]] = [gpu()] if self.sup.gpu_on() else []
        if self.cleanup is not None:
            steps.append(self.cleanup.gone(rt, rec))
        await asyncio.gather(*steps)
        self._feed_if_current(rt, epoch, E.RELEASED)

    def _release(self, rt: UnitRuntime, a: Release, ctx: Ctx) -> None:
        """An inactive or failed unit holds no fd for its processes."""
        w = self.of(rt)
        if w.term is not None:
            rt.last_stop = w.term.rec
        h = rt.proc
        if h is not None:
            if h.exit_status is not None:
                code, sig, what = linux.describe_wait_status(h.exit_status)
                rt.last_exit_code, rt.last_signal = code, sig
                if rt.cause is not None and rt.cause.value != "failure":
                    rt.last_exit = f"{what} (pid {h.pid}, stopped)"
            if w.exit_wait is not None:
                w.exit_wait.cancel()
                w.exit_wait = None
            self.sup.disown(rt, h)
        rt.output.detach()
        launch.cgroup_done(self.sup, rt)
        if self.cleanup is not None:
            self.cleanup.released(rt)

    def _publish(self, rt: UnitRuntime, a: Publish, ctx: Ctx) -> None:
        self.sup.published(rt, ctx.prev_state, ctx.event, ctx.pid)


def capture_budget(spec: Any) -> float:
    """How long stacks may be captured before a kill (unit key capture_timeout)."""
    return float(getattr(spec, "capture_timeout", 3.0))


