"""Reads of a stack directory for `check` and `reload`: off the event loop, bounded, and
never holding a thread anything else needs.

A stack directory may sit on a network or FUSE mount, and a read under one that no longer
answers waits in the kernel until it does. Such a read keeps its thread. On the event
loop's shared worker threads it would take one that GPU reads and process walks wait for
(a few stuck reloads would take them all), and at the daemon's end it would be waited for.
So each read runs on a thread of its own, a daemon thread (the daemon's exit never waits on
it); the caller waits at most its timeout; and while MAX_OUT reads have not returned, a new
one is refused at once (`busy`), naming the oldest and how long it has been out.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from omnid.api.control import ControlError

T = TypeVar("T")

MAX_OUT = 2  # reads not returned yet (stuck, or slow) before a new one is refused


@dataclass(frozen=True)
class _Out:
    what: str
    since: float


class StackReads:
    def __init__(self, max_out: int = MAX_OUT) -> None:
        self.max_out = max_out
        self.out: dict[int, _Out] = {}
        self._ids = itertools.count()

    async def run(self, what: str, fn: Callable[[], T], timeout: float) -> T:
        """fn() on a thread of its own; TimeoutError past `timeout` (the thread goes on, counted
        in `out` until it returns); ControlError `busy` at once while max_out are out."""
        if len(self.out) >= self.max_out:
            oldest = min(self.out.values(), key=lambda o: o.since)
            raise ControlError("busy", f"{what}: refused while {len(self.out)} earlier reads have not returned; "
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

        threading.Thread(target=work, name=f"omnid-read {what}", daemon=True).start()
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
