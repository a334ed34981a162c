"""The daemon's side of a stack across hosts (omnid(8), CLUSTER), kept out of the Daemon class:
opening this host's membership (or taking it over after a re-exec), closing it after the
stack's stop, and exit_when_failed. Each function receives the omnid.daemon.Daemon (which
imports this module)."""

from __future__ import annotations

import sys
from typing import Any

import structlog

from omnid.core import groups
from omnid.core.lifecycle import Goal, UnitState

log = structlog.get_logger("omnid.daemon.main")


async def open_cluster(daemon: Any, takeover: dict | None = None) -> bool:
    """[cluster]: this host's membership (lease, watch, heartbeat) and its groups across hosts.
    gRPC and the etcd client are imported here, only for a stack that spans hosts. After a
    re-exec, the same lease, groups and heartbeat socket (omnid.core.crosshost.take_over),
    taken over before the session's loops start."""
    from omnid.cluster.session import ClusterRefused, ClusterSession
    from omnid.model.cluster import SettingsError
    from omnid.core.crosshost import CrossHost, read_handover

    assert daemon.sup is not None and daemon.stack.settings.cluster is not None
    try:
        daemon.cluster = ClusterSession(daemon.stack.settings.cluster)  # reads the TLS files
        crosshost = CrossHost(daemon.sup, daemon.cluster)
        if takeover is not None and takeover.get("cluster") is not None:  # checked by reexecrecord.check_against_stack
            crosshost.take_over(read_handover(takeover["cluster"], daemon.stack, {
                g: daemon.sup.units[names[0]].book.generation for g, names in daemon.stack.groups.items()}))
        await daemon.cluster.open()
    except (ClusterRefused, SettingsError) as exc:
        log.error("cluster membership refused", reason=str(exc))
        print(f"omnid: {exc}", file=sys.stderr)
        if daemon.cluster is not None:
            await daemon.cluster.close()
        daemon.cluster = None
        return False
    daemon.sup.crosshost = crosshost
    return True

async def close_cluster(daemon: Any) -> None:
    """After the stack's stop: every group was left, then the lease is given back."""
    if daemon.sup is not None and daemon.sup.crosshost is not None:
        await daemon.sup.crosshost.close()
    if getattr(daemon, "cluster", None) is not None:
        await daemon.cluster.close()

async def watch_failed_for_good(daemon: Any) -> None:
    """exit_when_failed: once a unit failed for good, stop the stack and exit 1, so that a
    cluster manager (Slurm --kill-on-bad-exit, a LeaderWorkerSet) restarts every host's part."""
    assert daemon.sup is not None and daemon.shutdown_requested is not None
    found: list[tuple[str, str]] = []

    def failed_for_good() -> bool:  # asked at every state change
        for rt in daemon.sup.units.values():
            if rt.goal is not Goal.ACTIVE or rt.busy:
                continue
            if (rt.state is UnitState.FAILED and not rt.book.restart_pending) or (
                    rt.state is UnitState.INACTIVE and groups.down_for_good(rt)):
                found.append((rt.name, rt.reason))
                return True
        return False

    await daemon.sup.wait_until(failed_for_good, None)
    name, why = found[0]
    log.error("a unit failed for good and exit_when_failed is set: stopping the stack, then exit 1",
              unit=name, reason=why)
    daemon.exit_code = 1
    daemon.shutdown_requested.set()

