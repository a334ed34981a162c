"""Critical Xid events, from NVML's event set (nvmlEventSetCreate, nvmlDeviceRegisterEvents
with nvmlEventTypeXidCriticalError, nvmlEventSetWait with a timeout) or the fake backend.

One thread of its own, for the backend's whole life, waits on the backend's
`wait(timeout_ms)` in a loop and hands each event to the attached `deliver` (the GPU
watch puts it on its event loop); events that come while no watch is attached (a
watch being restarted) are kept, up to PENDING_MAX, for the next one. The wait has a
timeout, so the thread comes back at least once a second; a wait that does not come
back within its timeout plus the call deadline is stuck (a hung driver) and is counted,
never replaced by a second thread.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from omnid.gpu.bounded import Stuck
from omnid.gpu.items import GpuItem

log = structlog.get_logger("omnid.gpu")

WAIT_MS = 1000
PENDING_MAX = 256


@dataclass(frozen=True)
class XidEvent:
    """One critical Xid on a GPU (its index) or on one MIG device (its UUID)."""

    gpu: GpuItem
    xid: int
    wall: float


class XidEventThread:
    def __init__(self, name: str, wait: Callable[[int], XidEvent | None], deliver: Callable[[XidEvent], None],
                 deadline_s: float, wait_ms: int = WAIT_MS) -> None:
        self.name = name
        self._wait = wait
        self._lock = threading.Lock()
        self._deliver: Callable[[XidEvent], None] | None = deliver
        self._pending: collections.deque[XidEvent] = collections.deque(maxlen=PENDING_MAX)
        self._deadline_s = deadline_s
        self._wait_ms = wait_ms
        self._stop = threading.Event()
        self._since: float | None = None  # monotonic start of the wait in progress
        self._wall = 0.0
        self._thread = threading.Thread(target=self._run, name=f"omnid-xid-{name}", daemon=True)
        self.delivered = 0

    def start(self) -> None:
        self._thread.start()

    def attach(self, deliver: Callable[[XidEvent], None]) -> None:
        """Deliver to `deliver` from now on, the events kept meanwhile first."""
        with self._lock:
            self._deliver = deliver
            kept = list(self._pending)
            self._pending.clear()
        for ev in kept:
            self._hand(ev)

    def detach(self) -> None:
        """Keep events (up to PENDING_MAX) until the next attach."""
        with self._lock:
            self._deliver = None

    def stop(self, timeout: float = 0.0) -> bool:
        """Ask the thread to end; True once it has (within `timeout`)."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stuck(self) -> Stuck | None:
        since = self._since
        if since is None or time.monotonic() - since <= self._wait_ms / 1000 + self._deadline_s:
            return None
        return Stuck(None, "nvmlEventSetWait (Xid events)", since, self._wall)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            self._since, self._wall = time.monotonic(), time.time()
            try:
                ev = self._wait(self._wait_ms)
            except Exception as exc:  # noqa: BLE001 - a broken event set: say so (rarely), wait, try again
                failures += 1
                if failures in (1, 10) or failures % 600 == 0:
                    log.error("Xid event wait failed", backend=self.name, error=str(exc), failures=failures)
                self._since = None
                self._stop.wait(1.0)
                continue
            finally:
                self._since = None
            failures = 0
            if ev is not None:
                self._hand(ev)

    def _hand(self, ev: XidEvent) -> None:
        with self._lock:
            deliver = self._deliver
            if deliver is None:
                self._pending.append(ev)
                return
        try:
            deliver(ev)
            self.delivered += 1
        except RuntimeError as exc:  # the watch's event loop is gone: keep it for the next watch
            log.warning("Xid event kept: its watch is gone", backend=self.name, gpu=ev.gpu, xid=ev.xid,
                        error=str(exc))
            with self._lock:
                if self._deliver is deliver:
                    self._deliver = None
                self._pending.append(ev)
