"""Critical Xid events through NVML: registering every GPU that gives them on one event set,
and one bounded wait for the next (on the event thread, omnid.gpu.events), with the GPU or
MIG device the event names."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import structlog

from omnid.gpu.events import XidEvent
from omnid.gpu.items import GpuItem

log = structlog.get_logger("omnid.gpu")

_NO_ID = 0xFFFFFFFF  # NVML: "no GPU/compute instance" in an event's instance ids


def _ptr(handle: Any) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return handle if isinstance(handle, int) else None


def register(nvml: Any, devices: list[Any], call: Callable[..., Any]) -> tuple[Any, str]:
    """(the event set, "") with every GPU that gives critical Xid events registered on it, or
    (None, why not). `call` is the backend's bounded NVML call."""
    try:
        event_set = call("nvmlEventSetCreate", None, nvml.nvmlEventSetCreate)
    except nvml.NVMLError as err:
        return None, f"NVML cannot create an event set: {err}"
    registered = []
    for g in devices:
        try:
            supported = call("nvmlDeviceGetSupportedEventTypes", g.index, nvml.nvmlDeviceGetSupportedEventTypes,
                             g.handle)
            if not supported & nvml.nvmlEventTypeXidCriticalError:
                log.warning("gpu: this GPU gives no Xid events through NVML", gpu=g.index)
                continue
            call("nvmlDeviceRegisterEvents", g.index, nvml.nvmlDeviceRegisterEvents, g.handle,
                 nvml.nvmlEventTypeXidCriticalError, event_set)
            registered.append(g.index)
        except nvml.NVMLError as err:
            log.warning("gpu: cannot register for Xid events", gpu=g.index, error=str(err))
    if not registered:
        call("nvmlEventSetFree", None, nvml.nvmlEventSetFree, event_set)
        return None, "no GPU here gives Xid events through NVML"
    log.info("gpu: watching critical Xid events", gpus=registered)
    return event_set, ""


def wait_event(nvml: Any, event_set: Any, devices: list[Any], timeout_ms: int) -> XidEvent | None:
    """One wait on the event set: the next critical Xid, or None when it timed out."""
    try:
        data = nvml.nvmlEventSetWait_v2(event_set, timeout_ms)
    except nvml.NVMLError as err:
        if err.value == nvml.NVML_ERROR_TIMEOUT:
            return None
        raise
    if not data.eventType & nvml.nvmlEventTypeXidCriticalError:
        return None
    return XidEvent(event_gpu(nvml, devices, data), int(data.eventData), time.time())


def event_gpu(nvml: Any, devices: list[Any], data: Any) -> GpuItem:
    """The GPU index, or the MIG device's UUID, an event names (-1: none omnid knows)."""
    ptr = _ptr(data.device)
    g = next((g for g in devices if _ptr(g.handle) == ptr), None)
    if g is None:
        try:
            index = int(nvml.nvmlDeviceGetIndex(data.device))
        except nvml.NVMLError as err:
            log.error("gpu: an Xid event names a GPU omnid cannot identify", error=str(err))
            return -1
        g = next((g for g in devices if g.index == index), None)
        if g is None:
            return index
    gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
    if gi == _NO_ID or not g.migs:
        return g.index
    hits = [m for m in g.migs if m.gi == gi and ci in (_NO_ID, m.ci)]
    # One MIG device: its UUID. A GPU instance with several: the whole GPU (broader is safer).
    return hits[0].uuid if len(hits) == 1 else g.index
