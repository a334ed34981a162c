"""Where hang captures are kept (omnid(8) FORENSICS, FILES): the state directory's
dumps/<escaped unit>/, one JSON file per capture, mode 0600 in directories of mode 0700,
bounded per unit in count and bytes (the oldest dropped first).

omnid runs as root: every step goes through directory fds opened with O_NOFOLLOW, and
files are created with O_EXCL|O_NOFOLLOW, so a symlink planted anywhere below the state
directory never redirects a write or a read; a directory owned by someone else is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import threading
from typing import Any

import structlog

from omnid.forensics.record import Capture
from omnid.base.ownership import UnsafePath, owner_name

log = structlog.get_logger("omnid.forensics.store")

DEFAULT_COUNT = 8
DEFAULT_BYTES = 4 << 20
_FILE = re.compile(r"[0-9]{17}-[0-9]+\.json")
_SAFE = re.compile(r"[A-Za-z0-9_@-]")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def escape(unit: str) -> str:
    """A unit name as one directory name: anything outside [A-Za-z0-9_@-] as %XX (so no
    '.', '..' or '/' can come out of it)."""
    return "".join(ch if _SAFE.fullmatch(ch) else "".join(f"%{b:02X}" for b in ch.encode()) for ch in unit)


class CaptureStore:
    """Captures of every unit, newest kept. Methods do blocking file I/O: the daemon calls
    them in a thread (`save_async`, or asyncio.to_thread)."""

    def __init__(self, state_dir: str | os.PathLike[str], *, max_count: int = DEFAULT_COUNT,
                 max_bytes: int = DEFAULT_BYTES) -> None:
        self.state_dir = os.fspath(state_dir)
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # one writer at a time: names and pruning stay consistent
        self._seq = 0
        # unit -> {"ts", "why", "summary"} of its newest capture; filled lazily, kept on save.
        self._last: dict[str, dict[str, Any] | None] = {}

    # ---- directories

    def _open_dir(self, parent: int, name: str, create: bool) -> int | None:
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a symlink; ENOTDIR: a file planted there
            raise UnsafePath(f"capture directory {name} in {self.state_dir}: {exc.strerror}; "
                             "expected a real directory") from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise UnsafePath(f"capture directory {name} in {self.state_dir} is owned by {owner_name(st.st_uid)}; "
                             f"expected {owner_name(os.geteuid())}")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
        return fd

    def _unit_dir(self, unit: str, create: bool) -> int | None:
        try:
            base = os.open(self.state_dir, _DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                return None
            raise
        try:
            dumps = self._open_dir(base, "dumps", create)
        finally:
            os.close(base)
        if dumps is None:
            return None
        try:
            return self._open_dir(dumps, escape(unit), create)
        finally:
            os.close(dumps)

    @staticmethod
    def _files(dfd: int) -> list[tuple[str, int]]:
        """(name, size) of the capture files in a unit's directory, oldest first."""
        out = []
        with os.scandir(dfd) as it:
            for e in it:
                if _FILE.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                    out.append((e.name, e.stat(follow_symlinks=False).st_size))
        return sorted(out)

    # ---- writing

    def save(self, cap: Capture) -> str:
        """Write a capture, then drop the oldest beyond max_count / max_bytes (the newest
        is always kept). Returns the file name. Raises OSError / UnsafePath."""
        data = json.dumps(cap.to_json(), separators=(",", ":")).encode()
        with self._lock:
            dfd = self._unit_dir(cap.unit, create=True)
            assert dfd is not None
            try:
                name = self._write(dfd, cap.ts, data)
                self._prune(dfd)
            finally:
                os.close(dfd)
            self._last[cap.unit] = _summary_of(cap)
        return name

    async def save_async(self, cap: Capture) -> None:
        """`save` in a thread; a failure is logged, never raised (a capture is evidence, not
        a reason to stop killing a unit)."""
        try:
            await asyncio.to_thread(self.save, cap)
        except (OSError, UnsafePath) as exc:
            log.error("cannot keep a capture", unit=cap.unit, state_dir=self.state_dir, error=str(exc))

    def _write(self, dfd: int, ts: float, data: bytes) -> str:
        stamp = f"{int(ts * 1e6):017d}"
        for _ in range(1000):
            self._seq += 1
            name = f"{stamp}-{self._seq}.json"
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=dfd)
            except FileExistsError:
                continue
            try:
                os.fchmod(fd, 0o600)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except BaseException:
                os.close(fd)
                os.unlink(name, dir_fd=dfd)
                raise
            os.close(fd)
            return name
        raise FileExistsError(f"no free capture file name under {self.state_dir}/dumps")

    def _prune(self, dfd: int) -> None:
        files = self._files(dfd)
        total = sum(size for _n, size in files)
        while len(files) > 1 and (len(files) > self.max_count or total > self.max_bytes):
            name, size = files.pop(0)
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
            total -= size

    # ---- reading

    def latest(self, unit: str, n: int = 1) -> list[Capture]:
        """The newest `n` captures of `unit`, oldest first ([] when there are none). A file
        that cannot be read or parsed is logged and skipped."""
        try:
            dfd = self._unit_dir(unit, create=False)
        except (OSError, UnsafePath) as exc:
            log.error("cannot read captures", unit=unit, state_dir=self.state_dir, error=str(exc))
            return []
        if dfd is None:
            return []
        out = []
        try:
            for name, _size in self._files(dfd)[-n:] if n > 0 else []:
                cap = self._read(dfd, unit, name)
                if cap is not None:
                    out.append(cap)
        finally:
            os.close(dfd)
        return out

    def _read(self, dfd: int, unit: str, name: str) -> Capture | None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as exc:
            log.warning("cannot open a capture file", unit=unit, file=name, error=exc.strerror)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > self.max_bytes + (1 << 20):
                log.warning("skipping a capture file that is not a plain file of sane size", unit=unit, file=name)
                return None
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read()
        finally:
            os.close(fd)
        try:
            return Capture.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            log.warning("skipping an unreadable capture file", unit=unit, file=name, error=str(exc))
            return None

    def last_summary(self, unit: str) -> dict[str, Any] | None:
        """{"ts", "why", "summary"} of the unit's newest capture (kept in memory after the
        first look, so `status` does not read files each time)."""
        if unit not in self._last:
            caps = self.latest(unit, 1)
            self._last[unit] = _summary_of(caps[0]) if caps else None
        return self._last[unit]


def _summary_of(cap: Capture) -> dict[str, Any]:
    return {"ts": cap.ts, "why": cap.why, "summary": cap.summary}
