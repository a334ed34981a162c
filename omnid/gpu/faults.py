"""GPU conditions: what is wrong with a GPU now (an Xid event, its memory health, a
stuck read), which units it reaches, what /health says, and whether a unit may start on
it (omnid(8) GPU FAULTS). Nothing here calls NVML: it is safe on the event loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import structlog

from omnid.gpu.items import GpuItem, is_mig, label
from omnid.gpu.xid import HOLD_S, XidAction, XidInfo, describe

log = structlog.get_logger("omnid.gpu")

# Statuses, worst first: "failed" and "degraded" turn /health 503; "notice" is for status.
_RANK = {"failed": 0, "degraded": 1, "notice": 2}


@dataclass(frozen=True)
class GpuCondition:
    """One thing wrong with one GPU or MIG device (gpu None: NVML itself, every GPU)."""

    gpu: GpuItem | None
    status: str  # "failed" | "degraded" | "notice"
    reason: str  # "Xid 79: GPU has fallen off the bus: ...", "row remapping pending: ..."
    since: float  # wall clock of the first event
    source: str  # "xid" | "memory" | "unreadable"
    xid: int | None = None
    count: int = 1  # events of this kind so far
    last: float = 0.0  # wall clock of the last event
    blocks_start: bool = False  # no unit may start on it (a lost GPU, a stuck read)

    def to_json(self) -> dict[str, Any]:
        return {"gpu": label(self.gpu), "status": self.status, "reason": self.reason, "since": self.since,
                "source": self.source, "xid": self.xid, "count": self.count, "blocks_start": self.blocks_start}

    def describe(self) -> str:
        when = datetime.fromtimestamp(self.since).strftime("%H:%M:%S")
        times = f", {self.count} times" if self.count > 1 else ""
        return f"{label(self.gpu)}: {self.reason} (since {when}{times})"


class GpuFaults:
    """The conditions the GPU watch found, per GPU. Xid conditions end HOLD_S after their
    last event, except a lost GPU's; memory-health conditions are replaced at each read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._xid: dict[tuple[GpuItem | None, int], GpuCondition] = {}
        self._memory: dict[GpuItem, GpuCondition] = {}

    def record_xid(self, gpu: GpuItem | None, info: XidInfo, wall: float | None = None) -> GpuCondition | None:
        """Record one Xid event; returns its condition (None for an Xid that is only logged)."""
        if not info.status:
            return None
        wall = time.time() if wall is None else wall
        with self._lock:
            old = self._xid.get((gpu, info.xid))
            cond = GpuCondition(gpu=gpu, status=info.status, reason=describe(info.xid),
                                since=old.since if old else wall, source="xid", xid=info.xid,
                                count=old.count + 1 if old else 1, last=wall,
                                blocks_start=info.action is XidAction.FAIL_GPU_LOST)
            self._xid[(gpu, info.xid)] = cond
        return cond

    def set_memory(self, found: dict[int, tuple[str, str]], wall: float | None = None) -> None:
        """The memory health just read: GPU index -> (status, reason); the rest is healthy."""
        wall = time.time() if wall is None else wall
        with self._lock:
            fresh = {}
            for gpu, (status, reason) in found.items():
                old = self._memory.get(gpu)
                keep = old is not None and old.reason == reason and old.status == status
                fresh[gpu] = old if keep and old is not None else GpuCondition(gpu, status, reason, wall, "memory",
                                                                               last=wall)
            for gpu in fresh.keys() - self._memory.keys():
                log.warning("GPU memory health", gpu=label(gpu), status=fresh[gpu].status, reason=fresh[gpu].reason)
            for gpu in self._memory.keys() - fresh.keys():
                log.info("GPU memory health back to normal", gpu=label(gpu))
            self._memory = fresh

    def conditions(self, now: float | None = None) -> list[GpuCondition]:
        now = time.time() if now is None else now
        with self._lock:
            for key, c in list(self._xid.items()):
                if not c.blocks_start and now - c.last > HOLD_S:
                    log.info("GPU condition over", gpu=label(c.gpu), xid=c.xid, after_s=round(now - c.since))
                    del self._xid[key]
            return sorted([*self._xid.values(), *self._memory.values()], key=lambda c: (_RANK[c.status], c.since))


class _Topology(Protocol):
    def parent_of(self, item: GpuItem) -> int | None: ...


def _index(backend: _Topology, item: GpuItem) -> int | None:
    return item if isinstance(item, int) else backend.parent_of(item)


