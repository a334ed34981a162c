"""Watching a unit's process: readiness while `starting`; while `active` the sd_notify
watchdog, the liveness probe (http or exec), the progress rule and the readiness probe that
continues; and the notify messages themselves. A deadline judged on what a unit says over the notify socket
(the watchdog, a `ready = notify` start's ready_timeout) is held back while that socket is
not read (omnid.base.closer.unheard: a stranger's fds fill the closer's queue, and the unit's
messages wait in the kernel behind them) and for a grace after: a silence a stranger made is
not the unit's. Monitors only report facts -- READY,
NOT_READY, WATCHDOG_EXPIRED, LIVENESS_FAILED -- by feeding them to the supervisor; the
lifecycle table decides what follows. The readiness probe that continues changes no state:
a unit that says it is not ready is *degraded* (`not_ready`, read by /health and status
like the GPU watch's `degraded`), never stopped. Every monitor is a task of the
executor's (a crash becomes the unit's INTERNAL_ERROR), one probe at a time each."""

from __future__ import annotations

import asyncio
import random
import time

import structlog

from omnid.base import closer, linux
from omnid.core import probes
from omnid.core import execprobe, progress
from omnid.core.lifecycle import Event, Phase, UnitState
from omnid.core.runtime import UnitRuntime
from omnid.process.tags import tags_of
from omnid.model.units import ReadyKind
from omnid.core.centre import Centre


log = structlog.get_logger("omnid.supervisor")
S, E = UnitState, Event
EARLY_NOTIFY_MAX = 4096  # sessions whose notify came before their spawn reply, at most
READY_PROBE_TIMEOUT_S = 2.0  # one readiness probe, at start and while active
MAX_ANCESTRY = 64  # parent links walked to find the spawner above a notify sender
# After the notify socket is read again, a start's READY=1 that waited in the kernel behind a
# stranger's datagrams gets this long to be read before ready_timeout is judged. The watchdog's
# grace is the unit's own watchdog_sec: one whole period to ping once it can be heard.
READY_GRACE_S = 5.0


