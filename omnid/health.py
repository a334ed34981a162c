"""Read-only health HTTP API (aiohttp) for load balancers and Prometheus
(DESIGN.md "Health HTTP"). Every answer is computed from the supervisor's state
at request time, so a death shows as 503 as soon as the pidfd fired."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import psutil
import structlog
from aiohttp import web

from omnid.supervisor import Supervisor, Unit
from omnid.states import UnitState

log = structlog.get_logger("omnid.health")
S = UnitState


def overall(sup: Supervisor, degraded: dict[str, str]) -> str:
    if sup.shutting_down:
        return "stopping"
    units = sup.units.values()
    if any(u.state is S.FAILED or u.dead for u in units):
        return "failed"  # (u.dead: the main process died; the failure op is about to record it)
    if any(u.state is S.STOPPING or u.goal.value == "inactive" for u in units) or degraded:
        return "degraded"
    if all(u.state is S.ACTIVE and u.ready for u in units):
        return "ok"
    return "starting"


def unit_reason(u: Unit, degraded: dict[str, str]) -> str:
    if u.name in degraded:
        return degraded[u.name]
    if u.dead:
        return "main process exited; failing"
    return u.reason


def group_usage(u: Unit) -> tuple[int, float, int]:
    """(RSS bytes, CPU seconds, processes) over the unit's process group."""
    if u.proc is None:
        return 0, 0.0, 0
    rss, cpu, n = 0, 0.0, 0
    try:
        main = psutil.Process(u.proc.pid)
        procs = [main, *main.children(recursive=True)]
    except psutil.Error:
        return 0, 0.0, 0
    for p in procs:
        try:
            with p.oneshot():
                rss += p.memory_info().rss
                t = p.cpu_times()
                cpu += t.user + t.system
                n += 1
        except psutil.Error:
            continue
    return rss, cpu, n


