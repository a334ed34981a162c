"""The fd store: fds a unit hands to the daemon over its notify socket and gets back on its
later starts (omnid.unit(5) `fd_store_max`; systemd's FileDescriptorStoreMax= and
sd_pid_notify_with_fds(3)).

A message `FDSTORE=1` with fds (SCM_RIGHTS), optionally `FDNAME=name` (default "stored")
and `FDPOLL=0`, stores them for the sending unit instance, at most `fd_store_max` fds; the
rest are closed at once and counted. `FDSTOREREMOVE=1` with `FDNAME=name` closes the
stored fds of that name. On every later start of the instance its stored fds are passed
after its held sockets (omnid.process.sockets): fds 3, 4, ... with LISTEN_FDS and LISTEN_FDNAMES.
A stored fd stays stored after it is passed, until removed, until it hangs up (POLLHUP or
POLLERR, unless stored with FDPOLL=0), until the operator stops the unit (`omnid stop`),
or until a reload removes the unit. The store is kept across `omnid reexec` (the fds are
inherited, `to_json`/`take_over`).

Every fd is hostile until checked. Only fds that are the kernel's own objects are kept:
sockets, pipes, memory files (memfd, a tmpfs file: F_GET_SEALS answers), eventfd, timerfd,
signalfd and pidfd. Anything else (a file on a disk or network filesystem, a directory, a
device such as /dev/nvidia*, an O_PATH fd, epoll, io_uring) is refused and closed: the
daemon would pin a mount, a GPU context or a deleted file, and nothing is opened, followed
or read to decide (the fd's /proc link names its kind, and an fstat is made only of the
kernel's own objects, never of a file that a FUSE server would be asked about).

Hang-ups are watched without a scan: each pollable stored fd is in one epoll set with no
events asked (only EPOLLHUP and EPOLLERR, always reported), and that set's own fd is one
reader of the loop. A stored fd whose peer hangs up is closed in the same turn. Every close
of a unit's fd goes through omnid.base.closer: a socket with SO_LINGER set, or a file a FUSE
server never flushes, waits in a closer thread, never on the loop.

Future package: process/ (beside sockets): imports nothing above the model.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import select
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from omnid.base import closer

log = structlog.get_logger("omnid.process.fdstore")

DEFAULT_NAME = "stored"  # systemd's name for a stored fd without FDNAME=
NAME_MAX = 255  # as a LISTEN_FDNAMES name (systemd's FDNAME_MAX)
SUMMARY_EVERY_S = 10.0  # refusals are logged as one summary line at most this often
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
# anon_inode kinds that hold nothing but a counter, a timer, a signal mask or a process
# reference; epoll, io_uring, userfaultfd, perf and bpf objects are refused.
_ANON_KINDS = ("anon_inode:[eventfd]", "anon_inode:[timerfd]", "anon_inode:[signalfd]", "anon_inode:[pidfd]",
               "pidfd:")


def name_problem(name: str) -> str | None:
    """Why `name` cannot be an fd's name in LISTEN_FDNAMES, or None (systemd's fdname_is_valid)."""
    if not name:
        return "an empty name"
    if len(name) > NAME_MAX:
        return f"longer than {NAME_MAX} characters"
    if any(c == ":" or not " " <= c <= "~" for c in name):
        return "not printable ASCII without ':'"
    return None


def kind_of(fd: int) -> str | None:
    """What a received fd is ("socket", "pipe", "memfd", "eventfd", ...), or None: refused.
    Reads the fd's /proc link (no filesystem is asked) and asks the kernel's own objects only."""
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if link.startswith("socket:["):
        return "socket"
    if link.startswith("pipe:["):
        return "pipe"
    for k in _ANON_KINDS:
        if link.startswith(k):
            return k.removeprefix("anon_inode:").strip("[]:")
    if link.startswith("/"):
        # A path: kept only when it is shared memory. F_GET_SEALS answers for shmem and
        # hugetlbfs regular files alone (EINVAL for any other file, EBADF for O_PATH) and
        # calls no filesystem code.
        try:
            fcntl.fcntl(fd, _F_GET_SEALS)
        except OSError:
            return None
        return "memfd"
    return None


def _ident(fd: int, kind: str) -> tuple[int, int] | None:
    """What makes a stored socket or memory file the same object as another (a unit that
    stores again, at each start, what it was given back): its inode, which is one per socket
    and per memory file. None for a pipe (both ends share an inode) and the anon_inode
    kinds (one inode for all): those are never deduplicated."""
    if kind not in ("socket", "memfd"):
        return None
    st = os.fstat(fd)  # the kernel's own object (kind_of): no filesystem is asked
    return (st.st_dev, st.st_ino)


@dataclass
class Stored:
    fd: int
    name: str
    poll: bool  # dropped when it hangs up
    kind: str
    ident: tuple[int, int] | None  # a socket's or memory file's (st_dev, st_ino): stored once


class FdStore:
    """The stored fds, per unit instance, in the order they were stored. `limit_of(unit)`
    is the instance's `fd_store_max` now (0 for an unknown unit)."""

    def __init__(self, limit_of: Callable[[str], int]) -> None:
        self.units: dict[str, list[Stored]] = {}
        self._limit_of = limit_of
        # The hang-up watch, opened by start() (a supervisor built without a loop opens no fd);
        # close-on-exec: a re-exec registers the fds it inherits again.
        self._epoll: select.epoll | None = None
        self._polled: dict[int, str] = {}  # stored fd -> unit, for the fds in the epoll set
        self.counters = {"stored": 0, "removed": 0, "passed": 0, "dropped_hangup": 0, "refused_over_limit": 0,
                         "refused_kind": 0, "refused_name": 0, "refused_duplicate": 0}
        self._reported: dict[str, int] = {}
        self._last_summary = 0.0

    # -- the loop ------------------------------------------------------------------------
    def start(self) -> None:
        """Watch stored fds for hang-ups from the running loop (before any is stored or taken over)."""
        self._epoll = select.epoll()
        asyncio.get_running_loop().add_reader(self._epoll.fileno(), self._hangups)

    def _hangups(self) -> None:
        assert self._epoll is not None
        for fd, _events in self._epoll.poll(0, 256):  # level-triggered: the rest next turn
            unit = self._polled.get(fd)
            held = self.units.get(unit or "", [])
            for s in held:
                if s.fd == fd:
                    held.remove(s)
                    self.counters["dropped_hangup"] += 1
                    log.info("stored fd hung up: dropped", unit=unit, name=s.name, kind=s.kind)
                    self._close(s)
                    break
            else:  # not ours any more (cannot happen: every close unregisters first)
                self._unpoll(fd)
            if unit is not None and not held:
                self.units.pop(unit, None)

    # -- what a unit sends ---------------------------------------------------------------
    def offer(self, unit: str, fields: dict[str, str], fds: list[int]) -> None:
        """An FDSTORE=1 or FDSTOREREMOVE=1 message of `unit` (attributed and rate-limited by
        the notify socket) with the fds it carried. Takes every fd: stored or closed."""
        try:
            if fields.get("FDSTOREREMOVE") == "1":
                self._remove(unit, fields.get("FDNAME", ""))
            if fields.get("FDSTORE") != "1" or not fds:
                return
            name = fields.get("FDNAME", DEFAULT_NAME)
            problem = name_problem(name)
            if problem is not None:
                self._refuse("refused_name", unit, len(fds), f"FDNAME is {problem}")
                return
            poll = fields.get("FDPOLL") != "0"
            limit = self._limit_of(unit)
            held = self.units.setdefault(unit, [])
            idents = {s.ident for s in held}
            while fds:
                fd = fds.pop(0)
                kind = kind_of(fd)
                if kind is None:
                    closer.close(fd)
                    self._refuse("refused_kind", unit, 1, "not a socket, pipe, memory file, eventfd, timerfd, "
                                 "signalfd or pidfd")
                    continue
                ident = _ident(fd, kind)
                if ident is not None and ident in idents:  # as systemd: the same object once (the new fd closed)
                    closer.close(fd)
                    self.counters["refused_duplicate"] += 1
                    continue
                if len(held) >= limit:
                    closer.close(fd)
                    self._refuse("refused_over_limit", unit, 1, f"fd_store_max ({limit}) reached")
                    continue
                s = Stored(fd, name, poll, kind, ident)
                held.append(s)
                idents.add(ident)
                self.counters["stored"] += 1
                if poll:
                    self._watch(unit, s)
                log.debug("fd stored", unit=unit, name=name, kind=kind, fd=fd, poll=poll)
            if not held:
                self.units.pop(unit, None)
        finally:
            for fd in fds:  # whatever an error left: never leaked
                closer.close(fd)

    def _remove(self, unit: str, name: str) -> None:
        held = self.units.get(unit, [])
        keep = [s for s in held if s.name != name]
        for s in held:
            if s.name == name:
                self.counters["removed"] += 1
                self._close(s)
        if keep:
            self.units[unit] = keep
        else:
            self.units.pop(unit, None)
        log.info("stored fds removed (FDSTOREREMOVE=1)", unit=unit, name=name, fds=len(held) - len(keep))

    def _refuse(self, why: str, unit: str, n: int, reason: str) -> None:
        self.counters[why] += n
        now = time.monotonic()
        if now - self._last_summary >= SUMMARY_EVERY_S:
            self._last_summary = now
            new = {k: v - self._reported.get(k, 0) for k, v in self.counters.items() if k.startswith("refused")}
            self._reported = dict(self.counters)
            log.warning("fds sent to the fd store refused and closed", unit=unit, last_reason=reason,
                        **{k: v for k, v in new.items() if v})

    # -- a start -------------------------------------------------------------------------
    def dup_for(self, unit: str) -> tuple[list[int], list[str]]:
        """Copies (close-on-exec) of the unit's stored fds and their names, for one spawn:
        the caller closes the copies once the spawner has them, so a stored fd that hangs up
        meanwhile never sends a reused fd number. At most fd_store_max (a lowered limit
        passes the first ones; the rest are closed at once)."""
        held = self.units.get(unit, [])
        limit = self._limit_of(unit)
        if len(held) > limit:
            for s in held[limit:]:
                self.counters["removed"] += 1
                self._close(s)
            del held[limit:]
            log.info("stored fds beyond a lowered fd_store_max closed", unit=unit, fd_store_max=limit)
        fds: list[int] = []
        try:
            for s in held:
                fds.append(fcntl.fcntl(s.fd, fcntl.F_DUPFD_CLOEXEC, 3))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        self.counters["passed"] += len(fds)
        return fds, [s.name for s in held]

    # -- the unit's end ------------------------------------------------------------------
    def drop(self, unit: str, why: str) -> None:
        """Close every stored fd of `unit` (stopped by the operator, removed by a reload)."""
        held = self.units.pop(unit, [])
        for s in held:
            self._close(s)
        if held:
            log.info("fd store emptied", unit=unit, fds=len(held), why=why)

    def keep_only(self, units: Iterable[str]) -> None:
        """After a reload: the store of an instance no longer in the stack is closed."""
        wanted = set(units)
        for name in [n for n in self.units if n not in wanted]:
            self.drop(name, "removed from the stack by a reload")

    def fds(self) -> list[int]:
        return [s.fd for held in self.units.values() for s in held]

    def count(self, unit: str) -> int:
        return len(self.units.get(unit, ()))

    def close_all(self) -> None:
        for name in list(self.units):
            self.drop(name, "the daemon stops")
        if self._epoll is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._epoll.fileno())
            except RuntimeError:
                pass
            self._epoll.close()
            self._epoll = None

    def _watch(self, unit: str, s: Stored) -> None:
        if self._epoll is None:
            return  # not started: no loop to watch from
        try:
            self._epoll.register(s.fd, 0)  # 0: EPOLLHUP and EPOLLERR only (always reported)
        except PermissionError:
            return  # a memory file cannot be polled: it never hangs up
        self._polled[s.fd] = unit

    def _unpoll(self, fd: int) -> None:
        if self._polled.pop(fd, None) is not None and self._epoll is not None:
            try:
                self._epoll.unregister(fd)
            except OSError:
                pass  # already gone from the set with its file

    def _close(self, s: Stored) -> None:
        # Out of the epoll set before the number can be reused (a dup elsewhere keeps the
        # file, and with it the registration, alive).
        self._unpoll(s.fd)
        closer.close(s.fd)  # a unit's socket may linger for as long as it asked: off the loop

    # -- omnid reexec --------------------------------------------------------------------
    def to_json(self) -> dict:
        return {unit: [{"fd": s.fd, "name": s.name, "poll": s.poll} for s in held]
                for unit, held in self.units.items()}

    def take_over(self, d: dict, units: Iterable[str]) -> None:
        """The store a previous program of this daemon held, inherited as fds; the store of a
        unit no longer in the stack is closed. ValueError/KeyError/TypeError on a malformed
        record (checked before anything is taken)."""
        items = [(str(unit), int(it["fd"]), str(it["name"]), bool(it["poll"]))
                 for unit, held in d.items() for it in held]
        for unit, fd, name, poll in items:
            os.set_inheritable(fd, False)
            kind = kind_of(fd) or "unknown"
            s = Stored(fd, name, poll, kind, _ident(fd, kind))
            self.units.setdefault(unit, []).append(s)
            if poll:
                self._watch(unit, s)
        self.keep_only(units)
