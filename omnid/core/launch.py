"""A unit's start, from the executor's Spawn action to the event fed back (SPAWNED or
SPAWN_FAILED, with the reason): the GPU check, what an unkillable previous instance left in
the unit's cgroup, the environment, the held sockets and stored fds passed as LISTEN_FDS, the
cleanup's TMPDIR, the spawner's request and its answer, the new process held by its pidfd.

The executor starts it as the unit's "spawn" work, with its `unsent` set (a unit leaves it when
its request is with the spawner client: the daemon's start waits for the first tier's), the
cleanup and the test-only fault hook. A spawn is never cancelled: the child would be lost; its
outcome is always fed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from typing import TYPE_CHECKING

import structlog

from omnid.base import closer
from omnid.core import groups, spawning
from omnid.core.cleanup import CannotPrepare
from omnid.core.lifecycle import Event
from omnid.core.runtime import UnitRuntime
from omnid.process.handle import ProcessHandle
from omnid.process.sockets import BindError
from omnid.process.spawnclient import SpawnError
from omnid.process.termination import terminate

if TYPE_CHECKING:
    from omnid.core.centre import Centre
    from omnid.core.cleanup import UnitCleanup
    from omnid.core.faults import Faults

log = structlog.get_logger("omnid.supervisor")
E = Event

# A spawn request -> the spawner's answer, at most: the spawner's own bound from fork to exec
# (omnid.spawner.SPAWN_EXEC_TIMEOUT_S, 10 s) and a margin. Past it the unit's spawn fails; a late
# answer is a process no unit owns, killed by the spawner (SpawnerClient._kill_unowned).
SPAWN_REPLY_TIMEOUT_S = 15.0


@dataclasses.dataclass(frozen=True)
class Launch:
    sup: Centre
    rt: UnitRuntime
    reason: str
    unsent: set[str]  # the executor's: rt.name leaves it once its request is queued
    cleanup: UnitCleanup | None
    faults: Faults | None


async def launch(ex: Launch) -> None:
    """Start `ex.rt` for `ex.reason`; what came of it is fed to the supervisor."""
    try:
        await _prepared(ex)
    finally:
        ex.unsent.discard(ex.rt.name)


async def _prepared(ex: Launch) -> None:
    sup, rt, spec = ex.sup, ex.rt, ex.rt.spec
    refusal = spawning.gpu_refusal(spec, sup.gpu)
    if refusal is None and spec.gpus and sup.gpu_on():
        # NVML reads run off the loop (a hung driver must not stall it)
        ours = {x.proc.pid for x in sup.units.values() if x.proc is not None}
        refusal = await asyncio.to_thread(spawning.gpu_held_by_leftover, spec, sup.gpu, ours)
    if refusal:
        sup.feed(rt, E.SPAWN_FAILED, refusal)
        return
    residue = sup.cgroups.residue(rt.name) if sup.cgroups else None
    if residue is not None:  # what an unkillable previous instance left in its cgroup
        log.warning("killing residue in a unit's cgroup before its start", unit=rt.name, cgroup=residue.path)
        await terminate(residue, signal.SIGKILL, spec.kill_timeout, 0.0, send_cont=False)
    extra = dict(groups.environment(sup, rt))
    listen: list[int] = []
    names: list[str] = []
    if spec.sockets:
        try:  # bound before the unit's first start, held from then on (omnid.process.sockets)
            listen, names = sup.sockets.fds_for(spec)
        except BindError as exc:
            sup.feed(rt, E.SPAWN_FAILED, str(exc))
            return
    stored: list[int] = []
    if sup.fdstore.count(rt.name):  # a limit lowered (to 0 too) by a reload closes the rest here
        try:  # copies, closed once sent: a stored fd may hang up (and close) meanwhile
            stored, stored_names = sup.fdstore.dup_for(rt.name)
        except OSError as exc:
            sup.feed(rt, E.SPAWN_FAILED, f"cannot copy the unit's stored fds: {exc.strerror}")
            return
        listen, names = [*listen, *stored], [*names, *stored_names]  # after its sockets, as systemd
    if listen:
        extra = {**extra, "LISTEN_FDS": str(len(listen)), "LISTEN_FDNAMES": ":".join(names)}
    try:
        await _with(ex, extra, listen)
    finally:
        for fd in stored:  # the last reference if the store dropped it meanwhile: off the loop
            closer.close(fd)


async def _with(ex: Launch, extra: dict[str, str], listen: list[int]) -> None:
    sup, rt, spec = ex.sup, ex.rt, ex.rt.spec
    try:
        if ex.cleanup is not None:  # the previous instance's leftovers gone; TMPDIR
            extra = {**await ex.cleanup.before_spawn(rt), **extra}
        env = spawning.environ(spec, sup.notify_socket, sup.token, extra)
        prep = spawning.prepare(spec, env=env, cgroups=sup.cgroups)
        if listen:
            prep.request = dataclasses.replace(prep.request, listen_fds=tuple(listen))
    except (spawning.CannotSpawn, CannotPrepare) as exc:
        cgroup_done(sup, rt)
        sup.feed(rt, E.SPAWN_FAILED, str(exc))
        return
    try:
        asked = sup.spawner.ask(prep.request, prep.out_w, prep.err_w)  # queued now, sent soon
        ex.unsent.discard(rt.name)
        sp = await asyncio.wait_for(asked, SPAWN_REPLY_TIMEOUT_S)
    except (SpawnError, asyncio.TimeoutError) as exc:
        prep.close_read_ends()
        cgroup_done(sup, rt)
        rt.spawn_errno = getattr(exc, "errno", None)
        sup.feed(rt, E.SPAWN_FAILED, str(exc) if isinstance(exc, SpawnError) else
                 f"spawn failed: no answer from the spawner within {SPAWN_REPLY_TIMEOUT_S:g} s")
        return
    finally:
        prep.close_write_ends()
    rt.spawn_errno = None
    h = ProcessHandle(unit=rt.name, pid=sp.pid, pidfd=sp.pidfd, pgid=sp.pid, start_time=sp.start_time)
    try:
        rt.output.attach(prep.out_r, prep.err_r)
    finally:
        sup.adopt(rt, h)  # held by its pidfd before anything else can fail: a crash now kills it
    if ex.cleanup is not None:
        ex.cleanup.spawned(rt, sp.pid)
    if ex.faults is not None:
        ex.faults.check(rt.name, "spawn")
    rt.ready_deadline = time.monotonic() + spec.ready_timeout
    log.debug("spawned", unit=rt.name, pid=h.pid, argv=list(spec.exec))
    sup.feed(rt, E.SPAWNED, ex.reason)


def cgroup_done(sup: Centre, rt: UnitRuntime) -> None:
    if sup.cgroups:
        sup.cgroups.release(rt.name)  # rmdir once nothing runs in it
