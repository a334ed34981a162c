"""NOTIFY_SOCKET receiver: the sd_notify protocol (omnid.unit(5), ENVIRONMENT OF A UNIT).

One AF_UNIX datagram socket per daemon, in the abstract namespace. SO_PASSCRED
makes the kernel attach the sender's pid to each message, which is how a
message is attributed to a unit (by process group). `systemd-notify` follows
its message with BARRIER=1 and a pipe fd and waits until the receiver closes
it: every fd passed with SCM_RIGHTS is closed as soon as it arrives (off the loop when
its close could wait on a filesystem or a peer: omnid.base.closer), except
those of an FDSTORE=1 message from a unit's own process within its rate limit,
which go to the fd store (omnid.process.fdstore), which keeps or closes each. A message
whose control data was cut (MSG_CTRUNC: more fds than SCM_MAX_FD, or the
daemon's fd table full) is dropped with whatever fds did arrive.
"""

from __future__ import annotations

import array
import hashlib
import asyncio
import os
import socket
import struct
import time
from collections.abc import Callable

import structlog

from omnid.base import closer

log = structlog.get_logger("omnid.api.notify")

_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
MAX_DATAGRAM = 4096
SCM_MAX_FD = 253  # the kernel's most fds in one message: room for all, so a cut is the fd table's


def parse_notify(data: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in data.decode(errors="replace").split("\n"):
        if "=" in line:
            key, _, value = line.partition("=")
            fields[key.strip()] = value
    return fields


MAX_PER_TURN = 64  # datagrams read per loop turn: a flood cannot starve pidfds or /health
RATE_PER_S = 100.0  # messages a unit may send per second, sustained ...
BURST = 200  # ... after a burst of this many
SUMMARY_EVERY_S = 10.0  # drops are logged as one summary line at most this often


class _Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, now: float) -> None:
        self.tokens, self.at = float(BURST), now

    def take(self, now: float) -> bool:
        self.tokens = min(float(BURST), self.tokens + (now - self.at) * RATE_PER_S)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class NotifyServer:
    """`attribute(pid)` names the unit a sender belongs to (its own processes only) or
    None: messages from anyone else are dropped and counted, never logged one by one."""

    def __init__(self, token: str, on_message: Callable[[int, dict[str, str]], object],
                 attribute: Callable[[int], str | None] | None = None, fd: int | None = None,
                 on_fds: Callable[[str, dict[str, str], list[int]], object] | None = None) -> None:
        """`on_fds(unit, fields, fds)`: an FDSTORE=1 or FDSTOREREMOVE=1 message of an attributed
        unit, with the fds it carried; it takes them (stores or closes each)."""
        # What units get in NOTIFY_SOCKET. An abstract name is listed to every user in
        # /proc/net/unix: it is derived from the token one way, never the token itself (the
        # token proves a process ours at takeover; nobody but root and the unit's user may read it).
        self.address = f"@omnid/{hashlib.sha256(b'omnid notify ' + token.encode()).hexdigest()[:24]}/notify"
        self._on_message = on_message
        self._attribute = attribute
        self._on_fds = on_fds
        self._buckets: dict[str, _Bucket] = {}
        self.counters = {"received": 0, "accepted": 0, "dropped_foreign": 0, "dropped_rate": 0,
                         "dropped_no_credentials": 0, "dropped_truncated": 0, "fds_closed": 0}
        self._reported: dict[str, int] = {}
        self._last_summary = 0.0
        if fd is not None:  # the socket a previous program of this daemon bound (omnid reexec)
            os.set_inheritable(fd, False)
            self.sock = socket.socket(fileno=fd)
            name = self.sock.getsockname()  # the name it was bound to, whatever program chose it
            if isinstance(name, bytes) and name[:1] == b"\0":
                self.address = "@" + name[1:].decode(errors="replace")
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self.sock.bind("\0" + self.address[1:])
        self.sock.setblocking(False)

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._readable)

    def forget(self, unit: str) -> None:
        self._buckets.pop(unit, None)

    def _drop(self, why: str) -> None:
        self.counters[why] += 1
        now = time.monotonic()
        if now - self._last_summary >= SUMMARY_EVERY_S:
            self._last_summary = now
            new = {k: v - self._reported.get(k, 0) for k, v in self.counters.items() if k.startswith("dropped")}
            self._reported = dict(self.counters)
            log.warning("notify datagrams dropped (not from a unit's own processes, over the rate limit, or fds cut)",
                        **{k: v for k, v in new.items() if v})

    def _readable(self) -> None:
        fds_size = socket.CMSG_SPACE(SCM_MAX_FD * array.array("i").itemsize)
        cred_size = socket.CMSG_SPACE(_CRED.size)
        for _ in range(MAX_PER_TURN):  # the rest waits for the next turn (level-triggered reader)
            try:
                data, ancdata, flags, _addr = self.sock.recvmsg(MAX_DATAGRAM, fds_size + cred_size,
                                                                socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("notify socket read failed", error=str(exc))
                return
            self.counters["received"] += 1
            pid = 0
            fds = array.array("i")
            for level, ctype, cdata in ancdata:
                if level != socket.SOL_SOCKET:
                    continue
                if ctype == socket.SCM_RIGHTS:
                    fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
                elif ctype == socket.SCM_CREDENTIALS and len(cdata) >= _CRED.size:
                    pid, _uid, _gid = _CRED.unpack(cdata[: _CRED.size])
            received = list(fds)
            try:
                self._message(data, flags, pid, received)
            finally:
                for fd in received:  # those not taken: the BARRIER=1 pipe, a dropped message's
                    closer.close(fd)  # a pipe at once (it releases the sender); what may wait, off the loop
                    self.counters["fds_closed"] += 1

    def _message(self, data: bytes, flags: int, pid: int, fds: list[int]) -> None:
        """One datagram. The caller closes what is left in `fds`; what goes to on_fds is taken
        out of the list first."""
        if flags & socket.MSG_CTRUNC:
            self._drop("dropped_truncated")
            return
        if pid <= 0:
            self._drop("dropped_no_credentials")
            return
        unit: str | None = None
        if self._attribute is not None:
            unit = self._attribute(pid)
            if unit is None:
                self._drop("dropped_foreign")
                return
            now = time.monotonic()
            bucket = self._buckets.get(unit)
            if bucket is None:
                bucket = self._buckets[unit] = _Bucket(now)
            if not bucket.take(now):
                self._drop("dropped_rate")
                return
        fields = parse_notify(data)
        if not fields or fields.keys() == {"BARRIER"}:
            return
        self.counters["accepted"] += 1
        if unit is not None and self._on_fds is not None and \
                (fields.get("FDSTORE") == "1" or fields.get("FDSTOREREMOVE") == "1"):
            self._hand_over(unit, fields, fds)
        try:
            self._on_message(pid, fields)
        except Exception:  # noqa: BLE001 - a bad message must not kill the reader
            log.exception("notify handler failed", pid=pid)

    def _hand_over(self, unit: str, fields: dict[str, str], fds: list[int]) -> None:
        assert self._on_fds is not None
        taken = list(fds)
        fds.clear()
        try:
            self._on_fds(unit, fields, taken)
        except Exception:  # noqa: BLE001 - the store closes what it does not keep, even on error
            log.exception("fd store failed on a message", unit=unit)

    def close(self) -> None:
        try:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        except RuntimeError:
            pass
        self.sock.close()
