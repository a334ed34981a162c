"""What the spawner decides about one spawn before it forks (omnid/process/spawner.py).

Which path from fork to exec a spawn takes (`may_hang`: a cwd or program on a filesystem that
can hang is forked, never vforked, read from the kernel's mount table without touching a
mount), which programs the child may execve (the unit's PATH, searched as execvpe would), and
the arguments each path's child gets ready-made: the placement's (sched_setaffinity,
set_mempolicy) and the compiled call's (omnid.process._spawnc.spawn), users and groups resolved.
A spawn that cannot start is `Refused` here, before any fork.

Nothing here forks or runs in a child; it runs in the spawner, so it stays light (the
standard library and omnid.base.linux only, see omnid/base/linux.py).
"""

from __future__ import annotations

import grp
import os
import pwd

from omnid.base import linux

# Filesystems whose operations can block without bound when their server or network hangs.
MAY_HANG = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse", "fuseblk", "9p", "ceph", "glusterfs", "afs",
            "lustre", "gpfs", "beegfs", "virtiofs", "davfs", "ncpfs", "coda", "ocfs2", "gfs2", "orangefs")


class Refused(Exception):
    """A spawn that cannot start, found before the fork; the text is the reason."""


def placement_args(wire: dict) -> tuple:
    """The child's sched_setaffinity / set_mempolicy arguments, built before fork."""
    cpus = wire.get("cpus") or ()
    mode = int(wire.get("mempolicy") or 0)
    mask, maxnode = linux.nodemask(wire.get("nodes") or ()) if mode else (None, 0)
    return (tuple(cpus), mode, mask, maxnode)


def exec_candidates(path: str, env: dict) -> list[str]:
    """What the child tries to execve, in order: `path` itself if it names a file, else each
    directory of the unit's PATH (execvpe's search, made before the fork)."""
    if "/" in path:
        return [path]
    dirs = (env.get("PATH") or os.defpath).split(os.pathsep)
    return [os.path.join(d or ".", path) for d in dirs]


def compiled_args(req: dict, out_fd: int, errout_fd: int, devnull: int, spawner_pid: int,
                  reset_signals: tuple[int, ...], placement: tuple | None) -> tuple:
    """omnid.process._spawnc.spawn's arguments for one request. Names are resolved here, before the
    fork (Refused: no such user or group); bad values raise ValueError or TypeError."""
    env = req["env"]
    argv = req["argv"]
    path = req.get("path") or argv[0]
    candidates = [os.fsencode(c) for c in exec_candidates(path, env)]
    envp = []
    for key, value in env.items():
        if not key or "=" in key:
            raise ValueError(f"illegal environment variable name {key!r}")
        envp.append(os.fsencode(f"{key}={value}"))
    rlimits = [(int(res), int(soft), int(hard)) for res, soft, hard in req.get("rlimits") or ()]
    cgroup = req.get("cgroup")
    procs = os.fsencode(os.path.join(cgroup, "cgroup.procs")) if cgroup else None
    cpus, mode, mask, maxnode = placement if placement is not None else ((), 0, None, 0)
    gid = uid = -1
    groups = None
    ids = req.get("ids")
    if ids is not None:  # resolved by the daemon when it read the stack: no NSS lookup here
        if ids["error"]:
            raise Refused(ids["error"])
        uid, gid, groups = ids["uid"], ids["gid"], ids["groups"]
    elif req.get("group"):
        try:
            gid = grp.getgrnam(req["group"]).gr_gid
        except KeyError as exc:
            raise Refused(f"group {req['group']!r} failed: {exc}") from None
    if req.get("user"):
        try:
            pw = pwd.getpwnam(req["user"])
        except KeyError as exc:
            raise Refused(f"user {req['user']!r} failed: {exc}") from None
        if gid < 0:
            gid = pw.pw_gid
        groups = os.getgrouplist(pw.pw_name, gid)
        uid = pw.pw_uid
    return (candidates, [os.fsencode(a) for a in argv], envp, out_fd, errout_fd, devnull, spawner_pid,
            reset_signals, rlimits, procs, list(cpus) or None, mode, bytes(mask) if mode else b"",
            maxnode, True, os.fsencode(req["cwd"]) if req.get("cwd") else None, gid, groups, uid)


# -- which path: the mount table ----------------------------------------------------------
def mounts() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, in mount order. Reads the kernel's table
    only: no path on any mount is touched."""
    out = []
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields = line.split()
                try:
                    sep = fields.index(b"-")
                except ValueError:
                    continue
                point = fields[4].decode(errors="replace")
                for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
                    point = point.replace(esc, ch)
                out.append((point, fields[sep + 1].decode(errors="replace")))
    except OSError:
        return []
    return out


def _fs_type(path: str, mounts: list[tuple[str, str]]) -> str:
    """The type of the filesystem `path` (absolute, taken literally: a symlink is not followed,
    which would touch the mount) lies on: the longest mount point above it, the last mounted."""
    path = os.path.normpath(path)
    best, kind = -1, ""
    for point, fstype in mounts:
        if path == point or path.startswith(point.rstrip("/") + "/"):
            if len(point) >= best:
                best, kind = len(point), fstype
    return kind


def may_hang(req: dict, table: list[tuple[str, str]] | None = None) -> str | None:
    """The first path of a spawn (its cwd, each program it may execve) on a filesystem that can
    hang, as "PATH (TYPE)"; None when every one is local."""
    table = mounts() if table is None else table
    cwd = req.get("cwd") or os.getcwd()
    paths = [cwd]
    argv = req.get("argv") or [""]
    for cand in ([req["path"]] if req.get("path") else exec_candidates(str(argv[0]), req.get("env") or {})):
        paths.append(cand if os.path.isabs(cand) else os.path.join(cwd, cand))
    for path in paths:
        kind = _fs_type(path, table)
        if kind.split(".")[0] in MAY_HANG:
            return f"{path} ({kind})"
    return None
