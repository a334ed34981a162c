"""NOTIFY_SOCKET receiver: the sd_notify protocol (DESIGN.md "The child's environment").

One AF_UNIX datagram socket per daemon, in the abstract namespace. SO_PASSCRED
makes the kernel attach the sender's pid to each message, which is how a
message is attributed to a unit (by process group). `systemd-notify` follows
its message with BARRIER=1 and a pipe fd and waits until the receiver closes
it: every fd passed with SCM_RIGHTS is closed as soon as it arrives.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
import struct
from collections.abc import Callable

import structlog

log = structlog.get_logger("omnid.notify")

_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
MAX_DATAGRAM = 4096


def parse_notify(data: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in data.decode(errors="replace").split("\n"):
        if "=" in line:
            key, _, value = line.partition("=")
            fields[key.strip()] = value
    return fields


class NotifyServer:
    def __init__(self, token: str, on_message: Callable[[int, dict[str, str]], object]) -> None:
        self.address = f"@omnid/{token}/notify"  # what units get in NOTIFY_SOCKET
        self._on_message = on_message
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind("\0" + self.address[1:])
        self.sock.setblocking(False)

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        fds_size = socket.CMSG_SPACE(16 * array.array("i").itemsize)
        cred_size = socket.CMSG_SPACE(_CRED.size)
        while True:
            try:
                data, ancdata, _flags, _addr = self.sock.recvmsg(MAX_DATAGRAM, fds_size + cred_size)
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("notify socket read failed", error=str(exc))
                return
            pid = 0
            for level, ctype, cdata in ancdata:
                if level != socket.SOL_SOCKET:
                    continue
                if ctype == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
                    for fd in fds:
                        os.close(fd)  # the BARRIER=1 pipe: closing it releases the sender
                elif ctype == socket.SCM_CREDENTIALS and len(cdata) >= _CRED.size:
                    pid, _uid, _gid = _CRED.unpack(cdata[: _CRED.size])
            fields = parse_notify(data)
            if not fields or fields.keys() == {"BARRIER"}:
                continue
            if pid <= 0:
                log.warning("notify message without sender credentials; ignored", fields=sorted(fields))
                continue
            try:
                self._on_message(pid, fields)
            except Exception:  # noqa: BLE001 - a bad message must not kill the reader
                log.exception("notify handler failed", pid=pid)

    def close(self) -> None:
        try:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        except RuntimeError:
            pass
        self.sock.close()
