"""Every NVML call bounded in time (omnid(8) GPU FAULTS).

Drivers exist whose NVML calls never return (the calling thread sleeps in D state inside
the driver). Such a call must never stall the GPU watch, a stop, a release check or
/health. So every GPU read runs on one dedicated worker thread of its backend; the
caller waits at most `timeout` seconds for each NVML call the job makes (jobs announce
each call with `note`), then gets `GpuUnreadable` naming the call and the GPU. While a
call is stuck, every new read fails at once with the same reason: the stuck thread is
counted, never multiplied (no new thread per call). When the call returns at last, the
worker goes on and reads work again.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("omnid.gpu")

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 2.0  # one NVML call; OMNID_NVML_TIMEOUT overrides it
IDLE_EXIT_S = 30.0  # an idle worker thread ends; the next read starts one again


class GpuUnreadable(Exception):
    """A GPU read did not finish: an NVML call is stuck (the message names it)."""


@dataclass(frozen=True)
class Stuck:
    """A call that has run past its deadline: which GPU (None: not a device call), what, since when."""

    gpu: int | None
    call: str
    since: float  # monotonic
    wall: float  # wall clock, for people

    def reason(self, now: float | None = None, *, where: bool = True) -> str:
        """"unreadable: GPU 1: nvmlDeviceGetMemoryInfo has not returned for 12 s (...)";
        where=False leaves the GPU out (a condition of that GPU names it already)."""
        age = (time.monotonic() if now is None else now) - self.since
        where = f"GPU {self.gpu}: " if where and self.gpu is not None else ""
        return (f"unreadable: {where}{self.call} has not returned for {age:.0f} s "
                f"(a stuck driver call; GPU reads are off until it returns)")


class BoundedCaller:
    """One worker thread running a backend's GPU reads, each NVML call bounded."""

    def __init__(self, name: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.name = name
        self.timeout = timeout
        self._q: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any]]] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # The NVML call the worker is in now: (gpu, call name, monotonic start); None between calls.
        self._call: tuple[int | None, str, float, float] | None = None
        self.hung_calls = 0  # calls that ran past their deadline, over the backend's life
        self._said_stuck = False

    # ---- state

    def stuck(self) -> Stuck | None:
        """The call that has been running past its deadline, or None."""
        call = self._call
        if call is None or time.monotonic() - call[2] <= self.timeout:
            return None
        return Stuck(call[0], call[1], call[2], call[3])

    @property
    def stuck_threads(self) -> int:
        return 1 if self.stuck() is not None else 0

    def note(self, call: str, gpu: int | None = None) -> None:
        """Called by a job (on the worker thread) right before each NVML call."""
        now = time.monotonic()
        self._call = (gpu, call, now, time.time())

    # ---- running jobs

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the worker thread and wait for it, from any thread (not the
        event loop: use asyncio.to_thread). Raises GpuUnreadable when a call of it, or
        one before it, runs past its deadline; exceptions of `fn` pass through."""
        fut = self._submit(fn, args)
        while True:
            stuck = self.stuck()
            if stuck is not None:
                self._give_up(fut, stuck)
            call = self._call
            wait = self.timeout if call is None else max(call[2] + self.timeout - time.monotonic(), 0.0) + 0.01
            try:
                return fut.result(timeout=wait)
            except concurrent.futures.TimeoutError:
                continue

    def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> concurrent.futures.Future[Any]:
        stuck = self.stuck()
        if stuck is not None:
            raise GpuUnreadable(stuck.reason())
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._q.put((fn, args, fut))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"omnid-gpu-{self.name}", daemon=True)
                self._thread.start()
        return fut

    def _give_up(self, fut: concurrent.futures.Future[Any], stuck: Stuck) -> None:
        fut.cancel()  # not started yet: never runs; running: it is the stuck one, left to finish
        if not self._said_stuck:
            self._said_stuck = True
            self.hung_calls += 1
            log.error("GPU read stuck: an NVML call did not return in time", backend=self.name, gpu=stuck.gpu,
                      call=stuck.call, timeout_s=self.timeout)
        raise GpuUnreadable(stuck.reason())

    def _work(self) -> None:
        while True:
            try:
                fn, args, fut = self._q.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._q.empty():
                        self._thread = None
                        return
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                fut.set_exception(exc)
            else:
                fut.set_result(result)
            finally:
                if self._said_stuck:
                    call = self._call
                    log.warning("GPU reads work again: the stuck NVML call returned", backend=self.name,
                                call=call[1] if call else "?",
                                after_s=round(time.monotonic() - call[2], 1) if call else None)
                    self._said_stuck = False
                self._call = None
