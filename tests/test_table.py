"""The lifecycle table (omnid.core.lifecycle), pair by pair.

Every (state, phase, event) either has a cell or is answered with IllegalEvent; every
action a cell yields has a handler in the executor; every outcome event those handlers
can feed back lands on a legal cell of the position the unit is in by then; every event
is fed somewhere in omnid and every position can be left. The rows that carry the
matrix's promises are spelled out below as expected answers."""

from __future__ import annotations

import ast
import inspect
import itertools
import re
from pathlib import Path

import pytest

from omnid.core import lifecycle as lc
from omnid.unitmodel import KillMode
from omnid.core.lifecycle import (ACTION_TYPES, ArmTimer, Capture, Cause, CountStart, DecideRestart, Drain, Event,
                                  IllegalEvent, Phase, Publish, RecordFailure, Release, ReportUnkillable, Signal,
                                  Spawn, StartMonitors, Step, UnitState, View, WaitRelease, WatchGone, WatchReady,
                                  step)

S, P, E = UnitState, Phase, Event
REPO = Path(__file__).resolve().parent.parent
ALL_PAIRS = [(s, p, e) for s in S for p in P for e in E]

# The events each action can feed back (the executor's and monitors' outcomes).
OUTCOMES: dict[type, tuple[Event, ...]] = {
    CountStart: (), Spawn: (E.SPAWNED, E.SPAWN_FAILED), Signal: (), WatchGone: (E.GONE,),
    WatchReady: (E.READY, E.NOT_READY), StartMonitors: (E.WATCHDOG_EXPIRED, E.LIVENESS_FAILED),
    Capture: (E.CAPTURED,), Drain: (E.DRAINED,), RecordFailure: (), DecideRestart: (), ReportUnkillable: (),
    WaitRelease: (E.RELEASED,), Release: (), Publish: (),
}
TIMER_OUTCOMES = {"ready_timeout": E.NOT_READY, "stop_timeout": E.STOP_TIMEOUT, "kill_timeout": E.KILL_TIMEOUT,
                  "capture_timeout": E.CAPTURED, "capture_due": E.CAPTURE_DUE, "drain_timeout": E.DRAINED,
                  "leftover_timeout": E.STOP_TIMEOUT}


def views(state: UnitState, phase: Phase) -> list[View]:
    """Every combination of the View's flags (and stop causes) for one position."""
    out = []
    for cause, bits, down in itertools.product((None, *Cause), range(16), (False, True)):
        out.append(View("worker@1", state, phase, cause=cause, leftovers=bool(bits & 1), gpu=bool(bits & 2),
                        capture=bool(bits & 4), drain=bool(bits & 8), shutting_down=down))
    # The kill-mode flags, against the flags the cells that read them read too.
    for cause, mode, bits in itertools.product((None, *Cause), KillMode, range(32)):
        out.append(View("worker@1", state, phase, cause=cause, leftovers=bool(bits & 1), gpu=bool(bits & 2),
                        drain=bool(bits & 16), kill_mode=mode, rest_pending=bool(bits & 4),
                        leftover_grace=bool(bits & 8)))
    return out


def outcomes(action) -> tuple[Event, ...]:
    if isinstance(action, ArmTimer):
        return (TIMER_OUTCOMES[action.which],)
    if isinstance(action, Capture) and not action.feed:
        return ()
    return OUTCOMES[type(action)]


@pytest.mark.parametrize("state,phase,event", ALL_PAIRS, ids=lambda v: v.value)
def test_every_pair_is_a_cell_or_named_illegal(state, phase, event):
    v = View("worker@1", state, phase)
    if (state, phase, event) not in lc.TABLE:
        with pytest.raises(IllegalEvent) as err:
            step(v, event)
        where = state.value if phase is P.IDLE else f"{state.value}/{phase.value}"
        assert str(err.value) == f"worker@1: event {event.value} is illegal in state {where}"
        return
    for view in views(state, phase):
        got = step(view, event)
        assert isinstance(got, Step)
        assert (got.state, got.phase) in lc.POSITIONS, (state, phase, event, got)
        assert got.state is state or got.state in lc.LEGAL[state]
        for action in got.actions:
            assert type(action) in ACTION_TYPES, action
        # Every outcome an action can feed back is legal where the unit is then, or the
        # outcome is void by then (position-scoped work is cancelled when it moves on).
        for action in got.actions:
            for ev in outcomes(action):
                assert (got.state, got.phase, ev) in lc.TABLE, \
                    f"{state.value}/{phase.value} --{event.value}--> {got.state.value}/{got.phase.value} " \
                    f"runs {action} whose outcome {ev.value} is illegal there"


