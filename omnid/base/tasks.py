"""Every asyncio task omnid creates has an owner that hears how it ended
(a house rule: no asyncio task whose exception nobody sees).

- `unit_task`: a task working for one unit (start, stop, liveness...). An
  unexpected exception is logged once, with the unit name, and handed to
  `on_crash`, which turns it into that unit's failure.
- `DaemonTask`: a daemon-wide task (control reader, GPU watch). An unexpected
  exception is logged once and the task is started again (after a short,
  growing pause, so a task that crashes at once cannot spin the loop).
- `suspended_at` / `pending_tasks`: where tasks wait, for the log line of a bounded
  wait that ran out (which await never ended).
"""

from __future__ import annotations

import asyncio
import gc
import types
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


def frame_line(frame: types.FrameType) -> str:
    """One frame for a log line: "function (dir/file.py:line)"."""
    return f"{frame.f_code.co_name} ({'/'.join(frame.f_code.co_filename.rsplit('/', 2)[-2:])}:{frame.f_lineno})"


def suspended_at(task: asyncio.Task, limit: int = 16) -> list[str]:
    """Where a pending task waits: its chain of awaits, outermost first, each as
    "function (dir/file.py:line)". Task.get_stack gives only the outermost frame of a suspended
    task; this follows each coroutine's await into the next, through async generators
    (`async for`), and ends at a future (a task it awaits has a chain of its own)."""
    out: list[str] = []
    obj: object = task.get_coro()
    while obj is not None and len(out) < limit:
        if type(obj).__name__ == "async_generator_asend":  # `async for` / __anext__: the generator is behind it
            obj = next((r for r in gc.get_referents(obj) if isinstance(r, types.AsyncGeneratorType)), None)
            continue
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None) or getattr(obj, "gi_frame", None)
        if frame is None:
            break
        out.append(frame_line(frame))
        obj = getattr(obj, "cr_await", None) or getattr(obj, "ag_await", None) or getattr(obj, "gi_yieldfrom", None)
    return out


def pending_tasks(loop: asyncio.AbstractEventLoop | None = None) -> dict[str, str]:
    """Every task of the loop not done (but the one asking): name -> where it waits."""
    loop = loop or asyncio.get_running_loop()
    here = asyncio.current_task(loop) if loop.is_running() else None
    return {t.get_name(): " > ".join(suspended_at(t)) or "?" for t in asyncio.all_tasks(loop)
            if t is not here and not t.done()}
