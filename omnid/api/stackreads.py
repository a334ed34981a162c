"""Reads of a stack directory for `check` and `reload`: off the event loop, bounded, and
never holding a thread anything else needs (omnid.base.ownthreads says why). A stack
directory may sit on a network or FUSE mount that no longer answers; past MAX_OUT reads
not returned, a new one is refused at once as `busy`, naming the oldest."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from omnid.api.control import ControlError
from omnid.base.ownthreads import MAX_OUT, Busy, OwnThreads

T = TypeVar("T")


class StackReads(OwnThreads):
    def __init__(self, max_out: int = MAX_OUT) -> None:
        super().__init__(max_out, kind="read")

    async def run(self, what: str, fn: Callable[[], T], timeout: float) -> T:
        """As OwnThreads.run, a refusal being the control socket's `busy`."""
        try:
            return await super().run(what, fn, timeout)
        except Busy as exc:
            raise ControlError("busy", str(exc)) from None
