"""A unit's private temporary directory (unit key `private_tmp`, omnid.unit(5)): systemd's
PrivateTmp= without a mount namespace. At each spawn of an instance omnid makes a fresh
directory under /tmp (random name, mkdir fails if the name exists, mode 0700, then owned
by the unit's user), and the unit's TMPDIR, TMP and TEMP point at it. When nothing of the
instance runs any more it is removed with everything in it, off the event loop, by an
fd-relative walk that never follows a symbolic link (a hostile unit may plant one to
/etc) and stops at a deadline.

What proves a directory is omnid's when a daemon that was SIGKILLed left it: the record
in the state directory (`tmpdirs.json`: a new directory is in it before the spawn that uses
it is sent; removals are written a moment later, several at once), the path and
the inode omnid made. A directory is removed only when its name is omnid's pattern, it is
a directory directly under the root (not a link), and its device and inode are the ones
recorded; anything else under /tmp is never touched.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from omnid.base import linux
from omnid.process import proof

log = structlog.get_logger("omnid.process.privatetmp")

TMP_ROOT = "/tmp"
PREFIX = "omnid-"
RECORD_NAME = "tmpdirs.json"
MAX_RECORD_BYTES = 8 << 20  # ~40,000 lines: a rewrite keeps it near the live directories
_NAME_RE = re.compile(r"^omnid-[A-Za-z0-9_.@:-]{1,200}-[0-9a-f]{12}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.@:-]")
ENV_KEYS = ("TMPDIR", "TMP", "TEMP")
# What `remove` says when it stopped at its deadline or entry budget with more to remove: the
# caller may go on with another slice (omnid.core.cleanup does, off the spawn path).
BOUND_REACHED = "not fully removed: its removal reached its bound (time or entries)"
SWEEP_SLICE_S = 5.0  # a previous daemon's directory: one slice each at start, the rest in the background


def bound_reached(left: str | None) -> bool:
    """Did a `remove` that returned `left` stop only at its bound (more slices would go on)?"""
    return left is not None and left.endswith(BOUND_REACHED)


@dataclass(frozen=True)
class TmpDir:
    """A directory omnid made: enough to prove it is still the same one."""

    unit: str
    path: str
    dev: int
    ino: int
    # The owner it was given: an inode number can be reused, and only the directory's owner
    # (or root) can remove it from the sticky /tmp and make another of that name.
    uid: int = -1

    def to_json(self) -> dict:
        return {"unit": self.unit, "path": self.path, "dev": self.dev, "ino": self.ino, "uid": self.uid}

    @classmethod
    def from_json(cls, d: object) -> TmpDir | None:
        """Untrusted JSON (a record file, a handover): None when it is not one of ours."""
        if not isinstance(d, dict):
            return None
        unit, path, dev, ino = d.get("unit"), d.get("path"), d.get("dev"), d.get("ino")
        if not (isinstance(unit, str) and isinstance(path, str) and isinstance(dev, int) and isinstance(ino, int)):
            return None
        if os.path.dirname(path) == "" or not _NAME_RE.match(os.path.basename(path)):
            return None
        uid = d.get("uid", -1)
        return cls(unit, path, dev, ino, uid if isinstance(uid, int) else -1)


def wanted(spec: object) -> bool:
    """Does this unit get one? `private_tmp = true` and no TMPDIR of its own in `env` (an
    operator's explicit TMPDIR wins: it names a place on purpose)."""
    env = getattr(spec, "env", {}) or {}
    return bool(getattr(spec, "private_tmp", False)) and "TMPDIR" not in env


def create(unit: str, uid: int | None, gid: int | None, root: str = TMP_ROOT) -> TmpDir:
    """mkdtemp's way (a random name, mkdir that fails on an existing name: no link can be
    planted in advance), mode 0700, then owned by the unit's user. OSError says why not."""
    safe = _UNSAFE.sub("_", unit)[:200] or "unit"
    for _ in range(16):
        path = os.path.join(root, f"{PREFIX}{safe}-{secrets.token_hex(6)}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        break
    else:
        raise FileExistsError(f"no free name under {root} after 16 tries")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if uid is not None or gid is not None:
                os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
            os.fchmod(fd, 0o700)  # the umask may have taken bits off; 0700 exactly
            st = os.fstat(fd)
        finally:
            os.close(fd)
    except OSError:
        try:
            os.rmdir(path)
        except OSError:
            pass
        raise
    return TmpDir(unit, path, st.st_dev, st.st_ino, st.st_uid)


def environment(d: TmpDir) -> dict[str, str]:
    return {k: d.path for k in ENV_KEYS}


def remove(d: TmpDir, deadline_s: float = 10.0, max_entries: int = 1_000_000,
           counted: list[int] | None = None) -> str | None:
    """Remove the directory and everything in it, if it is still the one omnid made. Blocking
    (call it off the event loop). None when it is gone; otherwise what is left and why.
    `counted` gets the number of entries the walk went through (the stop summary's)."""
    parent, name = os.path.split(d.path)
    if not _NAME_RE.match(name):
        return f"{d.path}: not an omnid private directory name; left alone"
    try:
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return f"{d.path}: cannot open {parent}: {exc.strerror}"
    try:
        try:
            st = linux.stat_same_mount(name, pfd, os.O_DIRECTORY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"{d.path}: {_why_not(exc)}; left alone"
        if not (verdict := _proof(st, d)):
            return f"{d.path}: {verdict.reason}; left alone"
        budget = [max_entries]
        try:
            left = _remove_tree(pfd, name, time.monotonic() + deadline_s, budget, d)
        finally:
            if counted is not None:
                counted.append(min(max_entries, max_entries - budget[0]))
        return None if left is None else f"{d.path}: {left}"
    finally:
        os.close(pfd)


def remove_if_empty(d: TmpDir) -> bool:
    """The common case, cheap enough for the event loop: an empty directory, still the one
    omnid made, removed with one rmdir. False: it is not empty, or not ours, or a file system
    is mounted on it (never asked anything: its server may never answer): the full removal's
    business, which says why."""
    parent, name = os.path.split(d.path)
    try:
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not _proof(linux.stat_same_mount(name, pfd, os.O_DIRECTORY), d):
            return False
        os.rmdir(name, dir_fd=pfd)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
    finally:
        os.close(pfd)


def _proof(st: os.stat_result, d: TmpDir) -> proof.Verdict:
    """Is this the directory omnid made? omnid.process.proof.tmp_dir (device, inode, owner)."""
    return proof.tmp_dir(d.path, st, d.dev, d.ino, d.uid)


def _why_not(exc: OSError) -> str:
    if exc.errno == errno.EXDEV:
        return "a file system is mounted on it"
    if exc.errno in (errno.ENOTDIR, errno.ELOOP):
        return "not the directory omnid made (replaced)"
    return f"cannot open: {exc.strerror}"


def _remove_tree(pfd: int, name: str, deadline: float, budget: list[int], d: TmpDir) -> str | None:
    """rmtree's fd-based walk, iterative: every directory opened O_NOFOLLOW relative to its
    parent's fd, links unlinked, never followed. Stops at the deadline or entry budget. The
    proof is asked again of the directory the fd holds: what is walked is what was proven."""
    try:
        top = linux.open_same_mount(name, os.O_RDONLY | os.O_DIRECTORY, pfd)
    except OSError as exc:
        return f"{_why_not(exc)}; left alone"
    if not (verdict := _proof(os.fstat(top), d)):  # swapped between the lstat and the open: not ours
        os.close(top)
        return f"{verdict.reason}; left alone"
    stack: list[tuple[int, str, int]] = [(pfd, name, top)]  # (parent fd, name, own fd)
    try:
        while stack:
            if time.monotonic() > deadline or budget[0] <= 0:
                return BOUND_REACHED
            parent_fd, dname, dfd = stack[-1]
            descended = False
            with os.scandir(dfd) as it:
                for entry in it:  # the bound asked first: an entry left is not counted (a next slice counts it)
                    if budget[0] <= 0 or time.monotonic() > deadline:
                        return BOUND_REACHED
                    budget[0] -= 1
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            sub = linux.open_same_mount(entry.name, os.O_RDONLY | os.O_DIRECTORY, dfd)
                            stack.append((dfd, entry.name, sub))
                            descended = True
                            break
                        os.unlink(entry.name, dir_fd=dfd)
                    except FileNotFoundError:
                        continue
                    except OSError as exc:
                        return f"cannot remove {entry.name}: {exc.strerror}; left alone"
            if descended:
                continue
            stack.pop()
            os.close(dfd)
            try:
                os.rmdir(dname, dir_fd=parent_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                return f"cannot remove {dname}: {exc.strerror}"
        return None
    finally:
        for _, _, fd in stack:
            os.close(fd)


def parse_record(raw: bytes, where: str) -> list[TmpDir]:
    """The directories a record names: its lines replayed ({"add": DIR} / {"drop": PATH}, the
    later winning), or an older omnid's one JSON list. What is not one of ours is skipped, and
    said once."""
    if raw.lstrip().startswith(b"["):
        try:
            data = json.loads(raw)
        except ValueError:
            log.warning("private tmp record is not JSON; ignoring it", path=where)
            return []
        out = [TmpDir.from_json(x) for x in data] if isinstance(data, list) else []
        return [d for d in out if d is not None]
    dirs: dict[str, TmpDir] = {}
    bad = 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(entry, dict) and "add" in entry and (d := TmpDir.from_json(entry["add"])) is not None:
            dirs[d.path] = d
        elif isinstance(entry, dict) and isinstance(entry.get("drop"), str):
            dirs.pop(entry["drop"], None)
        else:
            bad += 1
    if bad:
        log.warning("private tmp record lines ignored (not one of ours)", path=where, lines=bad)
    return list(dirs.values())


class Record:
    """tmpdirs.json in the daemon's state directory (only the daemon can write there, checked
    at start): the directories made and not yet removed, so that a daemon after a SIGKILL
    removes what its predecessor left -- and only that.

    One JSON object per line: {"add": DIR} or {"drop": PATH}, appended, the later line
    winning. A directory made is on disk before the spawn that uses it leaves (`flush`, called
    by the spawner client before it sends; else at the end of the loop's turn): one append,
    not a rewrite of the whole list and a rename, which cost a restart 0.4-3 ms on this
    ext4 on the way to its spawn (and 256 units nine of them). Removals are appended within
    DROP_DELAY_S, several at once, or at `flush`: a daemon SIGKILLed in between leaves an
    entry for a directory that is gone, which proves nothing (its inode is gone) and is
    skipped by the next daemon's sweep. Once the lines are more than twice the directories
    (and a margin), the file is rewritten whole, from a delayed write, never a flush: the
    rename stays off the spawn path. A record of an older omnid (one JSON list) is read too."""

    DROP_DELAY_S = 0.1
    COMPACT_MARGIN = 256  # lines beyond twice the live directories before a rewrite

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / RECORD_NAME
        self.dirs: dict[str, TmpDir] = {}  # path -> dir
        self.writes = 0  # appends and rewrites of the file (bench/daemon_path.py)
        self.rewrites = 0
        self._pending: list[bytes] = []  # lines not on disk yet
        self._lines = 0  # lines in the file as this daemon left it (unknown before: rewrite first)
        self._fd = -1  # the append fd, on the file the last rewrite made
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None

    def add(self, d: TmpDir) -> None:
        self.dirs[d.path] = d
        self._pending.append(json.dumps({"add": d.to_json()}).encode() + b"\n")
        self._changed(0.0)

    def drop(self, d: TmpDir) -> None:
        if self.dirs.pop(d.path, None) is not None:
            self._pending.append(json.dumps({"drop": d.path}).encode() + b"\n")
            self._changed(self.DROP_DELAY_S)

    def flush(self) -> None:
        """Append what changed since the last write, now (a no-op when nothing did)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._write(compact=False)

    def close(self) -> None:
        self.flush()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _delayed(self) -> None:
        self._timer = None
        self._write(compact=True)

    def _changed(self, delay: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a tool, a test): at once
            self.flush()
            return
        soon = self._timer is not None and not isinstance(self._timer, asyncio.TimerHandle)
        if self._timer is not None and (soon or delay > 0):
            return  # a write is due as soon, or sooner
        if self._timer is not None:  # a removal's delayed write: a new directory's goes now
            self._timer.cancel()
        self._timer = loop.call_soon(self._delayed) if delay <= 0 else loop.call_later(delay, self._delayed)

    def _write(self, compact: bool) -> None:
        """The pending lines appended; the whole file rewritten instead when it has none of
        this daemon's yet (the previous daemon's lines are read once, at start), or, from a
        delayed write, when it has grown past its bound."""
        if not self._pending and not (compact and self._overgrown()):
            return
        try:
            if self._fd < 0 or (compact and self._overgrown()):
                self._rewrite()
            else:
                data = b"".join(self._pending)
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
                self._lines += len(self._pending)
            self._pending.clear()
            self.writes += 1
        except OSError as exc:
            log.error("cannot write the private tmp record", path=str(self.path), error=str(exc))

    def _overgrown(self) -> bool:
        return self._fd >= 0 and self._lines > 2 * len(self.dirs) + self.COMPACT_MARGIN

    def _rewrite(self) -> None:
        lines = [json.dumps({"add": d.to_json()}).encode() + b"\n" for d in self.dirs.values()]
        proof.replace_daemon_file(self.path, b"".join(lines))
        self.rewrites += 1
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        # The file the rename put there, appended to from now on; a regular file of ours, never
        # a link (O_NOFOLLOW), in the daemon's own directory.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise OSError(errno.EPERM, f"{self.path} is not a regular file of the daemon's")
        self._fd, self._lines = fd, len(lines)

    def previous(self) -> list[TmpDir]:
        """What a previous daemon recorded (untrusted: a regular file of ours, size-capped)."""
        try:
            raw = proof.read_daemon_file(self.path, MAX_RECORD_BYTES)
        except OSError as exc:
            log.warning("private tmp record unreadable; ignoring it", path=str(self.path), error=str(exc))
            return []
        except ValueError:
            log.warning("private tmp record is not a small file of ours; ignoring it", path=str(self.path))
            return []
        if raw is None:
            return []
        return parse_record(raw, str(self.path))

    def sweep(self, previous: list[TmpDir], keep: set[str]) -> tuple[list[str], list[TmpDir]]:
        """Remove what the previous daemon recorded (`previous`, read before this daemon made
        any) and no longer uses (a re-exec keeps the live units' directories: `keep`), one
        slice of `remove` each. Returns (the paths removed, the directories whose slice reached
        its bound: still proven ours, for the caller to go on with and to record again)."""
        removed: list[str] = []
        unfinished: list[TmpDir] = []
        for d in previous:
            if d.path in keep:
                continue
            left = remove(d, deadline_s=SWEEP_SLICE_S)
            if left is None:
                removed.append(d.path)
            elif bound_reached(left):
                unfinished.append(d)
            else:
                log.warning("a previous daemon's private tmp directory was not removed", unit=d.unit, why=left)
        # Not rewritten here (a thread; the loop owns `dirs`): the next add or drop rewrites it,
        # and an entry of a removed directory proves nothing to a later daemon (inode gone).
        if removed:
            log.info("removed private tmp directories a previous daemon left", paths=removed)
        return removed, unfinished
