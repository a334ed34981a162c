"""The daemon's side of sd_notify(3) towards the service manager that started it
(systemd's Type=notify): READY=1 once the stack has settled, STATUS= progress
lines, EXTEND_TIMEOUT_USEC while a unit is still starting, WATCHDOG=1 from a timer
on the event loop when WATCHDOG_USEC is set, STOPPING=1 when the ordered stop
begins. Without NOTIFY_SOCKET every call is a no-op.

NOTIFY_SOCKET is removed from the daemon's environment on first use: units get the
daemon's own notify socket from the supervisor, never systemd's.
"""

from __future__ import annotations

import asyncio
import os
import socket

import structlog

log = structlog.get_logger("omnid.api.systemd")


class ServiceNotifier:
    def __init__(self, environ: dict | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.pop("NOTIFY_SOCKET", None) or None
        watchdog_usec = env.pop("WATCHDOG_USEC", None)
        watchdog_pid = env.pop("WATCHDOG_PID", None)
        self.address = address
        self._sock: socket.socket | None = None
        self._said_error = False
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
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

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
        try:
            self._sock.sendto("\n".join(fields).encode(), self._target)
        except OSError as exc:
            if not self._said_error:  # once: the manager may be gone, the stack must not care
                log.warning("cannot notify the service manager", notify_socket=self.address, error=str(exc))
                self._said_error = True

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
        if self._sock is not None:
            self._sock.close()
            self._sock = None
