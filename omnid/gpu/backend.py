"""The GPU backend protocol, what every backend answers, and the questions the
supervisor asks of any backend (see omnid.gpu for the whole story)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

log = structlog.get_logger("omnid.gpu")

_MIB = 1024 * 1024
# Inode number of the initial PID namespace (PROC_PID_INIT_INO in the kernel).
_INIT_PID_NS_INODE = 0xEFFFFFFC

_said: set[str] = set()


def _say_once(key: str, event: str, **fields: Any) -> None:
    """Log a warning the first time `key` is seen: GPU trouble is loud once, not per poll."""
    if key in _said:
        return
    _said.add(key)
    log.warning(event, **fields)


@dataclass(frozen=True)
class GpuProcess:
    """One process with a context on one GPU (a process on two GPUs appears twice)."""

    pid: int
    gpu: int
    # 0.0 when the driver cannot tell the amount (NVML_VALUE_NOT_AVAILABLE); the
    # process still holds the GPU, so it still counts as residue.
    used_mib: float


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML numbers it (PCI bus order)."""

    index: int
    name: str
    total_mib: float
    free_mib: float
    used_mib: float


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

    def gpus(self) -> list[GpuInfo]: ...

    def processes(self) -> list[GpuProcess]: ...


def in_initial_pid_namespace() -> bool:
    """True unless this process provably runs in a child PID namespace (a container)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino == _INIT_PID_NS_INODE
    except OSError as err:
        _say_once("pidns", "gpu: cannot read /proc/self/ns/pid; assuming host PID namespace",
                  error=str(err))
        return True


# ---------------------------------------------------------------------------- backends


class NoGpuBackend:
    """No GPU on this machine, or none that can be read; `reason` says which."""

    kind = "none"
    available = False
    pids_local = True

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def gpus(self) -> list[GpuInfo]:
        return []

    def processes(self) -> list[GpuProcess]:
        return []


# ---------------------------------------------------------------------------- questions


def memory_held_by(backend: GpuBackend, pids: Iterable[int]) -> list[GpuProcess]:
    """GPU memory held by any of `pids`; `[]` when the backend cannot tell (see `available`,
    `pids_local`)."""
    wanted = frozenset(pids)
    if not wanted or not backend.available:
        return []
    if not backend.pids_local:
        _say_once("held-pidns", "gpu: NVML pids are host pids; cannot match unit pids")
        return []
    return [p for p in backend.processes() if p.pid in wanted]


def holders_of(backend: GpuBackend, gpu_indexes: Iterable[int]) -> list[GpuProcess]:
    """Every process holding memory on any of `gpu_indexes` (whoever it belongs to)."""
    wanted = frozenset(gpu_indexes)
    if not wanted or not backend.available:
        return []
    return [p for p in backend.processes() if p.gpu in wanted]


async def gpus_async(backend: GpuBackend) -> list[GpuInfo]:
    """`backend.gpus()` in a worker thread: a GPU in a bad state can make NVML slow."""
    return await asyncio.to_thread(backend.gpus)


async def processes_async(backend: GpuBackend) -> list[GpuProcess]:
    """`backend.processes()` in a worker thread."""
    return await asyncio.to_thread(backend.processes)


async def wait_released(backend: GpuBackend, pids: Iterable[int], timeout: float,
                        interval: float = 0.05) -> tuple[float | None, list[GpuProcess]]:
    """Poll until none of `pids` holds GPU memory, for at most `timeout` seconds.

    Returns `(ms, [])` when the memory is free, ms counted from the call;
    `(None, leftovers)` when some is still held at the deadline;
    `(None, [])` when the backend cannot tell (no GPU, host pids, NVML not answering).
    Each read runs in a thread, so a hung driver delays nothing past the deadline.
    """
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
                asyncio.to_thread(memory_held_by, backend, wanted),
                timeout=max(deadline - loop.time(), interval))
        except TimeoutError:
            _say_once("wait-released-hung", "gpu: GPU read did not answer before the deadline",
                      timeout_s=timeout)
            return None, leftovers
        now = loop.time()
        if not leftovers:
            return (now - start) * 1000.0, []
        if now >= deadline:
            return None, leftovers
        await asyncio.sleep(min(interval, deadline - now))