def test_every_position_can_be_left_and_waits_only_on_what_it_started():
    """A position reached with pending work has a cell for each outcome of that work: no unit
    can be stranded (the FM-22 storm found one stuck in `starting` before this was a table)."""
    for (state, phase) in lc.POSITIONS:
        if state is S.INACTIVE and phase is P.IDLE:
            continue
        exits = [e for e in E if (state, phase, e) in lc.TABLE
                 and any((step(v, e).state, step(v, e).phase) != (state, phase) for v in views(state, phase))]
        assert exits, f"{state.value}/{phase.value} can never be left"


def test_every_action_type_has_exactly_one_handler_in_the_executor():
    from omnid.core.executor import Executor

    src = inspect.getsource(Executor.__init__)
    handled = set(re.findall(r"\b([A-Z][A-Za-z]+): self\._", src))
    assert handled == {t.__name__ for t in ACTION_TYPES}, handled ^ {t.__name__ for t in ACTION_TYPES}


def test_every_event_is_fed_somewhere_in_omnid():
    """An event nothing feeds is a row nobody can reach (4 of 16 were, before the executor)."""
    code = "\n".join(p.read_text() for p in (REPO / "omnid").rglob("*.py") if p.name != "lifecycle.py")
    converge = (REPO / "omnid" / "core" / "schedule.py").read_text()  # its answers are what converge feeds
    timers = set(TIMER_OUTCOMES.values())
    for ev in E:
        fed = (re.search(rf"feed\w*\([^)]*\bE(vent)?\.{ev.name}\b", code) or ev in timers
               or re.search(rf"\bE\.{ev.name}\b", converge))
        assert fed, f"nothing feeds {ev.name}"


def test_every_timer_the_table_arms_is_known_to_the_executor():
    from omnid.core.executor import TIMER_EVENTS

    assert TIMER_EVENTS == TIMER_OUTCOMES
    armed = {a.which for (s, p, e) in lc.TABLE for v in views(s, p) for a in step(v, e).actions
             if isinstance(a, ArmTimer)}
    assert armed == set(TIMER_EVENTS), armed ^ set(TIMER_EVENTS)


# ------------------------------------------------------------ the rows behind the matrix
def one(state, phase, event, **flags) -> Step:
    return step(View("worker@1", state, phase, **flags), event)


def test_a_start_stays_inactive_until_the_process_exists():
    assert one(S.INACTIVE, P.IDLE, E.START_REQUESTED) == Step(S.INACTIVE, P.SPAWNING, (CountStart(), Spawn()))
    assert one(S.INACTIVE, P.SPAWNING, E.SPAWNED) == Step(S.STARTING, P.IDLE, (Publish(), ArmTimer("ready_timeout"),
                                                                             WatchReady()))
    assert one(S.FAILED, P.SPAWNING, E.SPAWN_FAILED) == Step(S.FAILED, P.IDLE, (RecordFailure(), Release(),
                                                                               DecideRestart(), Publish()))
    # a stop cannot take a spawn back: converge stops the unit once it exists
    assert one(S.INACTIVE, P.SPAWNING, E.STOP_REQUESTED) == Step(S.INACTIVE, P.SPAWNING)


def test_a_death_is_failed_only_once_the_kernel_proves_the_unit_empty():
    died = one(S.ACTIVE, P.IDLE, E.EXITED)
    assert died == Step(S.FAILED, P.IDLE, (RecordFailure(), Release(), DecideRestart(), Publish()), Cause.FAILURE)
    half = one(S.ACTIVE, P.IDLE, E.EXITED, leftovers=True)
    assert half == Step(S.STOPPING, P.KILLED, (RecordFailure(), Publish(), Signal("SIGKILL"), ArmTimer("kill_timeout"),
                                              WatchGone()), Cause.FAILURE)
    assert one(S.STOPPING, P.KILLED, E.GONE, cause=Cause.FAILURE).state is S.FAILED
    # on a GPU host `failed` is published first, and the restart waits for the memory
    gpu = one(S.ACTIVE, P.IDLE, E.EXITED, gpu=True)
    assert (gpu.state, gpu.phase) == (S.FAILED, P.RELEASING) and gpu.actions[-1] == WaitRelease()
    assert one(S.FAILED, P.RELEASING, E.RELEASED) == Step(S.FAILED, P.IDLE)


