"""Watching a running unit: the sd_notify watchdog, the liveness probe and the
notify messages (DESIGN.md "Readiness and health"). Every monitor is a supervised
task (omnid.tasks): a monitor that dies of a bug fails its unit, it never just stops.
Mixed into `omnid.supervisor.Supervisor`."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from omnid import linux
from omnid.lifecycle import Event
from omnid.probes import ProbeFailed
from omnid.process import DAEMON_TAG, UNIT_TAG
from omnid.states import UnitState
from omnid.tasks import unit_task

if TYPE_CHECKING:
    from omnid.supervisor import Unit

log = structlog.get_logger("omnid.supervisor")
S = UnitState
E = Event


class Monitors:
    def _start_monitors(self, u: Unit) -> None:
        if u.spec.watchdog_sec > 0 and u.spec.ready.kind == "notify":
            u.watchdog_last = time.monotonic()
            self._arm_watchdog(u)
        if u.spec.liveness is not None:
            u.monitor = unit_task(self._liveness(u), unit=u.name, kind="liveness",
                                  on_crash=lambda exc: self._monitor_crashed(u, exc))

    def _stop_monitors(self, u: Unit) -> None:
        if u.watchdog_timer is not None:
            u.watchdog_timer.cancel()
            u.watchdog_timer = None
        if u.monitor is not None and u.monitor is not asyncio.current_task():
            u.monitor.cancel()
        u.monitor = None

    def _arm_watchdog(self, u: Unit) -> None:
        if u.watchdog_timer is not None:
            u.watchdog_timer.cancel()
        loop = asyncio.get_running_loop()
        # call_at runs on the loop's monotonic clock.
        deadline = loop.time() + u.spec.watchdog_sec
        u.watchdog_timer = loop.call_at(deadline, self._watchdog_expired, u)

    def _watchdog_expired(self, u: Unit) -> None:
        u.watchdog_timer = None
        if u.state is S.ACTIVE and u.op is None:
            silent = time.monotonic() - u.watchdog_last
            self._launch(u, "fail", self._fail_alive(u, f"watchdog: no ping for {silent:.1f} s", E.WATCHDOG_EXPIRED))

    async def _liveness(self, u: Unit) -> None:
        probe = u.spec.liveness
        assert probe is not None
        failures = 0
        while u.state is S.ACTIVE:
            await asyncio.sleep(probe.interval)
            try:
                await _probe()(probe.url, probe.timeout)
                failures = 0
                continue
            except ProbeFailed as exc:
                why = str(exc)
            except Exception as exc:  # noqa: BLE001 - any probe error is a failed probe, never a dead monitor
                why = f"GET {probe.url}: {type(exc).__name__}: {exc}"
            failures += 1
            log.warning("liveness probe failed", unit=u.name, error=why, count=failures, of=probe.failures)
            if failures >= probe.failures and u.state is S.ACTIVE and u.op is None:
                u.monitor = None
                self._launch(u, "fail", self._fail_alive(u, f"liveness: {why} ({failures}/{probe.failures})", E.LIVENESS_FAILED))
                return

    def _monitor_crashed(self, u: Unit, exc: BaseException) -> None:
        """A monitor task died of a bug: the unit is no longer watched, so it fails."""
        u.monitor = None
        if u.state is S.ACTIVE and u.op is None:
            self._launch(u, "fail", self._fail_alive(u, f"internal error in liveness monitor: "
                                                         f"{type(exc).__name__}: {exc}", E.INTERNAL_ERROR))

    def on_notify(self, sender_pid: int, fields: dict[str, str]) -> str | None:
        """sd_notify message from sender_pid; returns the unit it was attributed to."""
        st = linux.read_stat(sender_pid)
        u = None
        if st is not None:
            for cand in self.units.values():
                if cand.proc is not None and cand.proc.pgid in (st.pgid, st.sid):
                    u = cand
                    break
        if u is None and st is not None:
            # A unit can say READY=1 before the spawner's reply with its pid has been
            # read: hold the message for a unit of ours whose spawn is in flight.
            tag = linux.read_environ_var(sender_pid, UNIT_TAG)
            pending = self.units.get(tag) if tag else None
            if pending is not None and pending.proc is None and pending.op_kind == "start" \
                    and linux.read_environ_var(sender_pid, DAEMON_TAG) == self.token:
                self._early_notify.setdefault(st.sid, []).append(fields)
                return pending.name
        if u is None:
            log.warning("notify message from a pid in no unit's process group; ignored",
                        pid=sender_pid, fields=sorted(fields))
            return None
        self._apply_notify(u, fields)
        return u.name

    def _apply_notify(self, u: Unit, fields: dict[str, str]) -> None:
        if "MAINPID" in fields and fields["MAINPID"] != str(u.proc.pid if u.proc else ""):
            log.warning("notify MAINPID ignored: omnid tracks the process it spawned", unit=u.name,
                        mainpid=fields["MAINPID"])
        if "STATUS" in fields:
            u.status_text = fields["STATUS"]
        if fields.get("READY") == "1":
            u.ready_event.set()
        if fields.get("STOPPING") == "1":
            u.stopping_notified = True
        if fields.get("WATCHDOG") == "1":
            u.watchdog_last = time.monotonic()
            if u.watchdog_timer is not None:
                self._arm_watchdog(u)
        elif fields.get("WATCHDOG") == "trigger" and u.state is S.ACTIVE and u.op is None:
            self._launch(u, "fail", self._fail_alive(u, "watchdog: unit asked to be killed (WATCHDOG=trigger)", E.WATCHDOG_EXPIRED))


def _probe():
    """omnid.supervisor.http_probe, looked up at call time (tests replace it there)."""
    from omnid import supervisor

    return supervisor.http_probe
