"""The lifecycle of one unit as a table (after s6): a pure `step(view, event) ->
(new_state, actions)`. No I/O, no asyncio, no clock: the supervisor feeds in what
the kernel and the operator said (an `Event`), changes the unit's state to what
`step` returns, and carries out the `Action`s. `Supervisor._converge` stays the one
place that compares state with goal across units (it turns "goal inactive" or "a
requirement is down" into STOP_REQUESTED / DEPENDENCY_DOWN for one unit).

Every (state, event) pair is either in TABLE (legal) or answered with
`IllegalEvent` naming the unit, the state and the event; tests/test_lifecycle.py
walks all of them. `diagram()` renders the table for omnid.unit(5).

A future "group of units that fail together" (issue #11) needs no new row: the
supervisor turns one member's EXITED into DEPENDENCY_DOWN for its peers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from omnid.states import Goal, UnitState

S = UnitState


class Event(str, enum.Enum):
    START_REQUESTED = "start_requested"  # converge: goal active, requirements up
    RESTART_DUE = "restart_due"  # failed, restart policy says now
    SPAWNED = "spawned"  # the spawner answered with pid + pidfd
    SPAWN_FAILED = "spawn_failed"  # exec error, GPU held by a leftover
    READY = "ready"  # readiness check passed
    NOT_READY_IN_TIME = "not_ready_in_time"  # ready_timeout, or the readiness check failed
    EXITED = "exited"  # pidfd readable while nobody asked for it
    WATCHDOG_EXPIRED = "watchdog_expired"
    LIVENESS_FAILED = "liveness_failed"
    STOP_REQUESTED = "stop_requested"  # operator stop or stack shutdown
    DEPENDENCY_DOWN = "dependency_down"  # a required unit failed or stops
    DEPENDENCY_UP = "dependency_up"  # every required unit is active again
    STOP_TIMEOUT = "stop_timeout"  # stop_signal sent stop_timeout ago, still alive
    KILL_TIMEOUT = "kill_timeout"  # SIGKILL sent kill_timeout ago, still alive: unkillable
    GONE = "gone"  # main process reaped and nothing of the unit left
    INTERNAL_ERROR = "internal_error"  # an op of this unit crashed (a bug): fail it


# ------------------------------------------------------------------ actions
@dataclass(frozen=True)
class Spawn:
    pass


@dataclass(frozen=True)
class Signal:
    sig: str  # "stop_signal" (the unit's own) or a signal name: "SIGKILL"
    target: str = "group"  # "group": everything of the unit the kernel proves ours
    cont: bool = False  # SIGCONT after it, so a stopped process can act on it


@dataclass(frozen=True)
class ArmTimer:
    which: str  # "ready_timeout" | "stop_timeout" | "kill_timeout" | "watchdog" | "restart"


@dataclass(frozen=True)
class StartMonitors:
    pass


@dataclass(frozen=True)
class RecordFailure:
    pass


@dataclass(frozen=True)
class ReportUnkillable:
    pass


@dataclass(frozen=True)
class Release:
    """Close the pidfd and the output pipe: an inactive or failed unit holds no fd."""


@dataclass(frozen=True)
class Publish:
    pass


Action = Spawn | Signal | ArmTimer | StartMonitors | RecordFailure | ReportUnkillable | Release | Publish


@dataclass(frozen=True)
class UnitView:
    """What step needs to know of a unit besides its state."""

    name: str
    state: UnitState
    goal: Goal = Goal.ACTIVE
    failing: bool = False  # in STOPPING: the stop is the consequence of a failure
    leftovers: bool = False  # on EXITED: processes of the unit outlived the main one


class IllegalEvent(RuntimeError):
    def __init__(self, unit: str, state: UnitState, event: Event) -> None:
        super().__init__(f"{unit}: event {event.value} is illegal in state {state.value}")
        self.unit, self.state, self.event = unit, state, event


E = Event
_FAIL_ALIVE = (S.STOPPING, (RecordFailure(), Publish(), Signal("stop_signal"), ArmTimer("stop_timeout")))
_STOP = (S.STOPPING, (Publish(), Signal("stop_signal", cont=True), ArmTimer("stop_timeout")))

# (state, event) -> (new state, actions) for the rows that do not depend on the view.
TABLE: dict[tuple[UnitState, Event], tuple[UnitState, tuple]] = {
    (S.INACTIVE, E.START_REQUESTED): (S.INACTIVE, (Spawn(),)),
    (S.INACTIVE, E.SPAWNED): (S.STARTING, (Publish(), ArmTimer("ready_timeout"))),
    (S.INACTIVE, E.SPAWN_FAILED): (S.FAILED, (RecordFailure(), Release(), Publish(), ArmTimer("restart"))),
    (S.INACTIVE, E.STOP_REQUESTED): (S.INACTIVE, ()),
    (S.INACTIVE, E.DEPENDENCY_DOWN): (S.INACTIVE, ()),
    (S.INACTIVE, E.DEPENDENCY_UP): (S.INACTIVE, ()),
    (S.STARTING, E.READY): (S.ACTIVE, (Publish(), StartMonitors())),
    (S.STARTING, E.NOT_READY_IN_TIME): _FAIL_ALIVE,
    (S.STARTING, E.STOP_REQUESTED): _STOP,
    (S.STARTING, E.DEPENDENCY_DOWN): _STOP,
    (S.STARTING, E.DEPENDENCY_UP): (S.STARTING, ()),
    (S.STARTING, E.INTERNAL_ERROR): _FAIL_ALIVE,
    (S.ACTIVE, E.WATCHDOG_EXPIRED): _FAIL_ALIVE,
    (S.ACTIVE, E.LIVENESS_FAILED): _FAIL_ALIVE,
    (S.ACTIVE, E.STOP_REQUESTED): _STOP,
    (S.ACTIVE, E.DEPENDENCY_DOWN): _STOP,
    (S.ACTIVE, E.DEPENDENCY_UP): (S.ACTIVE, ()),
    (S.ACTIVE, E.INTERNAL_ERROR): _FAIL_ALIVE,
    (S.STOPPING, E.EXITED): (S.STOPPING, ()),  # the stop waits for the group as well
    (S.STOPPING, E.STOP_REQUESTED): (S.STOPPING, ()),
    (S.STOPPING, E.DEPENDENCY_DOWN): (S.STOPPING, ()),
    (S.STOPPING, E.DEPENDENCY_UP): (S.STOPPING, ()),
    (S.STOPPING, E.STOP_TIMEOUT): (S.STOPPING, (Signal("SIGKILL"), ArmTimer("kill_timeout"))),
    (S.STOPPING, E.INTERNAL_ERROR): (S.STOPPING, (RecordFailure(), Signal("SIGKILL"), ArmTimer("kill_timeout"))),
    (S.FAILED, E.START_REQUESTED): (S.FAILED, (Spawn(),)),
    (S.FAILED, E.RESTART_DUE): (S.FAILED, (Spawn(),)),
    (S.FAILED, E.SPAWNED): (S.STARTING, (Publish(), ArmTimer("ready_timeout"))),
    (S.FAILED, E.SPAWN_FAILED): (S.FAILED, (RecordFailure(), Release(), Publish(), ArmTimer("restart"))),
    (S.FAILED, E.STOP_REQUESTED): (S.INACTIVE, (Release(), Publish())),  # an operator's stop clears a failure
    (S.FAILED, E.DEPENDENCY_DOWN): (S.FAILED, ()),
    (S.FAILED, E.DEPENDENCY_UP): (S.FAILED, ()),
}


def step(view: UnitView, event: Event) -> tuple[UnitState, tuple]:
    """The next state of one unit and what to do about it. Pure."""
    st = view.state
    if event is E.EXITED and st in (S.STARTING, S.ACTIVE):
        if view.leftovers:  # a half-dead unit never lingers: SIGKILL the rest now
            return S.STOPPING, (RecordFailure(), Publish(), Signal("SIGKILL"), ArmTimer("kill_timeout"))
        return S.FAILED, (RecordFailure(), Release(), Publish(), ArmTimer("restart"))
    if event in (E.GONE, E.KILL_TIMEOUT) and st is S.STOPPING:
        report = (ReportUnkillable(),) if event is E.KILL_TIMEOUT else ()
        if view.failing:
            return S.FAILED, (*report, Release(), Publish(), ArmTimer("restart"))
        return S.INACTIVE, (*report, Release(), Publish())
    try:
        return TABLE[(st, event)]
    except KeyError:
        raise IllegalEvent(view.name, st, event) from None


def legal(state: UnitState, event: Event) -> bool:
    try:
        step(UnitView("?", state), event)
        return True
    except IllegalEvent:
        return False


def diagram() -> list[str]:
    """Every state change the table allows, one line each: `from --event--> to`."""
    lines = []
    for st in S:
        for ev in E:
            outs = set()
            for failing in (False, True):
                for leftovers in (False, True):
                    try:
                        new, _ = step(UnitView("?", st, failing=failing, leftovers=leftovers), ev)
                    except IllegalEvent:
                        continue
                    if new is not st:
                        outs.add(new)
            for new in sorted(outs, key=list(S).index):
                lines.append(f"{st.value:<9} --{ev.value}--> {new.value}")
    return lines
