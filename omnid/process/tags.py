"""The tags in a process's environment (OMNID_UNIT, OMNID_DAEMON), read without ever waiting
on that process's memory lock.

Reading /proc/PID/environ (and cmdline) takes the process's mm lock, which its owner can keep
for good: a thread faulting on a page of its own file on a mount that stops answering, with
another of its threads waiting in mmap, and every reader queues behind them (measured on Linux
6.18 with such a process: environ, cmdline, smaps_rollup and numa_maps never return; stat,
status, statm, cgroup, wchan, maps, children and fdinfo return in under 1 ms). So a tag is
read on a thread of its own, never on the caller's: the caller waits at most its bound and is
answered None ("not read") past it, while the read stays out, counted, until the kernel
answers. A process whose read is out is answered None at once, without waiting again, and
while `max_out` reads are out no new one starts. What a tag proves is only a hint of
ownership (a unit's user can copy it), so "not read" is never taken as proof of anything:
callers that signal treat it as "not ours", callers that wait for a unit to be gone say how
they count it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from omnid.base import linux

log = structlog.get_logger("omnid.tags")

# The tag every unit process carries (and inherits to its descendants).
UNIT_TAG = "OMNID_UNIT"
# Names the daemon instance that spawned a process: proof of ownership for leftovers.
DAEMON_TAG = "OMNID_DAEMON"

LOOP_WAIT_S = 0.02  # what a caller on the event loop waits for one read (a readable one takes ~0.1 ms)
PREFETCH_S = 0.5  # what an async caller awaits for a batch of reads (the loop runs meanwhile)
MAX_OUT = 8  # reads not returned before no new one is started
KEEP_S = 1.0  # how long an answer is reused: a unit's stop asks about the same processes a few times


@dataclass(frozen=True)
class Tags:
    unit: str | None
    daemon: str | None


_NONE = Tags(None, None)


class _Read:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.since = time.monotonic()
        self.tags = _NONE
        self.callbacks: list[Callable[[], None]] = []  # run on the reading thread once done


class TagReader:
    """Reads tags, each read on a daemon thread of its own (the daemon's exit never waits for
    one); thread-safe (the loop, the spawn precheck's thread and the start-up scan use it).
    The lock is held for dictionary updates only, never across a read."""

    def __init__(self, max_out: int = MAX_OUT, name: str = "tags") -> None:
        self.max_out = max_out
        self.name = name
        self._lock = threading.Lock()
        self._out: dict[tuple[int, int], _Read] = {}
        self._known: dict[tuple[int, int], tuple[Tags, float]] = {}
        self._said: set[tuple[int, int]] = set()  # stuck processes already logged
        self._full_said = False  # "max_out reads are out" logged, until fewer are
        self.not_read = 0  # answers "not read" given (a process's lock held, or too many out)

    def out(self) -> list[tuple[int, float]]:
        """(pid, seconds out) of every read that has not returned."""
        now = time.monotonic()
        with self._lock:
            return [(k[0], now - r.since) for k, r in self._out.items()]

    def get(self, pid: int, start_time: int | None = None, wait: float = LOOP_WAIT_S) -> Tags | None:
        """pid's tags (Tags(None, None): no tag, or the process is gone), or None when they were
        not read within `wait` (its memory lock is held?), or a read of it is already out, or
        max_out reads are. `start_time` (from /proc/PID/stat, which takes no lock of theirs)
        names the process; read here when not given."""
        if start_time is None:
            st = linux.read_stat(pid)
            if st is None:
                return _NONE
            start_time = st.start_time
        key = (pid, start_time)
        asked = self._ask(key)
        if not isinstance(asked, _Read):
            return asked
        if asked.done.wait(wait):
            return asked.tags
        self._not_read_in(key, wait)
        return None

    async def prefetch(self, procs: Iterable[tuple[int, int]], bound: float = PREFETCH_S) -> None:
        """Read the tags of `procs` ((pid, start time) each) not read lately, awaiting them at most
        `bound` while the loop runs: a get() of them right after is answered from what was read,
        and one of a process whose read is still out is answered None at once."""
        loop = asyncio.get_running_loop()
        waits: dict[asyncio.Future, tuple[int, int]] = {}
        for key in procs:
            asked = self._ask(key)
            if isinstance(asked, _Read):
                fut = loop.create_future()
                self._on_done(asked, lambda fut=fut: _settle_threadsafe(loop, fut))
                waits[fut] = key
        if not waits:
            return
        _done, pending = await asyncio.wait(waits, timeout=max(0.0, bound))
        for fut in pending:
            fut.cancel()
            self._not_read_in(waits[fut], bound)

    def _ask(self, key: tuple[int, int]) -> Tags | _Read | None:
        """An answer read lately, a read started now to wait for, or None: a read of it is out
        already (whoever started it waited its bound), or max_out reads are."""
        now = time.monotonic()
        with self._lock:
            hit = self._known.get(key)
            if hit is not None and now - hit[1] < KEEP_S:
                return hit[0]
            if key in self._out:
                self.not_read += 1
                return None
            full = len(self._out) >= self.max_out
            if full:
                self.not_read += 1
                said, self._full_said = self._full_said, True
            else:
                read = self._out[key] = _Read()
        if full:
            if not said:
                log.warning("tags of processes not read while reads are out", reader=self.name, pid=key[0],
                            reason=f"{self.max_out} reads of other processes' environments have not returned "
                                   f"(their memory locks held?): {self.out()}")
            return None
        threading.Thread(target=self._read, args=(key, read), name=f"omnid-{self.name} {key[0]}",
                         daemon=True).start()
        return read

    def _on_done(self, read: _Read, fn: Callable[[], None]) -> None:
        with self._lock:
            if not read.done.is_set():
                read.callbacks.append(fn)
                return
        fn()

    def _not_read_in(self, key: tuple[int, int], wait: float) -> None:
        with self._lock:
            self.not_read += 1
        self._say_once(key, f"its environment was not read within {wait * 1000:.0f} ms "
                            "(its memory lock is held?); taken as not proven ours until it is")

    def _read(self, key: tuple[int, int], read: _Read) -> None:
        pid, start = key
        try:
            env = _environ_vars(pid, (UNIT_TAG, DAEMON_TAG))
            # The pid may name another process by now: an answer counts only for the same start.
            st = linux.read_stat(pid)
            tags = Tags(env.get(UNIT_TAG), env.get(DAEMON_TAG)) if st is not None and st.start_time == start \
                else _NONE
        except Exception as exc:  # noqa: BLE001 - the read must end as "out" no longer, whatever happened
            log.error("reading a process's tags failed", pid=pid, error=f"{type(exc).__name__}: {exc}")
            tags = _NONE
        read.tags = tags
        with self._lock:
            self._out.pop(key, None)
            if len(self._known) > 4096:
                self._known.clear()
            self._known[key] = (tags, time.monotonic())
            was_said = key in self._said
            self._said.discard(key)
            if len(self._out) < self.max_out:
                self._full_said = False
            read.done.set()
            callbacks, read.callbacks = read.callbacks, []
        for fn in callbacks:
            fn()
        if was_said:
            log.info("a process's environment was read at last", pid=pid,
                     after_s=round(time.monotonic() - read.since, 1))

    def _say_once(self, key: tuple[int, int], what: str) -> None:
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
        log.warning("tags of a process not read", pid=key[0], reason=what)


def _environ_vars(pid: int, names: tuple[str, ...]) -> dict[str, str]:
    """The variables `names` of pid's environment (one read; what is not there is left out)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:  # gone, not ours to read, or a zombie's empty memory
        return {}
    want = {n.encode() + b"=": n for n in names}
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        for prefix, name in want.items():
            if item.startswith(prefix) and name not in out:
                out[name] = item[len(prefix):].decode(errors="replace")
    return out


def _settle_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
    def settle() -> None:
        if not fut.done():
            fut.set_result(None)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody waits
        pass


# The daemon's reader for its units' processes (the spawner's descendants, GPU holders, notify
# senders); a scan of the whole host at start-up has its own (omnid.daemon.statefile).
reader = TagReader()


def tags_of(pid: int, start_time: int | None = None, wait: float = LOOP_WAIT_S) -> Tags | None:
    """reader.get: pid's tags, or None when not read within `wait`."""
    return reader.get(pid, start_time, wait)
