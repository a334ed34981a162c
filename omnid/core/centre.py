"""The supervisor's face toward its parts (executor, monitors, schedule, requests,
groups): what they may read and call, and nothing else. They are handed the
supervisor as a `Centre` and never import omnid.core.supervisor, so the parts
and the whole form no import circle."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from omnid.core.lifecycle import Event
from omnid.core.runtime import UnitRuntime
from omnid.process import ProcessHandle
from omnid.units import Stack


class Centre(Protocol):
    stack: Stack
    order: list[str]
    units: dict[str, UnitRuntime]
    token: str
    notify_socket: str | None
    spawner: Any  # omnid.spawnclient.SpawnerClient
    gpu: Any  # omnid.gpu backend, or None
    cgroups: Any  # omnid.cgroup.CgroupRoot, or None
    shutting_down: bool
    started_at: float
    invariant_violations: list[str]
    stack_signalled: bool
    by_pid: dict[int, tuple[UnitRuntime, ProcessHandle]]
    executor: Any  # omnid.core.executor.Executor
    monitors: Any  # omnid.core.monitors.Monitors
    schedule: Any  # omnid.core.schedule.Schedule
    crosshost: Any  # omnid.core.crosshost.CrossHost, or None: no group spans hosts
    exits: Any  # omnid.core.exits.ExitBook (a helper's exit report: core/execprobe.py)
    sockets: Any  # omnid.sockets.HeldSockets
    fdstore: Any  # omnid.fdstore.FdStore

    def feed(self, rt: UnitRuntime, event: Event, detail: str = "") -> None: ...

    def kick(self) -> None: ...

    def tier_orphans(self) -> list[int] | None: ...

    def notify_changed(self) -> None: ...

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool: ...

    def expand(self, names: Iterable[str], whole_groups: bool = True) -> list[str]: ...

    def adopt(self, rt: UnitRuntime, h: ProcessHandle) -> None: ...

    def disown(self, rt: UnitRuntime, h: ProcessHandle) -> None: ...

    def published(self, rt: UnitRuntime, frm: Any, event: Event | None = None, pid: int | None = None) -> None: ...

    def gpu_on(self) -> bool: ...

    async def gpu_release(self, name: str, pids: list[int], timeout: float) -> tuple[float | None, list[str]]: ...
