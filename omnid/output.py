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
# Work bounds for a unit that writes as fast as it can: at most READS_PER_TURN reads
# of READ_SIZE per loop turn (then the other callbacks run, the pipe fills and the
# writer blocks: back-pressure, not memory), at most ECHO_PER_SEC lines a second
# echoed into the daemon's log (the rest are kept in the ring buffer and counted).
READ_SIZE = 65536
READS_PER_TURN = 1
# At most this many bytes a second read from one unit: beyond it the pipe is left
# unread until the second is over (the unit blocks in write(), as on a slow
# terminal), so a flood costs the daemon a bounded share of its loop.
READ_BYTES_PER_SEC = 4 << 20
ECHO_PER_SEC = 200
KEEP_BYTES = 1 << 20


class UnitOutput:
    """Ring buffer of a unit's recent lines; survives restarts of the unit."""

    def __init__(self, unit: str, keep: int = 2000, echo: bool = True) -> None:
        self.unit = unit
        # (timestamp, stream, line); stdout and stderr share one pipe today, so the
        # stream is "output" for both.
        self.lines: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=keep)
        self.kept_bytes = 0
        self.echo = echo
        self.lines_total = 0
        self.lines_truncated = 0
        self.echo_dropped = 0  # lines not echoed into the daemon's log (rate limit)
        self.evicted_for_bytes = 0
        self._echo_window = 0.0
        self._echo_count = 0
        self._fd = -1
        self._partial = b""
        self._read_window = 0.0
        self._read_bytes = 0
        self._paused: asyncio.TimerHandle | None = None
        self.read_pauses = 0

    def attach(self, fd: int) -> None:
        """Start reading a new process's output pipe (read end, owned from now on)."""
        self.detach()
        os.set_blocking(fd, False)
        self._fd = fd
        asyncio.get_running_loop().add_reader(fd, self._readable)

    def _readable(self) -> None:
        for _ in range(READS_PER_TURN):
            try:
                chunk = os.read(self._fd, READ_SIZE)
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
            now = time.monotonic()
            if now - self._read_window >= 1.0:
                self._read_window, self._read_bytes = now, 0
            self._read_bytes += len(chunk)
            if self._read_bytes >= READ_BYTES_PER_SEC:
                self._pause(self._read_window + 1.0 - now)
                return

    def _pause(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._fd)
        self.read_pauses += 1
        self._paused = loop.call_later(max(0.0, seconds), self._resume)

    def _resume(self) -> None:
        self._paused = None
        if self._fd >= 0:
            asyncio.get_running_loop().add_reader(self._fd, self._readable)

    def _feed(self, chunk: bytes) -> None:
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        if len(self._partial) > MAX_LINE:
            complete.append(self._partial)
            self._partial = b""
        if complete:
            self._emit_many(complete)

    def _flush_partial(self) -> None:
        if self._partial:
            self._emit_many([self._partial])
            self._partial = b""

    def _echo_budget(self, now: float, n: int) -> int:
        """How many of n new lines may still be echoed into the daemon's log this second."""
        if now - self._echo_window >= 1.0:
            if self._echo_count > ECHO_PER_SEC:
                log.warning("unit output rate-limited in the daemon log", unit=self.unit,
                            lines_not_echoed=self._echo_count - ECHO_PER_SEC,
                            hint="the last lines stay in `omnid logs`")
            self._echo_window = now
            self._echo_count = 0
        take = max(0, min(n, ECHO_PER_SEC - self._echo_count))
        self._echo_count += n
        return take

    def _emit_many(self, raws: list[bytes]) -> None:
        """Lines that can neither be echoed (rate limit) nor stay in the ring buffer
        (the last `keep` of this batch win) are only counted: a flood costs one split
        per read, not per-line work."""
        now = time.time()
        n = len(raws)
        self.lines_total += n
        echo_n = self._echo_budget(now, n) if self.echo else 0
        self.echo_dropped += (n - echo_n) if self.echo else 0
        for raw in raws[:echo_n]:
            log.info(self._keep(raw, now), unit=self.unit, stream="output")
        tail_from = max(echo_n, n - (self.lines.maxlen or n))
        for raw in raws[tail_from:]:
            self._keep(raw, now)

    def _keep(self, raw: bytes, now: float) -> str:
        if len(raw) > MAX_LINE:
            raw = raw[:MAX_LINE]
            self.lines_truncated += 1
        line = raw.decode(errors="replace").rstrip("\r")
        if len(self.lines) == self.lines.maxlen:
            self.kept_bytes -= len(self.lines[0][2])
        self.lines.append((now, "output", line))
        self.kept_bytes += len(line)
        while self.kept_bytes > KEEP_BYTES and len(self.lines) > 1:
            self.kept_bytes -= len(self.lines.popleft()[2])
            self.evicted_for_bytes += 1
        return line

    def detach(self) -> None:
        """Drain what is buffered, then stop reading and close the pipe."""
        if self._fd < 0:
            return
        try:
            for _ in range(64):  # bounded: a leftover writer must not hold the loop
                chunk = os.read(self._fd, READ_SIZE)
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
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
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
        return [{"ts": ts, "stream": stream, "line": line} for ts, stream, line in items]


def add_counters(snapshots: list[dict], units: dict) -> list[dict]:
    """Put each unit's output counters ("log") into its status object; the same for
    `omnid status --json` and GET /units (omnid-control(7))."""
    for snap in snapshots:
        u = units.get(snap["name"])
        out = getattr(u, "output", None)
        if out is not None:
            snap["log"] = {"lines": out.lines_total, "not_echoed": out.echo_dropped,
                           "truncated": out.lines_truncated, "read_pauses": out.read_pauses}
    return snapshots
