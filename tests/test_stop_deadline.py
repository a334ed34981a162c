"""Every wait bounded: the stack stop has a deadline (derived from the tiers' budgets, or
stop_deadline in omnid.toml), past which every unit is SIGKILLed; a second SIGTERM during a
stop does the same at once. The kernel (a pidfd held by the test) says when a unit is gone."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

import pytest

from tests.harness import make_stack, wait_for

STUBBORN = ("exec = " + json.dumps([sys.executable, "-c", "import signal, time\n"
                                    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(1000)"])
            + "\nstop_timeout = 60\nkill_timeout = 1\n")


def ignores_sigterm(pid: int) -> bool:
    """The kernel's word (SigIgn in /proc/PID/status) that the program set SIGTERM to SIG_IGN."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def exited(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def log_event(d, name: str) -> dict:
    return wait_for(lambda: next((e for e in d.log_events() if e.get("event") == name), None), 10,
                    f"{name!r} in the daemon's log:\n{d.log()[-3000:]}")


def test_the_derived_deadline_is_the_sum_of_the_tiers_worst_budgets(daemon_factory):
    d = daemon_factory(make_stack({
        "a": 'exec = ["sleep", "1000"]\nstop_timeout = 3\nkill_timeout = 1\n',
        "b": 'exec = ["sleep", "1000"]\nrequires = ["a"]\nstop_timeout = 2\nkill_timeout = 2\n',
        "c": 'exec = ["sleep", "1000"]\nrequires = ["a"]\nstop_timeout = 1\nkill_timeout = 1\n',
    }))
    d.wait_all_active()
    d.proc.send_signal(signal.SIGTERM)
    assert d.wait_exit(30) == 0
    ev = log_event(d, "stack stop deadline")
    # tier of a: 3 + 2*1 = 5; tier of b and c: max(2 + 2*2, 1 + 2*1) = 6; margin 5
    assert (ev["deadline_s"], ev["deadline_from"]) == (16.0, "derived"), ev


def test_past_the_deadline_every_unit_is_sigkilled_and_the_daemon_exits(daemon_factory):
    d = daemon_factory(make_stack({"stubborn": STUBBORN, "plain": 'exec = ["sleep", "1000"]\n'},
                                  settings="stop_deadline = 1.5\n"))
    units = d.wait_all_active()
    fds = {n: os.pidfd_open(u["pid"]) for n, u in units.items()}
    wait_for(lambda: ignores_sigterm(units["stubborn"]["pid"]), 10, "stubborn ignoring SIGTERM")
    try:
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.wait_exit(20)
        took = time.monotonic() - t0
        assert code == 1, d.log()[-3000:]
        assert all(exited(fd) for fd in fds.values())
        forced = log_event(d, "stack stop forced: SIGKILL to every unit")
        assert forced["why"] == "the stop deadline (1.5 s) passed" and forced["killed"] == ["stubborn"], forced
        # 1.5 s of deadline, then SIGKILL and the rest of the daemon's exit (not stop_timeout's 60 s)
        assert 1.5 <= took < 1.5 + 5, took
    finally:
        for fd in fds.values():
            os.close(fd)


def test_a_second_sigterm_during_a_stop_sigkills_every_unit_at_once(daemon_factory):
    d = daemon_factory(make_stack({"stubborn": STUBBORN, "b": 'exec = ["sleep", "1000"]\n'}))
    units = d.wait_all_active()
    fds = {n: os.pidfd_open(u["pid"]) for n, u in units.items()}
    wait_for(lambda: ignores_sigterm(units["stubborn"]["pid"]), 10, "stubborn ignoring SIGTERM")
    try:
        d.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: any(e.get("event") == "unit state" and e.get("unit") == "stubborn"
                             and e.get("to") == "stopping" for e in d.log_events()), 10, "stubborn stopping")
        assert not exited(fds["stubborn"])  # it ignores SIGTERM; stop_timeout is 60 s
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: exited(fds["stubborn"]), 5, "stubborn killed after the second SIGTERM")
        gone = time.monotonic() - t0
        code = d.wait_exit(10)
        out = time.monotonic() - t0
        assert code == 1 and all(exited(fd) for fd in fds.values()), d.log()[-3000:]
        forced = log_event(d, "stack stop forced: SIGKILL to every unit")
        assert forced["why"] == "a second signal", forced
        print(f"\nsecond SIGTERM -> every unit gone: {gone * 1000:.0f} ms; daemon exited: {out * 1000:.0f} ms")
    finally:
        for fd in fds.values():
            os.close(fd)


@pytest.mark.fast
def test_a_bad_stop_deadline_is_named_with_its_file_and_key():
    import pytest

    from omnid.model.units import StackInvalid, load_stack

    for value, says in (("-1", "stop_deadline: expected a number of seconds > 0"),
                        ('"soon"', 'stop_deadline: expected a number of seconds > 0, got string "soon"')):
        d = make_stack({"a": 'exec = ["sleep", "1"]\n'}, settings=f"stop_deadline = {value}\n")
        with pytest.raises(StackInvalid) as err:
            load_stack(d)
        assert any(e.file.name == "omnid.toml" and says in str(e) for e in err.value.errors), err.value.errors
    ok = load_stack(make_stack({"a": 'exec = ["sleep", "1"]\n'}, settings="stop_deadline = 90\n"))
    assert ok.settings.stop_deadline == 90.0