def test_leftovers_of_a_dead_main_get_the_stop_signal_and_leftover_timeout_before_sigkill():
    """issue 25: the failure is recorded and published at once (`stopping`); the leftovers get
    stop_signal + SIGCONT, and SIGKILL when leftover_timeout feeds STOP_TIMEOUT."""
    graced = one(S.ACTIVE, P.IDLE, E.EXITED, leftovers=True, leftover_grace=True)
    assert graced == Step(S.STOPPING, P.SIGNALLED, (RecordFailure(), Publish(), Signal("stop_signal", cont=True),
                                                   ArmTimer("leftover_timeout"), WatchGone()), Cause.FAILURE)
    # whatever the kill_mode: the main process is gone, everything left is signalled
    assert one(S.STARTING, P.IDLE, E.EXITED, leftovers=True, leftover_grace=True,
               kill_mode=KillMode.MIXED).actions[2] == Signal("stop_signal", cont=True)
    assert one(S.STOPPING, P.SIGNALLED, E.STOP_TIMEOUT, cause=Cause.FAILURE) == Step(
        S.STOPPING, P.KILLED, (Signal("SIGKILL"), ArmTimer("kill_timeout")))
    assert one(S.STOPPING, P.SIGNALLED, E.GONE, cause=Cause.FAILURE).state is S.FAILED
    assert one(S.STOPPING, P.SIGNALLED, E.GROUP_FENCED, cause=Cause.FAILURE).phase is P.KILLED  # no grace left
    # no leftovers: no grace to give; leftover_timeout = 0: SIGKILL at once, as before
    assert one(S.ACTIVE, P.IDLE, E.EXITED, leftover_grace=True).state is S.FAILED
    assert one(S.ACTIVE, P.IDLE, E.EXITED, leftovers=True).actions[2] == Signal("SIGKILL")


def test_kill_mode_mixed_and_process_signal_the_main_process_first_then_the_rest_on_its_exit():
    for mode in (KillMode.MIXED, KillMode.PROCESS):
        stop = one(S.ACTIVE, P.IDLE, E.STOP_REQUESTED, kill_mode=mode)
        assert stop == Step(S.STOPPING, P.SIGNALLED, (Publish(), Signal("stop_signal", cont=True, to="main"),
                                                     ArmTimer("stop_timeout"), WatchGone()), Cause.REQUEST)
        for ev in (E.DEPENDENCY_DOWN, E.GROUP_DOWN):
            assert Signal("stop_signal", cont=True, to="main") in one(S.ACTIVE, P.IDLE, ev, kill_mode=mode).actions
        assert one(S.STOPPING, P.DRAINING, E.DRAINED, cause=Cause.REQUEST, kill_mode=mode).actions[0] == \
            Signal("stop_signal", cont=True, to="main")
        # stop_timeout: everything gets SIGKILL, whatever the mode
        assert one(S.STOPPING, P.SIGNALLED, E.STOP_TIMEOUT, kill_mode=mode, rest_pending=True).actions[0] == \
            Signal("SIGKILL")
    # the main process exited: mixed SIGKILLs the rest (kill_timeout then bounds it) ...
    assert one(S.STOPPING, P.SIGNALLED, E.EXITED, kill_mode=KillMode.MIXED, rest_pending=True) == Step(
        S.STOPPING, P.KILLED, (Signal("SIGKILL", to="rest"), ArmTimer("kill_timeout")))
    # ... process gives it stop_signal, in the same position: the stop_timeout armed at the start still runs
    assert one(S.STOPPING, P.SIGNALLED, E.EXITED, kill_mode=KillMode.PROCESS, rest_pending=True) == Step(
        S.STOPPING, P.SIGNALLED, (Signal("stop_signal", cont=True, to="rest"),))
    # the rest dealt with (or everything signalled at once): its exit changes nothing
    for mode in KillMode:
        assert one(S.STOPPING, P.SIGNALLED, E.EXITED, kill_mode=mode) == Step(S.STOPPING, P.SIGNALLED)
    # a main process that drained and exited by itself: the rest's turn at once
    assert one(S.STOPPING, P.DRAINING, E.EXITED, cause=Cause.REQUEST, kill_mode=KillMode.MIXED) == Step(
        S.STOPPING, P.KILLED, (Signal("SIGKILL", to="rest"), ArmTimer("kill_timeout"), WatchGone()), Cause.REQUEST)
    assert one(S.STOPPING, P.DRAINING, E.EXITED, cause=Cause.REQUEST, kill_mode=KillMode.PROCESS).actions[0] == \
        Signal("stop_signal", cont=True, to="rest")
    assert one(S.STOPPING, P.DRAINING, E.EXITED, cause=Cause.REQUEST).actions[0] == Signal("stop_signal", cont=True)


