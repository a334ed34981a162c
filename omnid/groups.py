"""Worker groups (omnid.unit(5) `worker_group`): units whose members fail, stop and restart
together, like a torchelastic worker group, so that no rank is left blocked in a collective
holding its GPU. The restart bookkeeping of a group is one `RestartBook` shared by its
members; these rules are mixed into `omnid.supervisor.Supervisor`, whose `_converge` still
decides everything (it asks `_member_may_start`, and stops members through `_must_stop`)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from omnid.states import Goal, UnitState

if TYPE_CHECKING:
    from omnid.supervisor import Unit

log = structlog.get_logger("omnid.supervisor")
S = UnitState


@dataclass
class RestartBook:
    """Restart bookkeeping: one per unit, or one shared by every member of a worker group,
    so that backoff, the start limit and the generation count the group as one thing."""

    start_times: collections.deque = field(default_factory=collections.deque)
    consecutive_failures: int = 0
    restart_at: float = 0.0  # monotonic; no automatic start before
    restart_pending: bool = False
    gave_up: bool = False
    generation: int = 0  # starts so far (a worker group's start counts once)
    # Worker groups only: the group is up (a generation was opened and none of its members
    # failed yet); `down_reason` names the member whose failure took the generation down.
    up: bool = False
    down_reason: str | None = None
    failure_counted: bool = False


def book_field(name: str) -> property:
    """A Unit attribute that lives in its RestartBook (shared by a worker group's members)."""
    return property(lambda u: getattr(u.book, name), lambda u, value: setattr(u.book, name, value))


class WorkerGroups:
    @staticmethod
    def _group_down_for_good(u: Unit) -> bool:
        """A member failed and the group will not restart by itself (restart = "no", start limit)."""
        book = u.book
        return bool(u.spec.worker_group) and book.down_reason is not None and (book.gave_up or not book.restart_pending)

    def _group_settled(self, u: Unit, skip: frozenset = frozenset()) -> bool:
        """Is every member of u's worker group down, with nothing under way?"""
        for m in self.stack.group_members(u.name):
            mu = self.units[m]
            if m not in skip and (mu.op is not None or mu.state not in (S.INACTIVE, S.FAILED)):
                return False
        return True

    def _member_may_start(self, u: Unit, now: float) -> bool:
        if u.book.up:
            # The group's generation is open: a member that is down joins it at once.
            return u.state in (S.INACTIVE, S.FAILED) and self._requirements_up(u)
        # A new generation starts only once every member is down (none left blocked in a
        # collective of the old one) and the group's backoff has passed.
        if not self._group_settled(u) or self._group_down_for_good(u):
            return False
        if u.book.restart_pending and now < u.book.restart_at:
            return False
        if any(self.units[m].goal is not Goal.ACTIVE for m in self.stack.group_members(u.name)):
            return False
        return self._requirements_up(u)

    def _member_failed(self, u: Unit, what: str) -> None:
        if u.book.down_reason is None:
            # Every other member is stopped now (converge): survivors of a dead rank would hang
            # in their next collective, holding their GPUs.
            u.book.down_reason = f"{u.name} failed: {what}"
            u.book.up = False
            self._kick()

    def _open_generation(self, u: Unit, now: float) -> None:
        """A worker group starts (again) as one: counted once against its start limit."""
        book = u.book
        self._count_start(u, now)
        book.start_times.append(now)
        book.generation += 1
        book.up = True
        book.down_reason = None
        book.failure_counted = False
        book.restart_pending = False
        log.info("worker group starting", group=u.spec.worker_group, generation=book.generation,
                 members=list(self.stack.group_members(u.name)))

    def _group_env(self, u: Unit) -> dict[str, str]:
        """OMNID_GENERATION for every unit; a worker group's rank and size; torch's env:// rendezvous."""
        env = {"OMNID_GENERATION": str(u.book.generation)}
        if not u.spec.worker_group:
            return env
        members = self.stack.group_members(u.name)
        rank = members.index(u.name)
        env.update(OMNID_WORKER_GROUP=u.spec.worker_group, OMNID_GROUP_RANK=str(rank),
                   OMNID_GROUP_SIZE=str(len(members)))
        td = u.spec.torch_distributed
        if td is not None:
            env.update(MASTER_ADDR=td.master_addr, MASTER_PORT=str(td.master_port), RANK=str(rank),
                       WORLD_SIZE=str(len(members)), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(len(members)))
        return env
