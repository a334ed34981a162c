"""The invariant: a unit's state agrees with the kernel (omnid.unit(5), "Lifecycle").
Checked after every published state change in tests (OMNID_CHECK_INVARIANTS=1) and by
`omnid status --verify`:

- starting, active: the main process is alive and its pidfd is held;
- stopping: anything may be alive or just gone (the stop is under way);
- inactive, failed: the main process is reaped, no fd is held for it, and its
  process group and cgroup are empty -- zombies included, but for a group whose every
  member is a zombie: dead, their parents gone, they are the spawner's (the subreaper's) to
  reap, which it does in its next turn; a check at the transition can see them (a loaded host).

An inactive unit holds no handle, and its last group number alone proves nothing: once the
group emptied, the number may be a stranger's group. A live group counts as the unit's only
where a live member could be one of its processes: a descendant of the spawner (every
process of a unit is one, its subreaper's), not below another unit's live main process
(another session), and in the session the unit's main process made (its pid: every process
of the unit's group is in it, and a group of that number in another session is a stranger's).
What this cannot tell apart without reading environments (another process's mm lock): another
unit's escaped orphan that made a session of its own and was given the old number.
"""

from __future__ import annotations

from collections.abc import Collection

from omnid.base import linux
from omnid.core.lifecycle import UnitState
from omnid.core.runtime import UnitRuntime
from omnid.process.handle import group_alive

S = UnitState


def verify_unit(rt: UnitRuntime, cgroups: object | None, settled: bool = False, *, spawner_pid: int = 0,
                mains: Collection[int] = ()) -> list[str]:
    """Compare one unit's state with /proc. `spawner_pid`: the spawner, whose descendants the
    unit's processes are (0: unknown, every process on the host is looked at); `mains`: the
    units' live main processes, whose subtrees are other units'."""
    problems = []
    h = rt.proc
    st = rt.state
    if st in (S.STARTING, S.ACTIVE):
        if h is None or h.pidfd < 0:
            problems.append(f"{rt.name}: {st.value} without a held pidfd")
        else:
            ps = linux.read_stat(h.pid)
            alive = ps is not None and ps.start_time == h.start_time and ps.state not in ("Z", "X")
            # A dead main process is consistent only while its death is already on its way
            # to the loop (pidfd readable, or the exit report in): realigned in ms.
            if not alive and settled and not (h.exited.is_set() or h.reaped.is_set() or not h.leader_alive()):
                problems.append(f"{rt.name}: {st.value} but main process {h.pid} is not alive")
    elif st is S.STOPPING:
        pass  # the stop is in charge; anything may be alive or just gone
    else:
        if h is not None:
            problems.append(f"{rt.name}: {st.value} but still holds process {h.pid}")
        if rt.output.attached:
            problems.append(f"{rt.name}: {st.value} but its output pipe is open")
        if left := group_members(rt.last_pgid, spawner_pid, mains):
            problems.append(f"{rt.name}: {st.value} but process group {rt.last_pgid} is not empty "
                            f"(pids {', '.join(str(p.pid) for p in left)})")
        cg = cgroups.get(rt.name) if cgroups else None  # type: ignore[attr-defined]
        if cg is not None and cg.pids():  # residue read from cgroup.procs
            problems.append(f"{rt.name}: {st.value} but cgroup {cg.path} holds pids {cg.pids()}")
    return problems


def verify(units: dict[str, UnitRuntime], cgroups: object | None, *, spawner_pid: int = 0,
           mains: Collection[int] = ()) -> list[str]:
    problems: list[str] = []
    for rt in units.values():
        if not rt.busy:
            problems.extend(verify_unit(rt, cgroups, settled=True, spawner_pid=spawner_pid, mains=mains))
    return problems


def group_members(pgid: int, spawner_pid: int, mains: Collection[int] = ()) -> list[linux.ProcStat]:
    """The live members (zombies are dead) of process group `pgid` that could be a unit's whose
    main process had that pid (the module's docstring): none when the group is empty or a
    stranger's. The walk is the spawner's descendants, other units' subtrees pruned."""
    if not group_alive(pgid):
        return []
    procs = linux.descendants(spawner_pid, frozenset(mains)) if spawner_pid > 0 else linux.scan()
    return [p for p in procs if p.pgid == pgid and p.sid == pgid and p.state not in ("Z", "X")]
