"""FM-33: an action of the centre raises. The test-only hook OMNID_TEST_INJECT_FAULT
(omnid/core/faults.py) makes one executor action raise once for one unit, each in turn:
the unit ends `failed` with a reason naming the action, the traceback is logged once, the
other unit keeps running (same pid), `omnid stop` completes within its deadline, and
nothing of either unit is left in /proc (read from the kernel, by the units' tags)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from omnid.base import linux
from omnid.process.handle import UNIT_TAG
from tests.harness import make_stack, wait_for

SLEEP = 'exec = ["sleep", "1000"]\nstop_timeout = 2\nkill_timeout = 1\n'
# point -> (the victim's unit file, what the test does to reach the action, the name in the reason)
CASES = {
    "spawn": (SLEEP + 'restart = "no"\n', None, "internal error in spawn: InjectedFault"),
    "publish": (SLEEP + 'restart = "no"\n', None, "internal error in Publish: InjectedFault"),
    "timer": (SLEEP + 'restart = "no"\n', None, "internal error in ArmTimer: InjectedFault"),
    "monitors": (SLEEP + 'restart = "no"\n', None, "internal error in StartMonitors: InjectedFault"),
    "signal": (SLEEP, "stop", "internal error in Signal: InjectedFault"),
    "drain": (SLEEP + 'drain = { signal = "SIGUSR1" }\ndrain_timeout = 5\n', "stop",
              "internal error in Drain: InjectedFault"),
    "release": (SLEEP, "stop", "internal error in Release: InjectedFault"),
    # not ready within 1 s: a hung unit whose stacks are captured before the kill
    "capture": (SLEEP + 'restart = "no"\nready = "notify"\nready_timeout = 1\ncapture_timeout = 2\n', None,
                "internal error in Capture: InjectedFault"),
}


def tagged(unit: str) -> list[int]:
    """Live processes (not zombies) of this test whose environment carries omnid's tag for `unit`."""
    out, me = [], os.environ["OMNID_TEST_ID"]
    for name in os.listdir("/proc"):
        if name.isdigit() and linux.read_environ_var(int(name), UNIT_TAG) == unit \
                and linux.read_environ_var(int(name), "OMNID_TEST_ID") == me:
            st = linux.read_stat(int(name))
            if st is not None and st.state not in ("Z", "X"):
                out.append(int(name))
    return out


@pytest.mark.parametrize("point", list(CASES))
def test_an_action_that_raises_fails_its_unit_and_nothing_else(point, daemon_factory):
    victim_unit, then, reason = CASES[point]
    d = daemon_factory(make_stack({"victim": victim_unit, "other": SLEEP}),
                       env={"OMNID_TEST_INJECT_FAULT": f"{point}:victim"})
    other = d.wait_state("other", "active")["pid"]
    if then == "stop":
        d.wait_state("victim", "active")
        d.call("stop", {"units": ["victim"]}, timeout=20)
    # `failed`, as published (after an operator's stop, converge then clears it to inactive)
    failed = wait_for(lambda: [e for e in d.log_events() if e.get("event") == "unit state"
                               and e.get("unit") == "victim" and e.get("to") == "failed"], 20,
                      f"victim failed (log:\n{d.log()[-3000:]})")
    assert len(failed) == 1 and failed[0]["reason"].startswith(reason), failed
    wait_for(lambda: d.unit("victim")["state"] == ("inactive" if then == "stop" else "failed"), 10, "victim settled")
    wait_for(lambda: not tagged("victim"), 5, "the victim's processes gone from /proc")
    # the rest of the stack goes on: the other unit was never touched
    assert d.unit("other")["state"] == "active" and d.unit("other")["pid"] == other
    crashes = [e for e in d.log_events() if e.get("event") in ("action failed", "task crashed")
               and e.get("unit") == "victim"]
    assert len(crashes) == 1 and "Traceback" in (crashes[0].get("exception") or ""), crashes
    # the stack stop completes within its deadline, without being forced
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    code = d.wait_exit(30)
    took = time.monotonic() - t0
    stop = next(e for e in d.log_events() if e.get("event") == "stack stop deadline")
    assert code == 0 and took < stop["deadline_s"], (code, took, stop, d.log()[-2000:])
    assert not any(e.get("event") == "stack stop forced: SIGKILL to every unit" for e in d.log_events())
    assert not tagged("victim") and not tagged("other")


def test_a_malformed_injection_is_refused_and_nothing_raises(daemon_factory):
    d = daemon_factory(make_stack({"a": SLEEP}), env={"OMNID_TEST_INJECT_FAULT": "spawn"})
    d.wait_state("a", "active")
    refused = [e for e in d.log_events() if e.get("event") == "test fault injection refused"]
    assert refused and "expected POINT:UNIT" in refused[0]["reason"], d.log()[-2000:]
    assert json.dumps(d.unit("a")).count("internal error") == 0
