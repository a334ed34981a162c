"""Drain before stop (omnid.unit(5) `drain`, omnid(8) DRAIN): a planned stop of a serving
unit first tells it to stop taking work, so that the requests it accepted finish while
load balancers, seeing /health 503 "draining", send new ones elsewhere.

The drain request is a POST to the unit's `drain.http` URL or the signal `drain.signal`
(to the unit's process group, or under kill_mode mixed / process to its main process only).
The drain is over at the first of:
- the POST answered 200 or 204 (a drain endpoint that answers once in-flight work is done);
- the unit says so with sd_notify `STATUS=idle` (or a STATUS beginning with "idle");
- with a `progress` rule, the engine's own metrics say so: its `busy` gauges (vLLM:
  vllm:num_requests_running, vllm:num_requests_waiting) read 0 on IDLE_SCRAPES scrapes in a
  row, the rule's `interval` apart -- for an engine that has no drain endpoint and no idle
  notice, and whose own SIGTERM loses work (vLLM 0.32 aborts what is not yet scheduled and
  answers what comes during its own drain with a 500): the stop signal comes once nothing
  runs or waits;
- its main process exited (a server that drains, then exits by itself);
- drain_timeout (the table's timer).
A POST answered 202 means "accepted, draining": omnid waits for one of the others. Any
other answer, or no answer, is logged and the stop goes on at once (a broken drain hook
must not hold a stop for drain_timeout).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from omnid.core import probes, progress
from omnid.core.centre import Centre
from omnid.core.runtime import UnitRuntime
from omnid.model.unitmodel import KillMode, Progress

log = structlog.get_logger("omnid.supervisor")

# Scrapes in a row that must read every busy gauge at 0: one could fall between a request's
# arrival and its first engine step (vLLM counts a request once its engine has it).
IDLE_SCRAPES = 2
IDLE_INTERVAL_MAX_S = 1.0  # a drain reads the gauges at least this often, whatever the rule's interval


async def engine_idle(rule: Progress, unit: str) -> str:
    """Until the `busy` gauges of `rule` read 0 on IDLE_SCRAPES scrapes in a row (bounded by the
    caller: drain_timeout). A failed scrape or a gauge missing from the page proves nothing and
    starts the count again (said once: such a drain lasts its drain_timeout)."""
    interval = min(rule.interval, IDLE_INTERVAL_MAX_S)
    in_a_row, said = 0, False
    while True:
        t0 = time.monotonic()
        why = ""
        try:
            _counter, busy = await progress.scrape(rule)
            missing = [g for g, v in busy.items() if v is None]
            if missing:
                why = f"{', '.join(missing)} not in {rule.metrics}"
            elif sum(v for v in busy.values() if v is not None) > 0:
                why = "busy"
        except probes.ProbeFailed as exc:
            why = str(exc)
        if not why:
            in_a_row += 1
            if in_a_row >= IDLE_SCRAPES:
                return f"drained ({' + '.join(rule.busy)} = 0 on {IDLE_SCRAPES} scrapes of {rule.metrics})"
        else:
            in_a_row = 0
            if why != "busy" and not said:
                said = True
                log.warning("drain: the engine's metrics cannot prove it idle; waiting for drain_timeout "
                            "or another end", unit=unit, why=why)
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))


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
            metrics = None
            if rt.spec.progress is not None:
                metrics = asyncio.ensure_future(engine_idle(rt.spec.progress, rt.name))
                waits.append(metrics)
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if idle.is_set():
                return "drained (STATUS=idle)"
            if metrics is not None and metrics in done:
                if (exc := metrics.exception()) is not None:
                    log.warning("drain: reading the engine's metrics failed; stopping now", unit=rt.name,
                                error=f"{type(exc).__name__}: {exc}")
                    return f"drain's metrics wait failed ({type(exc).__name__}: {exc})"
                return metrics.result()
            return "drained (its main process exited)"
        finally:
            self._idle.pop(rt.name, None)
