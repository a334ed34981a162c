"""GPU truth: which GPUs exist, how full they are, and which pids hold memory on them.

This is the "GPU awareness" part of shared/DESIGN.md (Part 1). The supervisor uses it
for the residue check after a stop (`wait_released`, `gpu_release_ms`), to refuse a
start on a GPU still held by a leftover process (`holders_of`), for GPU figures in
`status` and `/metrics` (`GpuBackend.gpus`), and for `gpu_min_free_mib`.

Three backends share one small interface (`GpuBackend`):

- `NvmlBackend` reads NVML through nvidia-ml-py (`pynvml`);
- `NoGpuBackend` answers "no GPU" with the reason NVML could not be used;
- `FakeGpuBackend` is for tests on machines without a GPU and says so in its name
  and `kind`; it can be driven in memory or from a JSON file named by the
  environment variable OMNID_FAKE_GPU, re-read on every call so that a daemon under
  test sees changes made by the test while it runs.

Nothing here raises to its callers because a GPU is missing or unreadable: a backend
that cannot tell says so in `available` / `reason`, and read errors are logged once.

NVML reports pids in the host's PID namespace. When omnid runs in a container with
its own PID namespace those pids are not omnid's pids, so `pids_local` is False and
the per-pid functions answer "cannot tell" instead of matching unrelated processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

log = structlog.get_logger("omnid.gpu")

FAKE_GPU_ENV = "OMNID_FAKE_GPU"

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


class NvmlBackend:
    """GPUs and per-process GPU memory through NVML (`pynvml`, package nvidia-ml-py).

    NVML is initialised once, here; if that fails `available` is False with a reason
    and every read answers empty. A device that fails later (a lost GPU) is skipped
    and logged once per error, the other devices are still read.
    """

    kind = "nvml"

    def __init__(self) -> None:
        self.available = False
        self.reason = ""
        self.pids_local = in_initial_pid_namespace()
        self._nvml: Any = None
        self._handles: list[Any] = []
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
            self.reason = f"no GPU: nvidia-ml-py is not installed (pip install 'omnid[gpu]'): {err}"
            return
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            self.reason = _init_failure_reason(pynvml, err)
            return
        try:
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except pynvml.NVMLError as err:
            self.reason = f"no GPU: NVML initialised but cannot list devices: {err}"
            self._shutdown()
            return
        if not self._handles:
            self.reason = "no GPU: NVML found no devices"
            self._shutdown()
            return
        self.available = True
        if not self.pids_local:
            _say_once("nvml-pidns",
                      "gpu: omnid runs in a child PID namespace; NVML reports host pids, "
                      "so GPU memory cannot be matched to unit pids (run with the host "
                      "PID namespace for per-pid GPU residue checks)")

    def close(self) -> None:
        """Release NVML; the backend then answers as unavailable."""
        if self.available:
            self._shutdown()
            self.available = False
            self.reason = "no GPU: NVML backend closed"

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as err:
            _say_once("nvml-shutdown", "gpu: nvmlShutdown failed", error=str(err))
        self._handles = []

    def gpus(self) -> list[GpuInfo]:
        if not self.available:
            return []
        nvml = self._nvml
        found = []
        for index, handle in enumerate(self._handles):
            try:
                name = nvml.nvmlDeviceGetName(handle)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            except nvml.NVMLError as err:
                _say_once(f"nvml-gpu-{index}-{err}", "gpu: cannot read GPU, skipping it",
                          gpu=index, error=str(err))
                continue
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            found.append(GpuInfo(index=index, name=name,
                                 total_mib=memory.total / _MIB,
                                 free_mib=memory.free / _MIB,
                                 used_mib=memory.used / _MIB))
        return found

    def processes(self) -> list[GpuProcess]:
        if not self.available:
            return []
        held: dict[tuple[int, int], float] = {}
        for index, handle in enumerate(self._handles):
            for kind in ("compute", "graphics", "mps"):
                for entry in self._list(kind, index, handle):
                    used = entry.usedGpuMemory
                    mib = 0.0 if used is None else used / _MIB
                    # a process can be in several lists of one GPU with the same memory
                    key = (int(entry.pid), index)
                    held[key] = max(held.get(key, 0.0), mib)
        return [GpuProcess(pid=pid, gpu=gpu, used_mib=mib)
                for (pid, gpu), mib in sorted(held.items())]

    def _list(self, kind: str, index: int, handle: Any) -> list[Any]:
        nvml = self._nvml
        names = self._lister_names[kind]
        while names:
            try:
                return list(getattr(nvml, names[0])(handle))
            except nvml.NVMLError as err:
                if err.value == nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    names.pop(0)  # older driver: try the older version of the call
                    continue
                if err.value == nvml.NVML_ERROR_NOT_SUPPORTED and kind != "compute":
                    return []  # graphics / MPS lists do not exist on many datacenter GPUs
                _say_once(f"nvml-{kind}-{index}-{err}",
                          f"gpu: cannot list {kind} processes, skipping them",
                          gpu=index, error=str(err))
                return []
        if kind == "compute":
            _say_once("nvml-compute-missing",
                      "gpu: this NVML has no per-process listing; GPU residue cannot be checked")
        return []


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


class FakeGpuBackend:
    """A fake GPU backend for tests without a GPU (never used unless asked for).

    In memory, or backed by a JSON file that is re-read on every call:

        {"gpus": [{"index": 0, "name": "fake GPU 0", "total_mib": 81920,
                   "free_mib": 1024}],                # free_mib, used_mib optional
         "processes": [{"pid": 4242, "gpu": 0, "used_mib": 2048}],
         "available": true, "reason": "", "pids_local": true}   # all optional

    A GPU's `used_mib` defaults to the sum of its processes and `free_mib` to
    total - used, so setting process memory is enough for most tests; setting
    `free_mib` directly simulates memory taken by someone omnid does not know.
    A missing or invalid file makes the backend unavailable with a reason naming the
    file. Replace the file atomically (`write_fake_gpu_file`) so no reader sees half
    of it; the setters below do that when the backend has a file.
    """

    kind = "fake"

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._doc: dict[str, Any] = {"gpus": [], "processes": []}

    # ---- reading

    def _state(self) -> _FakeState:
        if self.path is None:
            return _parse_fake(self._doc, "fake GPU state")
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError) as err:
            return _FakeState.unavailable(f"fake GPU: cannot read {self.path}: {err}")
        return _parse_fake(doc, str(self.path))

    @property
    def available(self) -> bool:
        return self._state().available

    @property
    def reason(self) -> str:
        return self._state().reason

    @property
    def pids_local(self) -> bool:
        return self._state().pids_local

    def gpus(self) -> list[GpuInfo]:
        state = self._state()
        return state.gpus if state.available else []

    def processes(self) -> list[GpuProcess]:
        state = self._state()
        return state.processes if state.available else []

    # ---- setting (in memory, or load-modify-replace of the file)

    def set_gpu(self, index: int, total_mib: float = 81920.0, *, name: str | None = None,
                free_mib: float | None = None) -> None:
        """Add or replace GPU `index`; `free_mib=None` derives free memory from processes."""
        entry: dict[str, Any] = {"index": index, "name": name or f"fake GPU {index}",
                                 "total_mib": total_mib}
        if free_mib is not None:
            entry["free_mib"] = free_mib

        def change(doc: dict[str, Any]) -> None:
            doc["gpus"] = [g for g in doc.get("gpus", []) if g.get("index") != index] + [entry]
        self._update(change)

    def set_process(self, pid: int, used_mib: float, gpu: int = 0) -> None:
        """Make `pid` hold `used_mib` on `gpu` (replacing what it held there)."""
        def change(doc: dict[str, Any]) -> None:
            doc["processes"] = [p for p in doc.get("processes", [])
                                if (p.get("pid"), p.get("gpu")) != (pid, gpu)]
            doc["processes"].append({"pid": pid, "gpu": gpu, "used_mib": used_mib})
        self._update(change)

    def release(self, pid: int, gpu: int | None = None) -> None:
        """`pid` frees its memory on `gpu`, or on every GPU when `gpu` is None."""
        def change(doc: dict[str, Any]) -> None:
            doc["processes"] = [p for p in doc.get("processes", [])
                                if p.get("pid") != pid or (gpu is not None and p.get("gpu") != gpu)]
        self._update(change)

    def set_unavailable(self, reason: str = "no GPU: fake NVML failure") -> None:
        def change(doc: dict[str, Any]) -> None:
            doc["available"] = False
            doc["reason"] = reason
        self._update(change)

    def set_available(self) -> None:
        def change(doc: dict[str, Any]) -> None:
            doc["available"] = True
            doc.pop("reason", None)
        self._update(change)

    def set_pids_local(self, local: bool) -> None:
        def change(doc: dict[str, Any]) -> None:
            doc["pids_local"] = local
        self._update(change)

    def _update(self, change: Callable[[dict[str, Any]], None]) -> None:
        if self.path is None:
            change(self._doc)
            return
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            doc = {"gpus": [], "processes": []}
        change(doc)
        write_fake_gpu_file(self.path, doc)


def write_fake_gpu_file(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Write a fake GPU file so that a concurrent reader sees the old or the new one."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(doc, out)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


@dataclass(frozen=True)
class _FakeState:
    available: bool
    reason: str
    pids_local: bool
    gpus: list[GpuInfo]
    processes: list[GpuProcess]

    @classmethod
    def unavailable(cls, reason: str) -> _FakeState:
        _say_once(f"fake-{reason}", "gpu: fake GPU backend unavailable", reason=reason)
        return cls(False, reason, True, [], [])


def _parse_fake(doc: Any, source: str) -> _FakeState:
    def bad(where: str, expected: str) -> _FakeState:
        return _FakeState.unavailable(f"fake GPU: {source}: {where}: expected {expected}")

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not isinstance(doc, dict):
        return bad("top level", "a JSON object")
    processes = []
    for i, p in enumerate(doc.get("processes", [])):
        if not (isinstance(p, dict) and isinstance(p.get("pid"), int)
                and isinstance(p.get("gpu", 0), int) and number(p.get("used_mib"))):
            return bad(f"processes[{i}]",
                       '{"pid": int, "gpu": int (default 0), "used_mib": number}')
        processes.append(GpuProcess(pid=p["pid"], gpu=p.get("gpu", 0),
                                    used_mib=float(p["used_mib"])))
    gpus = []
    for i, g in enumerate(doc.get("gpus", [])):
        if not (isinstance(g, dict) and isinstance(g.get("index"), int)
                and number(g.get("total_mib"))
                and all(number(g[k]) for k in ("free_mib", "used_mib") if k in g)):
            return bad(f"gpus[{i}]", '{"index": int, "total_mib": number, "name": str, '
                       '"free_mib": number, "used_mib": number} (last three optional)')
        total = float(g["total_mib"])
        if "used_mib" in g:
            used = float(g["used_mib"])
        elif "free_mib" in g:
            used = total - float(g["free_mib"])
        else:
            used = sum(p.used_mib for p in processes if p.gpu == g["index"])
        free = float(g["free_mib"]) if "free_mib" in g else max(total - used, 0.0)
        gpus.append(GpuInfo(index=g["index"], name=str(g.get("name", f"fake GPU {g['index']}")),
                            total_mib=total, free_mib=free, used_mib=used))
    if doc.get("available", True) is not True:
        reason = doc.get("reason") or f"no GPU: fake GPU marked unavailable in {source}"
        return _FakeState(False, str(reason), bool(doc.get("pids_local", True)), [], [])
    return _FakeState(True, "", bool(doc.get("pids_local", True)),
                      sorted(gpus, key=lambda g: g.index), processes)


# ---------------------------------------------------------------------------- opening


def open_backend() -> GpuBackend:
    """The fake backend when OMNID_FAKE_GPU names a file, else NVML, else "no GPU"."""
    fake = os.environ.get(FAKE_GPU_ENV)
    if fake:
        log.info("gpu: using the FAKE GPU backend", path=fake, env=FAKE_GPU_ENV)
        return FakeGpuBackend(fake)
    nvml = NvmlBackend()
    if nvml.available:
        return nvml
    log.info("gpu: no GPU backend", reason=nvml.reason)
    return NoGpuBackend(nvml.reason)


def describe(backend: GpuBackend) -> str:
    """One line for logs and `status`: which backend, and what it sees or why not."""
    if not backend.available:
        return f"{backend.kind}: {backend.reason}"
    count = len(backend.gpus())
    where = f" from {backend.path}" if isinstance(backend, FakeGpuBackend) and backend.path else ""
    label = "FAKE GPU backend" if backend.kind == "fake" else backend.kind
    pidns = "" if backend.pids_local else ", host pids (not comparable)"
    return f"{label}{where}: {count} GPU{'s' if count != 1 else ''}{pidns}"


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
