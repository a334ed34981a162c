"""The lifecycle table (omnid.core.lifecycle), cell by cell.

The table must be total: every event has a cell in every position. What each cell does is
checked against EXPECTED below, written by hand from the lifecycle's meaning (not read from
the table): for each position, the positions each event can lead to (over every View), and
every event not named there must be an explicit "ignore" (same position, no action). Then,
by simulation over the table: a stop is honoured from every position, and INTERNAL_ERROR
(any action raising) leads out of every position to `failed`, killing what runs first."""

from __future__ import annotations

import ast
import inspect
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from omnid.core import lifecycle as lc
from omnid.model.unitmodel import KillMode
from omnid.core.lifecycle import (ACTION_TYPES, ArmTimer, Capture, Cause, CountStart, DecideRestart, Drain, Event,
                                  Goal, IllegalEvent, Phase, Publish, RecordFailure, Release, ReportUnkillable,
                                  Signal, Spawn, StartMonitors, Step, UnitState, View, WaitRelease, WatchGone,
                                  WatchReady, step)

S, P, E = UnitState, Phase, Event
REPO = Path(__file__).resolve().parent.parent

# The positions, by hand.
IN, INs = (S.INACTIVE, P.IDLE), (S.INACTIVE, P.SPAWNING)
ST, AC = (S.STARTING, P.IDLE), (S.ACTIVE, P.IDLE)
Sc, Sd, Ss = (S.STOPPING, P.CAPTURING), (S.STOPPING, P.DRAINING), (S.STOPPING, P.SIGNALLED)
Sk, Sr = (S.STOPPING, P.KILLED), (S.STOPPING, P.RELEASING)
FA, FAs, FAr = (S.FAILED, P.IDLE), (S.FAILED, P.SPAWNING), (S.FAILED, P.RELEASING)
ENDED = {IN, FA, FAr, Sr}  # where GONE can lead: inactive, failed, or a wait for the GPU's memory

# position -> {event: the positions it can lead to}; every other event: ignored there.
SPAWNING_CELLS = {E.SPAWNED: {ST}, E.SPAWN_FAILED: {FA}, E.INTERNAL_ERROR: {FA, Sk}}
EXPECTED: dict[tuple[UnitState, Phase], dict[Event, set]] = {
    IN: {E.START_REQUESTED: {INs}, E.INTERNAL_ERROR: {FA}},
    INs: SPAWNING_CELLS,
    ST: {E.READY: {AC}, E.NOT_READY: {Sc, Ss}, E.EXITED: {FA, FAr, Sk, Ss}, E.STOP_REQUESTED: {Ss},
         E.DEPENDENCY_DOWN: {Ss}, E.GROUP_DOWN: {Ss}, E.GROUP_FENCED: {Sk}, E.GPU_FAULT: {Ss},
         E.INTERNAL_ERROR: {Ss}},
    AC: {E.EXITED: {FA, FAr, Sk, Ss}, E.STOP_REQUESTED: {Sd, Ss}, E.DEPENDENCY_DOWN: {Ss}, E.GROUP_DOWN: {Ss},
         E.GROUP_FENCED: {Sk}, E.GPU_FAULT: {Ss}, E.INTERNAL_ERROR: {Ss}, E.WATCHDOG_EXPIRED: {Sc, Ss},
         E.LIVENESS_FAILED: {Sc, Ss}},
    Sc: {E.CAPTURED: {Ss}, E.EXITED: {Sk}, E.INTERNAL_ERROR: {Sk}, E.GROUP_FENCED: {Sk}},
    Sd: {E.DRAINED: {Ss}, E.EXITED: {Ss, Sk}, E.DEPENDENCY_DOWN: {Ss}, E.GROUP_DOWN: {Ss}, E.GROUP_FENCED: {Sk},
         E.GPU_FAULT: {Ss}, E.INTERNAL_ERROR: {Sk}},
    Ss: {E.GONE: ENDED, E.STOP_TIMEOUT: {Sk}, E.EXITED: {Ss, Sk}, E.CAPTURE_DUE: {Ss}, E.INTERNAL_ERROR: {Sk}, E.GROUP_FENCED: {Sk}},
    Sk: {E.GONE: ENDED, E.KILL_TIMEOUT: ENDED, E.INTERNAL_ERROR: {FA, FAr}},
    Sr: {E.RELEASED: {IN}, E.INTERNAL_ERROR: {FA}},
    FA: {E.START_REQUESTED: {FAs}, E.RESTART_DUE: {FAs}, E.STOP_REQUESTED: {IN}, E.INTERNAL_ERROR: {FA}},
    FAs: SPAWNING_CELLS,
    FAr: {E.RELEASED: {FA}, E.INTERNAL_ERROR: {FA}},
}
# A process runs in these positions (or may: a spawn that crashed after its child was adopted).
HOLDS_A_PROCESS = {ST, AC, Sc, Sd, Ss}
TIMER_OUTCOMES = {"ready_timeout": E.NOT_READY, "stop_timeout": E.STOP_TIMEOUT, "kill_timeout": E.KILL_TIMEOUT,
                  "capture_timeout": E.CAPTURED, "capture_due": E.CAPTURE_DUE, "drain_timeout": E.DRAINED,
                  "leftover_timeout": E.STOP_TIMEOUT, "abort_timeout": E.STOP_TIMEOUT}


