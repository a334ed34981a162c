"""The NVML backend (nvidia-ml-py): GPUs and their MIG devices, per-process memory (per
MIG device in MIG mode), memory health (remapped rows, retired pages) and critical Xid
events. Every NVML call runs on the backend's one bounded worker thread (omnid.gpu.bounded;
the Xid wait on a thread of its own, omnid.gpu.events), so a call that never returns
makes the backend unreadable with a reason instead of stalling anyone."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from omnid.gpu.backend import MIB, GpuInfo, GpuProcess, MigInfo, in_initial_pid_namespace, log, say_once
from omnid.gpu.bounded import DEFAULT_TIMEOUT_S, BoundedCaller, GpuUnreadable
from omnid.gpu.nvml_xid import register as register_xid_events, wait_event as wait_xid_event
from omnid.gpu.events import XidEvent, XidEventThread
from omnid.gpu.faults import GpuCondition, GpuFaults, read_conditions, stuck_threads
from omnid.gpu.items import GpuItem

NVML_TIMEOUT_ENV = "OMNID_NVML_TIMEOUT"
INIT_TIMEOUT_S = 10.0  # nvmlInit on a host without persistence mode can take seconds
TOPOLOGY_TTL_S = 10.0  # MIG devices and UUIDs are read again this often


def nvml_timeout() -> float:
    """Seconds one NVML call may take: $OMNID_NVML_TIMEOUT, default 2."""
    raw = os.environ.get(NVML_TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
        if value > 0:
            return value
    except ValueError:
        pass
    say_once("nvml-timeout-env", f"gpu: ignoring {NVML_TIMEOUT_ENV}={raw[:40]!r}: expected seconds > 0",
              default=DEFAULT_TIMEOUT_S)
    return DEFAULT_TIMEOUT_S


@dataclass
class _Mig:
    handle: Any
    uuid: str
    index: int
    gi: int
    ci: int


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str = ""
    migs: list[_Mig] = field(default_factory=list)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """GPUs, MIG devices and per-process GPU memory through NVML (`pynvml`).

    NVML is initialised once, here (bounded too); if that fails `available` is False with
    a reason and every read answers empty. A device that fails later (a lost GPU) is
    skipped and logged once per error, the other devices are still read. While an NVML
    call is stuck past its deadline, `available` is False, `reason` names the call, and
    reads raise GpuUnreadable at once.
    """

    kind = "nvml"

    def __init__(self, timeout: float | None = None) -> None:
        self._ready = False
        self._reason = ""
        self.pids_local = in_initial_pid_namespace()
        self.faults = GpuFaults()
        self._nvml: Any = None
        self._gpus: list[_Gpu] = []
        self._by_uuid: dict[str, int] = {}  # GPU or MIG UUID -> GPU index: a cache, read without NVML
        self._topology_at = float("-inf")
        self._calls = BoundedCaller("nvml", timeout if timeout is not None else nvml_timeout())
        self._events: XidEventThread | None = None
        self._event_set: Any = None
        # per process-list kind, the versioned pynvml functions this driver has
        self._lister_names: dict[str, list[str]] = {
            "compute": ["nvmlDeviceGetComputeRunningProcesses_v3",
                        "nvmlDeviceGetComputeRunningProcesses_v2"],
            "graphics": ["nvmlDeviceGetGraphicsRunningProcesses_v3",
                         "nvmlDeviceGetGraphicsRunningProcesses_v2"],
            "mps": ["nvmlDeviceGetMPSComputeRunningProcesses_v3",
                    "nvmlDeviceGetMPSComputeRunningProcesses_v2"],
        }
        try:
            import pynvml
        except ImportError as err:
            self._reason = f"no GPU: nvidia-ml-py is not installed (pip install 'omnid[gpu]'): {err}"
            return
        self._nvml = pynvml
        normal = self._calls.timeout
        self._calls.timeout = max(normal, INIT_TIMEOUT_S)
        try:
            self._reason = self._calls.run(self._init_job)
        except GpuUnreadable as exc:
            self._reason = f"no GPU: NVML did not answer at start ({exc})"
            return
        finally:
            self._calls.timeout = normal
        if self._reason:
            return
        self._ready = True
        if not self.pids_local:
            say_once("nvml-pidns",
                      "gpu: omnid runs in a child PID namespace; NVML reports host pids, "
                      "so GPU memory cannot be matched to unit pids (run with the host "
                      "PID namespace for per-pid GPU residue checks)")

    # ---------------------------------------------------------------- state (no NVML call)

    @property
    def available(self) -> bool:
        return self._ready and self._calls.stuck() is None

    @property
    def reason(self) -> str:
        if not self._ready:
            return self._reason
        stuck = self._calls.stuck()
        return f"GPU reads stuck: {stuck.reason()}" if stuck else ""

    @property
    def stuck_threads(self) -> int:
        return stuck_threads(self._calls, self._events)

    def conditions(self) -> list[GpuCondition]:
        return read_conditions(self.faults, self._calls, self._events)

    def parent_of(self, item: GpuItem) -> int | None:
        return item if isinstance(item, int) else self._by_uuid.get(item)

    # ---------------------------------------------------------------- life

    def _nv(self, call: str, gpu: int | None, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML call from a job on the worker thread: announced, so a stuck one is named."""
        self._calls.note(call, gpu)
        return fn(*args)

    def _init_job(self) -> str:
        nvml = self._nvml
        try:
            self._nv("nvmlInit", None, nvml.nvmlInit)
        except nvml.NVMLError as err:
            return _init_failure_reason(nvml, err)
        try:
            count = self._nv("nvmlDeviceGetCount", None, nvml.nvmlDeviceGetCount)
            handles = [self._nv("nvmlDeviceGetHandleByIndex", i, nvml.nvmlDeviceGetHandleByIndex, i)
                       for i in range(count)]
        except nvml.NVMLError as err:
            self._shutdown_job()
            return f"no GPU: NVML initialised but cannot list devices: {err}"
        if not handles:
            self._shutdown_job()
            return "no GPU: NVML found no devices"
        self._gpus = [_Gpu(i, h) for i, h in enumerate(handles)]
        self._refresh_topology()
        return ""

    def close(self) -> None:
        """Release NVML; the backend then answers as unavailable."""
        self.stop_xid_events(wait_s=2.0)
        if self._ready and self._calls.stuck() is None:
            try:
                self._calls.run(self._shutdown_job)
            except GpuUnreadable as exc:
                log.error("gpu: nvmlShutdown did not return", error=str(exc))
        if self._ready:
            self._ready = False
            self._reason = "no GPU: NVML backend closed"

    def _shutdown_job(self) -> None:
        try:
            if self._event_set is not None and self._events is None:  # never under a thread still waiting on it
                self._nv("nvmlEventSetFree", None, self._nvml.nvmlEventSetFree, self._event_set)
                self._event_set = None
            self._nv("nvmlShutdown", None, self._nvml.nvmlShutdown)
        except self._nvml.NVMLError as err:
            say_once("nvml-shutdown", "gpu: nvmlShutdown failed", error=str(err))
        self._gpus = []

    # ---------------------------------------------------------------- topology (MIG, UUIDs)

    def _refresh_topology(self) -> None:
        """UUIDs of every GPU and MIG device, on the worker thread."""
        nvml = self._nvml
        by_uuid: dict[str, int] = {}
        for g in self._gpus:
            try:
                g.uuid = _text(self._nv("nvmlDeviceGetUUID", g.index, nvml.nvmlDeviceGetUUID, g.handle))
                by_uuid[g.uuid] = g.index
            except nvml.NVMLError as err:
                say_once(f"nvml-uuid-{g.index}-{err}", "gpu: cannot read a GPU's UUID", gpu=g.index, error=str(err))
            g.migs = self._read_migs(g)
            for m in g.migs:
                by_uuid[m.uuid] = g.index
        self._by_uuid = by_uuid
        self._topology_at = time.monotonic()

    def _read_migs(self, g: _Gpu) -> list[_Mig]:
        nvml = self._nvml
        try:
            current, _pending = self._nv("nvmlDeviceGetMigMode", g.index, nvml.nvmlDeviceGetMigMode, g.handle)
        except nvml.NVMLError:
            return []  # not a MIG-capable GPU (NOT_SUPPORTED), or an old driver
        if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            return []
        migs = []
        try:
            count = self._nv("nvmlDeviceGetMaxMigDeviceCount", g.index, nvml.nvmlDeviceGetMaxMigDeviceCount, g.handle)
        except nvml.NVMLError as err:
            say_once(f"nvml-mig-{g.index}-{err}", "gpu: MIG mode on but its devices cannot be listed",
                      gpu=g.index, error=str(err))
            return []
        for j in range(count):
            try:
                h = self._nv("nvmlDeviceGetMigDeviceHandleByIndex", g.index,
                             nvml.nvmlDeviceGetMigDeviceHandleByIndex, g.handle, j)
                uuid = _text(self._nv("nvmlDeviceGetUUID", g.index, nvml.nvmlDeviceGetUUID, h))
            except nvml.NVMLError:
                continue  # NOT_FOUND: no MIG device in that slot
            ids = []
            for call in ("nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId"):
                try:
                    ids.append(int(self._nv(call, g.index, getattr(nvml, call), h)))
                except nvml.NVMLError:
                    ids.append(-1)
            migs.append(_Mig(h, uuid, j, ids[0], ids[1]))
        return migs

    def _topology(self, items: Iterable[GpuItem] | None = None) -> None:
        """Topology fresh enough, and every UUID in `items` known if this host has it
        (nvmlDeviceGetHandleByUUID for one not seen yet)."""
        if time.monotonic() - self._topology_at > TOPOLOGY_TTL_S:
            self._refresh_topology()
        for item in items or ():
            if isinstance(item, str) and item not in self._by_uuid:
                self._resolve(item)

    def _resolve(self, uuid: str) -> None:
        nvml = self._nvml
        try:
            handle = self._nv("nvmlDeviceGetHandleByUUID", None, nvml.nvmlDeviceGetHandleByUUID, uuid)
        except nvml.NVMLError as err:
            say_once(f"nvml-no-uuid-{uuid}", "gpu: no GPU or MIG device with this UUID on this host", uuid=uuid,
                      error=str(err))
            return
        self._refresh_topology()  # a MIG device made since the last read
        if uuid in self._by_uuid:
            return
        try:
            if self._nv("nvmlDeviceIsMigDeviceHandle", None, nvml.nvmlDeviceIsMigDeviceHandle, handle):
                handle = self._nv("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", None,
                                  nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, handle)
            index = int(self._nv("nvmlDeviceGetIndex", None, nvml.nvmlDeviceGetIndex, handle))
        except nvml.NVMLError as err:
            say_once(f"nvml-uuid-index-{uuid}", "gpu: cannot tell which GPU a UUID is on", uuid=uuid, error=str(err))
            return
        self._by_uuid = {**self._by_uuid, uuid: index}

    # ---------------------------------------------------------------- reads

    def gpus(self) -> list[GpuInfo]:
        if not self._ready:
            return []
        return self._calls.run(self._gpus_job)

    def _gpus_job(self) -> list[GpuInfo]:
        nvml = self._nvml
        self._topology()
        found = []
        for g in self._gpus:
            try:
                name = _text(self._nv("nvmlDeviceGetName", g.index, nvml.nvmlDeviceGetName, g.handle))
                memory = self._nv("nvmlDeviceGetMemoryInfo", g.index, nvml.nvmlDeviceGetMemoryInfo, g.handle)
            except nvml.NVMLError as err:
                say_once(f"nvml-gpu-{g.index}-{err}", "gpu: cannot read GPU, skipping it",
                          gpu=g.index, error=str(err))
                continue
            migs = []
            for m in g.migs:
                try:
                    mm = self._nv("nvmlDeviceGetMemoryInfo", g.index, nvml.nvmlDeviceGetMemoryInfo, m.handle)
                except nvml.NVMLError as err:
                    say_once(f"nvml-mig-{m.uuid}-{err}", "gpu: cannot read a MIG device", gpu=g.index, mig=m.uuid,
                              error=str(err))
                    continue
                migs.append(MigInfo(uuid=m.uuid, gpu=g.index, index=m.index, total_mib=mm.total / MIB,
                                    free_mib=mm.free / MIB, used_mib=mm.used / MIB, gpu_instance=m.gi,
                                    compute_instance=m.ci))
            found.append(GpuInfo(index=g.index, name=name, total_mib=memory.total / MIB,
                                 free_mib=memory.free / MIB, used_mib=memory.used / MIB, uuid=g.uuid,
                                 migs=tuple(migs)))
        return found

    def processes(self, items: Iterable[GpuItem] | None = None) -> list[GpuProcess]:
        if not self._ready:
            return []
        return self._calls.run(self._processes_job, None if items is None else list(items))

    def _processes_job(self, items: list[GpuItem] | None) -> list[GpuProcess]:
        self._topology(items)
        wanted = None if not items else {i for i in map(self.parent_of, items) if i is not None}
        held: dict[tuple[int, int, str], float] = {}
        for g in self._gpus:
            if wanted is not None and g.index not in wanted:
                continue
            # In MIG mode a process runs in one MIG device: list each (its own memory figures).
            targets = [(m.handle, m.uuid) for m in g.migs] or [(g.handle, "")]
            for handle, mig in targets:
                for kind in ("compute", "graphics", "mps"):
                    for entry in self._list(kind, g.index, handle):
                        used = entry.usedGpuMemory
                        mib = 0.0 if used is None else used / MIB
                        # a process can be in several lists of one device with the same memory
                        key = (int(entry.pid), g.index, mig)
                        held[key] = max(held.get(key, 0.0), mib)
        uuids = {g.index: g.uuid for g in self._gpus}
        return [GpuProcess(pid=pid, gpu=gpu, used_mib=mib, mig=mig, uuid=uuids.get(gpu, ""))
                for (pid, gpu, mig), mib in sorted(held.items())]

    def _list(self, kind: str, index: int, handle: Any) -> list[Any]:
        nvml = self._nvml
        names = self._lister_names[kind]
        while names:
            try:
                return list(self._nv(names[0], index, getattr(nvml, names[0]), handle))
            except nvml.NVMLError as err:
                if err.value == nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    names.pop(0)  # older driver: try the older version of the call
                    continue
                if err.value == nvml.NVML_ERROR_NOT_SUPPORTED and kind != "compute":
                    return []  # graphics / MPS lists do not exist on many datacenter GPUs
                say_once(f"nvml-{kind}-{index}-{err}",
                          f"gpu: cannot list {kind} processes, skipping them",
                          gpu=index, error=str(err))
                return []
        if kind == "compute":
            say_once("nvml-compute-missing",
                      "gpu: this NVML has no per-process listing; GPU residue cannot be checked")
        return []

    def memory_health(self) -> dict[int, tuple[str, str]]:
        if not self._ready:
            return {}
        return self._calls.run(self._memory_job)

    def _memory_job(self) -> dict[int, tuple[str, str]]:
        nvml = self._nvml
        out: dict[int, tuple[str, str]] = {}
        for g in self._gpus:
            try:
                corr, unc, pending, failure = self._nv("nvmlDeviceGetRemappedRows", g.index,
                                                       nvml.nvmlDeviceGetRemappedRows, g.handle)
            except nvml.NVMLError as err:
                if err.value not in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                    say_once(f"nvml-remap-{g.index}-{err}", "gpu: cannot read remapped rows", gpu=g.index,
                              error=str(err))
                    continue
                found = self._retired_pages(g)  # before Ampere: page retirement instead of row remapping
            else:
                found = remap_condition(corr, unc, bool(pending), bool(failure))
            if found is not None:
                out[g.index] = found
        return out

    def _retired_pages(self, g: _Gpu) -> tuple[str, str] | None:
        nvml = self._nvml
        try:
            pending = self._nv("nvmlDeviceGetRetiredPagesPendingStatus", g.index,
                               nvml.nvmlDeviceGetRetiredPagesPendingStatus, g.handle)
        except nvml.NVMLError:
            return None  # no page retirement on this GPU (or no ECC)
        if not pending:
            return None
        try:
            dbe = len(self._nv("nvmlDeviceGetRetiredPages", g.index, nvml.nvmlDeviceGetRetiredPages, g.handle,
                               nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
        except nvml.NVMLError:
            dbe = -1
        count = f" ({dbe} for double-bit ECC errors)" if dbe >= 0 else ""
        return "notice", f"retired pages pending{count}: reset the GPU to apply them"

    # ---------------------------------------------------------------- Xid events

    def start_xid_events(self, deliver: Callable[[XidEvent], None]) -> str | None:
        if not self._ready:
            return self._reason
        if self._events is not None:
            self._events.attach(deliver)
            return None
        try:
            why = self._calls.run(self._register_job)
        except GpuUnreadable as exc:
            return str(exc)
        if why:
            return why
        self._events = XidEventThread("nvml", self._wait_event, deliver, self._calls.timeout)
        self._events.start()
        return None

    def _register_job(self) -> str:
        self._event_set, why = register_xid_events(self._nvml, self._gpus, self._nv)
        return why

    def _wait_event(self, timeout_ms: int) -> XidEvent | None:
        """On the event thread: one bounded wait (its stuck check is the thread's)."""
        return wait_xid_event(self._nvml, self._event_set, self._gpus, timeout_ms)

    def stop_xid_events(self, wait_s: float | None = None) -> None:
        """Detach the watch (events are kept for the next one); with `wait_s`, end the
        event thread too (close)."""
        if self._events is None:
            return
        self._events.detach()
        if wait_s is not None and self._events.stop(wait_s):
            self._events = None


def remap_condition(corr: int, unc: int, pending: bool, failure: bool) -> tuple[str, str] | None:
    """A GPU's row remapping counts (correctable, uncorrectable, pending, failed) -> (condition,
    why), or None when there is nothing to say (the fake backend reads its rows through it too)."""
    if failure:
        return "degraded", f"row remapping failed ({unc} rows remapped for uncorrectable errors): the GPU needs service"
    if pending:
        return "notice", (f"row remapping pending ({unc} uncorrectable, {corr} correctable rows): "
                          "reset the GPU to apply it")
    return None


def _init_failure_reason(nvml: Any, err: Any) -> str:
    known = {
        nvml.NVML_ERROR_LIBRARY_NOT_FOUND:
            "no GPU: NVML not found (libnvidia-ml.so.1 cannot be loaded)",
        nvml.NVML_ERROR_DRIVER_NOT_LOADED: "no GPU: NVIDIA driver not loaded",
        nvml.NVML_ERROR_NO_PERMISSION: "no GPU: NVML: insufficient permissions",
        nvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
            "no GPU: NVML library and kernel driver versions differ (reload the driver or reboot)",
    }
    return known.get(err.value, f"no GPU: NVML init failed: {err}")
