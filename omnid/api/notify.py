"""NOTIFY_SOCKET receiver: the sd_notify protocol (omnid.unit(5), ENVIRONMENT OF A UNIT).

One AF_UNIX datagram socket per daemon, in the abstract namespace. SO_PASSCRED
makes the kernel attach the sender's pid to each message, and SO_PASSPIDFD (Linux 6.5) a
pidfd of the sender (SCM_PIDFD): the message is attributed to a unit by the process the
kernel names, never by a pid or a process group number that a stranger may have recycled
(the supervisor proves the process the unit's; without SO_PASSPIDFD, said once in the
log, by the pid). `systemd-notify` follows
its message with BARRIER=1 and a pipe fd and waits until the receiver closes
it: every fd passed with SCM_RIGHTS is closed as soon as it arrives (off the loop when
its close could wait on a filesystem or a peer: omnid.base.closer), except
those of an FDSTORE=1 message from a unit's own process within its rate limit,
which go to the fd store (omnid.process.fdstore), which keeps or closes each. A message
whose control data was cut (MSG_CTRUNC: more fds than SCM_MAX_FD, or the
daemon's fd table full) is dropped with whatever fds did arrive.

What a stranger can make the daemon hold is capped: fds whose close may wait queue for
omnid.base.closer's threads, and while a datagram's worth more would not fit under its cap
(closer.room()), the socket is not read: the senders wait in the kernel (a full receive
queue), not in our fd table. Reading resumes once half the queue is closed. A unit's own
messages wait too, so while the socket is not read, and for a grace after, no watchdog or
ready_timeout is judged on a unit's silence (closer.unheard; omnid.core.monitors).
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
from typing import NamedTuple

import structlog

from omnid.base import closer, linux

log = structlog.get_logger("omnid.api.notify")

_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
MAX_DATAGRAM = 4096
SCM_MAX_FD = 253  # the kernel's most fds in one message: room for all, so a cut is the fd table's
PAUSED_LOOK_S = 0.1  # while not read (closer queue full): how often to look for room again


class Sender(NamedTuple):
    """Who sent a datagram: the pid SCM_CREDENTIALS says and the kernel's pidfd of that very
    process (SCM_PIDFD; None where the kernel gives none). The pidfd is open only while the
    message is handled."""
    pid: int
    pidfd: int | None


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
    """`attribute(sender)` names the unit a sender belongs to (its own processes only) or
    None: messages from anyone else are dropped and counted, never logged one by one."""

    def __init__(self, token: str, on_message: Callable[[int, dict[str, str]], object],
                 attribute: Callable[[Sender], str | None] | None = None, fd: int | None = None,
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
                         "dropped_no_credentials": 0, "dropped_truncated": 0, "fds_closed": 0,
                         "paused": 0}
        self._reported: dict[str, int] = {}
        self._last_summary = 0.0
        if fd is not None:  # the socket a previous program of this daemon bound (omnid reexec)
            os.set_inheritable(fd, False)
            # Nobody read it during the exec: the units' pings wait in it, read from now on.
            closer.unheard.until = time.monotonic()
            self.sock = socket.socket(fileno=fd)
            name = self.sock.getsockname()  # the name it was bound to, whatever program chose it
            if isinstance(name, bytes) and name[:1] == b"\0":
                self.address = "@" + name[1:].decode(errors="replace")
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self.sock.bind("\0" + self.address[1:])
        self.sock.setblocking(False)
        why_not = linux.pass_pidfd(self.sock)  # again on an inherited socket: a no-op, or an older program's
        self.pidfds = why_not is None
        if why_not is not None:
            log.warning("notify senders are attributed by pid, not by the kernel's pidfd", reason=why_not)
        self._paused_since: float | None = None
        self._reading = False

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._readable)
        self._reading = True

    def _pause(self) -> None:
        """The closer's queue is full: stop reading until half of it is closed. The senders'
        datagrams (and fds) wait in the kernel, counted against them, not in our fd table."""
        loop = asyncio.get_running_loop()
        if self._reading:
            loop.remove_reader(self.sock.fileno())
            self._reading = False
        if self._paused_since is None:
            self._paused_since = time.monotonic()
            closer.unheard.stop(self._paused_since)  # the watchdog and ready_timeout hold their judgement
            self.counters["paused"] += 1
            log.warning("notify socket not read: fds received from outside wait to be closed (the senders wait)",
                        waiting=closer.MAX_WAITING - closer.room(), cap=closer.MAX_WAITING)
        loop.call_later(PAUSED_LOOK_S, self._resume_if_room)

    def _resume_if_room(self) -> None:
        if self._paused_since is None or self.sock.fileno() < 0:
            return  # closed meanwhile
        if closer.room() < closer.MAX_WAITING // 2:
            asyncio.get_running_loop().call_later(PAUSED_LOOK_S, self._resume_if_room)
            return
        now = time.monotonic()
        log.info("notify socket read again", paused_s=round(now - self._paused_since, 1))
        self._paused_since = None
        closer.unheard.go(now)
        self.start()

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
        cred_size = socket.CMSG_SPACE(_CRED.size) + socket.CMSG_SPACE(array.array("i").itemsize)  # + SCM_PIDFD
        for _ in range(MAX_PER_TURN):  # the rest waits for the next turn (level-triggered reader)
            if closer.room() < SCM_MAX_FD + 1:  # one more datagram might not fit under the cap
                self._pause()
                return
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
            pidfd: int | None = None
            fds = array.array("i")
            for level, ctype, cdata in ancdata:
                if level != socket.SOL_SOCKET:
                    continue
                if ctype == socket.SCM_RIGHTS:
                    fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
                elif ctype == socket.SCM_CREDENTIALS and len(cdata) >= _CRED.size:
                    pid, _uid, _gid = _CRED.unpack(cdata[: _CRED.size])
                elif ctype == linux.SCM_PIDFD and len(cdata) >= 4:
                    got = struct.unpack("i", cdata[:4])[0]
                    pidfd = got if got >= 0 else None  # -errno where the kernel could not make one (EMFILE)
            received = list(fds)
            try:
                self._message(data, flags, Sender(pid, pidfd), received)
            finally:
                if pidfd is not None:
                    os.close(pidfd)  # the kernel's own pidfd: its close waits on nothing
                for fd in received:  # those not taken: the BARRIER=1 pipe, a dropped message's
                    closer.close(fd)  # what cannot wait at once (a pipe releases the sender); the rest off the loop
                    self.counters["fds_closed"] += 1

    def _message(self, data: bytes, flags: int, sender: Sender, fds: list[int]) -> None:
        """One datagram. The caller closes what is left in `fds`; what goes to on_fds is taken
        out of the list first."""
        pid = sender.pid
        if flags & socket.MSG_CTRUNC:
            self._drop("dropped_truncated")
            return
        if pid <= 0:
            self._drop("dropped_no_credentials")
            return
        unit: str | None = None
        if self._attribute is not None:
            unit = self._attribute(sender)
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
        if self._paused_since is not None:
            closer.unheard.go(time.monotonic())
        self._paused_since = None
        try:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        except RuntimeError:
            pass
        self.sock.close()
