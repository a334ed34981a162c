"""The invariant (DESIGN.md "Unit state machine"): a unit's state agrees with the
kernel. Checked after every transition in tests and by `omnid status --verify`.
Mixed into `omnid.supervisor.Supervisor`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnid import linux
from omnid.process import group_alive
from omnid.states import UnitState

if TYPE_CHECKING:
    from omnid.supervisor import Unit

S = UnitState


class Invariants:
    def verify_unit(self, u: Unit, settled: bool = False) -> list[str]:
        """Compare a unit's state with /proc (DESIGN.md's invariant)."""
        problems = []
        h = u.proc
        st = u.state
        if st in (S.STARTING, S.ACTIVE):
            if h is None or h.pidfd < 0:
                problems.append(f"{u.name}: {st.value} without a held pidfd")
            else:
                ps = linux.read_stat(h.pid)
                alive = ps is not None and ps.start_time == h.start_time and ps.state not in ("Z", "X")
                # A dead main process is consistent only while its death is already on its
                # way to the loop (pidfd readable, or the exit report in): realigned in ms.
                if not alive and settled and not (h.exited.is_set() or h.reaped.is_set()
                                                  or not h.leader_alive()):
                    problems.append(f"{u.name}: {st.value} but main process {h.pid} is not alive")
        elif st is S.STOPPING:
            pass  # the stop op is in charge; anything may be alive or just gone
        else:
            if h is not None:
                problems.append(f"{u.name}: {st.value} but still holds process {h.pid}")
            if u.output is not None and u.output.attached:
                problems.append(f"{u.name}: {st.value} but its output pipe is open")
            if group_alive(u.last_pgid):
                problems.append(f"{u.name}: {st.value} but process group {u.last_pgid} is not empty")
            cg = self.cgroups.get(u.name) if self.cgroups else None
            if cg is not None and cg.pids():  # cgroup hook: residue read from cgroup.procs
                problems.append(f"{u.name}: {st.value} but cgroup {cg.path} holds pids {cg.pids()}")
        return problems

    def verify(self) -> list[str]:
        problems: list[str] = []
        for u in self.units.values():
            if u.op is None:
                problems.extend(self.verify_unit(u, settled=True))
        return problems

    def snapshot(self) -> list[dict]:
        out = []
        for n in self.order:
            snap = self.units[n].snapshot()
            if n in self.gpu_mib:
                snap["gpu_mib"] = self.gpu_mib[n]
            if n in self.degraded:
                snap["degraded"] = self.degraded[n]
            if self.cgroups:
                snap.update(self.cgroups.snapshot(n))  # cgroup hook
            out.append(snap)
        return out

    def idle(self) -> bool:
        return all(u.op is None for u in self.units.values())
