"""The kill policy's seam on cgroups: omnid.process.termination's Targets for a unit with a
cgroup (`CgroupTarget`, systemd's KillMode=control-group) and for a cgroup with no main
process of ours (`ResidueCgroupTarget`), and omnid.process.unitprocs' cgroup backend
(`CgroupProcesses`: what of a unit is left in its cgroup). A member is signalled through
its pidfd, and only while the kernel says it is in the cgroup; escalation is `cgroup.kill`;
gone is `populated 0`, seen as an event."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from omnid.base import linux
from omnid.process import cgroupfs
from omnid.process.cgroupunit import UnitCgroup
from omnid.process.cgroupwatch import EmptyWatch
from omnid.process.handle import ProcessHandle, Survivor, group_alive

ZOMBIE_REAP_S = 1.0  # a unit's last zombies, reaped by the spawner after `populated 0`


def _signal_members(path: str, name: str, sig: int) -> None:
    """`sig` to every process of the cgroup (and below): each through a pidfd, and only if
    it is still in the cgroup once its pidfd is open and has not exited after that read
    (linux.pidfd_if: then the read was about the process behind the fd)."""
    for pid in cgroupfs.tree_procs(path):
        fd = linux.pidfd_if(pid, lambda p=pid: cgroupfs.pid_in_cgroup(p, name))
        if fd is not None:
            try:
                linux.pidfd_send_signal(fd, sig)
            finally:
                os.close(fd)


def _survivors(path: str) -> list[Survivor]:
    out = []
    for pid in cgroupfs.tree_procs(path):
        st = linux.read_stat(pid)
        if st is not None and st.state not in ("Z", "X"):
            out.append(Survivor(pid, st.comm, st.state, "", f"pid {pid} ({st.comm}) in cgroup {path}", st.start_time))
    return out


class CgroupProcesses:
    """omnid.process.unitprocs' cgroup backend: what of a unit is left in its cgroup. Gone = the
    main process reaped (with none: nothing runs in the cgroup), `populated 0` in
    cgroup.events, and the process group empty: `populated 0` comes when the last process
    exits, before its reap, and its zombie still holds the group until the spawner (the
    subreaper) reaps it, moments later."""

    def __init__(self, watch: EmptyWatch, path: str, h: ProcessHandle | None = None) -> None:
        self.watch = watch
        self.path = path
        self.h = h

    def main_gone(self) -> bool:
        return self.h.reaped.is_set() if self.h is not None else not cgroupfs.populated(self.path)

    def left(self) -> bool:
        return cgroupfs.populated(self.path) or (self.h is not None and group_alive(self.h.pgid))

    def gone(self) -> bool:
        return self.main_gone() and not self.left()

    def members(self) -> list[Survivor]:
        return _survivors(self.path)

    async def wait_gone(self, deadline: float) -> bool:
        if self.h is None:
            return await self.watch.wait_empty(self.path, deadline)
        try:
            await asyncio.wait_for(self.h.reaped.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return False
        if not await self.watch.wait_empty(self.path, deadline):
            return False
        # The cgroup is empty, so what holds the group's number is a zombie of ours; the wait
        # is bounded all the same (ZOMBIE_REAP_S) in case the number was taken since.
        until = min(deadline, time.monotonic() + ZOMBIE_REAP_S)
        while group_alive(self.h.pgid) and time.monotonic() < until:
            await asyncio.sleep(0.005)
        return True


class CgroupTarget:
    """omnid.process.termination's Target for a unit with a cgroup (systemd's KillMode=control-group):
    the signal goes to the main process, its group (as the process-group backend does) and
    every process of the cgroup; kill_all is `cgroup.kill`; gone is CgroupProcesses', seen
    as an event, and then the directory is removed."""

    def __init__(self, unit: str, h: ProcessHandle, token: str | None, cg: UnitCgroup) -> None:
        self.name = unit
        self.h = h
        self.token = token
        self.cg = cg
        self.procs = CgroupProcesses(cg.watch, cg.path, h)
        self._proc_name = cgroupfs.proc_name(cg.path)

    def signal_all(self, sig: int) -> None:
        # The group by number first (one killpg) while its leader proves it ours; once the
        # leader is reaped (the leftovers of a dead main process, the rest under kill_mode
        # mixed / process) the cgroup holds every process of the group, and the group's tagged
        # members would be a scan of all of /proc (0.3-0.7 s on a loaded host) on the loop.
        if not self.h.reaped.is_set():
            self.h.signal_group(sig, self.token)
        if sig == signal.SIGKILL:
            self.cg.kill()
            return
        _signal_members(self.cg.path, self._proc_name, sig)

    def signal_main(self, sig: int) -> bool:
        return self.h.signal(sig)

    def kill_all(self) -> None:
        self.h.signal(signal.SIGKILL)
        self.cg.kill()

    async def wait_gone(self, deadline: float) -> bool:
        if not await self.procs.wait_gone(deadline):
            return False
        self.cg.release()
        return True

    def members(self) -> list[Survivor]:
        return self.procs.members()


class ResidueCgroupTarget:
    """omnid.process.termination's Target for a cgroup with no main process of ours: a previous
    daemon's unit cgroup, or what an unkillable instance left. Everything in it is
    ours by path (the root is omnid's); kill_all is `cgroup.kill`."""

    def __init__(self, watch: EmptyWatch, path: str) -> None:
        self.path = path
        self.name = f"cgroup {path}"
        self.procs = CgroupProcesses(watch, path)

    def signal_all(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self.kill_all()
            return
        _signal_members(self.path, cgroupfs.proc_name(self.path), sig)

    def signal_main(self, sig: int) -> bool:
        self.signal_all(sig)  # no main process of ours: everything is the target
        return cgroupfs.populated(self.path)

    def kill_all(self) -> None:
        cgroupfs.kill(self.path)

    async def wait_gone(self, deadline: float) -> bool:
        return await self.procs.wait_gone(deadline)

    def members(self) -> list[Survivor]:
        return self.procs.members()
