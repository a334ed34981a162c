"""Everything a unit's spawn needs before the spawner forks: the argv (Python units
through the title runner), the environment, the refusal to start on a GPU held by
a leftover, the unit's cgroup (made before the child joins it) and its output
pipes. `prepare` returns a `SpawnRequest` with the pipes, or the reason it cannot
start; the executor sends the request and feeds the outcome back."""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from omnid.process import numa
from omnid.process.cgroup import cgroup_limits
from omnid.process.tags import DAEMON_TAG, tags_of
from omnid.process.spawnclient import SpawnRequest
from omnid.model.units import Unit as UnitSpec

if TYPE_CHECKING:  # omnid.gpu is imported when a unit has GPUs, not before the first spawn
    from omnid.gpu.backend import GpuBackend

log = structlog.get_logger("omnid.supervisor")

RUNNER = str(Path(__file__).resolve().parent.parent / "process" / "runner.py")
_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")
# The daemon's own variables that a unit must not inherit.
_NOT_INHERITED = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "OMNID_CONTROL", "INVOCATION_ID")
# The GPU precheck's bound on reading its holders' environments (each on a thread of its own,
# omnid.process.tags): a holder that keeps its memory lock cannot hold a spawn longer.
PRECHECK_BOUND_S = 1.0


@dataclass
class Prepared:
    """A spawn ready to go: the request and the read ends of the unit's stdout and stderr
    (the write ends go to the spawner with the request, then are closed here)."""

    request: SpawnRequest
    out_r: int
    out_w: int
    err_r: int
    err_w: int

    def close_write_ends(self) -> None:
        for fd in (self.out_w, self.err_w):
            os.close(fd)

    def close_read_ends(self) -> None:
        for fd in (self.out_r, self.err_r):
            os.close(fd)


class CannotSpawn(Exception):
    """The spawn cannot even be asked for; the message is the failure reason."""


def argv(spec: UnitSpec) -> list[str]:
    out = list(spec.exec)
    if spec.title and len(out) >= 2 and _PYTHON_RE.match(os.path.basename(out[0])):
        if out[1] == "-m" and len(out) >= 3 or not out[1].startswith("-"):
            # Python units run through the runner, which sets the title and hands over
            # to the module or script unchanged.
            return [out[0], RUNNER, spec.title, *out[1:]]
    return out


def program_path(name: str, env: dict[str, str], spec: UnitSpec) -> str | None:
    """A bare program name looked up in the unit's PATH here, so that the child makes one
    execve instead of walking PATH in Python after the fork (the walk's failed tries and
    their copy-on-write faults cost the child 0.5-1.5 ms a spawn, measured). None, and
    the child walks PATH itself as before: a name with a slash, a name not found here
    (the child reports the error), a relative PATH entry (relative to the unit's cwd, not
    ours), and units run as another user or group (root's X_OK is not theirs)."""
    if "/" in name or spec.user or spec.group:
        return None
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    return found if found is not None and os.path.isabs(found) else None


def _inherited() -> dict[str, str]:
    """What a unit inherits of the daemon's environment. Decoded from os.environ once, not at
    every spawn (~1 ms of a 256-unit start's each, here), for as long as os.environ's raw
    bytes stay the same (compared as they are: a change is seen at the next spawn)."""
    raw = getattr(os.environ, "_data", None)
    cached = _INHERITED.get("env")
    if cached is not None and raw is not None and raw == _INHERITED.get("raw"):
        return cached
    base = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    # Units named `python3 -m ...` find the interpreter omnid runs under first.
    base["PATH"] = os.path.dirname(sys.executable) + os.pathsep + base.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    if raw is not None:
        _INHERITED.update(env=base, raw=dict(raw))
    return base


_INHERITED: dict = {}  # "env": the last _inherited(), "raw": os.environ's bytes it was decoded from


