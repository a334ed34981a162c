"""A unit's stdout/stderr: one pipe read by the daemon, logged line by line with
the unit's name, the last lines kept for `omnid logs` (DESIGN.md "The child's environment")."""

from __future__ import annotations

import asyncio
import collections
import os
import time

import structlog

log = structlog.get_logger("omnid.unit")

MAX_LINE = 16 * 1024


class UnitOutput:
    """Ring buffer of a unit's recent lines; survives restarts of the unit."""

    def __init__(self, unit: str, keep: int = 2000, echo: bool = True) -> None:
        self.unit = unit
        self.lines: collections.deque[tuple[float, str]] = collections.deque(maxlen=keep)
        self.echo = echo
        self._fd = -1
        self._partial = b""

    def attach(self, fd: int) -> None:
        """Start reading a new process's output pipe (read end, owned from now on)."""
        self.detach()
        os.set_blocking(fd, False)
        self._fd = fd
        asyncio.get_running_loop().add_reader(fd, self._readable)

    def _readable(self) -> None:
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("unit output read failed", unit=self.unit, error=str(exc))
                self.detach()
                return
            if not chunk:  # every writer closed it: the unit and its children are gone
                self._flush_partial()
                self._close()
                return
            self._feed(chunk)

    def _feed(self, chunk: bytes) -> None:
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        for raw in complete:
            self._emit(raw)
        if len(self._partial) > MAX_LINE:
            self._emit(self._partial)
            self._partial = b""

    def _flush_partial(self) -> None:
        if self._partial:
            self._emit(self._partial)
            self._partial = b""

    def _emit(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip("\r")
        self.lines.append((time.time(), line))
        if self.echo:
            log.info(line, unit=self.unit, stream="output")

    def detach(self) -> None:
        """Drain what is buffered, then stop reading and close the pipe."""
        if self._fd < 0:
            return
        try:
            while True:
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    break
                self._feed(chunk)
        except (BlockingIOError, OSError):
            pass
        self._flush_partial()
        self._close()

    def _close(self) -> None:
        if self._fd < 0:
            return
        try:
            asyncio.get_running_loop().remove_reader(self._fd)
        except RuntimeError:
            pass
        os.close(self._fd)
        self._fd = -1

    @property
    def attached(self) -> bool:
        return self._fd >= 0

    def tail(self, n: int) -> list[dict]:
        items = list(self.lines)[-n:] if n > 0 else []
        return [{"ts": ts, "line": line} for ts, line in items]
