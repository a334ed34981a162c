"""The lifecycle of one unit as a table (after s6's `actions[state][event]`).

`step(view, event)` is pure: no I/O, no asyncio, no clock. It answers, for one
unit, what its next state and phase are and which actions to carry out. The
supervisor's `feed` is the only caller; the executor carries the actions out
and feeds each outcome back as an event (spawned, gone, timer fired...).

A unit's public `state` is one of inactive/starting/active/stopping/failed; its
`phase` says what it is doing within that state (a spawn in flight, capturing
stacks before a kill, draining, signalled, killed, waiting for the GPU's memory
to be freed). A (state, phase) pair is a *position*; every cell of TABLE is the
whole decision for one position and one event. Cells that depend on the unit
(does it drain, is the GPU checked, did processes outlive the main one) read the
`View`. The table is total: every event has a cell in every position (POSITIONS, listed
by hand below); an event that means nothing in a position is an explicit "ignore" cell
(`_same`), listed with the reason it means nothing there. Only a (state, phase) pair that is
no position at all is answered with IllegalEvent (a bug in the supervisor, never an event).

INTERNAL_ERROR (an action or a task working for the unit raised: a bug) has a way out of
every position: the unit ends `failed` with the reason naming the action and the exception,
and what it had running is killed first through the termination policy (omnid.process.termination).

The legal state changes (`LEGAL`) and the diagram in omnid.unit(5) are derived
from this table; nothing else lists transitions.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omnid.model.unitmodel import KillMode


class UnitState(str, enum.Enum):
    INACTIVE = "inactive"
    STARTING = "starting"
    ACTIVE = "active"
    STOPPING = "stopping"
    FAILED = "failed"


class Goal(str, enum.Enum):
    ACTIVE = "active"
    INACTIVE = "inactive"


class Phase(str, enum.Enum):
    IDLE = "idle"  # nothing under way (starting: waiting for readiness; active: running)
    SPAWNING = "spawning"  # inactive/failed: a spawn request is at the spawner
    CAPTURING = "capturing"  # stopping: stacks captured before the first signal (a hung unit)
    DRAINING = "draining"  # stopping: told to stop taking work, until idle or drain_timeout
    SIGNALLED = "signalled"  # stopping: stop_signal sent; gone, or SIGKILL at stop_timeout
    KILLED = "killed"  # stopping: SIGKILL sent; gone, or unkillable at kill_timeout
    RELEASING = "releasing"  # stopping/failed: nothing runs; waiting until NVML shows the GPU memory freed
    #                          and (stopping) what the processes left is removed, both bounded


class Cause(str, enum.Enum):
    """Why a unit stops (state, never parsed from a reason)."""

    REQUEST = "request"  # an operator's stop
    SHUTDOWN = "shutdown"  # the whole stack stops (omnid stop, SIGTERM to the daemon)
    REQUIREMENT = "requirement"  # a unit it requires is down
    GROUP = "group"  # a member of its worker group failed (on this host or another)
    FAILURE = "failure"  # it failed itself: ends in `failed`


class Event(str, enum.Enum):
    START_REQUESTED = "start_requested"  # converge: goal active, requirements up
    RESTART_DUE = "restart_due"  # converge: failed, restart delay passed, requirements up
    SPAWNED = "spawned"  # the spawner answered with pid + pidfd
    SPAWN_FAILED = "spawn_failed"  # exec error, GPU held or faulty, EMFILE
    READY = "ready"  # the readiness check passed
    NOT_READY = "not_ready"  # ready_timeout fired, or the readiness check failed
    EXITED = "exited"  # the main process is gone (pidfd readable, exit status in)
    WATCHDOG_EXPIRED = "watchdog_expired"  # timer, or WATCHDOG=trigger
    LIVENESS_FAILED = "liveness_failed"  # `failures` probes in a row
    GPU_FAULT = "gpu_fault"  # a critical Xid on one of the unit's GPUs
    STOP_REQUESTED = "stop_requested"  # converge: goal inactive
    DEPENDENCY_DOWN = "dependency_down"  # converge: a required unit is down
    GROUP_DOWN = "group_down"  # converge: the worker group's generation is down
    GROUP_FENCED = "group_fenced"  # converge: this host is cut off from a group across hosts: SIGKILL now
    CAPTURE_DUE = "capture_due"  # timer: still alive shortly before stop_timeout
    CAPTURED = "captured"  # the capture ended (done or its bound passed)
    DRAINED = "drained"  # the unit said it is idle, or drain_timeout fired
    STOP_TIMEOUT = "stop_timeout"  # timer
    KILL_TIMEOUT = "kill_timeout"  # timer: SIGKILL sent kill_timeout ago, not gone
    GONE = "gone"  # kernel's proof: main reaped, group/cgroup empty, escapees swept
    RELEASED = "released"  # NVML shows the pids' GPU memory freed, or the bound passed
    INTERNAL_ERROR = "internal_error"  # a handler working for this unit crashed (a bug)


# ------------------------------------------------------------------ actions
@dataclass(frozen=True)
class CountStart:
    """Count the start against the start limit (a worker group's generation counts once)."""


@dataclass(frozen=True)
class Spawn:
    pass


@dataclass(frozen=True)
class Signal:
    sig: str  # "stop_signal" (the unit's own), "SIGKILL"
    cont: bool = False  # SIGCONT after it, so a stopped process can act on it
    # "all": every process of the unit; "main": the main process only (kill_mode mixed /
    # process); "rest": what is left once the main process has exited.
    to: str = "all"


@dataclass(frozen=True)
class ArmTimer:
    which: str  # the event it feeds: ready_timeout -> NOT_READY, stop_timeout, kill_timeout, capture_timeout ->
    #           CAPTURED, capture_due -> CAPTURE_DUE, drain_timeout -> DRAINED, leftover_timeout and
    #           abort_timeout (a hung unit's stop_timeout) -> STOP_TIMEOUT


@dataclass(frozen=True)
class WatchGone:
    """Wait for the kernel's proof that nothing of the unit runs; sweep escapees; feed GONE."""


@dataclass(frozen=True)
class WatchReady:
    """Run the readiness check; feed READY or NOT_READY."""


@dataclass(frozen=True)
class StartMonitors:
    """Watchdog and liveness, while active."""


@dataclass(frozen=True)
class Capture:
    """Capture every process's stacks, bounded in time (capture_timeout); with `feed`, feed
    CAPTURED when done (before the first signal); without, it runs beside the stop."""

    feed: bool = True


@dataclass(frozen=True)
class Drain:
    """Tell the unit to stop taking work (its `drain` hook); feed DRAINED when idle."""


@dataclass(frozen=True)
class RecordFailure:
    """Remember what failed (last exit, cause for dependents, the worker group's down reason)."""


@dataclass(frozen=True)
class DecideRestart:
    """Ask the restart policy: again after a delay, or not (restart = no, start limit)."""


@dataclass(frozen=True)
class ReportUnkillable:
    pass


@dataclass(frozen=True)
class WaitRelease:
    """Wait (bounded) until the dead pids hold no GPU memory (where it is checked) and what they
    left is removed (private tmp, IPC objects), each on its own clock; feed RELEASED."""


@dataclass(frozen=True)
class Release:
    """Close the pidfd and the output pipes: an inactive or failed unit holds no fd."""


@dataclass(frozen=True)
class Publish:
    """Log the state change, publish it on the event socket, wake waiters."""


Action = (CountStart | Spawn | Signal | ArmTimer | WatchGone | WatchReady | StartMonitors | Capture | Drain
          | RecordFailure | DecideRestart | ReportUnkillable | WaitRelease | Release | Publish)
ACTION_TYPES: tuple[type, ...] = (CountStart, Spawn, Signal, ArmTimer, WatchGone, WatchReady, StartMonitors,
                                  Capture, Drain, RecordFailure, DecideRestart, ReportUnkillable, WaitRelease,
                                  Release, Publish)


@dataclass(frozen=True)
class Ctx:
    """What a handler may need of the event being carried out (the executor's `run` gets it
    with the actions)."""

    prev_state: UnitState  # the state before this step
    detail: str = ""  # what the event's reporter said (a failure's description)
    event: Event | None = None  # the event being carried out
    pid: int | None = None  # the main process the step concerns (read before Release)


@dataclass(frozen=True)
class View:
    """What step needs to know of a unit besides its position."""

    name: str
    state: UnitState
    phase: Phase = Phase.IDLE
    goal: Goal = Goal.ACTIVE
    cause: Cause | None = None  # in STOPPING: why it stops
    leftovers: bool = False  # on EXITED: the kernel cannot prove the unit empty yet
    gpu: bool = False  # GPU memory of its pids is checked after it ends
    capture: bool = False  # stacks are captured before a hung unit is killed
    drain: bool = False  # it has a drain hook
    shutting_down: bool = False  # the whole stack is stopping
    running: bool = False  # the unit holds a main process (a spawn that crashed after the child was adopted)
    kill_mode: KillMode = KillMode.CONTROL_GROUP  # who gets stop_signal on a planned stop
    rest_pending: bool = False  # stopping: only the main process was signalled, the rest has had nothing yet
    leftover_grace: bool = False  # on EXITED with leftovers: they get stop_signal and leftover_timeout first
    cleanup: bool = False  # on GONE: what its processes left (private tmp, IPC objects) is still to be removed


@dataclass(frozen=True)
class Step:
    state: UnitState
    phase: Phase
    actions: tuple[Action, ...] = ()
    cause: Cause | None = None  # set when a stop begins


class IllegalEvent(RuntimeError):
    def __init__(self, unit: str, state: UnitState, phase: Phase, event: Event) -> None:
        where = state.value if phase is Phase.IDLE else f"{state.value}/{phase.value}"
        super().__init__(f"{unit}: event {event.value} is illegal in state {where}")
        self.unit, self.state, self.phase, self.event = unit, state, phase, event


S, P, E = UnitState, Phase, Event


# ------------------------------------------------------------------ cells
# A cell is a Step, or a function of the View returning one.
def _same(v: View) -> Step:
    """The event changes nothing in this position (a stop already under way, say)."""
    return Step(v.state, v.phase)


def _signalled(v: View, cause: Cause, *, cont: bool, capture: bool, first: tuple = (), whole: bool = False,
               timer: str = "stop_timeout") -> Step:
    """stop_signal to the unit, SIGKILL at stop_timeout (`timer`: abort_timeout for a hung
    unit); with capture on, the stacks are taken shortly before stop_timeout if it is still
    alive then (never later). To every process of it, or under kill_mode mixed / process to
    the main process alone (the rest when it has exited: `_main_exited`); `whole`: every
    process whatever the mode (a failed unit)."""
    due = (ArmTimer("capture_due"),) if capture and v.capture else ()
    to = "all" if whole or v.kill_mode is KillMode.CONTROL_GROUP else "main"
    return Step(S.STOPPING, P.SIGNALLED, (*first, Signal("stop_signal", cont=cont, to=to), ArmTimer(timer),
                                         *due, WatchGone()), cause)


def _stop(cause: Cause | None) -> Callable[[View], Step]:
    """A stop begins: a planned stop of a serving unit with a drain hook drains first; then
    stop_signal + SIGCONT (so a stopped process can act on it). None: an operator's stop."""

    def cell(v: View) -> Step:
        why = cause or (Cause.SHUTDOWN if v.shutting_down else Cause.REQUEST)
        if v.drain and v.state is S.ACTIVE and why in (Cause.REQUEST, Cause.SHUTDOWN):
            return Step(S.STOPPING, P.DRAINING, (Publish(), Drain(), ArmTimer("drain_timeout")), why)
        return _signalled(v, why, cont=True, capture=True, first=(Publish(),))

    return cell


def _drained(v: View) -> Step:
    return _signalled(v, v.cause or Cause.REQUEST, cont=True, capture=True)


def _drained_exited(v: View) -> Step:
    """The main process exited while draining (a server that drains, then exits): under
    kill_mode mixed / process what it left is the rest, dealt with as on its exit mid-stop."""
    if v.kill_mode is KillMode.CONTROL_GROUP:
        return _drained(v)
    cause = v.cause or Cause.REQUEST
    if v.kill_mode is KillMode.MIXED:
        return Step(S.STOPPING, P.KILLED, (Signal("SIGKILL", to="rest"), ArmTimer("kill_timeout"), WatchGone()), cause)
    return Step(S.STOPPING, P.SIGNALLED, (Signal("stop_signal", cont=True, to="rest"), ArmTimer("stop_timeout"),
                                         WatchGone()), cause)


def _main_exited(v: View) -> Step:
    """Stopping, signalled: the main process exited. When the stop signalled it alone (kill_mode
    mixed / process, `rest_pending`) the rest of the unit now gets SIGKILL (mixed) or
    stop_signal (process; SIGKILL still at the stop_timeout armed when the stop began).
    Otherwise the group may live on, and the stop goes on as it is."""
    if not v.rest_pending:
        return _same(v)
    if v.kill_mode is KillMode.MIXED:
        return Step(S.STOPPING, P.KILLED, (Signal("SIGKILL", to="rest"), ArmTimer("kill_timeout")))
    return Step(S.STOPPING, P.SIGNALLED, (Signal("stop_signal", cont=True, to="rest"),))


def _drain_cut(cause: Cause) -> Callable[[View], Step]:
    """A requirement or the group went down while draining: its requests must fail fast now."""
    return lambda v: _signalled(v, cause, cont=True, capture=False)


def _hung(v: View) -> Step:
    """Alive but failed (watchdog, liveness, readiness): stacks first (bounded), then the stop
    signal without SIGCONT: a stopped process stays stopped and is SIGKILLed at abort_timeout
    (stop_timeout unless the unit sets it)."""
    if v.capture:
        return Step(S.STOPPING, P.CAPTURING, (RecordFailure(), Publish(), Capture(), ArmTimer("capture_timeout")),
                    Cause.FAILURE)
    return _signalled(v, Cause.FAILURE, cont=False, capture=False, first=(RecordFailure(), Publish()), whole=True,
                      timer="abort_timeout")


def _captured(v: View) -> Step:
    """A failed unit is signalled whole whatever its kill_mode: the part that hangs may be any."""
    return _signalled(v, Cause.FAILURE, cont=False, capture=False, whole=True, timer="abort_timeout")


def _broken(v: View) -> Step:
    """A faulty GPU, or a bug in a handler working for the unit: stop it, no stacks wanted."""
    return _signalled(v, Cause.FAILURE, cont=False, capture=False, first=(RecordFailure(), Publish()), whole=True)


def _ended(v: View) -> Step:
    """Nothing of the unit runs any more (or what does is unkillable): inactive, or failed. The
    stop's timers end here, with the position: the exit is the exit. A planned stop then waits,
    as its own step, for what the processes held and left: the stop summary says when the GPU
    memory was freed and what the removal of their leftovers took (never an escalation). A
    failure is published at once; its leftovers go in a task (Release)."""
    if v.cause is Cause.FAILURE:
        if v.gpu:  # `failed` is published first; a restart waits for the GPU's memory
            return Step(S.FAILED, P.RELEASING, (Release(), DecideRestart(), Publish(), WaitRelease()))
        return Step(S.FAILED, P.IDLE, (Release(), DecideRestart(), Publish()))
    if v.gpu or v.cleanup:
        return Step(S.STOPPING, P.RELEASING, (WaitRelease(),))
    return Step(S.INACTIVE, P.IDLE, (Release(), Publish()))


def _exited(v: View) -> Step:
    """The main process exited while nobody asked: `failed` once the kernel proves the unit
    empty. The failure is recorded and published now (`stopping`); what outlived the main
    process gets stop_signal + SIGCONT and leftover_timeout (a resource tracker unlinks what
    it registered; the timer feeds STOP_TIMEOUT -> SIGKILL), or with leftover_timeout = 0 is
    SIGKILLed at once. A half-dead unit never lingers past that bound."""
    if v.leftovers and v.leftover_grace:
        return Step(S.STOPPING, P.SIGNALLED, (RecordFailure(), Publish(), Signal("stop_signal", cont=True),
                                             ArmTimer("leftover_timeout"), WatchGone()), Cause.FAILURE)
    if v.leftovers:
        return Step(S.STOPPING, P.KILLED, (RecordFailure(), Publish(), Signal("SIGKILL"), ArmTimer("kill_timeout"),
                                           WatchGone()), Cause.FAILURE)
    end = _ended(View(v.name, v.state, v.phase, v.goal, Cause.FAILURE, gpu=v.gpu))
    return Step(end.state, end.phase, (RecordFailure(), *end.actions), Cause.FAILURE)


def _unkillable(v: View) -> Step:
    end = _ended(v)
    return Step(end.state, end.phase, (ReportUnkillable(), *end.actions))


def _escalate(v: View) -> Step:
    """stop_timeout passed: SIGKILL (cgroup.kill); WatchGone goes on watching."""
    return Step(S.STOPPING, P.KILLED, (Signal("SIGKILL"), ArmTimer("kill_timeout")))


def _kill_rest(v: View) -> Step:
    """The main process died while its stacks were captured, or a handler broke mid-stop."""
    return Step(S.STOPPING, P.KILLED, (Signal("SIGKILL"), ArmTimer("kill_timeout"), WatchGone()))


def _kill_after_bug(v: View) -> Step:
    return Step(S.STOPPING, P.KILLED, (RecordFailure(), Signal("SIGKILL"), ArmTimer("kill_timeout"), WatchGone()),
                Cause.FAILURE)


def _bug_in_spawn(v: View) -> Step:
    """The spawn action crashed: before the child existed (nothing runs: failed at once), or
    after it was adopted (it is killed first, then the unit is failed)."""
    if v.running:
        return _kill_after_bug(v)
    return _SPAWN_FAILED


def _bug_in_kill(v: View) -> Step:
    """The kill path itself broke (SIGKILL was sent when this position was entered): give up
    loudly, naming what survives, and end `failed` whatever the stop's cause was."""
    end = _unkillable(View(v.name, v.state, v.phase, v.goal, Cause.FAILURE, gpu=v.gpu))
    return Step(end.state, end.phase, (RecordFailure(), *end.actions), Cause.FAILURE)


def _fenced(v: View) -> Step:
    """This host is cut off from its group across hosts (omnid.cluster): its members must be gone
    before its etcd lease can expire, so no stop signal and no grace: SIGKILL now."""
    return Step(S.STOPPING, P.KILLED, (Publish(), Signal("SIGKILL"), ArmTimer("kill_timeout"), WatchGone()), Cause.GROUP)


def _capture_beside(v: View) -> Step:
    return Step(v.state, v.phase, (Capture(feed=False),) if v.capture else ())


_SPAWN = Step(S.INACTIVE, P.SPAWNING, (CountStart(), Spawn()))
_RESPAWN = Step(S.FAILED, P.SPAWNING, (CountStart(), Spawn()))
_STARTED = Step(S.STARTING, P.IDLE, (Publish(), ArmTimer("ready_timeout"), WatchReady()))
_SPAWN_FAILED = Step(S.FAILED, P.IDLE, (RecordFailure(), Release(), DecideRestart(), Publish()))
_DOWN = (E.STOP_REQUESTED, E.DEPENDENCY_DOWN, E.GROUP_DOWN, E.GROUP_FENCED)
# A bug where nothing runs (a Release or Publish of an end crashed, a GPU wait crashed):
# failed, naming it; the restart policy decides as for any failure.
_FAILED_BY_BUG = Step(S.FAILED, P.IDLE, (RecordFailure(), Release(), DecideRestart(), Publish()), Cause.FAILURE)
# Events grouped by what produces them, for the "ignore" lists below.
_STARTS = (E.START_REQUESTED, E.RESTART_DUE)  # converge: only inactive or failed units start
_SPAWN_ANSWERS = (E.SPAWNED, E.SPAWN_FAILED)  # the outcome of a spawn: only while one is out
_READINESS = (E.READY, E.NOT_READY)  # the readiness check and ready_timeout: only in starting
_MONITORS = (E.WATCHDOG_EXPIRED, E.LIVENESS_FAILED)  # only in active

Cell = Step | Callable[[View], Step]


def _rows() -> dict[tuple[UnitState, Phase, Event], Cell]:
    t: dict[tuple[UnitState, Phase, Event], Cell] = {}

    def ignore(state: UnitState, phase: Phase, *events: Event) -> None:
        for ev in events:
            t[(state, phase, ev)] = _same

    # inactive: nothing runs
    t[(S.INACTIVE, P.IDLE, E.START_REQUESTED)] = _SPAWN
    ignore(S.INACTIVE, P.IDLE, *_DOWN)
    # a spawn is at the spawner: it cannot be taken back; converge stops the unit once spawned
    for st in (S.INACTIVE, S.FAILED):
        t[(st, P.SPAWNING, E.SPAWNED)] = _STARTED
        t[(st, P.SPAWNING, E.SPAWN_FAILED)] = _SPAWN_FAILED
        ignore(st, P.SPAWNING, *_DOWN)
    # starting: the process lives, readiness pending
    t[(S.STARTING, P.IDLE, E.READY)] = Step(S.ACTIVE, P.IDLE, (Publish(), StartMonitors()))
    t[(S.STARTING, P.IDLE, E.NOT_READY)] = _hung
    # starting and active alike
    for st in (S.STARTING, S.ACTIVE):
        t[(st, P.IDLE, E.EXITED)] = _exited
        t[(st, P.IDLE, E.STOP_REQUESTED)] = _stop(None)
        t[(st, P.IDLE, E.DEPENDENCY_DOWN)] = _stop(Cause.REQUIREMENT)
        t[(st, P.IDLE, E.GROUP_DOWN)] = _stop(Cause.GROUP)
        t[(st, P.IDLE, E.GROUP_FENCED)] = _fenced
        t[(st, P.IDLE, E.GPU_FAULT)] = _broken
        t[(st, P.IDLE, E.INTERNAL_ERROR)] = _broken
    t[(S.ACTIVE, P.IDLE, E.WATCHDOG_EXPIRED)] = _hung
    t[(S.ACTIVE, P.IDLE, E.LIVENESS_FAILED)] = _hung
    # stopping, capturing the stacks of a hung unit (bounded by capture_timeout)
    t[(S.STOPPING, P.CAPTURING, E.CAPTURED)] = _captured
    t[(S.STOPPING, P.CAPTURING, E.EXITED)] = _kill_rest
    t[(S.STOPPING, P.CAPTURING, E.INTERNAL_ERROR)] = _kill_after_bug
    ignore(S.STOPPING, P.CAPTURING, *_DOWN, E.GPU_FAULT)
    t[(S.STOPPING, P.CAPTURING, E.GROUP_FENCED)] = _kill_rest  # no time left for stacks
    # stopping, draining (a planned stop of a serving unit)
    t[(S.STOPPING, P.DRAINING, E.DRAINED)] = _drained
    t[(S.STOPPING, P.DRAINING, E.EXITED)] = _drained_exited
    t[(S.STOPPING, P.DRAINING, E.DEPENDENCY_DOWN)] = _drain_cut(Cause.REQUIREMENT)
    t[(S.STOPPING, P.DRAINING, E.GROUP_DOWN)] = _drain_cut(Cause.GROUP)
    t[(S.STOPPING, P.DRAINING, E.GROUP_FENCED)] = _kill_rest
    t[(S.STOPPING, P.DRAINING, E.GPU_FAULT)] = _broken
    t[(S.STOPPING, P.DRAINING, E.INTERNAL_ERROR)] = _kill_after_bug
    ignore(S.STOPPING, P.DRAINING, E.STOP_REQUESTED)
    # stopping, signalled: gone, or SIGKILL at stop_timeout
    t[(S.STOPPING, P.SIGNALLED, E.GONE)] = _ended
    t[(S.STOPPING, P.SIGNALLED, E.STOP_TIMEOUT)] = _escalate
    t[(S.STOPPING, P.SIGNALLED, E.CAPTURE_DUE)] = _capture_beside
    t[(S.STOPPING, P.SIGNALLED, E.INTERNAL_ERROR)] = _kill_after_bug
    t[(S.STOPPING, P.SIGNALLED, E.EXITED)] = _main_exited  # the rest's turn (mixed / process), or nothing
    ignore(S.STOPPING, P.SIGNALLED, *_DOWN, E.GPU_FAULT)
    t[(S.STOPPING, P.SIGNALLED, E.GROUP_FENCED)] = _escalate  # a stop under way: SIGKILL now, not at stop_timeout
    # stopping, killed: gone, or unkillable at kill_timeout
    t[(S.STOPPING, P.KILLED, E.GONE)] = _ended
    t[(S.STOPPING, P.KILLED, E.KILL_TIMEOUT)] = _unkillable
    t[(S.STOPPING, P.KILLED, E.INTERNAL_ERROR)] = _bug_in_kill  # the kill path itself broke: give up, loudly
    ignore(S.STOPPING, P.KILLED, E.EXITED, *_DOWN, E.GPU_FAULT)
    # stopping, releasing: nothing runs; the stop summary waits for the GPU's memory and the
    # removal of what the processes left (each bounded, each on its own clock)
    t[(S.STOPPING, P.RELEASING, E.RELEASED)] = Step(S.INACTIVE, P.IDLE, (Release(), Publish()))
    t[(S.STOPPING, P.RELEASING, E.INTERNAL_ERROR)] = _FAILED_BY_BUG
    ignore(S.STOPPING, P.RELEASING, *_DOWN, E.GPU_FAULT)
    # failed: nothing runs; the restart policy or an operator starts it again
    t[(S.FAILED, P.IDLE, E.START_REQUESTED)] = _RESPAWN
    t[(S.FAILED, P.IDLE, E.RESTART_DUE)] = _RESPAWN
    t[(S.FAILED, P.IDLE, E.STOP_REQUESTED)] = Step(S.INACTIVE, P.IDLE, (Publish(),))  # an operator's stop clears it
    ignore(S.FAILED, P.IDLE, E.DEPENDENCY_DOWN, E.GROUP_DOWN, E.GROUP_FENCED)
    # failed, releasing: `failed` is published; no restart until the GPU's memory is freed
    t[(S.FAILED, P.RELEASING, E.RELEASED)] = Step(S.FAILED, P.IDLE)
    t[(S.FAILED, P.RELEASING, E.INTERNAL_ERROR)] = Step(S.FAILED, P.IDLE, (Publish(),))
    ignore(S.FAILED, P.RELEASING, *_DOWN)

    # ---- INTERNAL_ERROR where nothing had a way out before (FM-33)
    t[(S.INACTIVE, P.IDLE, E.INTERNAL_ERROR)] = _FAILED_BY_BUG
    t[(S.INACTIVE, P.SPAWNING, E.INTERNAL_ERROR)] = _bug_in_spawn
    t[(S.FAILED, P.SPAWNING, E.INTERNAL_ERROR)] = _bug_in_spawn
    t[(S.FAILED, P.IDLE, E.INTERNAL_ERROR)] = Step(S.FAILED, P.IDLE, (Publish(),))  # the reason names it

    # ---- what means nothing where it arrives: explicit, never a hole. The outcome of work
    # of an older position is void (timers and tasks are scoped to the position they were
    # started in, and cancelled when it is left); a converge event for a unit that is not in a
    # position to act on it is answered by the next converge; a death (EXITED) while a stop
    # is under way is waited for by WatchGone, which proves the whole unit gone.
    def nothing(state: UnitState, phase: Phase, *events: Event) -> None:
        for ev in events:
            if (state, phase, ev) in t:
                raise AssertionError(f"{state.value}/{phase.value} {ev.value}: listed as ignored and handled")
            t[(state, phase, ev)] = _same

    nothing(S.INACTIVE, P.IDLE, E.RESTART_DUE, *_SPAWN_ANSWERS, *_READINESS, E.EXITED, *_MONITORS, E.GPU_FAULT,
            E.CAPTURE_DUE, E.CAPTURED, E.DRAINED, E.STOP_TIMEOUT, E.KILL_TIMEOUT, E.GONE, E.RELEASED)
    for st in (S.INACTIVE, S.FAILED):
        # a stop of a unit whose spawn is out: its answer comes within the spawn's bound, and
        # the converge after SPAWNED stops the unit at once (a spawn cannot be taken back)
        nothing(st, P.SPAWNING, *_STARTS, *_READINESS, E.EXITED, *_MONITORS, E.GPU_FAULT, E.CAPTURE_DUE,
                E.CAPTURED, E.DRAINED, E.STOP_TIMEOUT, E.KILL_TIMEOUT, E.GONE, E.RELEASED)
    nothing(S.STARTING, P.IDLE, *_STARTS, *_SPAWN_ANSWERS, *_MONITORS, E.CAPTURE_DUE, E.CAPTURED, E.DRAINED,
            E.STOP_TIMEOUT, E.KILL_TIMEOUT, E.GONE, E.RELEASED)
    nothing(S.ACTIVE, P.IDLE, *_STARTS, *_SPAWN_ANSWERS, *_READINESS, E.CAPTURE_DUE, E.CAPTURED, E.DRAINED,
            E.STOP_TIMEOUT, E.KILL_TIMEOUT, E.GONE, E.RELEASED)
    nothing(S.STOPPING, P.CAPTURING, *_STARTS, *_SPAWN_ANSWERS, *_READINESS, *_MONITORS, E.CAPTURE_DUE,
            E.DRAINED, E.STOP_TIMEOUT, E.KILL_TIMEOUT, E.GONE, E.RELEASED)
    nothing(S.STOPPING, P.DRAINING, *_STARTS, *_SPAWN_ANSWERS, *_READINESS, *_MONITORS, E.CAPTURE_DUE,
            E.CAPTURED, E.STOP_TIMEOUT, E.KILL_TIMEOUT, E.GONE, E.RELEASED)
    nothing(S.STOPPING, P.SIGNALLED, *_STARTS, *_SPAWN_ANSWERS, *_READINESS, *_MONITORS, E.CAPTURED, E.DRAINED,
            E.KILL_TIMEOUT, E.RELEASED)
    nothing(S.STOPPING, P.KILLED, *_STARTS, *_SPAWN_ANSWERS, *_READINESS, *_MONITORS, E.CAPTURE_DUE, E.CAPTURED,
            E.DRAINED, E.STOP_TIMEOUT, E.RELEASED)
    nothing(S.STOPPING, P.RELEASING, *_STARTS, *_SPAWN_ANSWERS, *_READINESS, E.EXITED, *_MONITORS,
            E.CAPTURE_DUE, E.CAPTURED, E.DRAINED, E.STOP_TIMEOUT, E.KILL_TIMEOUT, E.GONE)
    nothing(S.FAILED, P.IDLE, *_SPAWN_ANSWERS, *_READINESS, E.EXITED, *_MONITORS, E.GPU_FAULT, E.CAPTURE_DUE,
            E.CAPTURED, E.DRAINED, E.STOP_TIMEOUT, E.KILL_TIMEOUT, E.GONE, E.RELEASED)
    nothing(S.FAILED, P.RELEASING, *_STARTS, *_SPAWN_ANSWERS, *_READINESS, E.EXITED, *_MONITORS, E.GPU_FAULT,
            E.CAPTURE_DUE, E.CAPTURED, E.DRAINED, E.STOP_TIMEOUT, E.KILL_TIMEOUT, E.GONE)
    return t


TABLE: dict[tuple[UnitState, Phase, Event], Cell] = _rows()
POSITIONS: tuple[tuple[UnitState, Phase], ...] = tuple(dict.fromkeys((s, p) for s, p, _e in TABLE))
IGNORED: frozenset[tuple[UnitState, Phase, Event]] = frozenset(k for k, c in TABLE.items() if c is _same)


def step(view: View, event: Event) -> Step:
    """The next position of one unit and what to do about it. Pure."""
    cell = TABLE.get((view.state, view.phase, event))
    if cell is None:
        raise IllegalEvent(view.name, view.state, view.phase, event)
    return cell if isinstance(cell, Step) else cell(view)


def _views(state: UnitState, phase: Phase) -> list[View]:
    """Every View that can change a cell's answer, for the derived tables below. The kill-mode
    flags are varied against what the cells that read them also read (cause, leftovers, gpu):
    their full product with every other flag would make this ten times slower for nothing."""
    out = []
    for cause in (None, *Cause):
        for flags in range(16):
            kw: dict[str, Any] = dict(leftovers=bool(flags & 1), gpu=bool(flags & 2), capture=bool(flags & 4),
                                      drain=bool(flags & 8))
            out.append(View("?", state, phase, cause=cause, **kw))
            out.append(View("?", state, phase, cause=cause, shutting_down=True, **kw))
        for mode in KillMode:
            for flags in range(16):
                out.append(View("?", state, phase, cause=cause, leftovers=bool(flags & 1), gpu=bool(flags & 2),
                                kill_mode=mode, rest_pending=bool(flags & 4), leftover_grace=bool(flags & 8)))
    return out


def _outcomes(state: UnitState, phase: Phase, event: Event) -> set[UnitState]:
    """Every state a cell can lead to (a fixed Step has one; a rule, one per View)."""
    cell = TABLE[(state, phase, event)]
    if isinstance(cell, Step):
        return {cell.state}
    return {cell(v).state for v in _views(state, phase)}


def _derive_legal() -> dict[UnitState, frozenset[UnitState]]:
    legal: dict[UnitState, set[UnitState]] = {s: set() for s in S}
    for (st, ph, ev) in TABLE:
        legal[st].update(new for new in _outcomes(st, ph, ev) if new is not st)
    legal[S.FAILED].add(S.FAILED)  # failed -> failed: an automatic restart whose spawn failed again
    return {s: frozenset(n) for s, n in legal.items()}


def __getattr__(name: str) -> Any:
    # LEGAL: the state changes the table allows, what the invariant check and the docs hold
    # it to. Derived on first use, not at import: the daemon imports this module before its
    # first spawn, and the derivation walks every View of every rule.
    if name == "LEGAL":
        value = globals()["LEGAL"] = _derive_legal()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def legal(state: UnitState, phase: Phase, event: Event) -> bool:
    return (state, phase, event) in TABLE


def diagram() -> list[str]:
    """Every state change the table allows, one line each: `from --event--> to`."""
    lines = []
    for st in S:
        for ev in E:
            outs: set[UnitState] = set()
            for ph in P:
                if (st, ph, ev) in TABLE:
                    outs.update(new for new in _outcomes(st, ph, ev) if new is not st)
            for new in sorted(outs, key=list(S).index):
                lines.append(f"{st.value:<9} --{ev.value}--> {new.value}")
    return lines