def views(state: UnitState, phase: Phase) -> list[View]:
    """Every combination of the View's flags (and stop causes) for one position."""
    out = []
    for cause, bits, down in itertools.product((None, *Cause), range(32), (False, True)):
        out.append(View("worker@1", state, phase, cause=cause, leftovers=bool(bits & 1), gpu=bool(bits & 2),
                        capture=bool(bits & 4), drain=bool(bits & 8), shutting_down=down, running=bool(bits & 16)))
    # The kill-mode flags, against the flags the cells that read them read too.
    for cause, mode, bits in itertools.product((None, *Cause), KillMode, range(32)):
        out.append(View("worker@1", state, phase, cause=cause, leftovers=bool(bits & 1), gpu=bool(bits & 2),
                        drain=bool(bits & 16), kill_mode=mode, rest_pending=bool(bits & 4),
                        leftover_grace=bool(bits & 8)))
    return out


def pos(s: Step) -> tuple[UnitState, Phase]:
    return (s.state, s.phase)


@pytest.mark.fast
def test_the_positions_are_the_ones_written_by_hand():
    assert set(lc.POSITIONS) == set(EXPECTED)


@pytest.mark.fast
def test_the_table_is_total_and_every_cell_is_what_was_written_by_hand():
    wrong = []
    for position, cells in EXPECTED.items():
        vs = views(*position)
        for ev in E:
            got = [step(v, ev) for v in vs]  # no IllegalEvent: every cell exists
            if ev in cells:
                reached = {pos(g) for g in got}
                if reached != cells[ev]:
                    wrong.append(f"{position} {ev.value}: leads to {reached}, expected {cells[ev]}")
                if all(pos(g) == position and not g.actions for g in got):
                    wrong.append(f"{position} {ev.value}: expected to act, but it is ignored")
            elif any(g != Step(*position) for g in got):
                wrong.append(f"{position} {ev.value}: expected to be ignored, got {set(got)}")
    assert not wrong, "\n".join(wrong)
    assert {k for k in lc.IGNORED} == {(s, p, e) for (s, p), cells in EXPECTED.items() for e in E if e not in cells}


@pytest.mark.fast
def test_a_pair_that_is_no_position_is_named_illegal():
    with pytest.raises(IllegalEvent) as err:
        step(View("worker@1", S.INACTIVE, P.DRAINING), E.GONE)
    assert str(err.value) == "worker@1: event gone is illegal in state inactive/draining"


