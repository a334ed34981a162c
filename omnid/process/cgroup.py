"""cgroup v2 per unit: nothing escapes, emptiness is an event, figures come from the kernel;
and the daemon's hooks into it.

Where a writable cgroup v2 subtree exists (the *root*), every unit instance runs in
its own cgroup `<root>/<escaped unit name>`, joined by the child between fork and exec
(omnid.process.spawner), so no fork of the unit can escape it. The kill policy
(omnid.process.termination) acts on it through `CgroupTarget`: the stop signal goes to the main
process, its group and every member of the cgroup; escalation writes `cgroup.kill`; the
unit is gone when `cgroup.events` says `populated 0` — observed as an inotify event on
the asyncio loop, never by a sleep loop — and then the directory is removed.

The parts, each a module of its own, lowest first:
- omnid.process.cgroupfs: the cgroup2 files (read, write, populated, procs, kill, rmdir,
  figures) and whether the kernel says a pid is a member;
- omnid.process.cgroupwatch: `populated 0` as an event (one inotify instance);
- omnid.process.cgroupunit: the cgroup of one unit instance, and its limits;
- omnid.process.cgrouptargets: the kill policy's Targets and the unit-processes backend;
- omnid.process.cgrouproot: the daemon's root and the unit cgroups below it;
- omnid.process.cgroupdiscovery: finding the root (flag, omnid.toml, systemd delegation)
  and claiming it;
- this module: what the daemon calls (start, the stack's keys, the backend it reports).
"""

from __future__ import annotations

import structlog

from omnid.process.cgroupdiscovery import CgroupError, discover
from omnid.process.cgrouproot import KEY_CONTROLLER, CgroupRoot
# Re-exported: the names the executor, the spawn and the daemon take from here.
from omnid.process.cgrouptargets import CgroupTarget
from omnid.process.cgroupunit import cgroup_limits

__all__ = ["CgroupError", "CgroupRoot", "CgroupTarget", "backend", "cgroup_limits", "check_stack_keys", "start"]

log = structlog.get_logger("omnid.process.cgroup")


def backend(root: CgroupRoot | None) -> dict:
    """What `omnid status`, /health and /units say about the kill backend."""
    if root is None:
        return {"backend": "process-group", "cgroup": None}
    return {"backend": "cgroup", "cgroup": root.path}


def check_stack_keys(root: CgroupRoot | None, stack) -> None:
    """memory_max / tasks_max that this root (or no root) cannot honour: CgroupError naming
    every unit and key (at daemon start, and for `omnid reload` of an edited stack)."""
    errs = []
    for name, spec in sorted(stack.units.items()):
        keys = {k: getattr(spec, k, None) for k in KEY_CONTROLLER}
        if root is None:
            errs += [f"unit {name}: {k}: needs a cgroup v2 root (--cgroup-root, cgroup_root in omnid.toml or "
                     f"systemd Delegate=yes); omnid runs with process groups here" for k, v in keys.items() if v is not None]
        else:
            errs += root.check_keys(name, keys)
    if errs:
        raise CgroupError("; ".join(errs))


def start(explicit: str | None, origin: str, stack, companions: tuple[int, ...] = ()) -> CgroupRoot | None:
    """At daemon start, before the spawner has spawned anything: discover the root (`explicit`,
    as resolved by omnid.model.settings from `origin`: flag, env or omnid.toml; else delegation; the
    daemon and its `companions` move into its leaf), refuse unit keys it cannot honour
    (CgroupError naming unit and key), clean a previous daemon's cgroups."""
    source = {"flag": "--cgroup-root", "env": "OMNID_CGROUP_ROOT",
              "omnid.toml": f"cgroup_root in {getattr(stack.settings, 'file', 'omnid.toml')}"}.get(origin) \
        if explicit else None
    try:
        root = discover(explicit, source or "", companions)
    except CgroupError as exc:
        raise CgroupError(f"{source}: {exc}") from None
    try:
        check_stack_keys(root, stack)
    except CgroupError:
        if root is not None:
            root.close()
        raise
    if root is not None:
        left = root.clean_stale()
        if left:
            log.error("cgroups of a previous daemon could not be removed", cgroups=left)
        log.info("cgroup v2 per unit", root=root.path, source=root.source, controllers=sorted(root.controllers))
    return root
