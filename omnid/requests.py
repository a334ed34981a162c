"""Operator requests on the supervisor (DESIGN.md "Control protocol": start, stop,
restart, kill, shutdown). Each request sets goals, kicks `_converge` and waits for
the units to settle; a request overtaken by another one on the same unit is
answered at once with `Superseded` (every request gets exactly one reply).
Mixed into `omnid.supervisor.Supervisor`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from omnid.control import ControlError
from omnid.lifecycle import Event
from omnid.states import Goal, UnitState
from omnid.termination import StopRecord

if TYPE_CHECKING:
    from omnid.supervisor import Unit

S = UnitState
E = Event


class Superseded(ControlError):
    """An operator request overtaken by another one on the same unit: it is answered
    with this error at once instead of waiting for a state that will not come."""

    def __init__(self, by: str, units: list[str]) -> None:
        super().__init__("superseded", f"superseded: {by} requested by another client "
                                       f"(unit{'s' if len(units) > 1 else ''} {', '.join(units)})")


class OperatorRequests:
    def _claim(self, names: Iterable[str], by: str) -> dict[str, int]:
        """Record an operator request on these units; returns what its waiter checks."""
        out = {}
        for n in names:
            u = self.units[n]
            u.goal_seq += 1
            u.goal_by = by
            out[n] = u.goal_seq
        self._notify_changed()  # a waiting request on these units may be overtaken now
        return out

    def _overtaken(self, claims: dict[str, int]) -> tuple[str, list[str]] | None:
        """(what overtook, which units) if another request changed these units' goal."""
        units = self.units
        for n, seq in claims.items():  # the common answer is "no": stop at the first change
            if units[n].goal_seq != seq:
                break
        else:
            return None
        hit = [n for n, seq in claims.items() if units[n].goal_seq != seq]
        return self.units[hit[0]].goal_by, hit

    def _settled_up(self, u: Unit) -> bool:
        """A unit a start waits for is done: active, or failed/inactive for good."""
        if u.op is not None:
            return False
        if u.state is S.ACTIVE:
            return True
        if u.state is S.FAILED:
            return not u.restart_pending
        return u.state is S.INACTIVE and (self._stuck(u) or self._group_down_for_good(u))

    async def _wait_request(self, claims: dict[str, int], done: Callable[[], bool], timeout: float | None) -> None:
        """Wait until done() or until another request overtakes this one (then Superseded)."""
        await self.wait_until(lambda: done() or self._overtaken(claims) is not None, timeout)
        over = self._overtaken(claims)
        if over is not None and not done():
            raise Superseded(*over)

    async def start_units(self, names: list[str] | None, timeout: float | None = None) -> list[dict]:
        """Operator start: the named units (all when None) and everything they require."""
        targets = self.expand(names) if names else list(self.order)
        closure: list[str] = []
        todo = list(targets)
        while todo:
            n = todo.pop()
            if n in closure:
                continue
            closure.append(n)
            todo.extend(self.units[n].spec.requires)
            todo.extend(self.stack.group_members(n))
        for n in closure:
            u = self.units[n]
            u.goal = Goal.ACTIVE
            u.gave_up = False
            u.start_times.clear()
            u.consecutive_failures = 0
            if (u.state is S.FAILED and u.op is None) or u.book.down_reason is not None:
                u.restart_pending = True
                u.restart_at = 0.0
        claims = self._claim(closure, "start")
        self._kick()
        await self._wait_request(claims, lambda: all(self._settled_up(self.units[n]) for n in targets), timeout)
        return [self.units[n].snapshot() for n in targets]

    def _stuck(self, u: Unit) -> bool:
        """An inactive unit that will not start without an operator (a requirement gave up)."""
        for r in u.spec.requires:
            ru = self.units[r]
            if ru.state is S.FAILED and not ru.restart_pending:
                return True
            if ru.state is S.INACTIVE and ru.op is None and (ru.goal is Goal.INACTIVE or self._stuck(ru)
                                                         or self._group_down_for_good(ru)):
                return True
        return False

    async def stop_units(self, names: list[str] | None, timeout: float | None = None) -> list[StopRecord]:
        targets = self.expand(names) if names else list(self.order)
        closure = set(targets)
        if names:  # the whole stack needs no dependents walk (O(n^2) at 256 units)
            for n in targets:
                closure.update(d.name for d in self.stack.dependents(n))
        before = {n: self.units[n].last_stop for n in self.order}
        for n in targets:
            u = self.units[n]
            u.goal = Goal.INACTIVE
            u.restart_pending = False
            if u.state is S.FAILED and u.op is None:
                self._transition(u, E.STOP_REQUESTED, f"stopped by request (was failed: {u.reason})")
        claims = self._claim(targets, "stop")
        self._kick()

        def done() -> bool:
            return all(self.units[n].op is None and self.units[n].state in (S.INACTIVE, S.FAILED)
                       for n in closure)

        await self._wait_request(claims, done, timeout)
        stop_order = list(reversed(self.order))
        recs = [self.units[n].last_stop for n in stop_order
                if self.units[n].last_stop is not None and self.units[n].last_stop is not before[n]]
        return recs  # type: ignore[return-value]

    async def restart_units(self, names: list[str], timeout: float | None = None) -> list[dict]:
        """Stop the named units (and what requires them), start them again, and wait until
        everything this took down is back too; returns all of them (the caller sees which
        did not come back by their state and reason)."""
        targets = self.expand(names)
        deadline = None if timeout is None else time.monotonic() + timeout
        dependents = [d.name for n in targets for d in self.stack.dependents(n)]
        took_down = [n for n in dict.fromkeys(dependents) if n not in targets
                     and self.units[n].goal is Goal.ACTIVE and self.units[n].state in (S.STARTING, S.ACTIVE)]
        await self.stop_units(targets, timeout)
        left = None if deadline is None else max(0.1, deadline - time.monotonic())
        await self.start_units(targets, left)
        back = [*targets, *(n for n in self.order if n in took_down)]
        claims = {n: self.units[n].goal_seq for n in back}
        left = None if deadline is None else max(0.1, deadline - time.monotonic())
        await self._wait_request(claims, lambda: all(self._settled_up(self.units[n]) for n in back), left)
        return [self.units[n].snapshot() for n in back]

    def kill_unit(self, name: str, sig: int) -> list[str]:
        out = []
        for n in self.expand([name], whole_groups=False):
            u = self.units[n]
            if u.proc is not None and u.proc.signal_group(sig, self.token):
                out.append(n)
        return out

    async def shutdown(self, timeout: float | None = None) -> list[StopRecord]:
        self.shutting_down = True
        return await self.stop_units(None, timeout)
