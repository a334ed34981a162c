"""A unit's stdout and stderr: a pipe each, read by the daemon, logged line by line with
the unit's name and stream, the last lines kept for `omnid logs` (omnid.unit(5),
"ENVIRONMENT OF A UNIT")."""

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


class _Pipe:
    """One read end (stdout or stderr) of a unit's process: bytes in, whole lines out."""

    def __init__(self, owner: "UnitOutput", fd: int, stream: str) -> None:
        self.owner, self.fd, self.stream = owner, fd, stream
        self.partial = b""
        self.read_window = 0.0
        self.read_bytes = 0
        self.paused: asyncio.TimerHandle | None = None
        os.set_blocking(fd, False)
        asyncio.get_running_loop().add_reader(fd, self.readable)

    def readable(self) -> None:
        for _ in range(READS_PER_TURN):
            try:
                chunk = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("unit output read failed", unit=self.owner.unit, stream=self.stream, error=str(exc))
                self.drain_and_close()
                return
            if not chunk:  # every writer closed it: the unit and its children are gone
                self.flush()
                self.close()
                return
            self.feed(chunk)
            now = time.monotonic()
            if now - self.read_window >= 1.0:
                self.read_window, self.read_bytes = now, 0
            self.read_bytes += len(chunk)
            if self.read_bytes >= READ_BYTES_PER_SEC:
                self.pause(self.read_window + 1.0 - now)
                return

    def pause(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.fd)
        self.owner.read_pauses += 1
        self.paused = loop.call_later(max(0.0, seconds), self.resume)

    def resume(self) -> None:
        self.paused = None
        if self.fd >= 0:
            asyncio.get_running_loop().add_reader(self.fd, self.readable)

    def feed(self, chunk: bytes) -> None:
        data = self.partial + chunk
        *complete, self.partial = data.split(b"\n")
        if len(self.partial) > MAX_LINE:
            complete.append(self.partial)
            self.partial = b""
        if complete:
            self.owner._emit_many(complete, self.stream)

    def flush(self) -> None:
        if self.partial:
            self.owner._emit_many([self.partial], self.stream)
            self.partial = b""

    def drain_and_close(self) -> None:
        """Take what is buffered (bounded: a leftover writer must not hold the loop), then close."""
        if self.fd < 0:
            return
        try:
            for _ in range(64):
                chunk = os.read(self.fd, READ_SIZE)
                if not chunk:
                    break
                self.feed(chunk)
        except (BlockingIOError, OSError):
            pass
        self.flush()
        self.close()

    def close(self) -> None:
        if self.fd < 0:
            return
        if self.paused is not None:
            self.paused.cancel()
            self.paused = None
        try:
            asyncio.get_running_loop().remove_reader(self.fd)
        except RuntimeError:
            pass
        os.close(self.fd)
        self.fd = -1


class UnitOutput:
    """Ring buffer of a unit's recent lines, each with its time and stream (stdout or
    stderr: one pipe each, read separately); survives restarts of the unit."""

    def __init__(self, unit: str, keep: int = 2000, echo: bool = True) -> None:
        self.unit = unit
        self.lines: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=keep)  # (ts, stream, line)
        self.kept_bytes = 0
        self.echo = echo
        self.lines_total = 0
        self.lines_truncated = 0
        self.echo_dropped = 0  # lines not echoed into the daemon's log (rate limit)
        self.evicted_for_bytes = 0
        self.read_pauses = 0
        self._echo_window = 0.0
        self._echo_count = 0
        self._pipes: list[_Pipe] = []

    def attach(self, out_fd: int, err_fd: int | None = None) -> None:
        """Start reading a new process's stdout (and stderr) pipes (read ends, owned from now on)."""
        self.detach()
        self._pipes = [_Pipe(self, out_fd, "stdout" if err_fd is not None else "output")]
        if err_fd is not None:
            self._pipes.append(_Pipe(self, err_fd, "stderr"))

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

    def _emit_many(self, raws: list[bytes], stream: str) -> None:
        """Lines that can neither be echoed (rate limit) nor stay in the ring buffer
        (the last `keep` of this batch win) are only counted: a flood costs one split
        per read, not per-line work."""
        now = time.time()
        n = len(raws)
        self.lines_total += n
        echo_n = self._echo_budget(now, n) if self.echo else 0
        self.echo_dropped += (n - echo_n) if self.echo else 0
        for raw in raws[:echo_n]:
            log.info(self._keep(raw, now, stream), unit=self.unit, stream=stream)
        tail_from = max(echo_n, n - (self.lines.maxlen or n))
        for raw in raws[tail_from:]:
            self._keep(raw, now, stream)

    def _keep(self, raw: bytes, now: float, stream: str) -> str:
        if len(raw) > MAX_LINE:
            raw = raw[:MAX_LINE]
            self.lines_truncated += 1
        line = raw.decode(errors="replace").rstrip("\r")
        if len(self.lines) == self.lines.maxlen:
            self.kept_bytes -= len(self.lines[0][2])
        self.lines.append((now, stream, line))
        self.kept_bytes += len(line)
        while self.kept_bytes > KEEP_BYTES and len(self.lines) > 1:
            self.kept_bytes -= len(self.lines.popleft()[2])
            self.evicted_for_bytes += 1
        return line

    def detach(self) -> None:
        """Drain what is buffered, then stop reading and close the pipes."""
        for pipe in self._pipes:
            pipe.drain_and_close()
        self._pipes = []

    @property
    def attached(self) -> bool:
        return any(p.fd >= 0 for p in self._pipes)

    # -- across the daemon's re-exec (omnid.daemon.handover) ------------------------------
    def handover(self) -> dict:
        """What the next program of this daemon needs: the kept lines, the counters, and
        the open pipes (fd number, stream, the line they were in the middle of)."""
        return {"lines": [list(x) for x in self.lines], "lines_total": self.lines_total,
                "lines_truncated": self.lines_truncated, "echo_dropped": self.echo_dropped,
                "evicted_for_bytes": self.evicted_for_bytes, "read_pauses": self.read_pauses,
                "pipes": [{"fd": p.fd, "stream": p.stream, "partial": p.partial.decode("latin-1")}
                          for p in self._pipes if p.fd >= 0]}

    def pipe_fds(self) -> list[int]:
        return [p.fd for p in self._pipes if p.fd >= 0]

    def take_over(self, d: dict) -> None:
        """Continue where the previous program of this daemon left off (its fds inherited)."""
        for ts, stream, line in d["lines"]:
            self.lines.append((float(ts), str(stream), str(line)))
            self.kept_bytes += len(str(line))
        for key in ("lines_total", "lines_truncated", "echo_dropped", "evicted_for_bytes", "read_pauses"):
            setattr(self, key, int(d[key]))
        self._pipes = []
        for pd in d["pipes"]:
            fd = int(pd["fd"])
            os.set_inheritable(fd, False)
            pipe = _Pipe(self, fd, str(pd["stream"]))
            pipe.partial = str(pd["partial"]).encode("latin-1")
            self._pipes.append(pipe)

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
