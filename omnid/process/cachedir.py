"""A unit's cache directory (unit key `cache_dir`, omnid.unit(5)): systemd's CacheDirectory=.
A directory that outlives the unit's restarts, a reload and a re-exec of the daemon, unlike
its private TMPDIR (omnid.process.privatetmp), so that what a restarted engine compiled
before (torch inductor's and Triton's kernels, vLLM's torch.compile artefacts) is found again
instead of built again. Nothing of omnid ever removes it.

Where: `cache_root` of omnid.toml, else /var/cache/omnid for a root daemon and
$XDG_CACHE_HOME/omnid (~/.cache/omnid) for any other; below it one directory per
`cache_dir` name (`true`: the template's name, so the instances of a template share one:
inductor and Triton write each entry under a temporary name and rename it into place, and
inductor takes a file lock per compiled object, so processes sharing the directory do not
corrupt each other's entries, and an instance restarting finds what the other compiled).

Made as root without trusting a path: the root is walked from / on fds (each directory
O_NOFOLLOW, owned by root or the daemon's user and writable by no one else:
omnid.base.ownership.open_directory), its missing components made by mkdir relative to the
checked parent; the unit's directory is made by mkdir relative to the root's fd (mode 0700),
opened O_NOFOLLOW and given to the unit's user with fchown on that fd -- a chown only of a
directory this call has just made. An existing one is used only when it is a real directory
that the unit's user owns already; a symbolic link, a file, or a directory of another user
(a unit whose `user` changed, or someone else's directory) is refused with the reason, and
never re-owned: its contents were written by someone else, and a chown of them would give the
unit whatever was linked there. The operator removes it or chowns it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from omnid.base.ownership import UnsafePath, open_directory, owner_name
from omnid.base.ownthreads import Busy, OwnThreads
from omnid.model.settings import default_cache_root

log = structlog.get_logger("omnid.process.cachedir")

ENV_KEY = "OMNID_CACHE_DIR"
# The caches a restart would otherwise build again, each in a directory of its own below the
# unit's (created by the program that uses it), unless the unit's `env` names its own.
ENV_DIRS = (("TORCHINDUCTOR_CACHE_DIR", "torchinductor"), ("TRITON_CACHE_DIR", "triton"),
            ("VLLM_CACHE_ROOT", "vllm"))
MODE = 0o700
ROOT_MODE = 0o755  # the root itself: every unit's user must be able to pass through it
PREPARE_BOUND_S = 10.0  # the cache root may be on a network mount that never answers
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class CacheDirRefused(Exception):
    """The unit's cache directory cannot be used: the message names the key, the path and why."""


@dataclass(frozen=True)
class CacheDir:
    path: str
    uid: int
    mode: int
    made: bool  # this call made it (else: it was there, the unit's user's already)


def name_of(spec: Any) -> str | None:
    """The directory name below the cache root (None: the unit has none)."""
    value = getattr(spec, "cache_dir", False)
    if value is True:
        return str(spec.template)
    return value or None


def environment(path: str, unit_env: Mapping[str, str]) -> dict[str, str]:
    """What the unit's environment gains: OMNID_CACHE_DIR, and the caches' variables that its
    `env` does not set itself."""
    out = {ENV_KEY: path}
    for var, sub in ENV_DIRS:
        if var not in unit_env:
            out[var] = os.path.join(path, sub)
    return out


def open_root(root: str) -> tuple[int, str]:
    """(an fd of the cache root, its real path), every directory up to it checked on its fd;
    missing components are made (0755) relative to the checked directory above them. Blocking.
    UnsafePath says why not."""
    try:
        return open_directory(root, "cache root")
    except UnsafePath:
        real = os.path.realpath(root)
        existing, missing = real, []
        while existing != "/" and not os.path.lexists(existing):
            existing, leaf = os.path.split(existing)
            missing.insert(0, leaf)
        if not missing:  # it is there: unsafe (the same refusal again), or made meanwhile by another spawn
            return open_directory(root, "cache root")
    fd, _ = open_directory(existing, "cache root")
    try:
        for part in missing:
            try:
                os.mkdir(part, ROOT_MODE, dir_fd=fd)
                made = True
            except FileExistsError:
                made = False
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            if made:
                os.fchmod(nfd, ROOT_MODE)  # the umask may have taken bits off
            os.close(fd)
            fd = nfd
    except OSError as exc:
        raise UnsafePath(f"cache root {real}: cannot make it ({exc.strerror})") from None
    finally:
        os.close(fd)
    return open_directory(root, "cache root")  # the whole chain again, on fds


