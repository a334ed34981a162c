"""Finding the cgroup v2 root, and making sure it is omnid's: `--cgroup-root DIR` /
`cgroup_root` in omnid.toml; else, under systemd with `Delegate=yes`, the daemon's own
cgroup, with the daemon moved into a `daemon/` leaf so that units can be its siblings;
else None: omnid falls back to process groups and says so once. A root is claimed (marked
`trusted.omnid.root`) before anything below it is killed as stale, and a root that holds
cgroups omnid did not make is refused."""

from __future__ import annotations

import os

import structlog

from omnid.process import cgroupfs
from omnid.process.cgroupfs import DAEMON_LEAF
from omnid.process.cgrouproot import CgroupRoot

log = structlog.get_logger("omnid.process.cgroup")


class CgroupError(Exception):
    """A cgroup root that cannot be used; the message names the path and the reason."""


def validate(path: str) -> None:
    """Raise CgroupError unless path is a writable cgroup v2 directory."""
    if not os.path.isabs(path):
        raise CgroupError(f"cgroup root {path!r}: must be an absolute path")
    mount = cgroupfs.mount_of(os.path.realpath(path))
    if mount is None:
        raise CgroupError(f"cgroup root {path}: not on a cgroup2 file system (cgroup2 mounts: "
                          f"{', '.join(cgroupfs.cgroup2_mounts()) or 'none'})")
    if not os.path.isdir(path):
        parent = os.path.dirname(path.rstrip("/"))
        if not os.path.isdir(parent) or cgroupfs.mount_of(os.path.realpath(parent)) is None:
            raise CgroupError(f"cgroup root {path}: does not exist and its parent is not a cgroup2 directory")
        try:
            os.mkdir(path)
        except OSError as exc:
            raise CgroupError(f"cgroup root {path}: cannot create it: {exc.strerror}") from None
    for f in ("cgroup.procs", "cgroup.kill", "cgroup.events", "cgroup.subtree_control"):
        fp = os.path.join(path, f)
        if not os.path.exists(fp):
            raise CgroupError(f"cgroup root {path}: no {f} (kernel too old, or the cgroup2 root itself; "
                              f"cgroup.kill needs Linux 5.14)")
    if not os.access(path, os.W_OK) or not os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
        raise CgroupError(f"cgroup root {path}: not writable by uid {os.getuid()} (delegate it: Delegate=yes)")


def _own_cgroup() -> str | None:
    """This process's cgroup v2 directory (the `0::` line of /proc/self/cgroup)."""
    text = cgroupfs.read("/proc/self/cgroup") or ""
    for line in text.splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip()
            for m in cgroupfs.cgroup2_mounts():
                p = os.path.normpath(m + "/" + rel)
                if os.path.isdir(p):
                    return p
    return None


def _delegated(path: str) -> bool:
    """systemd marks a cgroup it delegated (Delegate=yes) with the trusted.delegate (or,
    for user managers, user.delegate) extended attribute set to 1."""
    for attr in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(path, attr) == b"1":
                return True
        except OSError:
            continue
    return False


MARK = "trusted.omnid.root"


def claim(path: str) -> None:
    """Make sure path is omnid's before anything below it is killed as stale: either it
    carries omnid's mark (trusted.omnid.root, set by an earlier daemon) or it holds no
    cgroup yet, and then it gets the mark. A root shared with others is refused."""
    try:
        if os.getxattr(path, MARK) == b"1":
            return
    except OSError:
        pass
    others = sorted(n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n)) and n != DAEMON_LEAF)
    if others:
        raise CgroupError(f"cgroup root {path}: holds cgroups omnid did not make ({', '.join(others[:5])}); "
                          f"give omnid a directory of its own (omnid kills whatever it finds below its root)")
    try:
        os.setxattr(path, MARK, b"1")
    except OSError as exc:
        log.warning("cannot mark the cgroup root as omnid's", root=path, error=str(exc))


def discover(explicit: str | None, source: str = "--cgroup-root", companions: tuple[int, ...] = ()) -> CgroupRoot | None:
    """The cgroup root to use, or None (process groups). An explicit root that cannot be
    used is an error (CgroupError); the automatic one falls back with one log line.
    `companions`: our own processes already started (the spawner) that move with us."""
    if explicit:
        validate(explicit)
        claim(explicit)
        return CgroupRoot(os.path.abspath(explicit), source)
    own = _own_cgroup()
    under_systemd = bool(os.environ.get("INVOCATION_ID"))
    why = None
    if not under_systemd:
        why = "not started by systemd (no INVOCATION_ID) and no --cgroup-root / cgroup_root given"
    elif own is None:
        why = "no cgroup v2 hierarchy in /proc/self/cgroup"
    elif not _delegated(own):
        why = f"own cgroup {own} is not delegated (set Delegate=yes in the service)"
    else:
        try:
            validate(own)
            leaf = os.path.join(own, DAEMON_LEAF)
            os.makedirs(leaf, exist_ok=True)
            # Move this process and its threads (none yet) into the leaf: units can be
            # siblings only if no process sits in an inner cgroup.
            cgroupfs.write(os.path.join(leaf, "cgroup.procs"), "0")
            for pid in companions:  # single-threaded, and no spawn asked of it yet
                cgroupfs.write(os.path.join(leaf, "cgroup.procs"), str(pid))
            claim(own)
            return CgroupRoot(own, "systemd delegation")
        except (CgroupError, OSError) as exc:
            why = f"delegated cgroup {own} unusable: {exc}"
    log.warning("no cgroup v2 root: omnid falls back to process groups; a unit's process that "
                "calls setsid() and double-forks can escape stop", reason=why)
    return None
