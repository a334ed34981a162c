"""Drain before stop (omnid.unit(5) `drain`, omnid(8) DRAIN): a planned stop of a serving
unit first tells it to stop taking work, so that the requests it accepted finish while
load balancers, seeing /health 503 "draining", send new ones elsewhere.

The drain request is a POST to the unit's `drain.http` URL or the signal `drain.signal`
(to the unit's process group, or under kill_mode mixed / process to its main process only).
The drain is over at the first of:
- the POST answered 200 or 204 (a drain endpoint that answers once in-flight work is done);
- the unit says so with sd_notify `STATUS=idle` (or a STATUS beginning with "idle");
- its main process exited (a server that drains, then exits by itself);
- drain_timeout (the table's timer).
A POST answered 202 means "accepted, draining": omnid waits for one of the others. Any
other answer, or no answer, is logged and the stop goes on at once (a broken drain hook
must not hold a stop for drain_timeout).
"""

from __future__ import annotations

import asyncio

import structlog

from omnid.core import probes
from omnid.core.centre import Centre
from omnid.core.runtime import UnitRuntime
from omnid.model.unitmodel import KillMode

log = structlog.get_logger("omnid.supervisor")


class Drains:
    def __init__(self, sup: Centre) -> None:
        self.sup = sup
        self._idle: dict[str, asyncio.Event] = {}

    def notified(self, rt: UnitRuntime, status: str) -> None:
        """sd_notify STATUS= from the unit: "idle..." ends a drain under way."""
        if status.strip().lower().startswith("idle"):
            ev = self._idle.get(rt.name)
            if ev is not None:
                ev.set()

    async def drain(self, rt: UnitRuntime) -> str:
        """Send the drain request and wait until it is over (never past drain_timeout: the
        table's timer ends the phase and cancels this). Returns what ended it."""
        hook = rt.spec.drain
        h = rt.proc
        if hook is None or h is None:
            return "no drain hook"
        idle = self._idle[rt.name] = asyncio.Event()
        try:
            if hook.url:
                try:
                    status = await probes.http_status(hook.url, rt.spec.drain_timeout, method="POST")
                except probes.ProbeFailed as exc:
                    log.warning("drain request failed; stopping now", unit=rt.name, error=str(exc))
                    return f"drain request failed ({exc})"
                if status in (200, 204):
                    return f"drained (POST {hook.url} answered {status})"
                if status != 202:
                    log.warning("drain request refused; stopping now", unit=rt.name, url=hook.url, status=status)
                    return f"drain request answered {status}"
            else:
                assert hook.sig is not None
                # kill_mode mixed / process: the main process alone drains (its engines keep
                # working for it); control-group: the whole unit, as its stop signal would.
                if rt.spec.kill_mode is KillMode.CONTROL_GROUP:
                    sent = h.signal_group(int(hook.sig), self.sup.token)
                else:
                    sent = h.signal(int(hook.sig))
                if not sent:
                    return "drain signal found no process"
            # `reaped`, not `exited`: the exit is fed to the table (EXITED) the moment its status is
            # in, so the table hears of it before this drain could end it as DRAINED -- which
            # would send the stop signal to a dead main process instead of dealing with the rest.
            waits = [asyncio.ensure_future(idle.wait()), asyncio.ensure_future(h.reaped.wait())]
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            return "drained (STATUS=idle)" if idle.is_set() else "drained (its main process exited)"
        finally:
            self._idle.pop(rt.name, None)
