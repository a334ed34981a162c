"""The GPU watch: GPU memory is hardware state with no event to wait on, so it is
read every OMNID_GPU_INTERVAL seconds (default 1) for `gpu_min_free_mib` (a unit
whose GPU is too full is *degraded*) and for the per-unit GPU memory figures; memory
health (remapped rows, retired pages) every MEMORY_HEALTH_EVERY reads; critical Xid
events as they come (omnid.gpu.events). An Xid that fails units is handed to
`sup.gpu_fault(gpu, xid, meaning)`; conditions of a unit's GPU (an Xid, a stuck read)
show in sup.degraded for running units and, through the backend's conditions, in
/health (omnid.gpu.faults.health_view). Every read is bounded: a stuck NVML call makes
the GPU unreadable, never the watch stuck. The daemon runs `watch` as a supervised
daemon-wide task; `assess` and `on_xid` are the policy."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import Any

import structlog

from omnid.base import linux
from omnid.gpu.backend import GpuBackend, GpuInfo, GpuProcess, find_device, gpus_async, processes_async
from omnid.gpu.bounded import GpuUnreadable
from omnid.gpu.events import XidEvent
from omnid.gpu.faults import affects
from omnid.gpu.items import label
from omnid.gpu.xid import XidAction, classify, describe as describe_xid

log = structlog.get_logger("omnid.gpu")

MEMORY_HEALTH_EVERY = 10  # reads of the GPUs per read of their memory health


def interval_s() -> float:
    return float(os.environ.get("OMNID_GPU_INTERVAL", "1.0"))


def assess(units: Iterable[Any], gpus: dict[Any, GpuInfo] | list[GpuInfo] | None, by_pgid: dict[int, float],
           backend_name: str, backend: Any = None) -> tuple[dict[str, str], dict[str, float]]:
    """(degraded: unit -> why, usage: unit -> GPU MiB of its process group) for the
    supervisor's units (each with .name, .spec, .state, .proc). `gpus`: what was read (a
    list, or a dict by index), None when the GPUs could not be read; with `backend`, its
    conditions (an Xid, a stuck read) degrade the running units they reach too."""
    infos = None if gpus is None else list(gpus.values()) if isinstance(gpus, dict) else list(gpus)
    conditions = [c for c in backend.conditions() if c.status in ("failed", "degraded")] if backend else []
    degraded: dict[str, str] = {}
    usage: dict[str, float] = {}
    for u in units:
        if u.proc is not None and by_pgid:
            usage[u.name] = by_pgid.get(u.proc.pgid, 0.0)
        if u.state.value not in ("starting", "active"):
            continue
        need = u.spec.gpu_min_free_mib
        if need > 0 and infos is not None:
            for item in u.spec.gpus:
                g = find_device(infos, item)
                if g is None:
                    degraded[u.name] = f"{label(item)} not visible to {backend_name}"
                elif g.free_mib < need:
                    degraded[u.name] = f"{label(item)} has {g.free_mib:.0f} MiB free, under gpu_min_free_mib = {need}"
        for c in conditions:
            if any(affects(backend, c.gpu, item) for item in u.spec.gpus):
                degraded[u.name] = c.describe()
                break
    return degraded, usage


def memory_by_pgid(procs: Iterable[GpuProcess]) -> dict[int, float]:
    """GPU memory by process group: one stat read per GPU process, not a /proc scan."""
    out: dict[int, float] = {}
    for p in procs:
        st = linux.read_stat(p.pid)
        if st is not None:
            out[st.pgid] = out.get(st.pgid, 0.0) + p.used_mib
    return out


def on_xid(backend: GpuBackend, sup: Any, ev: XidEvent) -> None:
    """One critical Xid: record its condition; if it fails units, tell the supervisor."""
    info = classify(ev.xid)
    backend.faults.record_xid(ev.gpu, info, ev.wall)
    fields = {"gpu": label(ev.gpu), "xid": ev.xid, "meaning": info.meaning, "action": info.action.value}
    if info.action is XidAction.LOG:
        log.info("GPU Xid (an application's own error)", **fields)
        return
    (log.error if info.fails_units else log.warning)("GPU Xid event", **fields)
    if not info.fails_units:
        return
    fault = getattr(sup, "gpu_fault", None)
    if fault is None:
        log.error("this supervisor cannot fail units for a GPU fault (no gpu_fault)", **fields)
        return
    try:
        fault(ev.gpu, ev.xid, info.meaning)
    except Exception:  # noqa: BLE001 - the watch goes on; the supervisor's bug is logged with its traceback
        log.exception("gpu_fault failed", **fields)


class _Reader:
    """One pass of reads, saying "cannot read" once per episode, not per second."""

    def __init__(self, backend: GpuBackend) -> None:
        self.backend = backend
        self.passes = 0
        self.said: str | None = None

    async def read(self) -> tuple[list[GpuInfo], list[GpuProcess]] | None:
        b = self.backend
        try:
            gpus = await gpus_async(b)
            procs = await processes_async(b) if b.pids_local else []
            if self.passes % MEMORY_HEALTH_EVERY == 0:
                b.faults.set_memory(await asyncio.to_thread(b.memory_health))
        except GpuUnreadable as exc:
            self._say("stuck", str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - say it once, keep watching
            self._say(f"failed: {exc}", f"read failed: {exc}")
            return None
        finally:
            self.passes += 1
        if self.said is not None:
            log.info("GPU reads work again")
            self.said = None
        return gpus, procs

    def _say(self, key: str, what: str) -> None:
        if self.said != key:  # once per episode (a stuck call's age changes every second)
            log.error("GPU read failed", error=what, stuck_threads=self.backend.stuck_threads)
            self.said = key


async def watch(backend: GpuBackend, sup: Any, interval: float | None = None) -> None:
    """Read the GPUs forever and take their Xid events; publish sup.degraded and
    sup.gpu_mib, call sup.gpu_fault. A read error is said once and the watch goes on;
    anything else ends the task (its owner restarts it)."""
    from omnid.gpu import describe

    interval = interval_s() if interval is None else interval
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[XidEvent] = asyncio.Queue()
    why = backend.start_xid_events(lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    if why:
        log.info("GPU Xid events not watched", reason=why)
    reader = _Reader(backend)
    try:
        while True:
            got = await reader.read()
            gpus, procs = got if got is not None else (None, [])
            name = describe(backend, gpus) if gpus is not None else f"{backend.kind} (unreadable)"
            degraded, usage = assess(sup.units.values(), gpus, memory_by_pgid(procs), name, backend)
            for unit in degraded.keys() - sup.degraded.keys():
                log.warning("unit degraded", unit=unit, reason=degraded[unit])
            for unit in sup.degraded.keys() - degraded.keys():
                log.info("unit no longer degraded", unit=unit)
            sup.degraded = degraded
            sup.gpu_mib = usage  # empty while unreadable: no stale figures in status or /metrics
            deadline = loop.time() + interval
            while (left := deadline - loop.time()) > 0:
                try:
                    ev = await asyncio.wait_for(events.get(), left)
                except TimeoutError:
                    break
                on_xid(backend, sup, ev)
    finally:
        backend.stop_xid_events()


__all__ = ["assess", "describe_xid", "interval_s", "memory_by_pgid", "on_xid", "watch"]