class HealthServer:
    def __init__(self, sup: Supervisor, listen: str, degraded: Callable[[], dict[str, str]] | None = None,
                 gpu_usage: Callable[[], dict[str, float]] | None = None,
                 notify_counters: Callable[[], dict[str, int]] | None = None) -> None:
        self.sup = sup
        host, _, port = listen.rpartition(":")
        self.host = host.strip("[]") or "127.0.0.1"
        self.port = int(port)
        self.degraded = degraded or (lambda: {})
        self.gpu_usage = gpu_usage or (lambda: {})
        self.notify_counters = notify_counters or (lambda: {})
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/health/live", self.live)
        self.app.router.add_get("/units", self.units)
        self.app.router.add_get("/units/{name}", self.unit)
        self.app.router.add_get("/metrics", self.metrics)
        self.runner: web.AppRunner | None = None

    async def start(self, sock: socket.socket | None = None) -> None:
        """Serve on `sock` (already bound and listening) or bind HOST:PORT now."""
        self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self.runner.setup()
        if sock is not None:
            site: web.BaseSite = web.SockSite(self.runner, sock)
        else:
            site = web.TCPSite(self.runner, self.host, self.port, reuse_address=True)
        await site.start()
        log.info("health API listening", url=f"http://{self.host}:{self.port}/health")

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def health(self, _req: web.Request) -> web.Response:
        degraded = self.degraded()
        status = overall(self.sup, degraded)
        body = {
            "status": status,
            "units": {u.name: {"state": u.state.value, "reason": unit_reason(u, degraded)}
                      for u in self.sup.units.values()},
        }
        return web.json_response(body, status=200 if status == "ok" else 503)

    async def live(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "ts": time.time()})

    async def units(self, _req: web.Request) -> web.Response:
        return web.json_response({"units": self.sup.snapshot()})

    async def unit(self, req: web.Request) -> web.Response:
        name = req.match_info["name"]
        u = self.sup.units.get(name)
        if u is None:
            return web.json_response({"error": {"code": "unknown_unit", "message": f"no unit named {name!r}"}},
                                     status=404)
        return web.json_response(u.snapshot())

    async def metrics(self, _req: web.Request) -> web.Response:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")

        def lbl(**kv: object) -> str:
            inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                             for k, v in kv.items())
            return "{" + inner + "}"

        units = list(self.sup.units.values())
        metric("omnid_unit_state", "gauge", "1 for the state the unit is in")
        for u in units:
            for st in S:
                lines.append(f"omnid_unit_state{lbl(unit=u.name, state=st.value)} {int(u.state is st)}")
        metric("omnid_unit_ready", "gauge", "1 when the unit is active and ready")
        for u in units:
            lines.append(f"omnid_unit_ready{lbl(unit=u.name)} {int(u.ready)}")
        metric("omnid_unit_restarts_total", "counter", "automatic restarts")
        for u in units:
            lines.append(f"omnid_unit_restarts_total{lbl(unit=u.name)} {u.restarts}")
        metric("omnid_unit_failures_total", "counter", "unrequested exits and failed starts")
        for u in units:
            lines.append(f"omnid_unit_failures_total{lbl(unit=u.name)} {u.deaths}")
        metric("omnid_unit_last_exit_code", "gauge", "exit code of the last exit (-1: killed by a signal or none)")
        for u in units:
            code = u.last_exit_code if u.last_exit_code is not None else -1
            lines.append(f"omnid_unit_last_exit_code{lbl(unit=u.name)} {code}")
        metric("omnid_unit_last_exit_signal", "gauge", "signal number of the last exit (0: none)")
        for u in units:
            lines.append(f"omnid_unit_last_exit_signal{lbl(unit=u.name)} {u.last_signal or 0}")
        metric("omnid_death_detection_ms", "gauge", "pidfd wake-up to failed state, last death of the unit")
        for u in units:
            if u.death_detect_ms is not None:
                lines.append(f"omnid_death_detection_ms{lbl(unit=u.name)} {u.death_detect_ms:.3f}")
        metric("omnid_unit_rss_bytes", "gauge", "resident memory of the unit's processes")
        usage = {u.name: group_usage(u) for u in units}
        for name, (rss, _cpu, _n) in usage.items():
            lines.append(f"omnid_unit_rss_bytes{lbl(unit=name)} {rss}")
        metric("omnid_unit_cpu_seconds_total", "counter", "CPU time of the unit's live processes")
        for name, (_rss, cpu, _n) in usage.items():
            lines.append(f"omnid_unit_cpu_seconds_total{lbl(unit=name)} {cpu:.3f}")
        metric("omnid_unit_processes", "gauge", "live processes in the unit's tree")
        for name, (_rss, _cpu, n) in usage.items():
            lines.append(f"omnid_unit_processes{lbl(unit=name)} {n}")
        gpu = self.gpu_usage()
        if gpu:
            metric("omnid_unit_gpu_memory_mib", "gauge", "GPU memory held by the unit's processes (NVML)")
            for name, mib in gpu.items():
                lines.append(f"omnid_unit_gpu_memory_mib{lbl(unit=name)} {mib:.1f}")
        me = psutil.Process()
        metric("omnid_daemon_rss_bytes", "gauge", "resident memory of the daemon")
        lines.append(f"omnid_daemon_rss_bytes {me.memory_info().rss}")
        metric("omnid_daemon_threads", "gauge", "threads of the daemon process")
        lines.append(f"omnid_daemon_threads {me.num_threads()}")
        metric("omnid_invariant_violations_total", "counter", "state/kernel disagreements found after transitions")
        lines.append(f"omnid_invariant_violations_total {len(self.sup.invariant_violations)}")
        notify = self.notify_counters()  # issue #9: dropped notify datagrams, by reason
        if notify:
            metric("omnid_notify_datagrams_total", "counter", "notify datagrams received, accepted or dropped")
            for what, n in notify.items():
                lines.append(f"omnid_notify_datagrams_total{lbl(outcome=what)} {n}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})
