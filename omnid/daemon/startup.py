"""The stack's first start, as systemd and `omnid start` see it: STATUS= progress lines,
EXTEND_TIMEOUT_USEC while units are still starting (a slow model load), and READY=1
once the stack has settled (every unit active, or failed and not restarting, or
waiting on one that is)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from omnid.core.lifecycle import UnitState as S

if TYPE_CHECKING:
    from omnid.core.supervisor import Supervisor
    from omnid.api.systemd import ServiceNotifier

log = structlog.get_logger("omnid.daemon.main")


def settled(sup: Supervisor) -> bool:
    for rt in sup.units.values():
        if rt.busy:
            return False
        if rt.state is S.ACTIVE or (rt.state is S.FAILED and not rt.book.restart_pending):
            continue
        if rt.state is S.INACTIVE and sup.schedule.stuck(rt):
            continue
        return False
    return True


def progress(sup: Supervisor) -> str:
    units = sup.units.values()
    active = sum(1 for rt in units if rt.state is S.ACTIVE)
    failed = sorted(rt.name for rt in units if rt.state is S.FAILED)
    starting = sorted(rt.name for rt in units if rt.state is S.STARTING)
    text = f"{active}/{len(sup.units)} units active"
    if starting:
        text += f", starting: {', '.join(starting[:5])}" + (" ..." if len(starting) > 5 else "")
    if failed:
        text += f", failed: {', '.join(failed[:5])}" + (" ..." if len(failed) > 5 else "")
    return text


async def watch(sup: Supervisor, service: ServiceNotifier, done: asyncio.Event, stopping: asyncio.Event) -> None:
    """Until the stack settles (then `done` is set and READY=1 sent) or the daemon stops."""
    last = ""
    while not stopping.is_set():
        if await sup.wait_until(lambda: settled(sup), 1.0):
            break
        text = progress(sup)
        if text != last:
            service.status(f"starting: {text}")
            last = text
        if any(rt.state is S.STARTING for rt in sup.units.values()):
            service.send("EXTEND_TIMEOUT_USEC=3000000")
    if stopping.is_set():
        return
    done.set()
    text = progress(sup)
    service.send("READY=1", f"STATUS=ready: {text}")
    log.info("stack settled", status=text)
