"""The GPU watch: GPU memory is hardware state with no event to wait on, so it is
read every OMNID_GPU_INTERVAL seconds (default 1) for `gpu_min_free_mib` (a unit
whose GPU is too full is *degraded*) and for the per-unit GPU memory figures.
The daemon runs `watch` as a supervised daemon-wide task; `assess` is the policy."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import Any

import structlog

from omnid import linux
from omnid.gpu.backend import GpuBackend, GpuInfo, GpuProcess, gpus_async, processes_async

log = structlog.get_logger("omnid.gpu")


def interval_s() -> float:
    return float(os.environ.get("OMNID_GPU_INTERVAL", "1.0"))


def assess(units: Iterable[Any], gpus: dict[int, GpuInfo], by_pgid: dict[int, float],
           backend_name: str) -> tuple[dict[str, str], dict[str, float]]:
    """(degraded: unit -> why, usage: unit -> GPU MiB of its process group) for the
    supervisor's units (each with .name, .spec, .state, .proc)."""
    degraded: dict[str, str] = {}
    usage: dict[str, float] = {}
    for u in units:
        if u.proc is not None and by_pgid:
            usage[u.name] = by_pgid.get(u.proc.pgid, 0.0)
        need = u.spec.gpu_min_free_mib
        if need > 0 and u.state.value in ("starting", "active"):
            for idx in u.spec.gpus:
                g = gpus.get(idx)
                if g is None:
                    degraded[u.name] = f"GPU {idx} not visible to {backend_name}"
                elif g.free_mib < need:
                    degraded[u.name] = f"GPU {idx} has {g.free_mib:.0f} MiB free, under gpu_min_free_mib = {need}"
    return degraded, usage


def memory_by_pgid(procs: Iterable[GpuProcess]) -> dict[int, float]:
    """GPU memory by process group: one stat read per GPU process, not a /proc scan."""
    out: dict[int, float] = {}
    for p in procs:
        st = linux.read_stat(p.pid)
        if st is not None:
            out[st.pgid] = out.get(st.pgid, 0.0) + p.used_mib
    return out


async def watch(backend: GpuBackend, sup: Any, interval: float | None = None) -> None:
    """Read the GPUs forever; publish sup.degraded and sup.gpu_mib. A read error is
    said once and the watch goes on; anything else ends the task (its owner restarts it)."""
    from omnid.gpu import describe

    interval = interval_s() if interval is None else interval
    said = False
    while True:
        try:
            gpus = {g.index: g for g in await gpus_async(backend)}
            procs = await processes_async(backend) if backend.pids_local else []
            said = False
        except Exception as exc:  # noqa: BLE001 - say it once, keep watching
            if not said:
                log.error("GPU read failed", error=str(exc))
                said = True
            await asyncio.sleep(interval)
            continue
        degraded, usage = assess(sup.units.values(), gpus, memory_by_pgid(procs), describe(backend))
        for name in degraded.keys() - sup.degraded.keys():
            log.warning("unit degraded", unit=name, reason=degraded[name])
        for name in sup.degraded.keys() - degraded.keys():
            log.info("unit no longer degraded", unit=name)
        sup.degraded = degraded
        sup.gpu_mib = usage
        await asyncio.sleep(interval)