# What the work an action starts feeds back (the executor's outcomes), for the simulations.
def feeds(action) -> list[Event]:
    if isinstance(action, ArmTimer):
        return [TIMER_OUTCOMES[action.which]]
    return {Spawn: [E.SPAWNED], WatchGone: [E.GONE], WatchReady: [E.READY], WaitRelease: [E.RELEASED],
            Drain: [E.DRAINED], Capture: [E.CAPTURED] if getattr(action, "feed", False) else []}.get(type(action), [])


# What each position waits for when a simulation starts in it (work started on entering it).
WAITS = {INs: [E.SPAWNED], FAs: [E.SPAWNED], Sc: [E.CAPTURED], Sd: [E.DRAINED], Ss: [E.GONE], Sk: [E.GONE],
         Sr: [E.RELEASED], FAr: [E.RELEASED]}


def simulate(view: View, first: Event, converge_stops: bool) -> tuple[list, list]:
    """Feed `first`, then what the started work feeds back (kernel and timers answer at once),
    and with converge_stops the STOP_REQUESTED converge feeds to a unit whose goal is inactive.
    Returns the positions visited and every action carried out."""
    here, cause, pending, visited, acted = pos(Step(view.state, view.phase)), view.cause, list(WAITS.get(
        (view.state, view.phase), [])), [], []
    ev = first
    for _ in range(30):
        v = View(view.name, *here, Goal.INACTIVE if converge_stops else Goal.ACTIVE, cause, gpu=view.gpu,
                 capture=view.capture, drain=view.drain, running=view.running)
        got = step(v, ev)
        if got.cause is not None:
            cause = got.cause
        if pos(got) != here:
            pending = []  # the old position's work is void
        here = pos(got)
        visited.append(here)
        acted.extend(got.actions)
        for a in got.actions:
            pending.extend(feeds(a))
        if converge_stops and here in (ST, AC, FA):
            ev = E.STOP_REQUESTED
        elif here in (IN, FA) or not pending:
            return visited, acted
        else:
            ev = pending.pop(0)
    raise AssertionError(f"no end after 30 events: {visited}")


@pytest.mark.parametrize("position", list(EXPECTED), ids=lambda p: f"{p[0].value}/{p[1].value}")
@pytest.mark.fast
def test_a_stop_request_is_honoured_in_every_position(position):
    for v in views(*position):
        visited, acted = simulate(v, E.STOP_REQUESTED, converge_stops=True)
        assert visited[-1] == IN, (position, v, visited)
        if position in HOLDS_A_PROCESS:
            assert any(isinstance(a, Signal) for a in acted) or position in (Sc, Sd, Ss), (position, v, acted)


@pytest.mark.parametrize("position", list(EXPECTED), ids=lambda p: f"{p[0].value}/{p[1].value}")
@pytest.mark.fast
def test_an_internal_error_leads_out_of_every_position_to_failed_killing_what_runs(position):
    for v in views(*position):
        visited, acted = simulate(v, E.INTERNAL_ERROR, converge_stops=False)
        assert visited[-1] == FA, (position, v, visited)
        assert RecordFailure() in acted or position in (FA, FAr), (position, v, acted)
        assert Publish() in acted, (position, v, acted)
        runs = position in HOLDS_A_PROCESS or (position in (INs, FAs) and v.running)
        if runs:  # killed through the termination policy before the unit is failed
            assert Signal("SIGKILL") in acted or Signal("stop_signal") in acted, (position, v, acted)
            assert acted.index(Release()) > max(i for i, a in enumerate(acted) if isinstance(a, Signal))


@pytest.mark.fast
def test_every_action_type_has_exactly_one_handler_in_the_executor():
    from omnid.core.executor import Executor

    handlers = Executor(SimpleNamespace())._handlers  # type: ignore[arg-type]
    assert set(handlers) == set(ACTION_TYPES)
    assert all(callable(h) for h in handlers.values())


@pytest.mark.fast
def test_every_timer_the_table_arms_is_known_to_the_executor():
    from omnid.core.executor import TIMER_EVENTS

    assert TIMER_EVENTS == TIMER_OUTCOMES
    armed = {a.which for (s, p, e) in lc.TABLE for v in views(s, p) for a in step(v, e).actions
             if isinstance(a, ArmTimer)}
    assert armed == set(TIMER_EVENTS), armed ^ set(TIMER_EVENTS)


