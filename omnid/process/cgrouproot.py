"""A cgroup v2 root that belongs to this omnid daemon, and the unit cgroups below it: each
unit instance runs in `<root>/<escaped unit name>`, made empty with its limits written
before the spawn (the child joins it between fork and exec), removed once the unit is
gone. Everything below the root except the daemon's leaf is omnid's, so a previous
daemon's cgroups found there are killed and removed. How a root is found and claimed is
omnid.process.cgroupdiscovery's."""

from __future__ import annotations

import asyncio
import errno
import os
import signal

import structlog

from omnid.base import promtext
from omnid.process import cgroupfs
from omnid.process.cgroupfs import DAEMON_LEAF
from omnid.process.cgrouptargets import ResidueCgroupTarget
from omnid.process.cgroupunit import Limits, UnitCgroup
from omnid.process.cgroupwatch import EmptyWatch
from omnid.process.termination import terminate

log = structlog.get_logger("omnid.process.cgroup")

# Controllers omnid enables for its units when the root offers them (the figures and the
# memory_max / tasks_max keys need them in the root's cgroup.subtree_control).
WANTED_CONTROLLERS = ("cpu", "memory", "pids")
KEY_CONTROLLER = {"memory_max": "memory", "tasks_max": "pids"}


class CgroupRoot:
    """A writable cgroup v2 directory that belongs to this omnid daemon."""

    def __init__(self, path: str, source: str) -> None:
        self.path = path
        self.source = source
        self.watch = EmptyWatch()
        self.units: dict[str, UnitCgroup] = {}
        self.controllers = self._enable_controllers()

    def _enable_controllers(self) -> frozenset[str]:
        offered = set((cgroupfs.read(os.path.join(self.path, "cgroup.controllers")) or "").split())
        enabled = set((cgroupfs.read(os.path.join(self.path, "cgroup.subtree_control")) or "").split())
        for c in WANTED_CONTROLLERS:
            if c in offered and c not in enabled:
                try:
                    cgroupfs.write(os.path.join(self.path, "cgroup.subtree_control"), f"+{c}")
                    enabled.add(c)
                except OSError as exc:
                    log.warning("cannot enable cgroup controller", root=self.path, controller=c, error=str(exc))
        return frozenset(enabled)

    def describe(self) -> dict:
        return {"backend": "cgroup", "cgroup": self.path, "source": self.source,
                "controllers": sorted(self.controllers)}

    def check_keys(self, unit: str, keys: dict[str, object]) -> list[str]:
        """Errors for memory_max / tasks_max that this root cannot honour."""
        errs = []
        for key, value in keys.items():
            if value is None:
                continue
            c = KEY_CONTROLLER[key]
            if c not in self.controllers:
                errs.append(f"unit {unit}: {key}: needs the {c} controller in cgroup root {self.path}, which "
                            f"offers {', '.join(sorted(self.controllers)) or 'none'} (in a hybrid layout "
                            f"{c} is usually mounted as cgroup v1)")
        return errs

    def _unit_cgroup(self, unit: str, path: str) -> UnitCgroup:
        return UnitCgroup(unit, path, self.watch, self.release)

    def create(self, unit: str, limits: Limits | None = None) -> UnitCgroup:
        """The cgroup of a new instance of unit: made empty, limits written, before the spawn."""
        path = os.path.join(self.path, cgroupfs.escape(unit))
        if os.path.isdir(path) and cgroupfs.populated(path):
            # The previous instance's residue must be killed first (residue() + terminate).
            raise OSError(errno.EBUSY, f"cgroup {path} still holds pids {cgroupfs.tree_procs(path)}")
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        if limits is not None:
            if limits.memory_max is not None:
                cgroupfs.write(os.path.join(path, "memory.max"), str(limits.memory_max))
            if limits.tasks_max is not None:
                cgroupfs.write(os.path.join(path, "pids.max"), str(limits.tasks_max))
        cg = self._unit_cgroup(unit, path)
        self.units[unit] = cg
        return cg

    def get(self, unit: str) -> UnitCgroup | None:
        return self.units.get(unit)

    def handover(self) -> dict:
        """For the next program of this daemon (omnid reexec): the root and each unit's cgroup."""
        return {"path": self.path, "source": self.source, "units": {u: cg.path for u, cg in self.units.items()}}

    @classmethod
    def take_over(cls, d: dict) -> CgroupRoot:
        """The root a previous program of this daemon used, with its units' cgroups as they
        are: nothing is cleaned (what runs there is this daemon's own units)."""
        root = cls(str(d["path"]), str(d["source"]))
        for unit, path in d["units"].items():
            if not str(path).startswith(root.path + "/"):
                raise ValueError(f"cgroup {path!r} of unit {unit} is not under the root {root.path}")
            root.units[str(unit)] = root._unit_cgroup(str(unit), str(path))
        return root

    def release(self, unit: str) -> None:
        """The unit is gone: rmdir its cgroup if nothing runs there (else it stays listed)."""
        cg = self.units.get(unit)
        if cg is not None and not cg.populated() and cg.remove():
            del self.units[unit]

    def stale(self) -> list[str]:
        """Cgroups below the root that no unit of this daemon made: a previous daemon's."""
        try:
            names = sorted(os.listdir(self.path))
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            p = os.path.join(self.path, n)
            if n != DAEMON_LEAF and os.path.isdir(p) and not any(cg.path == p for cg in self.units.values()):
                out.append(p)
        return out

    def clean_stale(self, timeout: float = 5.0) -> list[str]:
        """Kill and remove a previous daemon's cgroups (at daemon start, before the loop runs),
        through the one kill policy. They are ours by path: the root is omnid's. Returns what
        could not be removed, described."""
        left = []
        for p in self.stale():
            if cgroupfs.populated(p):
                log.warning("killing a previous daemon's unit cgroup", cgroup=p, pids=cgroupfs.tree_procs(p))
                asyncio.run(terminate(ResidueCgroupTarget(self.watch, p), signal.SIGKILL, timeout, 0.0,
                                      send_cont=False))
            if cgroupfs.populated(p) or not cgroupfs.remove_tree(p):
                left.append(f"{p} (pids {cgroupfs.tree_procs(p)})")
        return left

    def residue(self, unit: str) -> ResidueCgroupTarget | None:
        """What still runs in a unit's cgroup before its next start (an unkillable previous
        instance), as a Target for the kill policy; None when it is empty or absent."""
        path = os.path.join(self.path, cgroupfs.escape(unit))
        target = ResidueCgroupTarget(self.watch, path) if os.path.isdir(path) else None
        return target if target is not None and target.procs.left() else None

    def write_metrics(self, page: promtext.Page) -> None:
        """Every unit cgroup's figures onto `page` (omnid.promtext.Page; health.py's /metrics).
        A figure no cgroup has (its controller is not enabled) gets no family at all."""
        names = {"memory_current": ("omnid_unit_cgroup_memory_bytes", page.gauge,
                                    "memory.current of the unit's cgroup"),
                 "memory_peak": ("omnid_unit_cgroup_memory_peak_bytes", page.gauge, "memory.peak of the unit's cgroup"),
                 "cpu_usage_usec": ("omnid_unit_cgroup_cpu_usage_usec_total", page.counter,
                                    "cpu.stat usage_usec of the unit's cgroup"),
                 "pids_current": ("omnid_unit_cgroup_pids", page.gauge, "pids.current of the unit's cgroup")}
        figs = {u: cg.figures() for u, cg in sorted(self.units.items())}
        for key, (metric, declare, help_) in names.items():
            rows = [(u, f[key]) for u, f in figs.items() if key in f]
            if rows:
                fam = declare(metric, help_)
                for u, v in rows:
                    fam.add(v, unit=u)

    def snapshot(self, unit: str) -> dict:
        cg = self.units.get(unit)
        if cg is None:
            return {"cgroup": None}
        return {"cgroup": cg.path, "cgroup_figures": cg.figures()}

    def close(self) -> None:
        self.watch.close()
