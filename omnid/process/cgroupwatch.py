"""`populated 0` as an event: a unit's cgroup is empty when its cgroup.events says so,
seen through inotify on the asyncio loop (or poll(2) before the loop runs), never by a
sleep loop."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import select
import struct
import time

from omnid.process.cgroupfs import populated


class EmptyWatch:
    """One inotify instance for the whole daemon (an instance per unit would hit
    fs.inotify.max_user_instances = 128 with a 256-unit stack): IN_MODIFY on each
    waited-for cgroup.events, dispatched from the asyncio loop's reader."""

    IN_MODIFY = 0x2
    IN_IGNORED = 0x8000
    IN_NONBLOCK = os.O_NONBLOCK
    IN_CLOEXEC = os.O_CLOEXEC
    _EV = struct.Struct("iIII")

    def __init__(self) -> None:
        # The interpreter already links libc (ctypes.util.find_library would cost the daemon's
        # start ~2 ms of imports: shutil, tempfile).
        libc = ctypes.CDLL(None, use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        self._rm = libc.inotify_rm_watch
        self._rm.argtypes = (ctypes.c_int, ctypes.c_int)
        fd = libc.inotify_init1(self.IN_NONBLOCK | self.IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_init1: {os.strerror(e)}")
        self.fd = fd
        self._waiters: dict[int, set[asyncio.Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, path: str) -> int:
        wd = self._add(self.fd, path.encode(), self.IN_MODIFY)
        if wd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_add_watch {path}: {os.strerror(e)}")
        return wd

    def _on_readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        off = 0
        while off + self._EV.size <= len(data):
            wd, _mask, _cookie, ln = self._EV.unpack_from(data, off)
            off += self._EV.size + ln
            for ev in self._waiters.get(wd, ()):
                ev.set()

    async def wait_empty(self, path: str, deadline: float) -> bool:
        """Until `populated 0` in path/cgroup.events (an event), or False at the deadline."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self.fd)
            loop.add_reader(self.fd, self._on_readable)
            self._loop = loop
        events = os.path.join(path, "cgroup.events")
        try:
            wd = self.add(events)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return True  # removed: empty by definition
            raise
        ev = asyncio.Event()
        self._waiters.setdefault(wd, set()).add(ev)
        try:
            while populated(path):  # read after the watch is in place: no lost wake-up
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                ev.clear()
                try:
                    await asyncio.wait_for(ev.wait(), left)
                except asyncio.TimeoutError:
                    return not populated(path)
            return True
        finally:
            s = self._waiters.get(wd)
            if s is not None:
                s.discard(ev)
                if not s:
                    del self._waiters[wd]
                    self._rm(self.fd, wd)  # the same wd may be handed out again after this

    def wait_empty_sync(self, path: str, deadline: float) -> bool:
        """The same wait, before the event loop runs (daemon start): poll(2) on the inotify fd."""
        try:
            wd = self.add(os.path.join(path, "cgroup.events"))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return True
            raise
        try:
            p = select.poll()
            p.register(self.fd, select.POLLIN)
            while populated(path):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if p.poll(left * 1000):
                    try:
                        os.read(self.fd, 65536)
                    except BlockingIOError:
                        pass
            return True
        finally:
            self._rm(self.fd, wd)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.fd)
        os.close(self.fd)
