"""Ownership rules for what a (root) daemon trusts on disk (issue #9; man omnid(8) SECURITY).

Like sshd's StrictModes: a directory the daemon keeps its control socket or state
in, and (when running as root) every unit file and the units directory, must be
owned by the daemon's uid (or root) and writable by no one else. Otherwise
another user could plant a socket, a state file listing pids to kill, a symlink
at a temporary name, or a unit running their program as root.
"""

from __future__ import annotations

import errno
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


def _dir_problem(st: os.stat_result, trusted: tuple[int, ...]) -> str | None:
    """sshd's StrictModes for an ancestor directory: owned by a trusted uid and writable by no
    one else -- except a sticky directory (/tmp): there another user may add names, but not
    rename or remove ours, and a name they add is theirs (refused when it is walked)."""
    if st.st_uid in trusted and st.st_mode & stat.S_ISVTX:
        return None
    return _problem(st, trusted)


def open_checked(path: str | Path, what: str, *, trusted: tuple[int, ...] | None = None,
                 private: bool = False) -> int:
    """Open `path` for reading so that what is read is what was checked (man omnid(8),
    SECURITY): the directory is resolved once (realpath), then walked from / one component at
    a time with O_NOFOLLOW, each directory checked on its open fd (owner trusted, writable by
    no one else, sticky allowed); the file is opened with O_NOFOLLOW below the last one and
    checked on its fd (a regular file, owner trusted, not writable by group or others, with
    `private` not readable by them either). A swap of any component between the check and
    the read cannot happen: there is no second lookup by path. Returns the open fd (the
    caller reads it and closes it); raises UnsafePath naming the path and the reason.
    `trusted`: the uids allowed to own them (default: trusted_uids())."""
    trusted = trusted or trusted_uids()
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    parent = os.path.realpath(parent)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open("/", os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    here = "/"
    try:
        parts = [p for p in parent.split("/") if p] + [name]
        for i, part in enumerate(parts):
            st = os.fstat(fd)
            problem = _dir_problem(st, trusted)
            if problem:
                raise UnsafePath(f"refusing {what} {path}: its directory {here} is {problem}; every directory "
                                 f"above it must be owned by {' or '.join(owner_name(u) for u in trusted)} and "
                                 "writable by no one else (or sticky, as /tmp)")
            last = i == len(parts) - 1
            here = os.path.join(here, part)
            try:
                nfd = os.open(part, flags | (os.O_NONBLOCK if last else os.O_DIRECTORY), dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafePath(f"refusing {what} {path}: {here} is a symlink; expected a real "
                                     f"{'file' if last else 'directory'}") from None
                raise UnsafePath(f"{what} {path}: cannot open {here} ({exc.strerror})") from None
            os.close(fd)
            fd = nfd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"refusing {what} {path}: not a regular file")
        problem = _problem(st, trusted)
        if problem is None and private and st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
            problem = f"mode {stat.S_IMODE(st.st_mode):04o} is readable by group or others; expected chmod 600"
        if problem:
            raise UnsafePath(f"refusing {what} {path}: it is {problem} (owner {owner_name(st.st_uid)}, "
                             f"mode {stat.S_IMODE(st.st_mode):04o})")
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_checked(path: str | Path, what: str, limit: int, **kw) -> bytes:
    """open_checked, then at most `limit` bytes from the same fd."""
    fd = open_checked(path, what, **kw)
    try:
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size < limit and (chunk := os.read(fd, min(1 << 16, limit - size))):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_directory(path: str | Path, what: str) -> str | None:
    """Why the directory `path` (its real path) and every directory above it up to / cannot be
    trusted, or None: the same walk as open_checked (O_NOFOLLOW, checked on each open fd)."""
    trusted = trusted_uids()
    real = os.path.realpath(path)
    fd = os.open("/", os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    here = "/"
    try:
        for part in [p for p in real.split("/") if p] + [None]:
            st = os.fstat(fd)
            problem = _dir_problem(st, trusted) if part is not None else _problem(st, trusted)
            if problem:
                where = "it" if part is None else f"its directory {here}"
                return (f"{what} {real}: {where} is {problem} (owner {owner_name(st.st_uid)}, mode "
                        f"{stat.S_IMODE(st.st_mode):04o}); it and every directory above it must be owned by "
                        f"{' or '.join(owner_name(u) for u in trusted)} and writable by no one else")
            if part is None:
                return None
            here = os.path.join(here, part)
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=fd)
            except OSError:
                return None  # not there (or not a directory): the caller says so, by path
            os.close(fd)
            fd = nfd
        return None
    finally:
        os.close(fd)


def open_directory(path: str | Path, what: str) -> tuple[int, str]:
    """(an fd of the directory `path`, its real path), after the walk of open_checked: resolved
    once, walked from / with O_NOFOLLOW, every directory up to it and itself checked on its
    open fd (owner trusted, writable by no one else, or sticky as /tmp: there no other user
    can rename or remove what we put in it). The caller closes the fd. UnsafePath names the
    directory and why."""
    trusted = trusted_uids()
    real = os.path.realpath(path)
    fd = os.open("/", os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    here = "/"
    try:
        for part in [p for p in real.split("/") if p] + [None]:
            st = os.fstat(fd)
            problem = _dir_problem(st, trusted)
            if problem:
                where = "it" if part is None else f"its directory {here}"
                raise UnsafePath(f"refusing {what} {real}: {where} is {problem} (owner {owner_name(st.st_uid)}, mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}); it and every directory above it must be owned "
                                 f"by {' or '.join(owner_name(u) for u in trusted)} and writable by no one else "
                                 "(or sticky, as /tmp)")
            if part is None:
                return fd, real
            here = os.path.join(here, part)
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafePath(f"refusing {what} {real}: {here} is a symlink; expected a real directory") from None
                raise UnsafePath(f"{what} {real}: cannot open {here} ({exc.strerror})") from None
            os.close(fd)
            fd = nfd
        raise AssertionError("unreachable")
    except BaseException:
        os.close(fd)
        raise


def read_unit_file(path: str | Path, limit: int) -> bytes:
    """A unit file's bytes (at most `limit`). A root daemon runs what it says: read_checked
    (O_NOFOLLOW, every directory up to / and the file checked on their open fds, the bytes
    from the same fd). Any other daemon runs it as its own user: a plain read."""
    if os.geteuid() != 0:
        with open(path, "rb") as f:
            return f.read(limit)
    try:
        return read_checked(path, "unit file", limit)
    except UnsafePath as exc:
        raise UnsafePath(f"{exc}; a root daemon runs only unit files that root owns and no one else can "
                         "write, in directories the same holds for") from None


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
