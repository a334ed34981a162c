"""Tiny sd_notify client for the reference stack (omnid.unit(5), ENVIRONMENT OF A UNIT).

A unit started with ``ready = "notify"`` finds ``NOTIFY_SOCKET`` in its
environment: a Unix datagram socket path, or an abstract socket name when it
starts with ``@``. The protocol is one datagram of ``KEY=VALUE`` lines
(``READY=1``, ``WATCHDOG=1``, ``STATUS=...``, ``STOPPING=1``). Standard library
only: the demo's engine and serve must not pull anything heavy in for this.
"""

from __future__ import annotations

import os
import socket
import sys
import threading


class Notifier:
    """One sd_notify endpoint; a no-op when the process was not given one."""

    def __init__(self, address: str | None) -> None:
        self._address = _socket_address(address) if address else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned = False

    @classmethod
    def from_env(cls) -> "Notifier":
        return cls(os.environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *fields: str, wait_s: float = 0.0) -> bool:
        """Send ``fields`` as one datagram; False (said once on stderr) when it could not be sent.

        A Unix datagram socket blocks its sender once the receiver's queue is full (as few as
        10 datagrams: net.unix.max_dgram_qlen), so by default this never waits: a ping from a
        work loop must not stall the work. ``wait_s`` bounds the wait for messages that matter.
        """
        if self._address is None:
            return False
        payload = "\n".join(fields).encode()
        try:
            with self._lock:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.settimeout(wait_s if wait_s > 0 else 0.0)  # 0.0: non-blocking
                self._sock.sendto(payload, self._address)
            return True
        except OSError as exc:  # BlockingIOError / TimeoutError: the receiver is not reading
            if not self._warned:
                # Never fail silently: a lost READY=1 makes the supervisor time the unit out.
                self._warned = True
                print(f"sdnotify: cannot send {fields!r} to NOTIFY_SOCKET={os.environ.get('NOTIFY_SOCKET')!r}: "
                      f"{exc!r} (further failures are not reported)", file=sys.stderr, flush=True)
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []), wait_s=2.0)

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def stopping(self) -> bool:
        return self.send("STOPPING=1", wait_s=0.2)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _socket_address(value: str) -> str | bytes:
    # '@name' is the abstract namespace: the kernel name starts with a NUL byte.
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


def watchdog_interval() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings the supervisor expects, from ``WATCHDOG_USEC``.

    As with systemd, ``WATCHDOG_PID``, when set, must name this process.
    Returns None when no interval was given.
    """
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    usec = os.environ.get("WATCHDOG_USEC", "")
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1_000_000 if value > 0 else None