def prepare(root: str, name: str, uid: int | None, gid: int | None) -> CacheDir:
    """The unit's directory `name` below `root`, made or found, owned by `uid` (None: the
    daemon's own user). Blocking (a thread: the root may be on a hung mount).
    CacheDirRefused says why it cannot be used."""
    try:
        rfd, real = open_root(root)
    except UnsafePath as exc:
        raise CacheDirRefused(f"cache_dir: {exc}") from None
    path = os.path.join(real, name)
    owner = os.geteuid() if uid is None else uid
    try:
        problem = _unreachable(os.fstat(rfd), owner, gid)
        if problem:
            raise CacheDirRefused(f"cache_dir: cache root {real} is {problem}: the unit's user "
                                  f"{owner_name(owner)} could not reach its directory; chmod 755 it")
        try:
            os.mkdir(name, MODE, dir_fd=rfd)
            made = True
        except FileExistsError:
            made = False
        except OSError as exc:
            raise CacheDirRefused(f"cache_dir {path}: cannot make it ({exc.strerror})") from None
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=rfd)
        except OSError as exc:
            why = f"cannot be opened ({exc.strerror})"
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_DIRECTORY|O_NOFOLLOW on a link: ENOTDIR
                try:
                    link = stat.S_ISLNK(os.stat(name, dir_fd=rfd, follow_symlinks=False).st_mode)
                except OSError:
                    link = False
                why = "is a symbolic link; expected a directory (a link is never followed)" if link else \
                    "is not a directory"
            raise CacheDirRefused(f"cache_dir {path} {why}; remove it to have omnid make the directory") from None
        try:
            if made:
                if uid is not None or gid is not None:
                    os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
                os.fchmod(fd, MODE)
            st = os.fstat(fd)
        except OSError as exc:
            if made:  # not left behind owned by the daemon, where the next spawn would refuse it
                try:
                    os.rmdir(name, dir_fd=rfd)
                except OSError:
                    pass
            raise CacheDirRefused(f"cache_dir {path}: cannot give it to {owner_name(owner)} "
                                  f"({exc.strerror})") from None
        finally:
            os.close(fd)
    finally:
        os.close(rfd)
    if st.st_uid != owner:
        raise CacheDirRefused(
            f"cache_dir {path} is owned by {owner_name(st.st_uid)}, not by the unit's user {owner_name(owner)}; "
            "omnid never re-owns a directory it did not just make: remove it, or chown it to the unit's user")
    return CacheDir(path, st.st_uid, stat.S_IMODE(st.st_mode), made)


def _unreachable(st: os.stat_result, uid: int, gid: int | None) -> str | None:
    """Why a process of `uid` (and `gid`) could not pass through the root, or None."""
    if uid in (0, st.st_uid) or st.st_mode & stat.S_IXOTH or (gid == st.st_gid and st.st_mode & stat.S_IXGRP):
        return None
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owned by {owner_name(st.st_uid)}"


class UnitCaches:
    """The daemon's door to cache directories: each made on a thread of its own, bounded, and
    one at a time per directory (the instances of a template share one and start together:
    the second must not find the first's directory between its mkdir and its fchown)."""

    def __init__(self, root: Callable[[], object] | None = None) -> None:
        self._root = root  # the stack's `cache_root` now (a reload may change it), or None
        self._locks: dict[str, asyncio.Lock] = {}
        self.threads = OwnThreads(2, kind="cache directory preparation")

    def root(self) -> str:
        configured = self._root() if self._root is not None else None
        return str(configured) if configured else default_cache_root()

    async def before_spawn(self, spec: Any, uid: int | None, gid: int | None) -> dict[str, str]:
        """The directory made or found; what the unit's environment gains ({}: no cache_dir).
        CacheDirRefused says why the unit cannot start."""
        name = name_of(spec)
        if name is None:
            return {}
        root = self.root()
        lock = self._locks.setdefault(os.path.join(root, name), asyncio.Lock())
        async with lock:
            try:
                d = await self.threads.run(f"{spec.name}'s cache directory",
                                           lambda: prepare(root, name, uid, gid), PREPARE_BOUND_S)
            except TimeoutError:
                raise CacheDirRefused(f"cache_dir {os.path.join(root, name)}: not made in {PREPARE_BOUND_S:g} s "
                                      "(a mount that does not answer?)") from None
            except Busy as exc:
                raise CacheDirRefused(f"cache_dir: {exc}") from None
        if d.made:
            log.info("cache directory made", unit=spec.name, path=d.path, uid=d.uid, mode=f"{d.mode:04o}")
        return environment(d.path, spec.env)
