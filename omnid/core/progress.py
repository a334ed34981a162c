"""The `progress` rule (omnid.unit(5)): a unit that says work is waiting must show it being
done. Every `interval` seconds its Prometheus endpoint is read (bounded in time and size);
when the `busy` gauges summed are > 0 and `counter` has not grown for `stall_sec`, the
monitor feeds LIVENESS_FAILED and the lifecycle table captures the unit's stacks, then
kills it -- a hung engine behind a /health that still answers 200.

The gauges freeze with a hung engine (vLLM publishes them once per engine step), so one
that hangs between two batches says "idle" for ever. With a `canary`, an idle unit is asked
for work: once the gauges have said idle for `stall_sec`, the canary request goes out, and
if it is accepted and neither answered nor seen producing a token within `stall_sec` while
the metrics page still answers, the unit is hung. A refused connection judges nothing (the
server in front may be restarting), nor does a metrics page that stopped answering.

`StallRule` and `CanaryWatch` are the decisions, pure (fed observations with their times,
they return a reason or None); `watch` is the monitor task that scrapes and feeds them."""

from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import dataclass, field

import structlog

from omnid.core import probes
from omnid.base import promtext
from omnid.core.centre import Centre
from omnid.core.lifecycle import Event, Phase, UnitState
from omnid.core.runtime import UnitRuntime
from omnid.model.unitmodel import Canary, Progress

log = structlog.get_logger("omnid.supervisor")

SCRAPE_MAX_BYTES = 8 << 20  # a metrics page bigger than this is a failed scrape
# A page over this is parsed on a worker thread, one such page at a time: promtext.sums reads
# ~6 MB/s on the project's 2-core VM, so a page at the cap held the loop (every death it sees)
# for ~1.5 s. A page up to this size is parsed on the loop (~45 ms at most), no thread hop.
PARSE_ON_LOOP_MAX = 256 << 10
_big_parses: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()
SCRAPE_TIMEOUT_MAX_S = 5.0


@dataclass
class StallRule:
    """When is a busy unit stuck? Progress is the counter changing (a drop is a reset of
    the engine's metrics: progress too) or the unit being idle; a failed scrape proves
    nothing, so it counts as no progress only while work was last seen waiting."""

    rule: Progress
    counter: float | None = None  # last value read
    since: float | None = None  # when progress was last proven (monotonic); None: not yet
    busy: dict[str, float] = field(default_factory=dict)  # the busy gauges last read

    def busy_now(self) -> bool:
        return sum(self.busy.values()) > 0

    def observe(self, now: float, counter: float | None, busy: dict[str, float | None]) -> str | None:
        was_busy = self.busy_now()
        self.busy = {k: v for k, v in busy.items() if v}  # the gauges > 0 (None, 0: not busy)
        if counter is None:
            # The counter is not in the page (a typo, or not exported yet): nothing to judge.
            self.busy, self.since = {}, now
            return None
        if counter != self.counter or not was_busy or not self.busy_now() or self.since is None:
            # Moved (up, or down: a reset), idle, or busy only from now on: the clock starts
            # here, so a stall is never counted from before work was seen waiting.
            self.counter, self.since = counter, now
            return None
        return self._judge(now, "")

    def scrape_failed(self, now: float, why: str) -> str | None:
        if not self.busy_now() or self.since is None:
            self.since = now  # idle as far as we know: never failed for that
            return None
        return self._judge(now, f"; metrics unreadable ({why})")

    def _judge(self, now: float, note: str) -> str | None:
        assert self.since is not None
        stuck = now - self.since
        if stuck < self.rule.stall_sec:
            return None
        gauges = ", ".join(f"{k} = {v:g}" for k, v in self.busy.items())
        return f"progress: {self.rule.counter} stuck at {self.counter:g} for {stuck:.1f} s while {gauges}{note}"


@dataclass
class CanaryWatch:
    """When the canary goes out, and what its end means."""

    stall_sec: float
    idle_since: float | None = None  # the gauges have said idle since (monotonic)
    sent_at: float | None = None  # the canary in flight since
    counter_at_send: float | None = None
    scraped: bool = False  # the metrics page answered while it was out

    def observe(self, now: float, busy: bool) -> None:
        """After each metrics page read."""
        if busy:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        if self.sent_at is not None:
            self.scraped = True

    def due(self, now: float) -> bool:
        return self.sent_at is None and self.idle_since is not None and now - self.idle_since >= self.stall_sec

    def sent(self, now: float, counter: float | None) -> None:
        self.sent_at, self.counter_at_send, self.scraped = now, counter, False

    def ended(self, now: float, hung: bool, counter: float | None) -> bool:
        """The canary came back (answered, refused, failed) or timed out after being accepted
        (`hung`): True when that proves the unit hung. The idle clock starts again. A counter
        not in the page (None) judges nothing, as for the rule itself."""
        was_sent = self.sent_at
        self.sent_at, self.idle_since = None, now
        return (hung and was_sent is not None and self.scraped and counter is not None
                and counter == self.counter_at_send)


