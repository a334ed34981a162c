"""The operator requests on a unit and the reasons they leave, driven through a real
supervisor in-process (real children, checked in /proc). The lifecycle table itself
is tested pair by pair in tests/test_table.py."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from omnid.core.lifecycle import UnitState as S
from omnid.core.requests import Superseded
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
        await sup.requests.stop_units(["a"], 10)
        start = asyncio.ensure_future(sup.requests.start_units(["a"], None))
        await insup.until(lambda: u.state is S.STARTING, 10, "a starting", sup)
        stop = asyncio.ensure_future(sup.requests.stop_units(["a"], None))
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
        stop = asyncio.ensure_future(sup.requests.stop_units(["a"], None))
        await insup.until(lambda: u.state is S.STOPPING, 10, "a stopping", sup)
        start = asyncio.ensure_future(sup.requests.start_units(["a"], None))
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
        await sup.requests.stop_units(["worker"], 10)
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
        snaps = await asyncio.wait_for(sup.requests.restart_units(["worker"], 20), 25)
        by = {s["name"]: s for s in snaps}
        assert set(by) == {"worker", "engine"}, by
        assert by["engine"]["state"] == "active" and by["engine"]["pid"] != old_engine, by
        assert alive(by["engine"]["pid"]) and alive(by["worker"]["pid"])

    insup.run({"worker": WORKER, "engine": slow_engine}, body)


# ------------------------------------------------------------ a restart waits for the dependents to stop
def test_a_failed_requirement_restarts_only_after_the_units_that_require_it_have_stopped():
    """Seen with a Ray head and a Ray worker node as units: the head was restarted after
    restart_sec while the node (30 s stop) still stopped, Ray refused it ("already running"),
    and each refusal spent one of the start limit's starts. omnid(8): dependents are stopped
    first, then the restart policy applies."""
    base = insup.SLEEPER.replace('restart = "no"\n', 'restart = "on-failure"\nrestart_sec = 0.1\n')
    slow = ('exec = ["sh", "-c", "trap \\"\\" TERM; sleep 1000 & wait; wait"]\nstop_timeout = 2\nkill_timeout = 2\n'
            'restart = "on-failure"\nrestart_sec = 0.1\nrequires = ["base"]\n')

    async def body(sup):
        b, d = sup.units["base"], sup.units["node"]
        await insup.until(lambda: d.state is S.ACTIVE, 10, "node active", sup)
        old = b.proc.pid
        os.kill(old, signal.SIGKILL)  # our own child, its pidfd held by the supervisor
        await insup.until(lambda: d.state is S.STOPPING, 5, "node stopping", sup)
        seen_stopping = 0
        while d.state is S.STOPPING:  # ~2 s: the node ignores SIGTERM until stop_timeout
            assert b.state is S.FAILED and b.proc is None, (b.state, b.reason, "restarted while node stops")
            seen_stopping += 1
            await asyncio.sleep(0.02)
        assert seen_stopping > 20, seen_stopping
        await insup.until(lambda: b.state is S.ACTIVE and d.state is S.ACTIVE, 10, "both back", sup)
        assert b.proc.pid != old and len(b.book.start_times) == 2, b.book.start_times

    insup.run({"base": base, "node": slow}, body)