def environ(spec: UnitSpec, notify_socket: str | None, token: str, extra: Mapping[str, str]) -> dict[str, str]:
    env = spec.environ(_inherited(), notify_socket)  # a new dict: the cached one is never changed
    env[DAEMON_TAG] = token  # proof of ownership for leftover cleanup
    env.update(extra)
    if spec.gpus and "CUDA_DEVICE_ORDER" not in spec.env:
        # NVML numbers GPUs in PCI order; make CUDA agree so gpus = [1] is the same card.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def gpu_refusal(spec: UnitSpec, backend: GpuBackend | None) -> str | None:
    """A GPU of the unit has fallen off the bus or cannot be read: no start (no NVML call)."""
    if backend is None or not spec.gpus:
        return None
    from omnid import gpu as gpu_mod

    return gpu_mod.start_refusal(backend, spec.gpus)


def gpu_held_by_leftover(spec: UnitSpec, backend: GpuBackend | None, ours: set[int],
                         bound_s: float = PRECHECK_BOUND_S) -> str | None:
    """A unit must not start on a GPU that a leftover omnid process still holds.

    The holders' tags are read within `bound_s` in all. A holder whose environment is not read
    by then (its memory lock is held: stuck in a fault on a hung mount, say) is not proven
    omnid's, and the spawn goes on with a warning naming it, as for any process outside omnid:
    refusing would keep the unit down, restart after restart, for as long as a process stays
    stuck that omnid can neither prove its own nor remove, while the GPU memory it holds is
    reported (a start that does not fit fails with the engine's own out-of-memory error)."""
    if backend is None or not spec.gpus or not getattr(backend, "available", False) \
            or not getattr(backend, "pids_local", False):
        return None
    from omnid import gpu as gpu_mod

    deadline = time.monotonic() + bound_s
    for holder in gpu_mod.holders_of(backend, spec.gpus):
        if holder.pid in ours:
            continue
        tags = tags_of(holder.pid, wait=max(0.0, deadline - time.monotonic()))
        if tags is None:
            log.warning("GPU used by a process whose environment was not read within the precheck's "
                        f"bound ({bound_s:g} s; its memory lock is held?): not proven a leftover of omnid; "
                        "starting", unit=spec.name, gpu=holder.gpu, pid=holder.pid, used_mib=holder.used_mib)
            continue
        tag = tags.unit
        if tag is not None:
            return (f"GPU {holder.gpu} is held by pid {holder.pid} ({holder.used_mib:.0f} MiB, a leftover "
                    f"omnid process of unit {tag} not managed by this daemon): refusing to start")
        log.warning("GPU used by a process outside omnid", unit=spec.name, gpu=holder.gpu, pid=holder.pid,
                    used_mib=holder.used_mib)
    return None


def prepare(spec: UnitSpec, *, env: dict[str, str], cgroups: object | None) -> Prepared:
    """The unit's cgroup (before the child joins it, pre-exec), its pipes and the request.
    CannotSpawn says why not (no cgroup, no fds left)."""
    try:
        cg_path = cgroups.create(spec.name, cgroup_limits(spec)).path if cgroups else None  # type: ignore[attr-defined]
    except OSError as exc:
        raise CannotSpawn(f"cannot create the unit's cgroup: {exc}") from None
    pipes: list[int] = []
    try:
        pipes.extend(os.pipe2(os.O_CLOEXEC))  # stdout
        pipes.extend(os.pipe2(os.O_CLOEXEC))  # stderr
    except OSError as exc:  # EMFILE is a failed spawn (backoff), not a crashed handler
        for fd in pipes:
            os.close(fd)
        code = errno.errorcode.get(exc.errno or 0, exc.errno)
        raise CannotSpawn(f"spawn failed: {code}: cannot create the output pipes ({exc.strerror})") from None
    out_r, out_w, err_r, err_w = pipes
    args = tuple(argv(spec))
    req = SpawnRequest(unit=spec.name, argv=args, env=env, cwd=spec.cwd, user=spec.user,
                       group=spec.group, rlimits=tuple(spec.limits), cgroup=cg_path,
                       placement=numa.placement_for(spec), path=program_path(args[0], env, spec))
    return Prepared(req, out_r, out_w, err_r, err_w)
