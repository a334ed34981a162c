"""The daemon's side of sd_notify(3) towards the service manager that started it
(systemd's Type=notify): READY=1 once the stack has settled, STATUS= progress
lines, EXTEND_TIMEOUT_USEC while a unit is still starting, WATCHDOG=1 from a timer
on the event loop when WATCHDOG_USEC is set, STOPPING=1 when the ordered stop
begins. Without NOTIFY_SOCKET every call is a no-op.

NOTIFY_SOCKET is removed from the daemon's environment on first use: units get the
daemon's own notify socket from the supervisor, never systemd's.

The socket is non-blocking: a manager that does not read (its queue holds ten datagrams:
five seconds of pings at WATCHDOG_USEC=1 s) must not stop the loop in sendto(), and with it
death detection and /health. What cannot go now waits, in order, and goes from a timer
once the manager reads again: one WATCHDOG=1 says what several would, so pings are not
piled up, and past MAX_PENDING the oldest ping or status line gives way, never READY=1,
STOPPING=1 or EXTEND_TIMEOUT_USEC.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket

import structlog

log = structlog.get_logger("omnid.api.systemd")

MAX_PENDING = 32  # notifications waiting for a manager that does not read
RETRY_S = 0.05  # how soon a waiting notification is tried again
_PING = b"WATCHDOG=1"


class ServiceNotifier:
    def __init__(self, environ: dict | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.pop("NOTIFY_SOCKET", None) or None
        watchdog_usec = env.pop("WATCHDOG_USEC", None)
        watchdog_pid = env.pop("WATCHDOG_PID", None)
        self.address = address
        self._sock: socket.socket | None = None
        self._said_error = False
        self._pending: collections.deque[bytes] = collections.deque()
        self._retry: asyncio.TimerHandle | None = None
        self.waited = 0  # notifications that could not go at once (the manager's queue was full)
        self.watchdog_usec = 0
        if watchdog_usec and watchdog_usec.isdigit() and (not watchdog_pid or watchdog_pid == str(os.getpid())):
            self.watchdog_usec = int(watchdog_usec)
        self._watchdog: asyncio.TimerHandle | None = None
        if address:
            if address.startswith("@"):
                address = "\0" + address[1:]
            if not (address.startswith("\0") or address.startswith("/")):
                log.warning("NOTIFY_SOCKET is neither a path nor an abstract address; not notifying",
                            notify_socket=self.address)
                self.address = None
                return
            self._target = address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)

    def handover(self) -> dict:
        """The environment this notifier was made from, for the daemon's next program."""
        env = {}
        if self.address:
            env["NOTIFY_SOCKET"] = self.address
        if self.watchdog_usec:
            env["WATCHDOG_USEC"] = str(self.watchdog_usec)
            env["WATCHDOG_PID"] = str(os.getpid())
        return env

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> None:
        if self._sock is None:
            return
        msg = "\n".join(fields).encode()
        if self._pending or not self._sent(msg):  # behind what already waits: the order is kept
            self._hold(msg)

    def _sent(self, msg: bytes) -> bool:
        """False: the manager's queue is full (try again later). Any other error is said once
        and the notification dropped: the manager may be gone, the stack must not care."""
        assert self._sock is not None
        try:
            self._sock.sendto(msg, self._target)
        except BlockingIOError:
            return False
        except OSError as exc:
            if not self._said_error:
                log.warning("cannot notify the service manager", notify_socket=self.address, error=str(exc))
                self._said_error = True
        return True

    def _hold(self, msg: bytes) -> None:
        if msg == _PING and _PING in self._pending:
            return
        if not self._pending:
            log.warning("the service manager does not read its notify socket: notifications wait",
                        notify_socket=self.address)
        self.waited += 1
        self._pending.append(msg)
        if len(self._pending) > MAX_PENDING:
            old = next((m for m in self._pending if m == _PING or (m.startswith(b"STATUS=") and b"\n" not in m)),
                       self._pending[0])
            self._pending.remove(old)
        self._try_later()

    def _try_later(self) -> None:
        if self._retry is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (yet, or any more): the next send or close tries again
            return
        self._retry = loop.call_later(RETRY_S, self._flush)

    def _flush(self) -> None:
        self._retry = None
        while self._pending and self._sock is not None:
            if not self._sent(self._pending[0]):
                self._try_later()
                return
            self._pending.popleft()
        log.info("the service manager reads its notify socket again", waited=self.waited)

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def start_watchdog(self) -> None:
        """WATCHDOG=1 every half WATCHDOG_USEC from a loop timer: a stalled loop stops the pings."""
        if self._sock is None or not self.watchdog_usec:
            return
        interval = self.watchdog_usec / 2e6
        loop = asyncio.get_running_loop()

        def ping() -> None:
            self.send("WATCHDOG=1")
            self._watchdog = loop.call_later(interval, ping)

        ping()

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        while self._pending and self._sock is not None and self._sent(self._pending[0]):
            self._pending.popleft()  # a last try for what waits (STOPPING=1): never a wait
        if self._sock is not None:
            self._sock.close()
            self._sock = None
