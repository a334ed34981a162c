"""GPU truth: which GPUs exist, how full they are, and which pids hold memory on them.

This is the "GPU awareness" part of the design (omnid(8)). The supervisor uses it
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

import os

from omnid.gpu.backend import (GpuBackend, GpuInfo, GpuProcess, NoGpuBackend, gpus_async, holders_of,
                               in_initial_pid_namespace, log, memory_held_by, processes_async, wait_released)
from omnid.gpu.nvml import NvmlBackend
from omnid.gpu.testing import FAKE_GPU_ENV, FakeGpuBackend, write_fake_gpu_file

__all__ = ["FAKE_GPU_ENV", "FakeGpuBackend", "GpuBackend", "GpuInfo", "GpuProcess", "NoGpuBackend", "NvmlBackend",
           "describe", "gpus_async", "holders_of", "in_initial_pid_namespace", "memory_held_by", "open_backend",
           "processes_async", "wait_released", "write_fake_gpu_file"]



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
