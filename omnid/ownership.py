"""Ownership rules for what a (root) daemon trusts on disk (issue #9; man omnid(8) SECURITY).

Like sshd's StrictModes: a directory the daemon keeps its control socket or state
in, and (when running as root) every unit file and the units directory, must be
owned by the daemon's uid (or root) and writable by no one else. Otherwise
another user could plant a socket, a state file listing pids to kill, a symlink
at a temporary name, or a unit running their program as root.
"""

from __future__ import annotations

import os
import pwd
import resource
import stat
from pathlib import Path


class UnsafePath(Exception):
    """A path another user could control; the message names path, owner and mode."""


def owner_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _problem(st: os.stat_result, trusted: tuple[int, ...]) -> str | None:
    if st.st_uid not in trusted:
        return f"owned by {owner_name(st.st_uid)}, expected {' or '.join(owner_name(u) for u in trusted)}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = [w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others")) if st.st_mode & bit]
        return f"mode {stat.S_IMODE(st.st_mode):04o} is writable by {' and '.join(who)}"
    return None


def trusted_uids() -> tuple[int, ...]:
    me = os.geteuid()
    return (me,) if me == 0 else (me, 0)


def check_private_dir(path: str | Path, what: str, trusted: tuple[int, ...] | None = None) -> None:
    """`path` must be a real directory (not a symlink) owned by us (or a `trusted` uid),
    writable by its owner only."""
    trusted = trusted or (os.geteuid(),)
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafePath(f"{what} {path}: cannot stat ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{what} {path} is a symlink (owned by {owner_name(st.st_uid)}); "
                         "expected a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{what} {path} is not a directory")
    problem = _problem(st, trusted)
    if problem:
        raise UnsafePath(f"refusing {what} {path}: {problem} (owner {owner_name(st.st_uid)}, "
                         f"mode {stat.S_IMODE(st.st_mode):04o}); it must be owned by "
                         f"{' or '.join(owner_name(u) for u in trusted)} and writable by no one else")


def check_unit_path(path: str | Path, *, directory: bool) -> str | None:
    """For a root daemon: why this unit file or units directory is not trustworthy, or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # reported by the parser
    problem = _problem(st, trusted_uids())
    if problem is None:
        return None
    kind = "units directory" if directory else "unit file"
    return (f"{kind} is {problem} (owner {owner_name(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}); "
            f"a root daemon runs only unit files that root owns and no one else can write")


def raise_nofile_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit; returns (soft, hard) now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        target = 1 << 20
    else:
        target = hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard
