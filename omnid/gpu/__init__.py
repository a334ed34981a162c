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
- `omnid.gpu.fake.FakeGpuBackend` is a DEVELOPER OPTION for omnid's own tests on machines
  without a GPU, and says so in its name and `kind`. It is not part of this package's
  API and production never imports it: `open_backend` loads it only when the
  environment variable OMNID_DEVELOPER_FAKE_GPU names its JSON file (re-read on every
  call, so that a daemon under test sees changes the test makes while it runs).

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

from omnid.base import ownership, testswitch
from omnid.gpu.backend import (GpuBackend, GpuInfo, GpuProcess, MigInfo, NoGpuBackend, find_device, gpus_async,
                               holders_of, in_initial_pid_namespace, log, memory_held_by, processes_async,
                               wait_released)
from omnid.gpu.bounded import GpuUnreadable
from omnid.gpu.events import XidEvent
from omnid.gpu.faults import GpuCondition, affects, health_view, start_refusal, worst
from omnid.gpu.items import GpuItem, is_mig, label
from omnid.gpu.nvml import NvmlBackend
from omnid.gpu.xid import classify as classify_xid

__all__ = ["FAKE_GPU_ENV", "GpuBackend", "GpuCondition", "GpuInfo", "GpuItem", "GpuProcess",
           "GpuUnreadable", "MigInfo", "NoGpuBackend", "NvmlBackend", "XidEvent", "affects", "classify_xid",
           "describe", "find_device", "gpus_async", "health_view", "holders_of", "in_initial_pid_namespace",
           "is_mig", "label", "memory_held_by", "open_backend", "processes_async", "start_refusal", "status",
           "wait_released", "worst"]



# What a loaded NVIDIA driver shows: its proc directory, its control device, and WSL's
# GPU paravirtualisation device (where NVML runs without the other two).
DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg")


# The developer option that swaps NVML for the fake backend (omnid.gpu.fake; a test switch,
# omnid.base.testswitch), and the name it had before it was one (read only to say that it is
# not read any more).
FAKE_GPU_ENV = testswitch.FAKE_GPU_ENV
RETIRED_FAKE_GPU_ENV = "OMNID_FAKE_GPU"


def open_backend() -> GpuBackend:
    """NVML, else "no GPU" with the reason; the FAKE backend only under the developer
    option OMNID_DEVELOPER_FAKE_GPU (developer_fake)."""
    fake = developer_fake()
    if fake is not None:
        return fake
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


def developer_fake() -> GpuBackend | None:
    """The fake GPU backend when the developer option asks for it and nothing refuses it,
    else None (the real backends; a refusal is logged as an error naming the reason).

    It cannot be switched on by accident in production: only this variable turns it on
    (no flag, no setting, no control request); it is a test switch (omnid.base.testswitch:
    refused outside omnid's test suite, and in a systemd service, a Kubernetes pod or a
    Slurm job), and refused for a file that a user other than omnid's (or root) could write
    or replace, since its contents decide which units may start and which fail (an injected
    Xid). When on, it says so here at every start, in `omnid status` and in /health."""
    if os.environ.get(RETIRED_FAKE_GPU_ENV):
        log.error(f"gpu: {RETIRED_FAKE_GPU_ENV} is not read any more: the fake GPU backend is the "
                  f"developer option {FAKE_GPU_ENV}", env=RETIRED_FAKE_GPU_ENV)
    path = os.environ.get(FAKE_GPU_ENV)
    if not path:
        return None
    refused = testswitch.refusal()
    if refused is None:
        try:
            os.close(ownership.open_checked(path, f"fake GPU file ({FAKE_GPU_ENV})"))
        except ownership.UnsafePath as exc:
            refused = str(exc)
    if refused:
        log.error(f"gpu: developer option {FAKE_GPU_ENV} refused, using the real GPUs", reason=refused, path=path)
        return None
    from omnid.gpu.fake import FakeGpuBackend

    log.error(f"gpu: FAKE GPU BACKEND (developer option {FAKE_GPU_ENV}): GPU figures, processes and faults come "
              "from a file, not from NVML; for omnid's own tests only", path=path, env=FAKE_GPU_ENV)
    return FakeGpuBackend(path)


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
    path = getattr(backend, "path", None) if backend.kind == "fake" else None
    where = f" from {path}" if path else ""
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
    if backend.kind == "fake":
        out["warning"] = f"FAKE GPU backend (developer option {FAKE_GPU_ENV}): not real GPUs"
    if sup is not None:
        out["health"] = health_view(backend, [(u.name, list(u.spec.gpus)) for u in sup.units.values()])
    return out
