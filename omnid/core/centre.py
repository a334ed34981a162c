"""The supervisor's face toward its parts (executor, monitors, schedule, requests,
groups): what they may read and call, and nothing else. They are handed the
supervisor as a `Centre` and never import omnid.core.supervisor, so the parts
and the whole form no import circle.

Each part the supervisor holds is named by its type: the ones below the core
(the spawner's client, the GPU backend, the cgroup root, the held sockets, the
exit book) by their own class; the core's parts that are themselves handed a
Centre (executor, monitors, schedule, requests, the cross-host side) by a
protocol of what the other parts call on them, since importing their modules
here would close a circle. mypy checks that the Supervisor is a Centre and that
each part is what its protocol says (`python -m mypy omnid/core`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from omnid.core.lifecycle import Action, Ctx, Event, UnitState
from omnid.core.runtime import UnitRuntime
from omnid.process.handle import ProcessHandle
from omnid.model.units import Stack

if TYPE_CHECKING:  # type names only: none of these imports omnid.core.centre
    from omnid.process.fdstore import FdStore
    from omnid.process.cgroup import CgroupRoot
    from omnid.core.exitbook import ExitBook
    from omnid.core.policy import Decision
    from omnid.gpu.backend import GpuBackend
    from omnid.process.sockets import HeldSockets
    from omnid.process.spawnclient import SpawnerClient
    from omnid.process.termination import StopRecord
    from omnid.model.units import Unit as UnitSpec


class UnitWorks(Protocol):
    """What runs for one unit (omnid.core.executor.Works), as the monitors see it."""

    tasks: dict[str, asyncio.Task]


class DrainsPart(Protocol):
    """omnid.core.drain.Drains: a unit's STATUS= during its drain."""

    def notified(self, rt: UnitRuntime, status: str) -> None: ...


class ExecutorPart(Protocol):
    """omnid.core.executor.Executor: carries out the table's actions."""

    @property
    def drains(self) -> DrainsPart | None: ...

    def of(self, rt: UnitRuntime) -> UnitWorks: ...

    def forget(self, name: str) -> None: ...

    def run(self, rt: UnitRuntime, actions: tuple[Action, ...], ctx: Ctx) -> None: ...

    def run_for(self, rt: UnitRuntime, kind: str, coro: Coroutine[Any, Any, None]) -> None: ...


class MonitorsPart(Protocol):
    """omnid.core.monitors.Monitors: readiness, liveness, watchdog and progress of a unit."""

    async def readiness(self, rt: UnitRuntime) -> None: ...

    def start(self, rt: UnitRuntime) -> None: ...

    def resume(self, rt: UnitRuntime) -> None: ...

    def stop(self, rt: UnitRuntime) -> None: ...

    def restart(self, rt: UnitRuntime, keep_watchdog_off: bool = False) -> None: ...

    def ready_held(self, rt: UnitRuntime) -> float | None: ...


class SchedulePart(Protocol):
    """omnid.core.schedule.Schedule: which unit may start or must stop, and when it is settled."""

    def requirements_up(self, rt: UnitRuntime) -> bool: ...

    def stuck(self, rt: UnitRuntime) -> bool: ...

    def settled_up(self, rt: UnitRuntime) -> bool: ...

    def settled_down(self, rt: UnitRuntime) -> bool: ...


class RequestsPart(Protocol):
    """omnid.core.requests.OperatorRequests, as a reload uses it."""

    def dependents_up(self, targets: list[str]) -> list[str]: ...

    async def start_units(self, names: list[str] | None, timeout: float | None = None) -> list[dict]: ...

    async def stop_units(self, names: list[str] | None, timeout: float | None = None) -> list[StopRecord]: ...

    async def roll(self, names: list[str], timeout: float | None = None,
                   specs: dict[str, UnitSpec] | None = None) -> tuple[list[dict], str]: ...


class CrossHostPart(Protocol):
    """omnid.core.crosshost.CrossHost: a worker group's side across hosts."""

    def link(self, rt: UnitRuntime) -> object | None: ...

    def may_open(self, rt: UnitRuntime) -> bool: ...

    def opened(self, rt: UnitRuntime) -> int: ...

    def environment(self, rt: UnitRuntime) -> dict[str, str]: ...

    def member_failed(self, rt: UnitRuntime, what: str) -> None: ...

    def decided(self, rt: UnitRuntime, decision: Decision) -> None: ...

    def settled(self, rt: UnitRuntime) -> None: ...

    def stop_event(self, rt: UnitRuntime) -> tuple[bool, str] | None: ...


class Centre(Protocol):
    stack: Stack
    order: list[str]
    units: dict[str, UnitRuntime]
    token: str
    notify_socket: str | None
    echo_output: bool
    shutting_down: bool
    started_at: float
    invariant_violations: list[str]
    stack_signalled: bool
    by_pid: dict[int, tuple[UnitRuntime, ProcessHandle]]

    # The parts: read-only here (the supervisor makes them), so each may be a subtype.
    @property
    def spawner(self) -> SpawnerClient: ...

    @property
    def gpu(self) -> GpuBackend | None: ...

    @property
    def cgroups(self) -> CgroupRoot | None: ...  # None: process groups

    @property
    def executor(self) -> ExecutorPart: ...

    @property
    def monitors(self) -> MonitorsPart: ...

    @property
    def schedule(self) -> SchedulePart: ...

    @property
    def requests(self) -> RequestsPart: ...

    @property
    def crosshost(self) -> CrossHostPart | None: ...  # None: no group spans hosts

    @property
    def exits(self) -> ExitBook: ...  # a helper's exit report: core/execprobe.py

    @property
    def sockets(self) -> HeldSockets: ...

    @property
    def fdstore(self) -> FdStore: ...

    def feed(self, rt: UnitRuntime, event: Event, detail: str = "") -> None: ...

    def kick(self) -> None: ...

    def tier_orphans(self) -> list[int] | None: ...

    def notify_changed(self) -> None: ...

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool: ...

    def expand(self, names: Iterable[str], whole_groups: bool = True) -> list[str]: ...

    def adopt(self, rt: UnitRuntime, h: ProcessHandle) -> None: ...

    def disown(self, rt: UnitRuntime, h: ProcessHandle) -> None: ...

    def published(self, rt: UnitRuntime, frm: UnitState, event: Event | None = None,
                  pid: int | None = None) -> None: ...

    def replace_stack(self, stack: Stack, units: dict[str, UnitRuntime]) -> None: ...

    def gpu_on(self) -> bool: ...

    async def gpu_release(self, name: str, pids: list[int], timeout: float) -> tuple[float | None, list[str]]: ...