async def ask(canary: Canary, timeout: float) -> str | None:
    """Send the canary: None when it was answered (any status: the server is alive), refused
    or failed early; the reason when it was accepted and no answer came within `timeout`."""
    connected = False

    def on_connected() -> None:
        nonlocal connected
        connected = True

    try:
        await probes.http_request(canary.url, timeout, method=canary.method, body=canary.body.encode(),
                                  headers=canary.headers, on_connected=on_connected)
    except probes.ProbeTimedOut as exc:
        return str(exc) if connected else None
    except probes.ProbeFailed as exc:
        log.info("progress: canary not answered; nothing judged", url=canary.url, error=str(exc))
    except Exception as exc:  # noqa: BLE001 - the canary's task must end with a verdict, never raise
        log.warning("progress: canary failed in omnid; nothing judged", url=canary.url,
                    error=f"{type(exc).__name__}: {exc}")
    return None


async def scrape(rule: Progress) -> tuple[float | None, dict[str, float | None]]:
    """One read of the metrics page: (counter, busy gauges). ProbeFailed says why not; nothing
    else leaves it, whatever the page holds."""
    timeout = min(rule.interval, SCRAPE_TIMEOUT_MAX_S)
    answer = await probes.http_request(rule.metrics, timeout, read_body=SCRAPE_MAX_BYTES, body_exact=True)
    if not 200 <= answer.status < 300:
        raise probes.ProbeFailed(f"GET {rule.metrics} answered {answer.status}")
    names = (rule.counter, *rule.busy)
    try:
        if len(answer.body) <= PARSE_ON_LOOP_MAX:
            got = _sums(answer.body, names)
        else:
            # One at a time: the loop's shared worker threads are also the GPU reads' and a
            # stop's process walks, which must not queue behind several big pages.
            loop = asyncio.get_running_loop()
            one = _big_parses.setdefault(loop, asyncio.Semaphore(1))
            async with one:
                got = await loop.run_in_executor(None, _sums, answer.body, names)
    except promtext.MalformedExposition as exc:
        raise probes.ProbeFailed(f"GET {rule.metrics}: not Prometheus text: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a gap in the page's reader fails this scrape, not the monitor
        log.warning("progress: a metrics page the reader has no words for; a failed scrape", url=rule.metrics,
                    error=f"{type(exc).__name__}: {exc}")
        raise probes.ProbeFailed(f"GET {rule.metrics}: unreadable page ({type(exc).__name__}: {exc})") from None
    return got[rule.counter], {b: got[b] for b in rule.busy}


def _sums(body: bytes, names: tuple[str, ...]) -> dict[str, float | None]:
    return promtext.sums(body.decode("utf-8", "replace"), names)


async def watch(sup: Centre, rt: UnitRuntime) -> None:
    """The progress monitor of an active unit (a task of the executor's, "progress")."""
    rule = rt.spec.progress
    assert rule is not None
    state = StallRule(rule)
    canary = CanaryWatch(rule.stall_sec) if rule.canary is not None else None
    asking: asyncio.Task[str | None] | None = None
    missing_said = False
    failing: str | None = None
    try:
        while rt.state is UnitState.ACTIVE:
            await asyncio.sleep(rule.interval)
            try:
                counter, busy = await scrape(rule)
            except Exception as exc:  # noqa: BLE001 - ProbeFailed, or any gap: a failed scrape, never a dead monitor
                why = (str(exc) if isinstance(exc, probes.ProbeFailed)
                       else f"GET {rule.metrics}: {type(exc).__name__}: {exc}")
                if failing != why:
                    log.warning("progress: metrics scrape failed", unit=rt.name, error=why, busy=state.busy_now())
                    failing = why
                verdict = state.scrape_failed(time.monotonic(), why)
            else:
                if failing is not None:
                    log.info("progress: metrics readable again", unit=rt.name)
                    failing = None
                if counter is None and not missing_said:
                    log.warning("progress: the counter is not in the metrics page; nothing judged until it is",
                                unit=rt.name, counter=rule.counter, url=rule.metrics)
                    missing_said = True
                verdict = state.observe(time.monotonic(), counter, busy)
                if canary is not None:
                    canary.observe(time.monotonic(), state.busy_now())
            if verdict is None and canary is not None and rule.canary is not None:
                now = time.monotonic()
                if asking is not None and asking.done():
                    unanswered = asking.result()
                    asking = None
                    if canary.ended(now, unanswered is not None, state.counter):
                        verdict = (f"progress: canary {unanswered}, and {rule.counter} stayed at {state.counter:g} "
                                   f"while the metrics answered (their busy gauges said idle: they freeze with "
                                   f"a hung engine)")
                if verdict is None and asking is None and canary.due(now):
                    canary.sent(now, state.counter)
                    asking = asyncio.get_running_loop().create_task(ask(rule.canary, rule.stall_sec))
            if verdict is not None and rt.state is UnitState.ACTIVE and rt.phase is Phase.IDLE:
                log.warning("progress stalled", unit=rt.name, reason=verdict)
                sup.feed(rt, Event.LIVENESS_FAILED, verdict)
                return
    finally:
        if asking is not None and not asking.done():
            asking.cancel()
