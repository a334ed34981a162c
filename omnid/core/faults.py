"""A test-only fault injection point (FM-33): make one action of the centre raise, once, for
one unit, so that the tests can prove what INTERNAL_ERROR does in every position.

Off unless the daemon's environment has OMNID_TEST_INJECT_FAULT="POINT:UNIT" (developer-only,
documented as such in ARCHITECTURE.md and omnid(8); no flag, no setting, no control request
turns it on, it is obeyed only where omnid.base.testswitch allows test switches, and the daemon
logs an error at start while it is set). POINT is one of POINTS:
an action type's handler in the executor, or "spawn": the spawn task once the child has been
adopted (the worst case: a process is out and must be killed).
"""

from __future__ import annotations

from omnid.base import testswitch

ENV = testswitch.INJECT_FAULT_ENV
# point -> the action type (its class name) whose handler raises; "spawn" is the spawn task.
POINTS = {"spawn": "", "signal": "Signal", "timer": "ArmTimer", "capture": "Capture", "drain": "Drain",
          "release": "Release", "publish": "Publish", "monitors": "StartMonitors"}


class InjectedFault(RuntimeError):
    """The exception the hook raises (a stand-in for a bug)."""


class Faults:
    def __init__(self, point: str, unit: str) -> None:
        self.point, self.unit = point, unit
        self.fired = False

    @classmethod
    def from_environ(cls) -> tuple[Faults | None, str | None]:
        """(the hook, None), (None, why the value is refused), or (None, None) when unset or
        not obeyed here (testswitch.refused_at_start says why)."""
        raw = testswitch.value(ENV)
        if not raw:
            return None, None
        point, sep, unit = raw.partition(":")
        if not sep or point not in POINTS or not unit:
            return None, f"{ENV}={raw!r} ignored: expected POINT:UNIT with POINT one of {', '.join(POINTS)}"
        return cls(point, unit), None

    def check(self, unit: str, point: str) -> None:
        """Raise once, at `point` for `unit`."""
        if not self.fired and unit == self.unit and point == self.point:
            self.fired = True
            raise InjectedFault(f"injected by {ENV} at {point}")

    def check_action(self, unit: str, action_type: str) -> None:
        if self.point != "spawn" and POINTS[self.point] == action_type:
            self.check(unit, self.point)
