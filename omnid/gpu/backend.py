"""The GPU backend protocol, what every backend answers, and the questions the
supervisor asks of any backend (see omnid.gpu for the whole story). A unit's GPU is an
index, a GPU UUID or a MIG device UUID (`GpuItem`); every question takes any of them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from omnid.gpu.bounded import GpuUnreadable
from omnid.gpu.faults import GpuCondition, GpuFaults
from omnid.gpu.items import GpuItem, is_mig, label

if TYPE_CHECKING:
    from omnid.gpu.events import XidEvent

log = structlog.get_logger("omnid.gpu")

MIB = 1024 * 1024
# Inode number of the initial PID namespace (PROC_PID_INIT_INO in the kernel).
_INIT_PID_NS_INODE = 0xEFFFFFFC

_said: set[str] = set()


def say_once(key: str, event: str, **fields: Any) -> None:
    """Log a warning the first time `key` is seen: GPU trouble is loud once, not per poll."""
    if key in _said:
        return
    _said.add(key)
    log.warning(event, **fields)


@dataclass(frozen=True)
class GpuProcess:
    """One process with a context on one GPU or MIG device (a process on two appears twice)."""

    pid: int
    gpu: int  # index of the (physical) GPU
    # 0.0 when the driver cannot tell the amount (NVML_VALUE_NOT_AVAILABLE); the
    # process still holds the GPU, so it still counts as residue.
    used_mib: float
    mig: str = ""  # the MIG device's UUID when the process runs on one
    uuid: str = ""  # the GPU's UUID, "" when the backend does not know it

    def on(self, item: GpuItem) -> bool:
        """Does this process hold memory on `item` (a whole GPU covers its MIG devices)?"""
        if isinstance(item, int):
            return self.gpu == item
        if is_mig(item):
            return self.mig == item
        return bool(self.uuid) and self.uuid == item

    def where(self) -> str:
        return f"GPU {self.gpu}" + (f" ({self.mig})" if self.mig else "")


@dataclass(frozen=True)
class MigInfo:
    """One MIG device (a GPU instance + compute instance of a GPU in MIG mode)."""

    uuid: str
    gpu: int  # index of its GPU
    index: int  # its index among its GPU's MIG devices
    total_mib: float
    free_mib: float
    used_mib: float
    gpu_instance: int = -1
    compute_instance: int = -1


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML numbers it (PCI bus order)."""

    index: int
    name: str
    total_mib: float
    free_mib: float
    used_mib: float
    uuid: str = ""
    migs: tuple[MigInfo, ...] = ()  # its MIG devices when it is in MIG mode


def find_device(gpus: Iterable[GpuInfo], item: GpuItem) -> GpuInfo | MigInfo | None:
    """The GPU or MIG device `item` names among `gpus`, or None."""
    for g in gpus:
        if item == g.index or (isinstance(item, str) and item == g.uuid):
            return g
        if is_mig(item):
            for m in g.migs:
                if m.uuid == item:
                    return m
    return None


class GpuBackend(Protocol):
    """What the supervisor needs to know about GPUs, whatever the source."""

    @property
    def kind(self) -> str:
        """`"nvml"`, `"fake"` or `"none"`."""
        ...

    @property
    def available(self) -> bool:
        """True when `gpus()` and `processes()` tell the truth right now."""
        ...

    @property
    def reason(self) -> str:
        """Why not available (`"no GPU: NVML not found ..."`); `""` when available."""
        ...

    @property
    def pids_local(self) -> bool:
        """True when the pids in `processes()` are pids of this PID namespace."""
        ...

    @property
    def stuck_threads(self) -> int:
        """Threads blocked in an NVML call past its deadline (each counted once)."""
        ...

    @property
    def faults(self) -> GpuFaults:
        """Conditions the GPU watch found (Xid events, memory health)."""
        ...

    def gpus(self) -> list[GpuInfo]:
        """Every GPU; raises GpuUnreadable when an NVML call does not return in time."""
        ...

    def processes(self, items: Iterable[GpuItem] | None = None) -> list[GpuProcess]:
        """Processes holding memory (on `items` only, when given); may raise GpuUnreadable."""
        ...

    def memory_health(self) -> dict[int, tuple[str, str]]:
        """GPU index -> ("degraded", why) for row remapping / page retirement pending or
        failed; may raise GpuUnreadable."""
        ...

    def conditions(self) -> list[GpuCondition]:
        """Everything wrong with the GPUs now (faults, and a stuck read), without an NVML call."""
        ...

    def parent_of(self, item: GpuItem) -> int | None:
        """The index of the GPU `item` is (or is a MIG device of), from what was last read;
        never an NVML call. None when unknown."""
        ...

    def start_xid_events(self, deliver: Callable[[XidEvent], None]) -> str | None:
        """Start delivering critical Xid events (from a thread of its own); returns why
        not when this backend cannot, else None."""
        ...

    def stop_xid_events(self, wait_s: float | None = None) -> None:
        """Stop delivering (events are kept for the next start); with `wait_s`, end the thread."""
        ...


