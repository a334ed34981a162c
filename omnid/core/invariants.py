"""The invariant: a unit's state agrees with the kernel (omnid.unit(5), "Lifecycle").
Checked after every published state change in tests (OMNID_CHECK_INVARIANTS=1) and by
`omnid status --verify`:

- starting, active: the main process is alive and its pidfd is held;
- stopping: anything may be alive or just gone (the stop is under way);
- inactive, failed: the main process is reaped, no fd is held for it, and its
  process group and cgroup are empty -- zombies included, but for a group whose every
  member is a zombie: dead, their parents gone, they are the spawner's (the subreaper's) to
  reap, which it does in its next turn; a check at the transition can see them (a loaded host).
"""

from __future__ import annotations

from omnid.base import linux
from omnid.core.lifecycle import UnitState
from omnid.core.runtime import UnitRuntime
from omnid.process.handle import group_alive

S = UnitState


def verify_unit(rt: UnitRuntime, cgroups: object | None, settled: bool = False) -> list[str]:
    """Compare one unit's state with /proc."""
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
        if group_alive(rt.last_pgid) and not only_zombies(rt.last_pgid):
            problems.append(f"{rt.name}: {st.value} but process group {rt.last_pgid} is not empty")
        cg = cgroups.get(rt.name) if cgroups else None  # type: ignore[attr-defined]
        if cg is not None and cg.pids():  # residue read from cgroup.procs
            problems.append(f"{rt.name}: {st.value} but cgroup {cg.path} holds pids {cg.pids()}")
    return problems


def verify(units: dict[str, UnitRuntime], cgroups: object | None) -> list[str]:
    problems: list[str] = []
    for rt in units.values():
        if not rt.busy:
            problems.extend(verify_unit(rt, cgroups, settled=True))
    return problems


def only_zombies(pgid: int) -> bool:
    """Is every process of the group a zombie (none alive)? A scan of /proc: for checks only."""
    return all(p.state in ("Z", "X") for p in linux.scan() if p.pgid == pgid)
