"""The supervisor's GPU duties (omnid.gpu holds the backends and the watch): fail the
units on a GPU that reported a critical fault, and wait for a stopped or dead unit's
GPU memory to be freed before it may start again."""

from __future__ import annotations

import structlog

from omnid.core.centre import Centre
from omnid.core.lifecycle import Event, UnitState

log = structlog.get_logger("omnid.supervisor")
S = UnitState


def fail_units_on(sup: Centre, gpu: int | str, xid: int, meaning: str) -> list[str]:
    """A critical fault (an Xid) on one GPU: every running unit on it fails, naming it.
    Returns the units that were failed."""
    from omnid.gpu import affects

    hit = []
    for rt in sup.units.values():
        if any(affects(sup.gpu, gpu, item) for item in rt.spec.gpus) \
                and rt.state in (S.STARTING, S.ACTIVE) and not rt.dead:
            hit.append(rt.name)
            sup.feed(rt, Event.GPU_FAULT, f"GPU {gpu} fault: Xid {xid} ({meaning})")
    return hit


async def wait_released(sup: Centre, name: str, pids: list[int], timeout: float) -> tuple[float | None, list[str]]:
    """Wait (at most `timeout`) until none of a stopped or dead unit's `pids` holds GPU
    memory: (ms, []) once free; (None, what is still held) at the deadline; (None, [])
    when the backend cannot tell. Memory still held is logged as an error, by pid."""
    from omnid import gpu as gpu_mod

    if not pids:
        return None, []
    try:
        ms, left = await gpu_mod.wait_released(sup.gpu, pids, timeout, items=sup.units[name].spec.gpus or None)
    except Exception as exc:  # noqa: BLE001 - a GPU read error must not break a stop
        log.warning("gpu release check failed", unit=name, error=str(exc))
        return None, []
    held = [f"pid {p.pid} holds {p.used_mib:.0f} MiB on GPU {p.gpu}" for p in left]
    if held:
        log.error("GPU memory still held after the unit's processes were killed", unit=name,
                  timeout_s=timeout, held=held)
    elif ms is not None:
        log.info("gpu memory released", unit=name, ms=round(ms, 1))
    return ms, held
