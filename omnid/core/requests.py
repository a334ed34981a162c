"""Operator requests (omnid-control(7): start, stop, restart, kill, shutdown). A request
sets goals, kicks converge and waits until the units settle; one overtaken by another
request on the same unit is answered at once with `Superseded` (every request gets
exactly one reply). Requests change goals only: converge feeds the events."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from omnid.base import linux
from omnid.core.errors import RequestRefused
from omnid.core.lifecycle import Goal, UnitState
from omnid.process.termination import StopRecord
from omnid.core.centre import Centre
from omnid.model.units import Unit as UnitSpec


S = UnitState


class Superseded(RequestRefused):
    """An operator request overtaken by another one on the same unit: it is answered
    with this error at once instead of waiting for a state that will not come."""

    def __init__(self, by: str, units: list[str]) -> None:
        super().__init__("superseded", f"superseded: {by} requested by another client "
                                       f"(unit{'s' if len(units) > 1 else ''} {', '.join(units)})")


class OperatorRequests:
    def __init__(self, sup: Centre) -> None:
        self.sup = sup
        self.units = sup.units

    def _claim(self, names: Iterable[str], by: str) -> dict[str, int]:
        """Record an operator request on these units; returns what its waiter checks."""
        out = {}
        for n in names:
            rt = self.units[n]
            rt.goal_seq += 1
            rt.goal_by = by
            out[n] = rt.goal_seq
        self.sup.notify_changed()  # a waiting request on these units may be overtaken now
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
        return units[hit[0]].goal_by, hit

    async def _wait(self, claims: dict[str, int], done: Callable[[], bool], timeout: float | None) -> None:
        """Wait until done() or until another request overtakes this one (then Superseded)."""
        await self.sup.wait_until(lambda: done() or self._overtaken(claims) is not None, timeout)
        over = self._overtaken(claims)
        if over is not None and not done():
            raise Superseded(*over)

    def _requirers(self, targets: list[str]) -> set[str]:
        """The targets and every unit that requires one of them, directly or through others,
        as the runtime records say now (a reload may have changed what requires what)."""
        required_by: dict[str, list[str]] = {}
        for rt in self.units.values():
            for r in rt.spec.requires:
                required_by.setdefault(r, []).append(rt.name)
        out, todo = set(targets), list(targets)
        while todo:
            for d in required_by.get(todo.pop(), ()):
                if d not in out:
                    out.add(d)
                    todo.append(d)
        return out

    def dependents_up(self, targets: list[str]) -> list[str]:
        """Units that require the targets and are up now: what stopping the targets takes down."""
        deps = [d.name for n in targets for d in self.sup.stack.dependents(n)]
        return [n for n in dict.fromkeys(deps) if n not in targets
                and self.units[n].goal is Goal.ACTIVE and self.units[n].state in (S.STARTING, S.ACTIVE)]

    def _took_down(self, targets: list[str]) -> list[str]:
        """Units that require the targets, want to run, and are down now (stopped because a
        target was): a start of the targets brings them back and waits for them too."""
        deps = [d.name for n in targets for d in self.sup.stack.dependents(n)]
        return [n for n in dict.fromkeys(deps) if n not in targets and self.units[n].goal is Goal.ACTIVE
                and (self.units[n].state is not S.ACTIVE or self.units[n].busy)]

    async def start_units(self, names: list[str] | None, timeout: float | None = None) -> list[dict]:
        """Operator start: the named units (all when None), everything they require, and
        waits for what requires them and is down because of them (as `restart` does)."""
        sup = self.sup
        targets = sup.expand(names) if names else list(sup.order)
        closure: list[str] = []
        todo = list(targets)
        while todo:
            n = todo.pop()
            if n in closure:
                continue
            closure.append(n)
            todo.extend(self.units[n].spec.requires)
            todo.extend(sup.stack.group_members(n))
        for n in closure:
            rt = self.units[n]
            rt.goal = Goal.ACTIVE
            rt.rolling = False  # an operator's start: it counts for its dependents again
            book = rt.book
            book.gave_up = False
            book.start_times.clear()
            book.consecutive_failures = 0
            book.ever_up = False
            # Failed and still busy (its GPU memory being released, a restart's spawn at the
            # spawner) counts too: the start comes once that is over, instead of being lost.
            if rt.state is S.FAILED or book.down_reason is not None:
                book.restart_pending = True
                book.restart_at = 0.0
            if rt.state in (S.INACTIVE, S.FAILED):
                rt.start_requested = True  # its next start is this request's, not counted in RESTARTS
        back = [*targets, *(n for n in sup.order if n in self._took_down(targets))] if names else targets
        claims = self._claim(closure, "start")
        sup.kick()
        await self._wait(claims, lambda: all(sup.schedule.settled_up(self.units[n]) for n in back), timeout)
        return [self.units[n].snapshot() for n in back]

    async def stop_units(self, names: list[str] | None, timeout: float | None = None, *,
                         for_good: bool = False) -> list[StopRecord]:
        """`for_good`: the operator's `omnid stop`: each named unit that is down at the end has
        its fd store emptied (a restart, or a stop for a reload, keeps it)."""
        sup = self.sup
        targets = sup.expand(names) if names else list(sup.order)
        closure = self._requirers(targets) if names else set(targets)  # the whole stack needs no walk
        before = {n: self.units[n].last_stop for n in sup.order}
        for n in targets:
            rt = self.units[n]
            rt.goal = Goal.INACTIVE
            rt.rolling = False
            rt.book.restart_pending = False
        claims = self._claim(targets, "stop")
        sup.kick()
        try:
            await self._wait(claims, lambda: all(sup.schedule.settled_down(self.units[n]) for n in closure), timeout)
        finally:
            if for_good:  # after the stop: a unit may store its state as it stops, for a restart
                for n in targets:
                    rt = self.units[n]
                    if rt.goal_seq == claims[n] and sup.schedule.settled_down(rt):
                        sup.fdstore.drop(n, "stopped by the operator")
        return [self.units[n].last_stop for n in reversed(sup.order)  # type: ignore[misc]
                if self.units[n].last_stop is not None and self.units[n].last_stop is not before[n]]

    async def restart_units(self, names: list[str], timeout: float | None = None) -> list[dict]:
        """Stop the named units (and what requires them), start them again, and wait until
        everything this took down is back too; returns all of them (the caller sees which
        did not come back by their state and reason)."""
        sup = self.sup
        targets = sup.expand(names)
        deadline = None if timeout is None else time.monotonic() + timeout
        took_down = self.dependents_up(targets)
        await self.stop_units(targets, timeout)
        left = None if deadline is None else max(0.1, deadline - time.monotonic())
        await self.start_units(targets, left)
        back = [*targets, *(n for n in sup.order if n in took_down)]
        claims = {n: self.units[n].goal_seq for n in back}
        left = None if deadline is None else max(0.1, deadline - time.monotonic())
        await self._wait(claims, lambda: all(sup.schedule.settled_up(self.units[n]) for n in back), left)
        return [self.units[n].snapshot() for n in back]

    def roll_refusal(self, names: list[str]) -> str | None:
        """Why these units cannot be rolled (None: they can): a worker group is one thing."""
        for n in self.sup.expand(names, whole_groups=False):
            spec = self.units[n].spec
            if spec.instances < 2:
                return (f"{n} has one instance: a roll keeps the others up while one is replaced, and "
                        f"there are none; use omnid restart {n} (without --rolling)")
            g = spec.worker_group
            if g:
                return (f"{n} is a member of worker group {g}: a group restarts as one thing and is not "
                        f"rolled; use omnid restart {n} (without --rolling)")
        return None

    async def roll(self, names: list[str], timeout: float | None = None,
                   specs: dict[str, UnitSpec] | None = None) -> tuple[list[dict], str]:
        """Rolling restart: the instances of the named units, `max_unavailable` at a time, each
        next batch only once the new ones are active (ready). Units that require them are not
        stopped (`rolling` keeps an instance out of their `down`): the siblings serve them.
        `specs`: a reload's new definitions, put in force instance by instance. A new instance
        that does not become active stops the roll: it stays failed (its restart policy does not
        retry the new spec) and the instances not reached keep running as they are. Returns
        the instances' snapshots and why the roll stopped ("" when it went through)."""
        sup = self.sup
        targets = sup.expand(names, whole_groups=False)
        deadline = None if timeout is None else time.monotonic() + timeout
        units = self.units
        step = max(1, min((specs or {}).get(n, units[n].spec).max_unavailable for n in targets))

        def left() -> float | None:
            return None if deadline is None else max(0.1, deadline - time.monotonic())

        for i in range(0, len(targets), step):
            batch = targets[i:i + step]
            for n in batch:
                rt = units[n]
                rt.rolling = True
                rt.goal = Goal.INACTIVE
                rt.book.restart_pending = False
            claims = self._claim(batch, "restart --rolling")
            sup.kick()
            await self._wait(claims, lambda: all(sup.schedule.settled_down(units[n]) for n in batch), left())
            started: dict[str, int] = {}
            for n in batch:
                rt = units[n]
                if specs is not None and n in specs:
                    rt.spec = specs[n]
                rt.goal = Goal.ACTIVE
                rt.start_requested = True
                book = rt.book
                book.gave_up, book.consecutive_failures, book.ever_up = False, 0, False
                book.start_times.clear()
                started[n] = book.generation
            claims = self._claim(batch, "restart --rolling")
            sup.kick()

            def came(n: str) -> bool:  # this roll's start of n is over: active, or failed
                rt = units[n]
                if rt.busy:
                    return False
                if rt.book.generation > started[n] and rt.state in (S.ACTIVE, S.FAILED):
                    return True
                return rt.state is S.INACTIVE and sup.schedule.stuck(rt)

            await self._wait(claims, lambda: all(came(n) for n in batch), left())
            failed = [n for n in batch if units[n].state is not S.ACTIVE]
            for n in batch:
                if n not in failed:
                    units[n].rolling = False
            if failed:
                for n in failed:
                    rt = units[n]
                    rt.book.restart_pending = False
                    rt.book.gave_up = True  # the new spec is not retried: `omnid start` does
                    rt.reason = f"rolling restart stopped here: {rt.reason or rt.state.value}"
                rest = targets[i + step:]
                why = (f"rolling restart stopped: {'; '.join(f'{n}: {units[n].reason}' for n in failed)}"
                       + (f"; not restarted, still running as before: {', '.join(rest)}" if rest else ""))
                sup.notify_changed()
                return [units[n].snapshot() for n in targets], why
        return [units[n].snapshot() for n in targets], ""

    def kill_unit(self, name: str, sig: int) -> list[str]:
        """`omnid kill`: sig to each instance's process group, proven the unit's (signal_group).
        Once a leader is reaped its group's members are looked for among the spawner's
        descendants, the units' subtrees pruned: never a scan of the host's /proc on the loop."""
        sup = self.sup

        def stack() -> list[linux.ProcStat]:
            return linux.descendants(sup.spawner.pid, frozenset(sup.by_pid))

        out = []
        for n in sup.expand([name], whole_groups=False):
            rt = self.units[n]
            if rt.proc is not None and rt.proc.signal_group(sig, sup.token, stack):
                out.append(n)
        return out

    async def shutdown(self, timeout: float | None = None) -> list[StopRecord]:
        self.sup.shutting_down = True
        return await self.stop_units(None, timeout)