# ------------------------------------------------------------ the rows behind the matrix
def one(state, phase, event, **flags) -> Step:
    return step(View("worker@1", state, phase, **flags), event)


@pytest.mark.fast
def test_a_start_stays_inactive_until_the_process_exists():
    assert one(S.INACTIVE, P.IDLE, E.START_REQUESTED) == Step(S.INACTIVE, P.SPAWNING, (CountStart(), Spawn()))
    assert one(S.INACTIVE, P.SPAWNING, E.SPAWNED) == Step(S.STARTING, P.IDLE, (Publish(), ArmTimer("ready_timeout"),
                                                                             WatchReady()))
    assert one(S.FAILED, P.SPAWNING, E.SPAWN_FAILED) == Step(S.FAILED, P.IDLE, (RecordFailure(), Release(),
                                                                               DecideRestart(), Publish()))
    # a stop cannot take a spawn back: converge stops the unit once it exists
    assert one(S.INACTIVE, P.SPAWNING, E.STOP_REQUESTED) == Step(S.INACTIVE, P.SPAWNING)
    # a crash in the spawn: failed at once, or, when the child was adopted, killed first
    assert one(S.INACTIVE, P.SPAWNING, E.INTERNAL_ERROR) == Step(S.FAILED, P.IDLE, (
        RecordFailure(), Release(), DecideRestart(), Publish()))
    assert one(S.INACTIVE, P.SPAWNING, E.INTERNAL_ERROR, running=True) == Step(S.STOPPING, P.KILLED, (
        RecordFailure(), Signal("SIGKILL"), ArmTimer("kill_timeout"), WatchGone()), Cause.FAILURE)


@pytest.mark.fast
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


@pytest.mark.fast
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


@pytest.mark.fast
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


@pytest.mark.fast
def test_a_failed_unit_and_a_fenced_one_are_signalled_whole_whatever_the_kill_mode():
    for mode in KillMode:
        for ev, state in ((E.WATCHDOG_EXPIRED, S.ACTIVE), (E.LIVENESS_FAILED, S.ACTIVE), (E.NOT_READY, S.STARTING),
                          (E.GPU_FAULT, S.ACTIVE), (E.INTERNAL_ERROR, S.ACTIVE)):
            assert Signal("stop_signal", cont=False) in one(state, P.IDLE, ev, kill_mode=mode).actions, (mode, ev)
        assert one(S.STOPPING, P.CAPTURING, E.CAPTURED, cause=Cause.FAILURE, kill_mode=mode).actions[0] == \
            Signal("stop_signal", cont=False)
        assert Signal("SIGKILL") in one(S.ACTIVE, P.IDLE, E.GROUP_FENCED, kill_mode=mode).actions


@pytest.mark.fast
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


@pytest.mark.fast
def test_dependency_and_group_stops_carry_their_cause_and_never_drain():
    for ev, cause in ((E.DEPENDENCY_DOWN, Cause.REQUIREMENT), (E.GROUP_DOWN, Cause.GROUP)):
        got = one(S.ACTIVE, P.IDLE, ev, drain=True)
        assert (got.state, got.phase, got.cause) == (S.STOPPING, P.SIGNALLED, cause)


@pytest.mark.fast
def test_a_planned_stop_of_a_serving_unit_drains_first_and_a_failure_elsewhere_cuts_the_drain():
    got = one(S.ACTIVE, P.IDLE, E.STOP_REQUESTED, drain=True)
    assert got == Step(S.STOPPING, P.DRAINING, (Publish(), Drain(), ArmTimer("drain_timeout")), Cause.REQUEST)
    assert one(S.STARTING, P.IDLE, E.STOP_REQUESTED, drain=True).phase is P.SIGNALLED  # not serving yet
    assert one(S.STOPPING, P.DRAINING, E.DRAINED, cause=Cause.REQUEST).phase is P.SIGNALLED
    cut = one(S.STOPPING, P.DRAINING, E.DEPENDENCY_DOWN, cause=Cause.REQUEST)
    assert (cut.phase, cut.cause) == (P.SIGNALLED, Cause.REQUIREMENT)


