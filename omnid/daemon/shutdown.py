"""The daemon's end: once a stop was asked (SIGTERM/SIGINT, `omnid shutdown`, the spawner's
death, exit_when_failed), drain if asked to, stop the stack in order within its deadline
(past it, or on a second signal, SIGKILL to every unit), close the cluster membership and
the fronts, stop the spawner, remove the state file. `stop_daemon` receives the daemon
(omnid.daemon.parts.DaemonParts) and returns its exit code; what the event loop still holds
after it (a task that will not end, a thread stuck in the kernel) is omnid.base.runloop's.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING

import structlog

from omnid.daemon import clusterwiring
from omnid.daemon import fronts
from omnid.base import linux
from omnid.base.tasks import pending_tasks, suspended_at

if TYPE_CHECKING:
    from omnid.daemon.parts import DaemonParts

log = structlog.get_logger("omnid.daemon.main")

# After a forced stop's SIGKILL to every unit: how long the kernel's proof of each unit's end
# is waited for before the daemon goes on to stop the spawner (whose exit kills what is left).
FORCED_WAIT_S = 5.0
# Leaving the groups across hosts and giving the lease back, at most: past it the daemon exits
# anyway (the lease expires by itself within lease_ttl, and the peers stop their ranks then).
CLUSTER_CLOSE_S = 10.0


async def stop_daemon(daemon: DaemonParts, startup_task: asyncio.Task | None) -> int:
    sup = daemon.sup
    assert sup is not None and daemon.control is not None and daemon.notify is not None
    assert daemon.shutdown_result is not None and daemon.force_stop is not None
    daemon.service.send("STOPPING=1", "STATUS=stopping the stack")
    log.info("stopping the stack")
    if startup_task is not None:
        startup_task.cancel()
        try:
            await startup_task
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - already logged by Daemon._report_task
            pass
    drain_sec = daemon.stack.settings.drain_sec or 0.0
    if drain_sec > 0 and not daemon.force_stop.is_set():  # the preStop pattern: /health says draining first
        sup.shutting_down = True
        sup.draining_until = time.monotonic() + drain_sec
        log.info("draining before the stop", drain_sec=drain_sec)
        try:  # a second signal ends the drain window at once
            await asyncio.wait_for(daemon.force_stop.wait(), drain_sec)
        except asyncio.TimeoutError:
            pass
    t0 = time.monotonic()
    if daemon.cleanup is not None:  # every unit goes: their leftovers in batches, off the loop
        daemon.cleanup.dirs.batched = True
    recs = await _stop_units_bounded(daemon)
    if daemon.cleanup is not None:  # removals of failed units' leftovers still under way
        await daemon.cleanup.settle()
    closing = asyncio.ensure_future(clusterwiring.close_cluster(daemon))
    done, _ = await asyncio.wait({closing}, timeout=CLUSTER_CLOSE_S)  # never waits on a stuck close's cancel
    if not done:
        log.error("leaving the cluster did not end in time: exiting anyway; this host's etcd lease expires by itself",
                  seconds=CLUSTER_CLOSE_S, waiting_in=" > ".join(suspended_at(closing)), tasks=pending_tasks())
        closing.cancel()
    elif closing.exception() is not None:
        log.error("leaving the cluster failed: exiting anyway; this host's etcd lease expires by itself",
                  error=f"{type(closing.exception()).__name__}: {closing.exception()}")
    daemon.shutdown_result.set_result(recs)
    left = [p for p in linux.children_of(daemon.spawner.pid)
            if (st := linux.read_stat(p)) is not None and st.state not in ("Z", "X")]
    if left:
        log.error("processes left under the spawner after stop", pids=left)
    log.info("stack stopped", seconds=round(time.monotonic() - t0, 3), units=len(recs),
             residue=sum(len(r.residue) for r in recs), unkillable=sum(len(r.unkillable) for r in recs))
    if any(r.unkillable for r in recs):
        daemon.exit_code = 1
    await fronts.replies_sent(daemon, 2.0, 0.01)  # the `shutdown` reply goes out before the sockets close
    if daemon.failed_watch is not None:
        daemon.failed_watch.cancel()
    daemon.stop_gpu_watch()
    await fronts.close(daemon)
    daemon.notify.close()
    sup.sockets.close_all()  # every unit is stopped: their sockets (and socket files) go
    sup.fdstore.close_all()  # and what they stored
    await daemon.spawner.shutdown()
    from omnid.forensics import capture  # loaded with the control handlers; not before the first spawn

    capture.close_readers()  # idle /proc reader threads would hold the end (omnid.base.runloop)
    if daemon.cleanup is not None:
        daemon.cleanup.close()
    daemon.state.remove()
    daemon.service.status(f"stopped (exit {daemon.exit_code})")
    daemon.service.close()
    return daemon.exit_code


def stop_deadline(daemon: DaemonParts) -> tuple[float, str]:
    """The stack stop's bound and where it came from: OMNID_STOP_DEADLINE, stop_deadline in
    omnid.toml, else the units' budgets (Supervisor.stop_budget)."""
    assert daemon.sup is not None
    raw = os.environ.get("OMNID_STOP_DEADLINE")
    if raw:
        try:
            value = float(raw)
            if value > 0 and value == value and value != float("inf"):
                return value, "env"
        except ValueError:
            pass
        log.error("OMNID_STOP_DEADLINE ignored: expected a positive number of seconds", value=raw)
    if daemon.sup.stack.settings.stop_deadline:
        return float(daemon.sup.stack.settings.stop_deadline), "omnid.toml"
    return daemon.sup.stop_budget(), "derived"


def _not_stopped(daemon: DaemonParts) -> dict[str, str]:
    assert daemon.sup is not None
    return {n: f"{rt.state.value}/{rt.phase.value}" for n, rt in daemon.sup.units.items()
            if not daemon.sup.schedule.settled_down(rt)}


async def _stop_units_bounded(daemon: DaemonParts) -> list:
    """The stack stop, in order, within its deadline; past it, or on a second SIGTERM/SIGINT,
    SIGKILL to every unit at once (as systemd's TimeoutStopSec and docker stop's second
    signal), then a bounded wait for the kernel to confirm (FORCED_WAIT_S)."""
    assert daemon.sup is not None and daemon.force_stop is not None
    deadline, origin = stop_deadline(daemon)
    log.info("stack stop deadline", deadline_s=round(deadline, 1), deadline_from=origin)
    stop = asyncio.get_running_loop().create_task(daemon.sup.requests.shutdown())
    forced = asyncio.get_running_loop().create_task(daemon.force_stop.wait())
    try:
        await asyncio.wait({stop, forced}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
        if stop.done():
            return stop.result()
        why = "a second signal" if daemon.force_stop.is_set() else f"the stop deadline ({deadline:g} s) passed"
        left = _not_stopped(daemon)
        killed = daemon.sup.kill_all()
        log.error("stack stop forced: SIGKILL to every unit", why=why, killed=killed, not_stopped=left)
        daemon.exit_code = 1
        try:
            return await asyncio.wait_for(asyncio.shield(stop), FORCED_WAIT_S)
        except asyncio.TimeoutError:
            log.error("units not down after SIGKILL; the spawner's exit kills what is left",
                      seconds=FORCED_WAIT_S, not_stopped=_not_stopped(daemon))
            stop.cancel()
            return []
    finally:
        forced.cancel()
