"""The daemon's event loop, from its first task to an end that is bounded.

`asyncio.run` ends by cancelling every task still there and waiting for each, closing the
async generators and joining the default executor's threads, each wait without a bound; the
interpreter's exit then joins every non-daemon thread. A task that does not end when
cancelled (a library's close that swallows its cancellation), or a thread stuck in the
kernel (a read under a hung NFS or FUSE mount waits in D state until the mount answers: a
`check` or `reload` of such a directory leaves one), would then keep a daemon whose units are
all stopped from ever exiting. `run` bounds the whole end (END_GRACE_S); what did not end is
logged, a task with where it waits, and the process exits without it (os._exit, once the
logs are flushed) with the exit code it had. An end where everything ended is asyncio.run's.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Coroutine
from types import FrameType
from typing import Any

import structlog

from omnid.base.tasks import frame_line, suspended_at

log = structlog.get_logger("omnid.base.runloop")

END_GRACE_S = 5.0  # the whole end: cancelled tasks, async generators, worker threads


def run(main: Coroutine[Any, Any, int], grace: float = END_GRACE_S) -> int:
    """Run `main` on a new event loop and return its exit code; the end is bounded (above)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    code = 1
    try:
        code = loop.run_until_complete(main)
        return code
    finally:
        left = end_loop(loop, time.monotonic() + grace)
        if left:
            log.error("exiting without what did not end in time", grace_s=grace, left=left, exit_code=code,
                      exc_info=sys.exc_info()[0] is not None)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def end_loop(loop: asyncio.AbstractEventLoop, deadline: float) -> list[str]:
    """Cancel what is left, close the async generators, close the loop (its default executor
    is shut down without a wait: idle threads end), join the non-daemon threads: each step
    until `deadline`. What did not end, named with where it waits."""
    left: list[str] = []

    def until(aw: Any) -> set:
        _done, pending = loop.run_until_complete(asyncio.wait(aw, timeout=max(0.0, deadline - time.monotonic())))
        return pending

    try:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in tasks:
            t.cancel()
        stuck = until(tasks) if tasks else set()
        for t in tasks:
            if t.done() and not t.cancelled():
                t.exception()  # seen: each task's owner reported it (omnid.base.tasks)
        left += [f"task {t.get_name()}, cancelled, still waits in {' > '.join(suspended_at(t)) or '?'}"
                 for t in stuck]
        if until({loop.create_task(loop.shutdown_asyncgens())}):
            left.append("async generators, not closed")
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    threads = [th for th in threading.enumerate()
               if th is not threading.main_thread() and not th.daemon and th.is_alive()]
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    frames = sys._current_frames()  # documented in sys: what each thread runs now
    left += [f"thread {th.name}, still runs {_frames(frames.get(th.ident or 0))}" for th in threads if th.is_alive()]
    return left


def _frames(frame: FrameType | None, keep: int = 4) -> str:
    """A thread's innermost `keep` calls, outermost first."""
    out: list[str] = []
    while frame is not None and len(out) < keep:
        out.append(frame_line(frame))
        frame = frame.f_back
    return " > ".join(reversed(out)) or "?"