class Monitors:
    def __init__(self, sup: Centre) -> None:
        self.sup = sup
        self._watchdogs: dict[str, asyncio.TimerHandle] = {}
        # session id -> notify messages that arrived before the spawner's reply with its pid
        self.early: dict[int, list[dict[str, str]]] = {}
        # notify sender (its pidfd's inode, or its pid) -> (unit, valid until)
        self._senders: dict[object, tuple[str | None, float]] = {}
        # unit -> why its readiness probe fails while it is active (/health: degraded)
        self.not_ready: dict[str, str] = {}
        self._reason_before: dict[str, str] = {}  # unit -> its reason before it was not ready
        # deadlines held back while the notify socket was not read (once per unit and pause)
        self.held_back = {"watchdog": 0, "ready_timeout": 0}
        self._held_in: dict[tuple[str, str], int] = {}  # (unit, deadline) -> the pause it was held in

    # ------------------------------------------------------------ readiness
    async def readiness(self, rt: UnitRuntime) -> None:
        """Until ready (feeds READY) or the check itself fails (feeds NOT_READY); the
        ready_timeout timer bounds it."""
        ready = rt.spec.ready
        if ready.kind is ReadyKind.STARTED:
            self._ready(rt)
            return
        if ready.kind is ReadyKind.NOTIFY:
            if rt.notified_ready:
                self._ready(rt)
            return  # READY=1 feeds it (on_notify)
        delay, last = 0.02, ""
        while True:
            try:
                if ready.kind is ReadyKind.HTTP:
                    await probes.http_probe(ready.url, timeout=READY_PROBE_TIMEOUT_S)
                else:
                    await probes.tcp_probe(ready.host, ready.port, timeout=READY_PROBE_TIMEOUT_S)
                break
            except probes.ProbeFailed as exc:
                if str(exc) != last:
                    log.debug("not ready yet", unit=rt.name, probe=str(exc))
                    last = str(exc)
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.25)
        self._ready(rt)

    def _ready(self, rt: UnitRuntime) -> None:
        if rt.state is S.STARTING and rt.phase is Phase.IDLE:
            self.sup.feed(rt, E.READY, "started" if rt.spec.ready.kind is ReadyKind.STARTED else "ready")

    # ------------------------------------------------------------ while active
    # The probe tasks of an active unit (the executor keeps them while the unit is active).
    PROBE_TASKS = ("liveness", "progress", "ready-probe")

    def start(self, rt: UnitRuntime) -> None:
        if rt.spec.watchdog_sec > 0 and rt.spec.ready.kind is ReadyKind.NOTIFY:
            rt.watchdog_last = time.monotonic()
            self._arm_watchdog(rt)
        self._start_probes(rt)

    def resume(self, rt: UnitRuntime) -> None:
        """An active unit taken over across the daemon's re-exec: the watchdog keeps counting
        from the last ping it had, the probes start again (the readiness probe at once: what
        it said before the re-exec is not carried over)."""
        if rt.spec.watchdog_sec > 0 and rt.spec.ready.kind is ReadyKind.NOTIFY:
            left = max(0.0, rt.watchdog_last + rt.spec.watchdog_sec - time.monotonic())
            self._watchdogs[rt.name] = asyncio.get_running_loop().call_later(left, self._expired, rt)
        if not rt.ready and rt.reason.startswith("not ready: "):
            # The previous program's view (the record keeps ready and reason): it holds until
            # the first probe, at once, says otherwise.
            self.not_ready[rt.name] = rt.reason
            self._reason_before[rt.name] = "ready"
        self._start_probes(rt, ready_first=0.0)

    def _start_probes(self, rt: UnitRuntime, ready_first: float | None = None) -> None:
        spec, ex = rt.spec, self.sup.executor
        if spec.liveness is not None:
            ex.run_for(rt, "liveness", self._liveness(rt))
        if spec.progress is not None:
            ex.run_for(rt, "progress", progress.watch(self.sup, rt))
        if spec.ready_interval > 0 and spec.ready.kind in (ReadyKind.HTTP, ReadyKind.TCP):
            ex.run_for(rt, "ready-probe", self._ready_probe(rt, ready_first))
        else:
            self._ready_again(rt)  # no probe to say it any more (a reload turned it off)

    def _stop_probes(self, rt: UnitRuntime) -> None:
        tasks = self.sup.executor.of(rt).tasks
        for kind in self.PROBE_TASKS:
            task = tasks.pop(kind, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    def stop(self, rt: UnitRuntime) -> None:
        t = self._watchdogs.pop(rt.name, None)
        if t is not None:
            t.cancel()
        self._stop_probes(rt)
        self._ready_again(rt)

    def restart(self, rt: UnitRuntime, keep_watchdog_off: bool = False) -> None:
        """New monitor settings for an active unit (reload): the watchdog counts from now; a
        unit not ready stays so until the new readiness probe, at once, says otherwise."""
        t = self._watchdogs.pop(rt.name, None)
        if t is not None:
            t.cancel()
        self._stop_probes(rt)
        if not keep_watchdog_off and rt.spec.watchdog_sec > 0 and rt.spec.ready.kind is ReadyKind.NOTIFY:
            rt.watchdog_last = time.monotonic()
            self._arm_watchdog(rt)
        self._start_probes(rt, ready_first=0.0)

    # ------------------------------------------------------------ readiness that continues
    async def _ready_probe(self, rt: UnitRuntime, first: float | None = None) -> None:
        """Kubernetes' readiness probe: while active, probe `ready` every ready_interval
        (jittered by up to a tenth, so units started together do not probe together), each
        probe bounded by READY_PROBE_TIMEOUT_S and awaited before the next is due."""
        ready, every = rt.spec.ready, rt.spec.ready_interval
        delay = first
        while rt.state is S.ACTIVE:
            await asyncio.sleep(every + random.uniform(0.0, every / 10) if delay is None else delay)
            delay = None
            try:
                if ready.kind is ReadyKind.HTTP:
                    await probes.http_probe(ready.url, timeout=READY_PROBE_TIMEOUT_S)
                else:
                    await probes.tcp_probe(ready.host, ready.port, timeout=READY_PROBE_TIMEOUT_S)
            except probes.ProbeFailed as exc:
                self._not_ready(rt, str(exc))
            except Exception as exc:  # noqa: BLE001 - any probe error says "not ready", never ends the probe
                self._not_ready(rt, f"{type(exc).__name__}: {exc}")
            else:
                self._ready_again(rt)

    def _not_ready(self, rt: UnitRuntime, why: str) -> None:
        if rt.state is not S.ACTIVE:
            return
        text = f"not ready: {why}"
        if self.not_ready.get(rt.name) == text:
            return
        if rt.name not in self.not_ready:
            self._reason_before[rt.name] = rt.reason
            log.warning("unit not ready; the stack is degraded", unit=rt.name, reason=why)
        self.not_ready[rt.name] = text
        rt.ready = False
        rt.reason = text
        self.sup.notify_changed()

    def _ready_again(self, rt: UnitRuntime) -> None:
        if self.not_ready.pop(rt.name, None) is None:
            return
        before = self._reason_before.pop(rt.name, "ready")
        if rt.state is S.ACTIVE:
            log.info("unit ready again", unit=rt.name)
            rt.ready = True
            rt.reason = before
        self.sup.notify_changed()

    def _arm_watchdog(self, rt: UnitRuntime) -> None:
        old = self._watchdogs.pop(rt.name, None)
        if old is not None:
            old.cancel()
        self._watchdogs[rt.name] = asyncio.get_running_loop().call_later(rt.spec.watchdog_sec, self._expired, rt)

    def _expired(self, rt: UnitRuntime) -> None:
        self._watchdogs.pop(rt.name, None)
        if rt.state is S.ACTIVE and rt.phase is Phase.IDLE:
            wait = self._unheard(rt, "watchdog", rt.spec.watchdog_sec)
            if wait is not None:
                self._watchdogs[rt.name] = asyncio.get_running_loop().call_later(wait, self._expired, rt)
                return
            silent = time.monotonic() - rt.watchdog_last
            self.sup.feed(rt, E.WATCHDOG_EXPIRED, f"watchdog: no ping for {silent:.1f} s")

    def ready_held(self, rt: UnitRuntime) -> float | None:
        """ready_timeout is due: None to judge it now, or the seconds to hold it back. Only a
        `ready = notify` start waits on the notify socket; any other readiness is judged."""
        if rt.state is not S.STARTING or rt.spec.ready.kind is not ReadyKind.NOTIFY:
            return None
        return self._unheard(rt, "ready_timeout", READY_GRACE_S)

    def _unheard(self, rt: UnitRuntime, deadline: str, grace: float) -> float | None:
        """Seconds to hold back `deadline` of rt because its notify messages could not be read
        (the socket not read, or read again less than `grace` ago), or None: judge it. Not
        bounded by a count: while the socket is not read, a missing ping proves nothing, and
        judging anyway would let a stranger kill any unit by keeping it unread. A hang is still
        judged by the liveness and progress probes (they do not use the socket), and by this
        deadline `grace` after the socket is read again."""
        wait = closer.unheard.hold(time.monotonic(), grace)
        if wait is None:
            return None
        pause = closer.unheard.pauses
        if self._held_in.get((rt.name, deadline)) != pause:
            if len(self._held_in) > 4 * len(self.sup.units) + 64:
                self._held_in.clear()
            self._held_in[(rt.name, deadline)] = pause
            self.held_back[deadline] += 1
            since = closer.unheard.since
            log.warning(f"{deadline} held back: the notify socket is not read (fds from outside wait to be "
                        "closed), so the unit's messages wait in the kernel; judged once it is read again",
                        unit=rt.name, grace_s=grace,
                        unread_s=round(time.monotonic() - since, 1) if since is not None else 0.0,
                        read_again_s_ago=None if since is not None else round(grace - wait, 1))
        return wait

    async def _liveness(self, rt: UnitRuntime) -> None:
        """One probe at a time: the next is due `interval` seconds after the last one ended."""
        probe = rt.spec.liveness
        assert probe is not None
        failures = 0
        while rt.state is S.ACTIVE:
            await asyncio.sleep(probe.interval)
            try:
                if probe.exec:
                    await execprobe.run(self.sup, rt, probe.exec, probe.timeout)
                else:
                    await probes.http_check(probe.url, probe.timeout, method=probe.method, body=probe.body,
                                            headers=probe.headers, accepts=probe.accepts, expect=probe.expect)
                failures = 0
                continue
            except probes.ProbeFailed as exc:
                why = str(exc)
            except Exception as exc:  # noqa: BLE001 - any probe error is a failed probe, never a dead monitor
                what = f"exec {probe.exec[0]}" if probe.exec else f"{probe.method} {probe.url}"
                why = f"{what}: {type(exc).__name__}: {exc}"
            failures += 1
            log.warning("liveness probe failed", unit=rt.name, error=why, count=failures, of=probe.failures)
            if failures >= probe.failures and rt.state is S.ACTIVE and rt.phase is Phase.IDLE:
                self.sup.feed(rt, E.LIVENESS_FAILED, f"liveness: {why} ({failures}/{probe.failures})")
                return

    # ------------------------------------------------------------ sd_notify
    def sender_unit(self, pid: int, pidfd: int | None = None) -> str | None:
        """The unit whose own process sent a notify datagram, or None: anyone else's message is
        dropped by the notify socket. `pidfd` is the kernel's (SCM_PIDFD) for the sender: the
        unit's main process is recognised by it even once reaped, and any other sender is
        proven by /proc reads that are about it only if its pidfd still names that pid after
        them (a pid or a process group number can be recycled; the process behind a pidfd
        cannot). Without one (a kernel before 6.5), by the pid the kernel gave."""
        now = time.monotonic()
        key = ("ino", linux.pidfd_inode(pidfd)) if pidfd is not None and linux.pidfd_inodes_unique() else pid
        hit = self._senders.get(key)
        if hit is not None and hit[1] > now:
            return hit[0]  # a flood costs one /proc read per sender per second, not per datagram
        if pidfd is None:
            unit = self._attribute(pid)
        else:
            unit = self._main_of(pidfd)
            if unit is None and (pid := linux.pidfd_pid(pidfd) or 0) > 0:
                unit = self._attribute(pid)
                if unit is not None and linux.pidfd_pid(pidfd) != pid:
                    unit = None  # reaped during the reads: they may be about whoever has the pid now
        if len(self._senders) > 4096:
            self._senders.clear()
        self._senders[key] = (unit, now + 1.0)
        return unit

    def _main_of(self, pidfd: int) -> str | None:
        """The unit whose main process the pidfd refers to (the kernel says, by pidfs inode)."""
        for rt in self.sup.units.values():
            if rt.proc is not None and rt.proc.pidfd >= 0 and linux.same_process(pidfd, rt.proc.pidfd):
                return rt.name
        return None

    def _attribute(self, pid: int) -> str | None:
        st = linux.read_stat(pid)
        if st is None:
            return None
        pending = False
        owner, owner_start = None, -1
        for rt in self.sup.units.values():
            if rt.proc is not None:
                # A group's number is recycled once the unit's processes are gone (its death's
                # cleanup can take 20 s), by a stranger's or the next unit's main process: a
                # process of an instance started no earlier than it (of two, the later one's)
                # and descends from our spawner.
                if rt.proc.pgid in (st.pgid, st.sid) and owner_start < rt.proc.start_time <= st.start_time:
                    owner, owner_start = rt, rt.proc.start_time
            elif rt.phase is Phase.SPAWNING:
                pending = True
        if owner is not None:
            return owner.name if self._descends_from_spawner(pid) else None
        if pending:
            # READY=1 can come before the spawner's reply: the environment proves it ours.
            # Parentage first, and the environment read off the loop, bounded (omnid.process.tags):
            # reading it takes the process's mm lock, which its owner can keep (a page fault on
            # its own FUSE file), so only a descendant of our spawner is read, and one not read
            # in time is not attributed.
            if not self._descends_from_spawner(pid):
                return None
            tag = self._tag_of_spawn_in_flight(pid, st.start_time)
            if tag is not None:
                return tag
        return None

    def _tag_of_spawn_in_flight(self, pid: int, start_time: int) -> str | None:
        """The unit named by pid's tags when they name a unit of ours and this daemon's token."""
        t = tags_of(pid, start_time)
        if t is not None and t.unit in self.sup.units and t.daemon == self.sup.token:
            return t.unit
        return None

    def _descends_from_spawner(self, pid: int) -> bool:
        """Is `pid` our spawner's child or a descendant of one? The token in a process's
        environment is readable by the user a unit runs as, who could copy it into a process
        of her own; parentage she cannot forge (an orphan is re-parented to the spawner, the
        subreaper: still ours)."""
        spawner = getattr(self.sup.spawner, "pid", 0)
        for _ in range(MAX_ANCESTRY):
            st = linux.read_stat(pid)
            if st is None or st.ppid <= 1:
                return False
            if st.ppid == spawner:
                return True
            pid = st.ppid
        return False

    def on_notify(self, sender_pid: int, fields: dict[str, str]) -> str | None:
        """An sd_notify message from sender_pid; returns the unit it was attributed to."""
        st = linux.read_stat(sender_pid)
        if st is None:
            return None
        for rt in self.sup.units.values():
            if rt.proc is not None and rt.proc.pgid in (st.pgid, st.sid):
                self.apply(rt, fields)
                return rt.name
        # A unit can say READY=1 before the spawner's reply with its pid has been read:
        # hold the message for a unit of ours whose spawn is in flight. Parentage first (no
        # lock of the sender's), then its tags, off the loop and bounded.
        tag = self._tag_of_spawn_in_flight(sender_pid, st.start_time) \
            if self._descends_from_spawner(sender_pid) else None
        pending = self.sup.units.get(tag) if tag else None
        if pending is not None and pending.proc is None and pending.phase is Phase.SPAWNING:
            if len(self.early) >= EARLY_NOTIFY_MAX:
                self.early.pop(next(iter(self.early)))
            self.early.setdefault(st.sid, []).append(fields)
            return pending.name
        log.warning("notify message from a pid in no unit's process group; ignored",
                    pid=sender_pid, fields=sorted(fields))
        return None

    def apply(self, rt: UnitRuntime, fields: dict[str, str]) -> None:
        if "MAINPID" in fields and fields["MAINPID"] != str(rt.proc.pid if rt.proc else ""):
            log.warning("notify MAINPID ignored: omnid tracks the process it spawned", unit=rt.name,
                        mainpid=fields["MAINPID"])
        if "STATUS" in fields:
            rt.status_text = fields["STATUS"]
            if (drains := self.sup.executor.drains) is not None:  # the supervisor always makes one
                drains.notified(rt, fields["STATUS"])
        if fields.get("STOPPING") == "1":
            rt.stopping_notified = True
        if fields.get("READY") == "1":
            rt.notified_ready = True
            if rt.spec.ready.kind is ReadyKind.NOTIFY and rt.proc is not None:
                self._ready(rt)
        if fields.get("WATCHDOG") == "1":
            rt.watchdog_last = time.monotonic()
            if rt.name in self._watchdogs:
                self._arm_watchdog(rt)
        elif fields.get("WATCHDOG") == "trigger" and rt.state is S.ACTIVE and rt.phase is Phase.IDLE:
            self.sup.feed(rt, E.WATCHDOG_EXPIRED, "watchdog: unit asked to be killed (WATCHDOG=trigger)")
