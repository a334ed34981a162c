"""Every asyncio task omnid creates has an owner that hears how it ended
(a house rule: no asyncio task whose exception nobody sees).

- `unit_task`: a task working for one unit (start, stop, liveness...). An
  unexpected exception is logged once, with the unit name, and handed to
  `on_crash`, which turns it into that unit's failure.
- `DaemonTask`: a daemon-wide task (control reader, GPU watch). An unexpected
  exception is logged once and the task is started again (after a short,
  growing pause, so a task that crashes at once cannot spin the loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("omnid.base.tasks")

RESTART_MIN_S = 0.05
RESTART_MAX_S = 5.0


def unit_task(coro: Awaitable[None], *, unit: str, kind: str,
              on_crash: Callable[[BaseException], None]) -> asyncio.Task:
    """Run `coro` for `unit`; a crash is logged and reported through on_crash."""
    task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]

    def done(t: asyncio.Task) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        if exc is None:
            return
        log.error("task crashed", unit=unit, task=kind, error=f"{type(exc).__name__}: {exc}",
                  exc_info=(type(exc), exc, exc.__traceback__))
        on_crash(exc)

    task.add_done_callback(done)
    return task


def report_crash(task: asyncio.Task, name: str) -> asyncio.Task:
    """For a one-shot task that cannot be restarted (the health API start-up, the
    waiter wake-up): its crash is logged the moment it happens, not at shutdown."""

    def done(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            exc = t.exception()
            log.error("task crashed", task=name, error=f"{type(exc).__name__}: {exc}",
                      exc_info=(type(exc), exc, exc.__traceback__))

    task.add_done_callback(done)
    return task


class DaemonTask:
    """A daemon-wide task that is restarted when it dies of an unexpected exception."""

    def __init__(self, name: str, start: Callable[[], asyncio.Task]) -> None:
        self.name = name
        self._start = start
        self.task: asyncio.Task | None = None
        self.crashes = 0
        self._delay = RESTART_MIN_S
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> "DaemonTask":
        self.task = self._start()
        self.task.add_done_callback(self._done)
        return self

    def _done(self, t: asyncio.Task) -> None:
        if self._closed or t.cancelled():
            return
        exc = t.exception()
        self.crashes += 1
        what = f"{type(exc).__name__}: {exc}" if exc is not None else "returned"
        log.error("daemon task died; restarting it", task=self.name, error=what, restart_in_s=self._delay,
                  exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)
        self._timer = asyncio.get_running_loop().call_later(self._delay, self._restart)
        self._delay = min(self._delay * 2, RESTART_MAX_S)

    def _restart(self) -> None:
        self._timer = None
        if not self._closed:
            self.start()

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()
