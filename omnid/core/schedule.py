"""Converge's questions across units (after runit: `state` is what is, `goal` what is
wanted). Each answer is computed from the runtime records and the stack graph; none
changes anything. The supervisor's converge asks them after every change and feeds
one event to each unit that must move: STOP_REQUESTED / DEPENDENCY_DOWN / GROUP_DOWN
(reverse start order, dependents first), then START_REQUESTED / RESTART_DUE (start
order, requirements first)."""

from __future__ import annotations


from omnid.core import groups
from omnid.core.lifecycle import Cause, Event, Goal, Phase, UnitState
from omnid.core.runtime import UnitRuntime
from omnid.core.centre import Centre


S, E = UnitState, Event


class Schedule:
    def __init__(self, sup: Centre) -> None:
        self.sup = sup
        self.units = sup.units
        # Units ordered after each unit (they require it or start after it).
        self.after: dict[str, list[str]] = {n: [] for n in sup.order}
        for name, spec in sup.stack.units.items():
            for dep in spec.dependencies:
                self.after[dep].append(name)

    # ------------------------------------------------------------ down
    def down(self, rt: UnitRuntime, seen: frozenset[str] = frozenset(), planned: bool = True) -> bool:
        """Is this unit unavailable to units that require it (not active, or on its way down)?
        A unit whose main process just died counts once its EXITED is in (ms later), so that
        `failed` is published before its dependents begin to stop. planned=False: only what
        is not active any more counts, not a goal of `inactive` (a planned stop waits for
        its dependents, so it takes nothing from under them yet)."""
        if rt.rolling:  # a rolling restart keeps its siblings up: dependents stay
            return False
        if rt.state is not S.ACTIVE or (planned and rt.goal is Goal.INACTIVE):
            return True
        if rt.name in seen:
            return False
        return any(self.down(self.units[r], seen | {rt.name}, planned) for r in rt.spec.requires)

    def must_stop(self, rt: UnitRuntime) -> tuple[Event, str] | None:
        """The event that stops a running unit now, with its reason for people; or None."""
        if rt.goal is Goal.INACTIVE:
            return E.STOP_REQUESTED, "stack stopping" if self.sup.shutting_down else "stopped by request"
        return self.failed_under(rt)

    def failed_under(self, rt: UnitRuntime, planned: bool = True) -> tuple[Event, str] | None:
        """GROUP_DOWN / GROUP_FENCED / DEPENDENCY_DOWN when what rt stands on went down, whatever
        its goal. With planned=False, what cuts a drain short: a requirement no longer active
        (its requests cannot finish any more), not one that is only to stop after rt."""
        if rt.spec.worker_group and rt.book.down_reason is not None:
            across = groups.stop_reason(self.sup, rt)  # a group across hosts: fenced, or down elsewhere
            if across is not None:
                return (E.GROUP_FENCED if across[0] else E.GROUP_DOWN), across[1]
            return E.GROUP_DOWN, f"stopped: worker group {rt.spec.worker_group} is down: {rt.book.down_reason}"
        for r in rt.spec.requires:
            if self.down(self.units[r], planned=planned):
                return E.DEPENDENCY_DOWN, f"stopped: requires {self.root_cause(r)}"
        return None

    def root_cause(self, name: str, seen: frozenset[str] = frozenset()) -> str:
        """Why unit `name` is unavailable, down to the unit that started it:
        "engine@0, which requires worker@1, which failed: killed by SIGKILL"."""
        ru = self.units[name]
        if ru.state is S.FAILED or ru.dead or (ru.state is S.STOPPING and ru.cause is Cause.FAILURE):
            return f"{name}, which failed: {ru.cause_text or ru.reason}"
        if ru.goal is Goal.INACTIVE:
            return f"{name}, which {'is stopping with the stack' if self.sup.shutting_down else 'was stopped by request'}"
        if name not in seen:
            for r in ru.spec.requires:
                if self.down(self.units[r], seen | {name}):
                    return f"{name}, which requires {self.root_cause(r, seen | {name})}"
        return f"{name}, which is {ru.state.value}" + (f" ({ru.reason})" if ru.reason else "")

    def blocked_by_dependents(self, rt: UnitRuntime) -> bool:
        """Units ordered after this one that are going down must be gone first: a unit stops
        only after its dependents, and starts again only once they have stopped (a restarted
        base must not meet the old dependent that still talks to its predecessor)."""
        for d in self.after[rt.name]:
            du = self.units[d]
            if du.state is S.STOPPING:
                return True
            if du.state in (S.STARTING, S.ACTIVE) and (du.dead or self.must_stop(du) is not None):
                return True
        return False

    # ------------------------------------------------------------ up
    def will_start(self, rt: UnitRuntime) -> bool:
        """Would this unit be started (now or later) without an operator?"""
        if rt.goal is not Goal.ACTIVE or rt.book.gave_up or groups.down_for_good(rt):
            return False
        if rt.state is S.FAILED:
            return rt.book.restart_pending
        return True

    def requirements_up(self, rt: UnitRuntime) -> bool:
        for r in rt.spec.requires:
            ru = self.units[r]
            if ru.state is not S.ACTIVE or self.down(ru):
                return False
        for a in rt.spec.dependencies:
            au = self.units[a]
            if au.state is S.ACTIVE:
                continue
            if au.state in (S.STARTING, S.STOPPING) or au.busy or self.will_start(au):
                return False
        return True

    def start_event(self, rt: UnitRuntime, now: float) -> Event | None:
        """START_REQUESTED or RESTART_DUE when this unit is to be spawned now, else None."""
        if rt.busy or rt.goal is not Goal.ACTIVE or rt.book.gave_up or self.sup.shutting_down:
            return None
        if rt.state not in (S.INACTIVE, S.FAILED) or self.blocked_by_dependents(rt):
            return None
        if rt.spec.worker_group:
            ok = groups.member_may_start(self.sup, rt, now)
        elif rt.state is S.FAILED:
            ok = rt.book.restart_pending and now >= rt.book.restart_at and self.requirements_up(rt)
        else:
            ok = self.requirements_up(rt)
        if not ok:
            return None
        return E.RESTART_DUE if rt.state is S.FAILED and rt.book.restart_pending else E.START_REQUESTED

    # ------------------------------------------------------------ settled
    def stuck(self, rt: UnitRuntime) -> bool:
        """An inactive unit that will not start without an operator (a requirement gave up)."""
        for r in rt.spec.requires:
            ru = self.units[r]
            if ru.state is S.FAILED and not ru.book.restart_pending and not ru.busy:
                return True
            if ru.state is S.INACTIVE and not ru.busy and (ru.goal is Goal.INACTIVE or self.stuck(ru)
                                                           or groups.down_for_good(ru)):
                return True
        return False

    def settled_up(self, rt: UnitRuntime) -> bool:
        """A unit a start waits for is done: active, or failed/inactive for good."""
        if rt.busy:
            return False
        if rt.state is S.ACTIVE:
            return True
        if rt.state is S.FAILED:
            return not rt.book.restart_pending
        return rt.state is S.INACTIVE and (self.stuck(rt) or groups.down_for_good(rt))

    def settled_down(self, rt: UnitRuntime) -> bool:
        return not rt.busy and rt.state in (S.INACTIVE, S.FAILED) and rt.phase is Phase.IDLE

    # ------------------------------------------------------------ reasons
    def refresh_waiting_reasons(self) -> None:
        """A unit stopped for a requirement keeps naming the current root cause (after
        every converge); so does one that wants to run but never started because a
        requirement failed for good before it could (else its reason would be empty)."""
        for rt in self.units.values():
            if rt.state is not S.INACTIVE or rt.busy:
                continue
            if rt.cause is Cause.REQUIREMENT:
                prefix = "stopped"
            elif rt.goal is Goal.ACTIVE and (not rt.reason or rt.reason.startswith("not started: ")) \
                    and self.stuck(rt):
                prefix = "not started"
            else:
                continue
            for r in rt.spec.requires:
                if self.down(self.units[r]):
                    why = f"{prefix}: requires {self.root_cause(r)}"
                    if why != rt.reason:
                        rt.reason = why
                        self.sup.notify_changed()
                    break
