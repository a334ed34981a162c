"""GPU truth: which GPUs and MIG devices exist, how full they are, which pids hold memory
on them, and what is wrong with them (Xid events, memory health, a stuck driver call).

This is the "GPU awareness" part of omnid (omnid(8) GPU awareness, GPU FAULTS). The
supervisor uses it for the residue check after a stop (`wait_released`,
`gpu_release_ms`), to refuse a start on a GPU still held by a leftover process
(`holders_of`) or one that has fallen off the bus or cannot be read (`start_refusal`),
for GPU figures in `status` and `/metrics` (`GpuBackend.gpus`), for `gpu_min_free_mib`,
and to fail the units of a GPU that reports a critical Xid (the watch calls
`sup.gpu_fault`). A unit's GPU is an index, a GPU UUID or a MIG device UUID.

Three backends share one small interface (`GpuBackend`):

- `NvmlBackend` reads NVML through nvidia-ml-py (`pynvml`);
- `NoGpuBackend` answers "no GPU" with the reason NVML could not be used;
- `FakeGpuBackend` is for tests on machines without a GPU and says so in its name
  and `kind`; it can be driven in memory or from a JSON file named by the
  environment variable OMNID_FAKE_GPU, re-read on every call so that a daemon under
  test sees changes made by the test while it runs.

Every NVML call is bounded in time (omnid.gpu.bounded): a call that never returns makes
the backend unreadable with a reason, it never stalls its caller. Nothing here raises
to its callers because a GPU is missing: a backend that cannot tell says so in
`available` / `reason`; a stuck read raises GpuUnreadable where "cannot tell" must not
be taken for "nothing held" (memory_held_by), and is "cannot tell" elsewhere.

NVML reports pids in the host's PID namespace. When omnid runs in a container with
its own PID namespace those pids are not omnid's pids, so `pids_local` is False and
the per-pid functions answer "cannot tell" instead of matching unrelated processes.
"""

from __future__ import annotations

import os
from typing import Any

from omnid.gpu.backend import (GpuBackend, GpuInfo, GpuProcess, MigInfo, NoGpuBackend, find_device, gpus_async,
                               holders_of, in_initial_pid_namespace, log, memory_held_by, processes_async,
                               wait_released)
from omnid.gpu.bounded import GpuUnreadable
from omnid.gpu.events import XidEvent
from omnid.gpu.faults import GpuCondition, affects, health_view, start_refusal, worst
from omnid.gpu.items import GpuItem, is_mig, label
from omnid.gpu.nvml import NvmlBackend
from omnid.gpu.fake import FAKE_GPU_ENV, FakeGpuBackend, write_fake_gpu_file
from omnid.gpu.xid import classify as classify_xid

__all__ = ["FAKE_GPU_ENV", "FakeGpuBackend", "GpuBackend", "GpuCondition", "GpuInfo", "GpuItem", "GpuProcess",
           "GpuUnreadable", "MigInfo", "NoGpuBackend", "NvmlBackend", "XidEvent", "affects", "classify_xid",
           "describe", "find_device", "gpus_async", "health_view", "holders_of", "in_initial_pid_namespace",
           "is_mig", "label", "memory_held_by", "open_backend", "processes_async", "start_refusal", "status",
           "wait_released", "worst", "write_fake_gpu_file"]



# What a loaded NVIDIA driver shows: its proc directory, its control device, and WSL's
# GPU paravirtualisation device (where NVML runs without the other two).
DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg")


def open_backend() -> GpuBackend:
    """The fake backend when OMNID_FAKE_GPU names a file, else NVML, else "no GPU"."""
    fake = os.environ.get(FAKE_GPU_ENV)
    if fake:
        log.info("gpu: using the FAKE GPU backend", path=fake, env=FAKE_GPU_ENV)
        return FakeGpuBackend(fake)
    if not any(os.path.exists(p) for p in DRIVER_PATHS):
        # Not even the library is loaded: pynvml costs ~2.7 MiB of the daemon's memory
        # and finds nothing where no driver is.
        reason = "no GPU: no NVIDIA driver on this host (none of " + ", ".join(DRIVER_PATHS) + " exists)"
        log.info("gpu: no GPU backend", reason=reason)
        return NoGpuBackend(reason)
    nvml = NvmlBackend()
    if nvml.available:
        return nvml
    log.info("gpu: no GPU backend", reason=nvml.reason)
    return NoGpuBackend(nvml.reason)


def describe(backend: GpuBackend, gpus: list[GpuInfo] | None = None) -> str:
    """One line for logs and `status`: which backend, and what it sees or why not
    (`gpus`: what the caller just read, so this makes no NVML call of its own)."""
    if not backend.available:
        return f"{backend.kind}: {backend.reason}"
    if gpus is None:
        try:
            gpus = backend.gpus()
        except GpuUnreadable as exc:
            return f"{backend.kind}: {exc}"
    count = len(gpus)
    migs = sum(len(g.migs) for g in gpus)
    where = f" from {backend.path}" if isinstance(backend, FakeGpuBackend) and backend.path else ""
    name = "FAKE GPU backend" if backend.kind == "fake" else backend.kind
    pidns = "" if backend.pids_local else ", host pids (not comparable)"
    mig = f", {migs} MIG device{'s' if migs != 1 else ''}" if migs else ""
    return f"{name}{where}: {count} GPU{'s' if count != 1 else ''}{mig}{pidns}"


def status(backend: GpuBackend | None, sup: Any = None) -> dict:
    """The `gpu` object of `omnid status --json` (its daemon part): backend, whether it can
    be read and why not, stuck reader threads, every condition, and (with the supervisor)
    which units each reaches (omnid-control(7)). Makes no NVML call: safe on the event
    loop while a driver call hangs."""
    if backend is None:
        return {"backend": "none", "readable": False, "reason": "GPU checks not started", "conditions": []}
    conds = backend.conditions()
    out = {"backend": backend.kind, "readable": bool(backend.available), "reason": backend.reason,
           "stuck_threads": backend.stuck_threads, "conditions": [c.to_json() for c in conds]}
    if sup is not None:
        out["health"] = health_view(backend, [(u.name, list(u.spec.gpus)) for u in sup.units.values()])
    return out
