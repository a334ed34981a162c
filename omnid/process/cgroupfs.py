"""The cgroup v2 file system, read and written as plain files: which mounts are cgroup2,
a unit name as a directory name, `cgroup.events`, `cgroup.procs`, `cgroup.kill`, the
figures, and whether a process is a member (the kernel's answer in /proc/PID/cgroup).

Nothing here knows a unit or a root; omnid.process.cgrouproot, cgroupwatch and
cgrouptargets stand on it."""

from __future__ import annotations

import errno
import os
import re

import structlog

from omnid.process import proof
from omnid.process.proof import DAEMON_LEAF  # the daemon's own leaf below a delegated root: never a unit's

log = structlog.get_logger("omnid.process.cgroupfs")


def cgroup2_mounts(mounts_file: str = "/proc/mounts") -> list[str]:
    out = []
    with open(mounts_file) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "cgroup2":
                out.append(parts[1].replace("\\040", " "))
    return out


def mount_of(path: str) -> str | None:
    """The cgroup2 mount point that holds path, or None."""
    best = None
    for m in cgroup2_mounts():
        if (path == m or path.startswith(m.rstrip("/") + "/")) and (best is None or len(m) > len(best)):
            best = m
    return best


_SAFE = re.compile(r"[A-Za-z0-9_.:@-]")


def escape(name: str) -> str:
    """A unit name as one cgroup directory name: bytes outside [A-Za-z0-9_.:@-] as \\xNN
    (systemd's escaping); a leading '.' or a name that could be taken for a control file
    (`cgroup.*`, `memory.*`, ... all contain '.') or the daemon leaf gets a '_' prefix."""
    out = "".join(ch if _SAFE.fullmatch(ch) else "".join(f"\\x{b:02x}" for b in ch.encode()) for ch in name)
    if out.startswith((".", "_")) or "." in out or out == DAEMON_LEAF:
        out = "_" + out
    return out


def read(path: str) -> str | None:
    """A cgroup file's text; None when it (or its cgroup) is gone or its controller is not there."""
    try:
        with open(path) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ENODEV, errno.ENOENT, errno.EOPNOTSUPP):
            return None
        raise


def write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def populated(path: str) -> bool:
    text = read(os.path.join(path, "cgroup.events"))
    if text is None:
        return False  # removed: nothing can run in it
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == "populated":
            return v.strip() == "1"
    return False


def procs(path: str) -> list[int]:
    text = read(os.path.join(path, "cgroup.procs"))
    return [int(x) for x in text.split()] if text else []


def tree_procs(path: str) -> list[int]:
    """Members of path and of every cgroup below it (a unit may create sub-cgroups)."""
    out: list[int] = []
    for dirpath, _dirs, _files in os.walk(path):
        out.extend(procs(dirpath))
    return out


def kill(path: str) -> None:
    """SIGKILL to every process of the cgroup and its sub-cgroups, by the kernel (`cgroup.kill`)."""
    try:
        write(os.path.join(path, "cgroup.kill"), "1")
    except FileNotFoundError:
        pass


def remove_tree(path: str, root: str | None = None) -> bool:
    """rmdir path once empty (sub-cgroups first); False while something still runs in it, or
    when it is not a unit's cgroup under `root` (default: its parent, the root that made it;
    omnid.process.proof.cgroup_dir says why, logged)."""
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        return True
    verdict = proof.cgroup_dir(path, os.path.dirname(path.rstrip("/")) if root is None else root, st,
                               os.path.exists(os.path.join(path, "cgroup.events")))
    if not verdict:
        log.warning("cgroup not removed", cgroup=path, why=verdict.reason)
        return False
    for dirpath, dirs, _files in os.walk(path, topdown=False):
        for d in dirs:
            try:
                os.rmdir(os.path.join(dirpath, d))
            except FileNotFoundError:
                pass
            except OSError:
                return False
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def figures(path: str) -> dict:
    """memory.current, memory.peak, cpu.stat usage_usec, pids.current: only those whose
    file exists (a controller on cgroup v1 in a hybrid layout has none; nothing is faked)."""
    out: dict = {}
    for key, fname in (("memory_current", "memory.current"), ("memory_peak", "memory.peak"),
                       ("pids_current", "pids.current")):
        text = read(os.path.join(path, fname))
        if text is not None and text.strip().isdigit():
            out[key] = int(text)
    text = read(os.path.join(path, "cpu.stat"))
    if text:
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "usage_usec" and v.strip().isdigit():
                out["cpu_usage_usec"] = int(v)
    return out


# ------------------------------------------------------------------------ membership


def proc_name(path: str) -> str:
    """The cgroup's path as /proc/PID/cgroup names it (relative to its cgroup2 mount)."""
    mount = mount_of(os.path.realpath(path)) or "/"
    return "/" + os.path.relpath(os.path.realpath(path), mount)


def pid_in_cgroup(pid: int, name: str) -> bool:
    """The kernel says pid is in the cgroup `name` (proc_name's form) or below it: the
    `0::` line of /proc/PID/cgroup, which takes no lock of the process's. A pid proves
    nothing by itself (it may be recycled): read it with the process's pidfd open
    (omnid.base.linux.pidfd_if), as the kill targets do."""
    text = read(f"/proc/{pid}/cgroup") or ""
    for line in text.splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip()
            return rel == name or rel.startswith(name + "/")
    return False
