"""Across the daemon's re-exec (omnid.daemon.handover), the supervisor's part: every unit's runtime
record, restart book and recent output written out by the old program (`handover`), taken
over by the new one (`take_over`: same processes, their pidfds and pipes inherited), and
what the records imply re-armed (`resume`)."""

from __future__ import annotations

import asyncio
import os
import time

from omnid.core.centre import Centre
from omnid.core.lifecycle import ArmTimer, Ctx, UnitState, WatchReady
from omnid.core.runtime import RestartBook

S = UnitState


def handover(sup: Centre) -> dict:
    """Every unit's runtime record, restart book and recent output (omnid.daemon.handover)."""
    books: dict[str, dict] = {}
    units: dict[str, dict] = {}
    for name in sup.order:
        rt = sup.units[name]
        key = f"group:{rt.spec.worker_group}" if rt.spec.worker_group else f"unit:{name}"
        books[key] = rt.book.to_json()
        units[name] = {**rt.to_json(), "book": key, "output": rt.output.handover()}
    return {"units": units, "books": books, "started_at": sup.started_at,
            "invariant_violations": list(sup.invariant_violations), "sockets": sup.sockets.handover(),
            "fdstore": sup.fdstore.to_json()}


def take_over(sup: Centre, d: dict) -> None:
    """Continue with the records a previous program of this daemon handed over: same
    processes (their pidfds and pipes inherited), same counters, same restart books.
    KeyError/ValueError/TypeError on anything malformed (the caller falls back)."""
    books = {key: RestartBook.from_json(b) for key, b in d["books"].items()}
    sup.started_at = float(d["started_at"])
    sup.invariant_violations = [str(x) for x in d["invariant_violations"]]
    for name, rec in d["units"].items():
        rt = sup.units.get(name)
        if rt is None:
            raise ValueError(f"unit {name} was handed over but is not in the stack")
        rt.book = books[rec["book"]]
        rt.load_json(rec)
        rt.output.take_over(rec["output"])
        h = rt.proc
        if h is not None:
            rt.proc = None
            os.set_inheritable(h.pidfd, False)
            if h.exit_status is not None:
                h.reaped.set()
            sup.adopt(rt, h)
    # The units' listening sockets, still open (a program before them hands over none).
    sup.sockets.take_over(d.get("sockets") or {}, {n: rt.spec for n, rt in sup.units.items()})
    sup.fdstore.take_over(d.get("fdstore") or {}, sup.units)  # the units' fd stores (omnid.process.fdstore)
    for rt in sup.units.values():  # a worker group's members share one book again
        if rt.spec.worker_group:
            rt.book = books[f"group:{rt.spec.worker_group}"]


def resume(sup: Centre) -> None:
    """Re-arm what the records imply: readiness of starting units (same deadline), the
    monitors of active ones (the watchdog counts from its last ping), restart timers."""
    loop = asyncio.get_running_loop()
    now = time.monotonic()
    for rt in sup.units.values():
        if rt.state is S.STARTING:
            sup.executor.run(rt, (ArmTimer("ready_timeout"), WatchReady()), Ctx(rt.state))
        elif rt.state is S.ACTIVE:
            sup.monitors.resume(rt)
        elif rt.state is S.FAILED and rt.book.restart_pending:
            loop.call_later(max(0.0, rt.book.restart_at - now), sup.kick)
    sup.kick()