@pytest.mark.fast
def test_a_hung_unit_gets_its_stacks_captured_then_the_stop_signal_without_sigcont():
    for ev, state in ((E.WATCHDOG_EXPIRED, S.ACTIVE), (E.LIVENESS_FAILED, S.ACTIVE), (E.NOT_READY, S.STARTING)):
        got = one(state, P.IDLE, ev, capture=True)
        assert got == Step(S.STOPPING, P.CAPTURING, (RecordFailure(), Publish(), Capture(),
                                                    ArmTimer("capture_timeout")), Cause.FAILURE)
        no_capture = one(state, P.IDLE, ev)
        assert Signal("stop_signal", cont=False) in no_capture.actions
    after = one(S.STOPPING, P.CAPTURING, E.CAPTURED, cause=Cause.FAILURE, capture=True)
    assert after.actions[0] == Signal("stop_signal", cont=False) and ArmTimer("capture_due") not in after.actions
    # its SIGKILL comes at abort_timeout (stop_timeout unless the unit sets it), with capture or without
    assert ArmTimer("abort_timeout") in after.actions and ArmTimer("stop_timeout") not in after.actions
    assert ArmTimer("abort_timeout") in one(S.ACTIVE, P.IDLE, E.LIVENESS_FAILED).actions
    # an operator's stop of a stubborn unit takes the stacks before stop_timeout, beside the stop
    stop = one(S.ACTIVE, P.IDLE, E.STOP_REQUESTED, capture=True)
    assert ArmTimer("capture_due") in stop.actions
    assert one(S.STOPPING, P.SIGNALLED, E.CAPTURE_DUE, capture=True).actions == (Capture(feed=False),)


@pytest.mark.fast
def test_an_operator_stop_clears_a_failure():
    assert one(S.FAILED, P.IDLE, E.STOP_REQUESTED) == Step(S.INACTIVE, P.IDLE, (Publish(),))


@pytest.mark.fast
def test_legal_state_changes_are_derived_from_the_table():
    assert lc.LEGAL == {
        S.INACTIVE: {S.STARTING, S.FAILED},
        S.STARTING: {S.ACTIVE, S.STOPPING, S.FAILED},
        S.ACTIVE: {S.STOPPING, S.FAILED},
        S.STOPPING: {S.INACTIVE, S.FAILED},
        S.FAILED: {S.STARTING, S.INACTIVE, S.FAILED},
    }


@pytest.mark.fast
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
@pytest.mark.fast
def test_feed_moves_the_unit_keeps_its_cause_and_reason_and_hands_every_action_to_the_executor(tmp_path):
    """No process: the executor is replaced by a recorder, so this checks `feed` alone --
    the position, the epoch that voids older timers, the stop cause and the reason."""
    import asyncio

    from omnid.core.supervisor import Supervisor
    from omnid.model.units import load_stack
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
        sup.feed(rt, E.READY)  # means nothing in failed: an ignore cell, nothing runs, nothing moves
        assert len(ran) == n and (rt.state, rt.phase, rt.reason) == (S.FAILED, P.IDLE, "watchdog: no ping for 5.0 s")
        # a crash in the spawn after the child was adopted: killed, then failed, naming the action
        sup.feed(rt, E.START_REQUESTED)
        assert (rt.state, rt.phase) == (S.FAILED, P.SPAWNING)
        rt.proc = SimpleNamespace(pid=4242)  # adopted (no process: the executor is a recorder here)
        sup.feed(rt, E.INTERNAL_ERROR, "internal error in spawn: InjectedFault: boom")
        assert (rt.state, rt.phase, rt.cause) == (S.STOPPING, P.KILLED, Cause.FAILURE)
        assert ran[-1][1][:2] == (RecordFailure(), Signal("SIGKILL"))
        rt.proc = None
        sup.feed(rt, E.GONE)
        assert (rt.state, rt.phase) == (S.FAILED, P.IDLE)
        assert rt.reason == "internal error in spawn: InjectedFault: boom", rt.reason
        # a crash while a stop is under way keeps what the stop was for, after the bug
        sup.feed(rt, E.INTERNAL_ERROR, "internal error in Publish: RuntimeError: x")
        assert (rt.state, rt.reason) == (S.FAILED, "internal error in Publish: RuntimeError: x")

    asyncio.run(main())


