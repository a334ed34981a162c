"""The NVML backend (nvidia-ml-py)."""

from __future__ import annotations

from typing import Any

from omnid.gpu.backend import _MIB, GpuInfo, GpuProcess, _say_once, in_initial_pid_namespace


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
