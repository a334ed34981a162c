"""Blocking work that may never return, each call on a thread of its own: bounded for the
caller, and never holding a thread anything else needs.

A read on a network or FUSE mount that no longer answers waits in the kernel until it does;
so does a read of /proc/PID/maps while that process's memory lock is held. Such a call keeps
its thread. On the event loop's shared worker threads it would take one that GPU reads and
process walks wait for (a few stuck calls would take them all), and at the daemon's end it
would be waited for. So each call runs on a thread of its own, a daemon thread (the daemon's
exit never waits on it); the caller waits at most its timeout; and while `max_out` calls have
not returned, a new one is refused at once (Busy), naming the oldest and how long it has been
out. Users: the stack directory's reads for `check` and `reload` (omnid.api.handlers), and
the removal of a unit's leftovers (omnid.core.cleanup).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

MAX_OUT = 2  # calls not returned yet (stuck, or slow) before a new one is refused


class Busy(Exception):
    """Refused at once: `max_out` earlier calls have not returned (the message names the oldest)."""


@dataclass(frozen=True)
class _Out:
    what: str
    since: float


class OwnThreads:
    def __init__(self, max_out: int = MAX_OUT, kind: str = "call") -> None:
        self.max_out = max_out
        self.kind = kind  # how a refusal names them: "read", "removal"
        self.out: dict[int, _Out] = {}
        self._ids = itertools.count()

    def oldest(self) -> str | None:
        """The oldest call not returned, and for how long, or None."""
        if not self.out:
            return None
        o = min(self.out.values(), key=lambda o: o.since)
        return f"{o.what}, out for {time.monotonic() - o.since:.0f} s"

    async def run(self, what: str, fn: Callable[[], T], timeout: float) -> T:
        """fn() on a thread of its own; TimeoutError past `timeout` (the thread goes on, counted
        in `out` until it returns); Busy at once while max_out are out."""
        if len(self.out) >= self.max_out:
            oldest = min(self.out.values(), key=lambda o: o.since)
            raise Busy(f"{what}: refused while {len(self.out)} earlier {self.kind}s have not returned; "
                       f"the oldest, {oldest.what}, has been out for "
                       f"{time.monotonic() - oldest.since:.0f} s (a mount that does not answer?)")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen, even after the caller gave up
        key = next(self._ids)
        self.out[key] = _Out(what, time.monotonic())

        def settle(result: object, exc: BaseException | None) -> None:
            self.out.pop(key, None)
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(result)  # type: ignore[arg-type]

        def work() -> None:
            try:
                result, exc = fn(), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, exc = None, e
            try:
                loop.call_soon_threadsafe(settle, result, exc)
            except RuntimeError:  # the loop closed meanwhile: the daemon is gone, nobody waits
                pass

        threading.Thread(target=work, name=f"omnid-{self.kind} {what}", daemon=True).start()
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