def affects(backend: _Topology, fault: GpuItem | None, item: GpuItem) -> bool:
    """Does a condition of `fault` (None: every GPU) reach a unit on `item`? A whole GPU's
    condition reaches its MIG devices; a MIG device's reaches that device and units on
    the whole GPU, not the GPU's other MIG devices."""
    if fault is None or fault == item:
        return True
    if is_mig(fault):
        if is_mig(item):
            return False
        parent = backend.parent_of(fault)
        return parent is not None and _index(backend, item) == parent
    index = _index(backend, fault)
    return index is not None and _index(backend, item) == index


def start_refusal(backend: Any, gpus: Iterable[GpuItem]) -> str | None:
    """Why a unit must not start on `gpus` now (a GPU that has fallen off the bus, a GPU
    whose reads are stuck), or None. Pure: reads what the backend already knows."""
    items = list(gpus)
    if backend is None or not items:
        return None
    for c in backend.conditions():
        if not c.blocks_start:
            continue
        for item in items:
            if affects(backend, c.gpu, item):
                after = ("reset the GPU (or reboot), then restart omnid" if c.source == "xid"
                         else "it starts again once the call returns")
                return f"refusing to start on {label(item)}: {c.describe()}; {after}"
    return None


def health_view(backend: Any, units: Iterable[tuple[str, Sequence[GpuItem]]]) -> dict[str, dict[str, Any]]:
    """For /health and status: each condition that reaches a unit, by GPU label:
    {"status", "reason", "units"} (a GPU no unit uses does not change the stack's health)."""
    if backend is None:
        return {}
    conds = backend.conditions()
    if not conds:
        return {}
    users = [(name, list(gpus)) for name, gpus in units if gpus]
    out: dict[str, dict[str, Any]] = {}
    for c in conds:
        hit = sorted(name for name, gpus in users if any(affects(backend, c.gpu, g) for g in gpus))
        if not hit:
            continue
        key = label(c.gpu)
        if key in out:  # one line per GPU: the worst condition, the others appended
            out[key]["reason"] += f"; {c.reason}"
            out[key]["units"] = sorted(set(out[key]["units"]) | set(hit))
            continue
        out[key] = {"status": c.status, "reason": c.describe().removeprefix(f"{key}: "), "units": hit}
    return out


def worst(view: dict[str, dict[str, Any]]) -> str:
    """"failed", "degraded" or "" from a health_view ("notice" does not count)."""
    statuses = {v["status"] for v in view.values()}
    if "failed" in statuses:
        return "failed"
    return "degraded" if "degraded" in statuses else ""


def read_conditions(faults: GpuFaults, calls: Any, events: Any | None) -> list[GpuCondition]:
    """Every condition of a backend: its faults, a stuck bounded call (calls, an
    omnid.gpu.bounded.BoundedCaller) first, and a stuck Xid event reader (events, an
    omnid.gpu.events.XidEventThread, or None) last."""
    out = faults.conditions()
    stuck = calls.stuck()
    if stuck is not None:
        out.insert(0, unreadable(stuck))
    if events is not None and (ev := events.stuck()) is not None:
        out.append(GpuCondition(None, "degraded", f"Xid events unreadable: {ev.reason()}", ev.wall, "unreadable"))
    return out


def stuck_threads(calls: Any, events: Any | None) -> int:
    """Reader threads stuck in the driver: the bounded caller's and the Xid reader."""
    return calls.stuck_threads + (1 if events is not None and events.stuck() is not None else 0)


def unreadable(stuck: Any) -> GpuCondition:
    """The condition of a stuck NVML call (an omnid.gpu.bounded.Stuck)."""
    return GpuCondition(gpu=stuck.gpu, status="degraded", reason=stuck.reason(where=False), since=stuck.wall,
                        source="unreadable", last=time.time(), blocks_start=True)


def remap_condition(corr: int, unc: int, pending: bool, failure: bool) -> tuple[str, str] | None:
    """What a GPU's remapped rows mean (NVML's nvmlDeviceGetRemappedRows: correctable and
    uncorrectable counts, pending, failure): (status, reason) for GpuFaults.set_memory, or
    None when healthy. Shared by every backend that reads them (NVML, the fake)."""
    if failure:
        return "degraded", f"row remapping failed ({unc} rows remapped for uncorrectable errors): the GPU needs service"
    if pending:
        return "notice", (f"row remapping pending ({unc} uncorrectable, {corr} correctable rows): "
                          "reset the GPU to apply it")
    return None