def test_a_failed_unit_and_a_fenced_one_are_signalled_whole_whatever_the_kill_mode():
    for mode in KillMode:
        for ev, state in ((E.WATCHDOG_EXPIRED, S.ACTIVE), (E.LIVENESS_FAILED, S.ACTIVE), (E.NOT_READY, S.STARTING),
                          (E.GPU_FAULT, S.ACTIVE), (E.INTERNAL_ERROR, S.ACTIVE)):
            assert Signal("stop_signal", cont=False) in one(state, P.IDLE, ev, kill_mode=mode).actions, (mode, ev)
        assert one(S.STOPPING, P.CAPTURING, E.CAPTURED, cause=Cause.FAILURE, kill_mode=mode).actions[0] == \
            Signal("stop_signal", cont=False)
        assert Signal("SIGKILL") in one(S.ACTIVE, P.IDLE, E.GROUP_FENCED, kill_mode=mode).actions


def test_an_operator_stop_sends_the_stop_signal_with_sigcont_and_escalates_at_stop_timeout():
    stop = one(S.ACTIVE, P.IDLE, E.STOP_REQUESTED)
    assert stop == Step(S.STOPPING, P.SIGNALLED, (Publish(), Signal("stop_signal", cont=True),
                                                 ArmTimer("stop_timeout"), WatchGone()), Cause.REQUEST)
    assert one(S.ACTIVE, P.IDLE, E.STOP_REQUESTED, shutting_down=True).cause is Cause.SHUTDOWN
    assert one(S.STOPPING, P.SIGNALLED, E.STOP_TIMEOUT) == Step(S.STOPPING, P.KILLED, (Signal("SIGKILL"),
                                                                                     ArmTimer("kill_timeout")))
    assert one(S.STOPPING, P.SIGNALLED, E.GONE, cause=Cause.REQUEST) == Step(S.INACTIVE, P.IDLE, (Release(),
                                                                                                Publish()))
    unk = one(S.STOPPING, P.KILLED, E.KILL_TIMEOUT, cause=Cause.REQUEST)
    assert unk == Step(S.INACTIVE, P.IDLE, (ReportUnkillable(), Release(), Publish()))


def test_dependency_and_group_stops_carry_their_cause_and_never_drain():
    for ev, cause in ((E.DEPENDENCY_DOWN, Cause.REQUIREMENT), (E.GROUP_DOWN, Cause.GROUP)):
        got = one(S.ACTIVE, P.IDLE, ev, drain=True)
        assert (got.state, got.phase, got.cause) == (S.STOPPING, P.SIGNALLED, cause)


def test_a_planned_stop_of_a_serving_unit_drains_first_and_a_failure_elsewhere_cuts_the_drain():
    got = one(S.ACTIVE, P.IDLE, E.STOP_REQUESTED, drain=True)
    assert got == Step(S.STOPPING, P.DRAINING, (Publish(), Drain(), ArmTimer("drain_timeout")), Cause.REQUEST)
    assert one(S.STARTING, P.IDLE, E.STOP_REQUESTED, drain=True).phase is P.SIGNALLED  # not serving yet
    assert one(S.STOPPING, P.DRAINING, E.DRAINED, cause=Cause.REQUEST).phase is P.SIGNALLED
    cut = one(S.STOPPING, P.DRAINING, E.DEPENDENCY_DOWN, cause=Cause.REQUEST)
    assert (cut.phase, cut.cause) == (P.SIGNALLED, Cause.REQUIREMENT)


def test_a_hung_unit_gets_its_stacks_captured_then_the_stop_signal_without_sigcont():
    for ev, state in ((E.WATCHDOG_EXPIRED, S.ACTIVE), (E.LIVENESS_FAILED, S.ACTIVE), (E.NOT_READY, S.STARTING)):
        got = one(state, P.IDLE, ev, capture=True)
        assert got == Step(S.STOPPING, P.CAPTURING, (RecordFailure(), Publish(), Capture(),
                                                    ArmTimer("capture_timeout")), Cause.FAILURE)
        no_capture = one(state, P.IDLE, ev)
        assert Signal("stop_signal", cont=False) in no_capture.actions
    after = one(S.STOPPING, P.CAPTURING, E.CAPTURED, cause=Cause.FAILURE, capture=True)
    assert after.actions[0] == Signal("stop_signal", cont=False) and ArmTimer("capture_due") not in after.actions
    # an operator's stop of a stubborn unit takes the stacks before stop_timeout, beside the stop
    stop = one(S.ACTIVE, P.IDLE, E.STOP_REQUESTED, capture=True)
    assert ArmTimer("capture_due") in stop.actions
    assert one(S.STOPPING, P.SIGNALLED, E.CAPTURE_DUE, capture=True).actions == (Capture(feed=False),)


