"""Exit reports and statuses that do not meet their unit in order (omnid.core.exits tells the
death they belong to). Its books are bounded: a spawner that never sends what was expected
cannot grow them. A part of its own so that the `Centre` can name it without an import circle."""

from __future__ import annotations

import asyncio
import collections

from omnid.process.handle import ProcessHandle
from omnid.process.spawnclient import ExitReport

BOUND = 4096


class ExitBook:
    """Exit reports and statuses that do not meet their unit in order:
    - a report may arrive before the reply of the spawn it ends (kept `early` until the
      unit adopts its process);
    - a status read from the pidfd makes the report that follows redundant (`read`: dropped
      when it comes; the spawner reports a reap before any spawn that could reuse the pid);
    - a report of a helper the daemon spawned for a unit (an exec probe) belongs to whoever
      waits for it (`expect_helper`), never to a unit: it is taken, or dropped when nobody
      waits any more."""

    def __init__(self) -> None:
        self._early: collections.OrderedDict[int, ExitReport] = collections.OrderedDict()
        self._read: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._helpers: collections.OrderedDict[int, asyncio.Future[int]] = collections.OrderedDict()

    @staticmethod
    def _put(book: collections.OrderedDict, pid: int, value) -> None:
        book[pid] = value
        if len(book) > BOUND:
            book.popitem(last=False)

    def keep_early(self, rep: ExitReport) -> None:
        self._put(self._early, rep.pid, rep)

    def take_early(self, h: ProcessHandle) -> ExitReport | None:
        """The report kept for the process `h` now holds, if that process has ended (a report
        kept for a pid that lives again is an earlier process's: dropped)."""
        rep = self._early.pop(h.pid, None)
        return rep if rep is not None and not h.leader_alive() else None

    def read_from_pidfd(self, pid: int) -> None:
        self._put(self._read, pid, None)

    def already_read(self, pid: int) -> bool:
        """True (once) for a report whose status the pidfd gave first."""
        return self._read.pop(pid, 0) is None

    def expect_helper(self, pid: int) -> asyncio.Future[int]:
        """The wait status the spawner will report for helper `pid`, just spawned (its
        report may have come with the spawn's reply: kept early, taken here). The caller
        reads the pidfd's status first where the kernel gives it (linux.pidfd_exit_status):
        this is the fallback, and the registration stays until the report comes."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._put(self._helpers, pid, fut)
        rep = self._early.pop(pid, None)
        if rep is not None:
            fut.set_result(rep.status)
            self._helpers.pop(pid, None)
        return fut

    def helper_exit(self, rep: ExitReport) -> bool:
        """True when the report is a helper's (taken: it is no unit's business)."""
        fut = self._helpers.pop(rep.pid, None)
        if fut is None:
            return False
        if not fut.done():
            fut.set_result(rep.status)
        return True