def in_initial_pid_namespace() -> bool:
    """True unless this process provably runs in a child PID namespace (a container)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino == _INIT_PID_NS_INODE
    except OSError as err:
        say_once("pidns", "gpu: cannot read /proc/self/ns/pid; assuming host PID namespace",
                  error=str(err))
        return True


# ---------------------------------------------------------------------------- backends


class NoGpuBackend:
    """No GPU on this machine, or none that can be read; `reason` says which."""

    kind = "none"
    available = False
    pids_local = True
    stuck_threads = 0

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.faults = GpuFaults()

    def gpus(self) -> list[GpuInfo]:
        return []

    def processes(self, items: Iterable[GpuItem] | None = None) -> list[GpuProcess]:
        return []

    def memory_health(self) -> dict[int, tuple[str, str]]:
        return {}

    def conditions(self) -> list[GpuCondition]:
        return []

    def parent_of(self, item: GpuItem) -> int | None:
        return None

    def start_xid_events(self, deliver: Callable[[XidEvent], None]) -> str | None:
        return self.reason

    def stop_xid_events(self, wait_s: float | None = None) -> None:
        pass


# ---------------------------------------------------------------------------- questions


def memory_held_by(backend: GpuBackend, pids: Iterable[int], items: Iterable[GpuItem] | None = None) -> list[GpuProcess]:
    """GPU memory held by any of `pids` (on `items` only, when given: a unit's GPUs or MIG
    devices); `[]` when the backend cannot tell (see `available`, `pids_local`). Raises
    GpuUnreadable when a read gets stuck: "cannot tell" must never read as "released"."""
    wanted = frozenset(pids)
    if not wanted or not backend.available:
        return []
    if not backend.pids_local:
        say_once("held-pidns", "gpu: NVML pids are host pids; cannot match unit pids")
        return []
    scope = None if items is None else list(items)
    return [p for p in _processes(backend, scope) if p.pid in wanted and (not scope or any(p.on(i) for i in scope))]


def holders_of(backend: GpuBackend, items: Iterable[GpuItem]) -> list[GpuProcess]:
    """Every process holding memory on any of `items` (indexes, GPU or MIG UUIDs), whoever
    it belongs to. `[]` when the backend cannot tell, a stuck read included (logged):
    call start_refusal first, which refuses a start on an unreadable GPU."""
    wanted = list(dict.fromkeys(items))
    if not wanted or not backend.available:
        return []
    try:
        procs = _processes(backend, wanted)
    except GpuUnreadable as exc:
        log.warning("gpu: cannot list the holders of a unit's GPUs", gpus=[label(i) for i in wanted], error=str(exc))
        return []
    return [p for p in procs if any(p.on(i) for i in wanted)]


def _processes(backend: GpuBackend, items: Iterable[GpuItem] | None) -> list[GpuProcess]:
    items = None if items is None else list(items)
    if not items:
        return backend.processes()
    return backend.processes(items)


async def gpus_async(backend: GpuBackend) -> list[GpuInfo]:
    """`backend.gpus()` in a worker thread: a GPU in a bad state can make NVML slow."""
    return await asyncio.to_thread(backend.gpus)


async def processes_async(backend: GpuBackend) -> list[GpuProcess]:
    """`backend.processes()` in a worker thread."""
    return await asyncio.to_thread(backend.processes)


async def wait_released(backend: GpuBackend, pids: Iterable[int], timeout: float,
                        interval: float = 0.05,
                        items: Iterable[GpuItem] | None = None) -> tuple[float | None, list[GpuProcess]]:
    """Poll until none of `pids` holds GPU memory (on `items` only, when given: the unit's
    GPUs or MIG devices), for at most `timeout` seconds.

    Returns `(ms, [])` when the memory is free, ms counted from the call;
    `(None, leftovers)` when some is still held at the deadline;
    `(None, [])` when the backend cannot tell (no GPU, host pids, NVML not answering).
    Each read runs in a thread and every NVML call is bounded (omnid.gpu.bounded), so a
    hung driver delays nothing past the deadline.
    """
    scope = None if items is None else list(items)
    wanted = frozenset(pids)
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout
    leftovers: list[GpuProcess] = []
    while True:
        if not backend.available or not backend.pids_local:
            return None, []
        if not wanted:
            return 0.0, []
        try:
            leftovers = await asyncio.wait_for(
                asyncio.to_thread(memory_held_by, backend, wanted, scope),
                timeout=max(deadline - loop.time(), interval))
        except (TimeoutError, GpuUnreadable) as exc:
            say_once("wait-released-hung", "gpu: GPU read did not answer before the deadline; "
                      "cannot tell whether the memory is released", timeout_s=timeout, error=str(exc))
            return None, leftovers
        now = loop.time()
        if not leftovers:
            return (now - start) * 1000.0, []
        if now >= deadline:
            return None, leftovers
        await asyncio.sleep(min(interval, deadline - now))
