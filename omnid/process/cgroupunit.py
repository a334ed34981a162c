"""The cgroup of one unit instance (`<root>/<escaped unit name>`), and the unit keys that
become its files. omnid.process.cgrouproot makes and forgets them; the kill targets
(omnid.process.cgrouptargets) act on them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omnid.process import cgroupfs
from omnid.process.cgroupwatch import EmptyWatch


@dataclass(frozen=True)
class Limits:
    """Unit keys that become cgroup files (None: not set)."""

    memory_max: int | None = None
    tasks_max: int | None = None


def cgroup_limits(spec) -> Limits | None:
    """The cgroup files a unit's keys ask for (memory_max, tasks_max), or None."""
    lim = Limits(memory_max=getattr(spec, "memory_max", None), tasks_max=getattr(spec, "tasks_max", None))
    return lim if lim != Limits() else None


class UnitCgroup:
    """The cgroup of one unit instance. `release` is its root's: once the unit is gone, the
    root removes the directory if nothing runs there and forgets it."""

    def __init__(self, unit: str, path: str, watch: EmptyWatch, release: Callable[[str], None]) -> None:
        self.unit = unit
        self.path = path
        self.watch = watch
        self._release = release

    def pids(self) -> list[int]:
        return cgroupfs.tree_procs(self.path)

    def populated(self) -> bool:
        return cgroupfs.populated(self.path)

    def kill(self) -> None:
        """SIGKILL to every process of the cgroup and its sub-cgroups, by the kernel."""
        cgroupfs.kill(self.path)

    async def wait_empty(self, deadline: float) -> bool:
        return await self.watch.wait_empty(self.path, deadline)

    def remove(self) -> bool:
        """rmdir once empty (sub-cgroups first); False while something still runs in it."""
        return cgroupfs.remove_tree(self.path)

    def release(self) -> None:
        """The unit is gone: its root removes this cgroup if nothing runs there."""
        self._release(self.unit)

    def figures(self) -> dict:
        return cgroupfs.figures(self.path)
