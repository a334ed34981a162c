"""Issue #8 / #12: the lifecycle of one unit and the operator requests on it.

The table test of `omnid.lifecycle.step` is further down; the tests here drive a
real supervisor in-process (real children, checked in /proc)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from omnid.states import UnitState as S
from omnid.supervisor import Superseded
from tests import insup
from tests.harness import alive

WORKER = insup.SLEEPER


def _engine(extra: str = "") -> str:
    return (insup.SLEEPER.replace('restart = "no"\n', 'restart = "always"\nrestart_sec = 0.1\n')
            + 'requires = ["worker"]\n' + extra)


# ------------------------------------------------------------ superseded requests
def test_a_start_overtaken_by_a_stop_on_the_same_unit_is_answered_superseded():
    slow = insup.SLEEPER.replace('exec = ["sleep", "1000"]',
                                 'exec = ["sh", "-c", "sleep 0.5; exec sleep 1000"]\nready = { tcp = "127.0.0.1:9" }\nready_timeout = 30')

    async def body(sup):
        u = sup.units["a"]
        await sup.stop_units(["a"], 10)
        start = asyncio.ensure_future(sup.start_units(["a"], None))
        await insup.until(lambda: u.state is S.STARTING, 10, "a starting", sup)
        stop = asyncio.ensure_future(sup.stop_units(["a"], None))
        with pytest.raises(Superseded) as err:
            await asyncio.wait_for(start, 10)
        assert err.value.code == "superseded"
        assert err.value.message.startswith("superseded: stop requested by another client"), err.value.message
        await asyncio.wait_for(stop, 10)
        assert u.state is S.INACTIVE

    insup.run({"a": slow}, body)


def test_a_stop_overtaken_by_a_start_on_the_same_unit_is_answered_superseded():
    stubborn = insup.SLEEPER.replace('exec = ["sleep", "1000"]',
                                     'exec = ["sh", "-c", "trap \\"\\" TERM; sleep 1000 & wait; wait"]')
    stubborn = stubborn.replace("stop_timeout = 2", "stop_timeout = 1")

    async def body(sup):
        u = sup.units["a"]
        await insup.until(lambda: u.state is S.ACTIVE, 10, "a active", sup)
        stop = asyncio.ensure_future(sup.stop_units(["a"], None))
        await insup.until(lambda: u.state is S.STOPPING, 10, "a stopping", sup)
        start = asyncio.ensure_future(sup.start_units(["a"], None))
        with pytest.raises(Superseded) as err:
            await asyncio.wait_for(stop, 10)
        assert err.value.message.startswith("superseded: start requested by another client"), err.value.message
        snaps = await asyncio.wait_for(start, 15)
        assert snaps[0]["state"] == "active"

    insup.run({"a": stubborn}, body)


# ------------------------------------------------------------ #12: root-cause reasons
def test_a_dependents_reason_names_the_root_cause_and_stays_current():
    async def body(sup):
        w, e = sup.units["worker"], sup.units["engine"]
        await insup.until(lambda: e.state is S.ACTIVE, 10, "engine active", sup)
        os.kill(w.proc.pid, signal.SIGKILL)  # our own child, its pidfd held by the supervisor
        await insup.until(lambda: w.state is S.FAILED and e.state is S.INACTIVE, 10, "worker failed, engine down", sup)
        assert e.reason == "stopped: requires worker, which failed: killed by SIGKILL", e.reason
        await sup.stop_units(["worker"], 10)
        await insup.until(lambda: e.reason == "stopped: requires worker, which was stopped by request", 5,
                          f"engine's reason to follow the worker (is {e.reason!r})", sup)

    insup.run({"worker": WORKER, "engine": _engine()}, body)


def test_a_transitive_dependents_reason_names_the_unit_that_failed():
    async def body(sup):
        w, top = sup.units["worker"], sup.units["serve"]
        await insup.until(lambda: top.state is S.ACTIVE, 10, "serve active", sup)
        os.kill(w.proc.pid, signal.SIGKILL)
        await insup.until(lambda: top.state is S.INACTIVE and w.state is S.FAILED, 10, "serve down", sup)
        assert top.reason == ("stopped: requires engine, which requires worker, "
                              "which failed: killed by SIGKILL"), top.reason

    serve = _engine().replace('requires = ["worker"]', 'requires = ["engine"]')
    insup.run({"worker": WORKER, "engine": _engine(), "serve": serve}, body)


# ------------------------------------------------------------ #12: restart waits for dependents
def test_restart_waits_until_the_dependents_it_took_down_are_back_and_returns_them():
    slow_engine = _engine().replace('exec = ["sleep", "1000"]',
                                    'exec = ["sh", "-c", "sleep 0.4; exec sleep 1000"]\nready = { tcp = "127.0.0.1:1" }')
    slow_engine = slow_engine.replace('ready = { tcp = "127.0.0.1:1" }', '')

    async def body(sup):
        e = sup.units["engine"]
        await insup.until(lambda: e.state is S.ACTIVE, 10, "engine active", sup)
        old_engine = e.proc.pid
        snaps = await asyncio.wait_for(sup.restart_units(["worker"], 20), 25)
        by = {s["name"]: s for s in snaps}
        assert set(by) == {"worker", "engine"}, by
        assert by["engine"]["state"] == "active" and by["engine"]["pid"] != old_engine, by
        assert alive(by["engine"]["pid"]) and alive(by["worker"]["pid"])

    insup.run({"worker": WORKER, "engine": slow_engine}, body)


# ====================================================================== the table
# Every (state, event) pair of omnid.lifecycle.step. Reading this tells you the
# whole lifecycle of one unit. None = illegal (IllegalEvent naming unit, state, event).
from omnid import lifecycle as lc  # noqa: E402
from omnid.lifecycle import (ArmTimer, Event as Ev, IllegalEvent, Publish, RecordFailure, Release,  # noqa: E402
                             ReportUnkillable, Signal, Spawn, StartMonitors, UnitView, step)
from omnid.states import LEGAL  # noqa: E402

I, ST, A, SP, F = S.INACTIVE, S.STARTING, S.ACTIVE, S.STOPPING, S.FAILED
SPAWN = (Spawn(),)
NOTHING = ()
STARTED = (Publish(), ArmTimer("ready_timeout"))
SPAWN_FAILED = (RecordFailure(), Release(), Publish(), ArmTimer("restart"))
FAIL_ALIVE = (RecordFailure(), Publish(), Signal("stop_signal"), ArmTimer("stop_timeout"))
STOP = (Publish(), Signal("stop_signal", cont=True), ArmTimer("stop_timeout"))
DIED = (RecordFailure(), Release(), Publish(), ArmTimer("restart"))
DIED_WITH_LEFTOVERS = (RecordFailure(), Publish(), Signal("SIGKILL"), ArmTimer("kill_timeout"))
ESCALATE = (Signal("SIGKILL"), ArmTimer("kill_timeout"))

# (state, event): (new state, actions) -- or for view-dependent rows, a dict
# {view flags: (new state, actions)}.
EXPECTED = {
    # inactive: only a start (or the spawn's answer) moves it
    (I, Ev.START_REQUESTED): (I, SPAWN),  # stays inactive until the process exists
    (I, Ev.RESTART_DUE): None,
    (I, Ev.SPAWNED): (ST, STARTED),
    (I, Ev.SPAWN_FAILED): (F, SPAWN_FAILED),
    (I, Ev.READY): None,
    (I, Ev.NOT_READY_IN_TIME): None,
    (I, Ev.EXITED): None,
    (I, Ev.WATCHDOG_EXPIRED): None,
    (I, Ev.LIVENESS_FAILED): None,
    (I, Ev.STOP_REQUESTED): (I, NOTHING),
    (I, Ev.DEPENDENCY_DOWN): (I, NOTHING),
    (I, Ev.DEPENDENCY_UP): (I, NOTHING),
    (I, Ev.STOP_TIMEOUT): None,
    (I, Ev.KILL_TIMEOUT): None,
    (I, Ev.GONE): None,
    (I, Ev.INTERNAL_ERROR): None,
    # starting: process alive, not ready yet
    (ST, Ev.START_REQUESTED): None,
    (ST, Ev.RESTART_DUE): None,
    (ST, Ev.SPAWNED): None,
    (ST, Ev.SPAWN_FAILED): None,
    (ST, Ev.READY): (A, (Publish(), StartMonitors())),
    (ST, Ev.NOT_READY_IN_TIME): (SP, FAIL_ALIVE),
    (ST, Ev.EXITED): {"leftovers": (SP, DIED_WITH_LEFTOVERS), "clean": (F, DIED)},
    (ST, Ev.WATCHDOG_EXPIRED): None,
    (ST, Ev.LIVENESS_FAILED): None,
    (ST, Ev.STOP_REQUESTED): (SP, STOP),
    (ST, Ev.DEPENDENCY_DOWN): (SP, STOP),
    (ST, Ev.DEPENDENCY_UP): (ST, NOTHING),
    (ST, Ev.STOP_TIMEOUT): None,
    (ST, Ev.KILL_TIMEOUT): None,
    (ST, Ev.GONE): None,
    (ST, Ev.INTERNAL_ERROR): (SP, FAIL_ALIVE),
    # active: ready, monitored
    (A, Ev.START_REQUESTED): None,
    (A, Ev.RESTART_DUE): None,
    (A, Ev.SPAWNED): None,
    (A, Ev.SPAWN_FAILED): None,
    (A, Ev.READY): None,
    (A, Ev.NOT_READY_IN_TIME): None,
    (A, Ev.EXITED): {"leftovers": (SP, DIED_WITH_LEFTOVERS), "clean": (F, DIED)},
    (A, Ev.WATCHDOG_EXPIRED): (SP, FAIL_ALIVE),
    (A, Ev.LIVENESS_FAILED): (SP, FAIL_ALIVE),
    (A, Ev.STOP_REQUESTED): (SP, STOP),
    (A, Ev.DEPENDENCY_DOWN): (SP, STOP),
    (A, Ev.DEPENDENCY_UP): (A, NOTHING),
    (A, Ev.STOP_TIMEOUT): None,
    (A, Ev.KILL_TIMEOUT): None,
    (A, Ev.GONE): None,
    (A, Ev.INTERNAL_ERROR): (SP, FAIL_ALIVE),
    # stopping: the kill policy is running
    (SP, Ev.START_REQUESTED): None,
    (SP, Ev.RESTART_DUE): None,
    (SP, Ev.SPAWNED): None,
    (SP, Ev.SPAWN_FAILED): None,
    (SP, Ev.READY): None,
    (SP, Ev.NOT_READY_IN_TIME): None,
    (SP, Ev.EXITED): (SP, NOTHING),
    (SP, Ev.WATCHDOG_EXPIRED): None,
    (SP, Ev.LIVENESS_FAILED): None,
    (SP, Ev.STOP_REQUESTED): (SP, NOTHING),
    (SP, Ev.DEPENDENCY_DOWN): (SP, NOTHING),
    (SP, Ev.DEPENDENCY_UP): (SP, NOTHING),
    (SP, Ev.STOP_TIMEOUT): (SP, ESCALATE),
    (SP, Ev.KILL_TIMEOUT): {"failing": (F, (ReportUnkillable(), Release(), Publish(), ArmTimer("restart"))),
                            "requested": (I, (ReportUnkillable(), Release(), Publish()))},
    (SP, Ev.GONE): {"failing": (F, (Release(), Publish(), ArmTimer("restart"))),
                    "requested": (I, (Release(), Publish()))},
    (SP, Ev.INTERNAL_ERROR): (SP, (RecordFailure(), Signal("SIGKILL"), ArmTimer("kill_timeout"))),
    # failed: the restart policy or an operator decides
    (F, Ev.START_REQUESTED): (F, SPAWN),
    (F, Ev.RESTART_DUE): (F, SPAWN),
    (F, Ev.SPAWNED): (ST, STARTED),
    (F, Ev.SPAWN_FAILED): (F, SPAWN_FAILED),
    (F, Ev.READY): None,
    (F, Ev.NOT_READY_IN_TIME): None,
    (F, Ev.EXITED): None,
    (F, Ev.WATCHDOG_EXPIRED): None,
    (F, Ev.LIVENESS_FAILED): None,
    (F, Ev.STOP_REQUESTED): (I, (Release(), Publish())),  # an operator's stop clears a failure
    (F, Ev.DEPENDENCY_DOWN): (F, NOTHING),
    (F, Ev.DEPENDENCY_UP): (F, NOTHING),
    (F, Ev.STOP_TIMEOUT): None,
    (F, Ev.KILL_TIMEOUT): None,
    (F, Ev.GONE): None,
    (F, Ev.INTERNAL_ERROR): None,
}

VIEWS = {"leftovers": {"leftovers": True}, "clean": {"leftovers": False},
         "failing": {"failing": True}, "requested": {"failing": False}}


def test_the_table_covers_every_state_event_pair():
    assert set(EXPECTED) == {(s, e) for s in S for e in Ev}
    assert len(EXPECTED) == len(S) * len(Ev) == 80


@pytest.mark.parametrize("state,event", sorted(EXPECTED, key=lambda k: (list(S).index(k[0]), list(Ev).index(k[1]))),
                         ids=lambda v: v.value)
def test_step(state, event):
    want = EXPECTED[(state, event)]
    if want is None:
        with pytest.raises(IllegalEvent) as err:
            step(UnitView("worker@1", state), event)
        assert str(err.value) == f"worker@1: event {event.value} is illegal in state {state.value}"
        return
    cases = want.items() if isinstance(want, dict) else [("any", want)]
    for flags, (new, actions) in cases:
        got = step(UnitView("worker@1", state, **VIEWS.get(flags, {})), event)
        assert got == (new, actions), (state, event, flags, got)
        assert new is state or new in LEGAL[state], f"step allows {state.value} -> {new.value}, LEGAL does not"


def test_step_is_pure_no_io_no_asyncio():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(lc))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module.split(".")[0] for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"asyncio", "os", "socket", "subprocess", "time", "signal", "select"}, imported


def test_the_man_page_shows_the_diagram_generated_from_the_table():
    from pathlib import Path

    man = (Path(__file__).resolve().parent.parent / "man" / "omnid.unit.5").read_text()
    block = man.split(".SS Lifecycle", 1)[1].split(".nf\n", 1)[1].split("\n.fi", 1)[0]
    assert block.splitlines() == lc.diagram()
