"""Worker groups (omnid.unit(5) `worker_group`): units whose members fail, stop and
restart together, like a torchelastic worker group, so that no rank is left blocked
in a collective holding its GPU. A group's members share one RestartBook; a
generation opens when the group starts and goes down with its first failed member.

Also here, because every start passes through it: counting a start (a group's
generation counts once) and the environment that says which start it is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import structlog

from omnid.core import policy
from omnid.core.lifecycle import Cause, Goal, Phase, UnitState
from omnid.core.runtime import UnitRuntime
from omnid.core.centre import Centre


log = structlog.get_logger("omnid.supervisor")
S = UnitState
_PID_SUFFIX = re.compile(r" \(pid \d+, while \w+\)")


def without_pid(what: str) -> str:
    """A failure as dependents name it: "killed by SIGKILL", not "... (pid 12, while active)"."""
    return _PID_SUFFIX.sub("", what)


def _cross(sup: Centre, rt: UnitRuntime):
    """The group's side across hosts (omnid.core.crosshost), or None for a group on this host."""
    ch = getattr(sup, "crosshost", None)
    return ch if ch is not None and ch.link(rt) is not None else None


def members(sup: Centre, rt: UnitRuntime) -> list[UnitRuntime]:
    return [sup.units[m] for m in sup.stack.group_members(rt.name)]


def settled(sup: Centre, rt: UnitRuntime, skip: frozenset[str] = frozenset()) -> bool:
    """Is every member of rt's worker group down, with nothing under way?"""
    return all(m.name in skip or (not m.busy and m.state in (S.INACTIVE, S.FAILED)) for m in members(sup, rt))


def down_for_good(rt: UnitRuntime) -> bool:
    """A member failed and the group will not restart by itself (restart = "no", start limit)."""
    book = rt.book
    return bool(rt.spec.worker_group) and book.down_reason is not None and (book.gave_up or not book.restart_pending)


def member_may_start(sup: Centre, rt: UnitRuntime, now: float) -> bool:
    if rt.book.up:
        # The group's generation is open: a member that is down joins it at once.
        return rt.state in (S.INACTIVE, S.FAILED) and sup.schedule.requirements_up(rt)
    # A new generation starts only once every member is down (none left blocked in a
    # collective of the old one) and the group's backoff has passed.
    if not settled(sup, rt) or down_for_good(rt):
        return False
    if rt.book.restart_pending and now < rt.book.restart_at:
        return False
    if any(m.goal is not Goal.ACTIVE for m in members(sup, rt)):
        return False
    if not sup.schedule.requirements_up(rt):
        return False
    ch = _cross(sup, rt)  # across hosts: only once every host has joined the generation
    return ch is None or ch.may_open(rt)


def member_failed(sup: Centre, rt: UnitRuntime, what: str) -> None:
    """The generation is down: every other member is stopped now (converge feeds GROUP_DOWN),
    or survivors of a dead rank would hang in their next collective, holding their GPUs."""
    if rt.book.down_reason is None:
        rt.book.down_reason = f"{rt.name} failed: {what}"
        rt.book.up = False
        ch = _cross(sup, rt)
        if ch is not None:  # every other host stops its members too
            ch.member_failed(rt, without_pid(what))
        sup.kick()


def count_start(sup: Centre, rt: UnitRuntime, now: float) -> str:
    """Count a start (a worker group's when its generation opens: once for the group) and
    return the reason the `starting` state will carry."""
    spec, book = rt.spec, rt.book
    # RESTARTS counts automatic restarts only (omnid(8)): a start after the unit's own failure,
    # or after its worker group went down with a failed member; never one an operator asked for
    # (start, restart, reload), nor a dependent's start after its requirement came back.
    automatic = not rt.start_requested and (rt.state is S.FAILED
                                            or (bool(spec.worker_group) and rt.cause is Cause.GROUP))
    rt.start_requested = False
    if spec.worker_group:
        if not book.up:
            policy.starts_in_window(book, spec, now)
            book.start_times.append(now)
            ch = _cross(sup, rt)
            book.generation = ch.opened(rt) if ch is not None else book.generation + 1
            book.up = True
            book.down_reason = None
            book.failure_counted = False
            book.restart_pending = False
            log.info("worker group starting", group=spec.worker_group, generation=book.generation,
                     members=list(sup.stack.group_members(rt.name)))
    else:
        policy.starts_in_window(book, spec, now)
        book.start_times.append(now)
        book.generation += 1
        book.restart_pending = False
    if automatic:
        rt.restarts += 1
    rt.notified_ready = False
    rt.stopping_notified = False
    rt.status_text = ""
    if spec.worker_group and book.generation > 1:
        return f"worker group {spec.worker_group} generation {book.generation}"
    return f"restart {rt.restarts} after: {rt.last_exit}" if automatic else "starting"


def environment(sup: Centre, rt: UnitRuntime) -> Mapping[str, str]:
    """OMNID_GENERATION for every unit; a worker group's rank and size; torch's env:// rendezvous."""
    env = {"OMNID_GENERATION": str(rt.book.generation)}
    spec = rt.spec
    if not spec.worker_group:
        return env
    names = sup.stack.group_members(rt.name)
    rank = names.index(rt.name)
    env.update(OMNID_WORKER_GROUP=spec.worker_group, OMNID_GROUP_RANK=str(rank), OMNID_GROUP_SIZE=str(len(names)))
    td = spec.torch_distributed
    if td is not None:
        env.update(MASTER_ADDR=td.master_addr, MASTER_PORT=str(td.master_port), RANK=str(rank),
                   WORLD_SIZE=str(len(names)), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(len(names)))
    ch = _cross(sup, rt)
    if ch is not None:  # ranks across hosts: RANK = host index x local size + local index, ...
        env.update(ch.environment(rt))
    return env


def stop_reason(sup: Centre, rt: UnitRuntime) -> tuple[bool, str] | None:
    """For a group across hosts whose generation is down: (fenced, reason); else None."""
    ch = _cross(sup, rt)
    return ch.stop_event(rt) if ch is not None else None


def decided(sup: Centre, rt: UnitRuntime, decision) -> None:
    """The restart policy decided after this member's failure (omnid.core.executor)."""
    ch = _cross(sup, rt)
    if ch is not None:
        ch.decided(rt, decision)


def after_end(sup: Centre, rt: UnitRuntime) -> None:
    """rt ended (inactive or failed): once every member is down, the next start is a new generation."""
    if rt.spec.worker_group and rt.book.up and rt.phase is Phase.IDLE and settled(sup, rt):
        rt.book.up = False
    ch = _cross(sup, rt)
    if ch is not None and rt.phase is Phase.IDLE and settled(sup, rt):
        ch.settled(rt)