def test_an_operator_stop_clears_a_failure():
    assert one(S.FAILED, P.IDLE, E.STOP_REQUESTED) == Step(S.INACTIVE, P.IDLE, (Publish(),))


def test_legal_state_changes_are_derived_from_the_table():
    assert lc.LEGAL == {
        S.INACTIVE: {S.STARTING, S.FAILED},
        S.STARTING: {S.ACTIVE, S.STOPPING, S.FAILED},
        S.ACTIVE: {S.STOPPING, S.FAILED},
        S.STOPPING: {S.INACTIVE, S.FAILED},
        S.FAILED: {S.STARTING, S.INACTIVE, S.FAILED},
    }


def test_step_is_pure_no_io_no_asyncio():
    tree = ast.parse(inspect.getsource(lc))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module.split(".")[0] for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"asyncio", "os", "socket", "subprocess", "time", "signal", "select"}, imported


def test_the_man_page_and_the_architecture_page_show_the_diagram_generated_from_the_table():
    man = (REPO / "man" / "omnid.unit.5").read_text()
    block = man.split(".SS Lifecycle", 1)[1].split(".nf\n", 1)[1].split("\n.fi", 1)[0]
    assert block.splitlines() == lc.diagram()
    arch = (REPO / "ARCHITECTURE.md").read_text()
    block = arch.split("<!-- lifecycle diagram: generated -->", 1)[1].split("```\n", 1)[1].split("\n```", 1)[0]
    assert block.splitlines() == lc.diagram()


# ------------------------------------------------------------ events in, actions out (the supervisor's feed)
def test_feed_moves_the_unit_keeps_its_cause_and_reason_and_hands_every_action_to_the_executor(tmp_path):
    """No process: the executor is replaced by a recorder, so this checks `feed` alone --
    the position, the epoch that voids older timers, the stop cause and the reason."""
    import asyncio

    from omnid.core.supervisor import Supervisor
    from omnid.units import load_stack
    from tests.harness import make_stack

    async def main() -> None:
        stack = load_stack(make_stack({"a": 'exec = ["sleep", "1"]\nrestart = "on-failure"\n'}))
        sup = Supervisor(stack, spawner=None, token="t" * 16)  # type: ignore[arg-type]
        ran: list[tuple[str, tuple]] = []
        sup.executor.run = lambda rt, actions, ctx: ran.append((ctx.event.value, actions))  # type: ignore[method-assign]
        sup.kick = lambda: None  # type: ignore[method-assign]
        rt = sup.units["a"]
        sup.feed(rt, E.START_REQUESTED)
        assert (rt.state, rt.phase, rt.epoch) == (S.INACTIVE, P.SPAWNING, 1)
        assert ran[-1] == ("start_requested", (CountStart(), Spawn()))
        sup.feed(rt, E.SPAWNED, "starting")
        assert (rt.state, rt.phase, rt.reason) == (S.STARTING, P.IDLE, "starting")
        sup.feed(rt, E.READY, "started")
        assert rt.state is S.ACTIVE and ran[-1][1] == (Publish(), StartMonitors())
        sup.feed(rt, E.WATCHDOG_EXPIRED, "watchdog: no ping for 5.0 s")
        assert (rt.state, rt.phase, rt.cause) == (S.STOPPING, P.SIGNALLED, Cause.FAILURE)
        assert ran[-1][1][0] == RecordFailure() and Signal("stop_signal") in ran[-1][1]
        epoch = rt.epoch
        sup.feed(rt, E.STOP_TIMEOUT)
        assert (rt.phase, rt.epoch) == (P.KILLED, epoch + 1), "a timer armed before this is void now"
        sup.feed(rt, E.STOP_REQUESTED, "stopped by request")  # already stopping: changes nothing
        assert rt.cause is Cause.FAILURE and rt.stop_reason == "watchdog: no ping for 5.0 s"
        sup.feed(rt, E.GONE)
        assert rt.state is S.FAILED and rt.reason == "watchdog: no ping for 5.0 s"
        assert ran[-1][1] == (Release(), DecideRestart(), Publish())
        n = len(ran)
        sup.feed(rt, E.READY)  # illegal in failed: logged as a bug, nothing runs, nothing moves
        assert len(ran) == n and rt.state is S.FAILED

    asyncio.run(main())