# ------------------------------------------------------------ events fed by the running centre
def test_the_running_centre_feeds_the_events_the_table_answers():
    """By behaviour, not by reading source: a real Supervisor (real spawner and children)
    records every event fed while units start, fail to spawn, are not ready, die, take
    their dependent down, restart, are stopped past stop_timeout, and hit a bug. The rest
    (watchdog, liveness, GPU, groups, capture, drain, kill_timeout, release) are fed in the
    tests of those features (test_hang_kill, test_drain, test_groups, test_gpu_faults...)."""
    import asyncio
    import os
    import signal
    import sys

    from omnid.core.faults import Faults
    from tests import insup

    stubborn = ("exec = " + repr([sys.executable, "-c", "import signal, time\n"
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(1000)"])
                .replace("'", '"') + "\nstop_timeout = 0.3\nkill_timeout = 2\n")
    units = {
        "base": 'exec = ["sleep", "1000"]\nrestart = "on-failure"\nrestart_sec = 0.1\n',
        "dep": 'exec = ["sleep", "1000"]\nrequires = ["base"]\nrestart = "on-failure"\nrestart_sec = 0.1\n',
        "bad": 'exec = ["/nonexistent/omnid-test"]\nrestart = "no"\n',
        "slow": 'exec = ["sleep", "1000"]\nready = "notify"\nready_timeout = 0.5\ncapture_timeout = 0\n'
                'restart = "no"\nstop_timeout = 1\n',
        "stubborn": stubborn,
        "buggy": 'exec = ["sleep", "1000"]\nrestart = "no"\n',
    }
    fed: list[Event] = []

    async def body(sup):
        real_feed = sup.feed

        def recording(rt, event, detail=""):
            fed.append(event)
            real_feed(rt, event, detail)

        sup.feed = recording  # type: ignore[method-assign]
        sup.executor.faults = Faults("monitors", "buggy")
        u = sup.units
        await insup.until(lambda: u["base"].state is S.ACTIVE and u["dep"].state is S.ACTIVE
                          and u["bad"].state is S.FAILED and u["slow"].state is S.FAILED
                          and u["buggy"].state is S.FAILED and u["stubborn"].state is S.ACTIVE, 20, "the start", sup)
        old = u["base"].proc.pid
        os.kill(old, signal.SIGKILL)  # our spawner's unreaped child until its exit is reported
        await insup.until(lambda: u["base"].state is S.ACTIVE and u["base"].proc.pid != old
                          and u["dep"].state is S.ACTIVE, 20, "base and dep back", sup)
        await insup.until(lambda: _ignores_term(u["stubborn"].proc.pid), 10, "stubborn ignoring SIGTERM", sup)
        await sup.requests.stop_units(["stubborn"], 20)
        assert u["stubborn"].state is S.INACTIVE and u["stubborn"].last_stop.escalated

    insup.run(units, body)
    expected = {E.START_REQUESTED, E.SPAWNED, E.SPAWN_FAILED, E.READY, E.NOT_READY, E.EXITED, E.DEPENDENCY_DOWN,
                E.GONE, E.RESTART_DUE, E.STOP_REQUESTED, E.STOP_TIMEOUT, E.INTERNAL_ERROR}
    assert expected <= set(fed), expected - set(fed)


def _ignores_term(pid: int) -> bool:
    import signal

    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGTERM - 1)))
