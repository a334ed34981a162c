"""Read-only health HTTP API (aiohttp) for load balancers and Prometheus
(omnid-control(7), HEALTH HTTP). Every answer is computed from the supervisor's state
at request time, so a death shows as 503 as soon as the pidfd fired."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import time
from collections.abc import Callable

import structlog
from aiohttp import web

from omnid.base import closer, promtext
from omnid.process.output import add_counters
from omnid.process.handle import tree_usage
from omnid.process.cgroup import backend as cgroup_backend
from omnid.api.verdict import HEALTH_VERDICTS, gpu_view, overall, unit_reason
from omnid.core.lifecycle import UnitState
from omnid.core.runtime import UnitRuntime as Unit
from omnid.core.supervisor import Supervisor

log = structlog.get_logger("omnid.api.health")
S = UnitState


USAGE_INTERVAL_S = 1.0  # /metrics' process figures are at most this old (plus one walk)
USAGE_WAIT_S = 2.0  # a scrape waits this long for a walk under way, then serves the last figures


def _walk(pids: dict[str, int | None]) -> dict[str, tuple[int, float, int]]:
    out = {}
    for name, pid in pids.items():
        use = tree_usage(pid)
        out[name] = (use.rss, use.cpu_s, use.processes) if use else (0, 0.0, 0)
    return out


class UsageCache:
    """The units' process figures for /metrics, walked in a thread (never on the loop that
    sees deaths) at most once per USAGE_INTERVAL_S, one walk at a time whatever the number of
    scrapers: a scrape flood costs the loop the rendering of a page, nothing more."""

    def __init__(self) -> None:
        self.figures: dict[str, tuple[int, float, int]] = {}
        self.at = -USAGE_INTERVAL_S
        self.walks = 0
        self._walk: asyncio.Future | None = None

    async def get(self, units: list[Unit]) -> dict[str, tuple[int, float, int]]:
        if self._walk is None and time.monotonic() - self.at >= USAGE_INTERVAL_S:
            pids = {u.name: u.proc.pid if u.proc else None for u in units}
            self._walk = asyncio.ensure_future(asyncio.to_thread(_walk, pids))
            self.walks += 1
        walk = self._walk
        if walk is not None:
            await asyncio.wait([walk], timeout=USAGE_WAIT_S)
            if walk.done() and walk is self._walk:
                self._walk = None
                self.at = time.monotonic()
                if walk.exception() is not None:
                    log.error("process figures not read", error=repr(walk.exception()))
                else:
                    self.figures = walk.result()
        return {u.name: self.figures.get(u.name, (0, 0.0, 0)) for u in units}


MAX_CONNECTIONS = 256  # open health connections; more are closed at accept (man omnid(8) SECURITY)
FIRST_BYTE_TIMEOUT_S = 5.0  # a connection that sends nothing is closed after this
KEEPALIVE_TIMEOUT_S = 5.0  # an idle keep-alive connection is closed after this
SHUTDOWN_TIMEOUT_S = 2.0  # at the daemon's end, requests under way get this long (aiohttp's default: 60 s)


class _ConnectionGuard:
    """Counts health connections; the protocol wrapper below enforces the cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.active = 0
        self.refused = 0
        self.idle_closed = 0
        self.evicted = 0
        # Connections that have not sent a byte yet, oldest first: at the cap, the oldest
        # of these makes room for a new one, so idle connections held by a stranger cannot
        # lock out a load balancer's probe (which sends its request at once).
        self.silent: dict[int, _GuardedProtocol] = {}


class _GuardedProtocol(asyncio.Protocol):
    """Wraps aiohttp's per-connection protocol: refuses past the cap, closes silent ones.
    An fd held by a stranger must never be one libzmq or a spawn needed."""

    def __init__(self, guard: _ConnectionGuard, make: Callable[[], asyncio.Protocol]) -> None:
        self.guard, self.make = guard, make
        self.inner: asyncio.Protocol | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.guard.active >= self.guard.cap:
            if not self.guard.silent:
                self.guard.refused += 1
                transport.abort()  # type: ignore[attr-defined]
                return
            oldest = next(iter(self.guard.silent.values()))
            self.guard.evicted += 1
            oldest._close_silent()
        self.guard.active += 1
        self.guard.silent[id(self)] = self
        self.transport = transport
        self.inner = self.make()
        self.timer = asyncio.get_running_loop().call_later(FIRST_BYTE_TIMEOUT_S, self._silent)
        self.inner.connection_made(transport)

    def _silent(self) -> None:
        self.timer = None
        if self.transport is not None:
            self.guard.idle_closed += 1
            self._close_silent()

    def _close_silent(self) -> None:
        """Abort now and count the slot free at once (connection_lost comes a turn later)."""
        self.guard.silent.pop(id(self), None)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        transport, inner = self.transport, self.inner
        self.transport, self.inner = None, None
        if inner is not None:
            self.guard.active -= 1
            inner.connection_lost(None)
        if transport is not None:
            transport.abort()  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.guard.silent.pop(id(self), None)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.silent.pop(id(self), None)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.inner is not None:
            self.guard.active -= 1
            self.transport = None
            inner, self.inner = self.inner, None
            inner.connection_lost(exc)


class _CappedSockSite(web.SockSite):
    def __init__(self, runner: web.AppRunner, sock: socket.socket, guard: _ConnectionGuard) -> None:
        super().__init__(runner, sock, backlog=128)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _GuardedProtocol(self._guard, server), sock=self._sock, backlog=self._backlog)


class HealthServer:
    def __init__(self, sup: Supervisor, listen: str, degraded: Callable[[], dict[str, str]] | None = None,
                 gpu_usage: Callable[[], dict[str, float]] | None = None,
                 notify_counters: Callable[[], dict[str, int]] | None = None) -> None:
        self.sup = sup
        self.site: _CappedSockSite | None = None
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
        self.connections = _ConnectionGuard(MAX_CONNECTIONS)
        self.usage = UsageCache()

    async def start(self, sock: socket.socket | None = None) -> None:
        """Serve on `sock` (already bound and listening) or bind HOST:PORT now."""
        self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                    keepalive_timeout=KEEPALIVE_TIMEOUT_S, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self.runner.setup()
        if sock is None:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
            sock.setblocking(False)
        self.site = _CappedSockSite(self.runner, sock, self.connections)
        await self.site.start()
        log.info("health API listening", url=f"http://{self.host}:{self.port}/health")

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def quiesce(self, timeout: float) -> int:
        """Before the daemon re-executes: stop accepting (new connections wait in the listening
        socket's backlog, which outlives this program through the dup the daemon keeps) and
        serve the connections already accepted, until none is open or `timeout`. Returns how
        many were still open (idle keep-alive ones: their clients reconnect)."""
        server = getattr(self.site, "_server", None)
        loop = asyncio.get_running_loop()
        if server is not None:
            # Stop reading the listening socket, but do not close the server: a connection
            # accepted in the same turn is still being set up, and asyncio refuses to attach it
            # to a closed server (its socket would be left open, unanswered, then reset at the
            # exec). The program is replaced anyway; the listening socket lives on in its dup.
            for sock in server.sockets:
                loop.remove_reader(sock.fileno())
        deadline = loop.time() + timeout
        # Connections accepted in the same turn as the close are set up by tasks that run in
        # the next turns: let them run before counting what is open.
        await asyncio.sleep(0.02)
        while self.connections.active and loop.time() < deadline:
            await asyncio.sleep(0.005)
        return self.connections.active

    async def health(self, _req: web.Request) -> web.Response:
        degraded = self.degraded()
        gpus = gpu_view(self.sup)
        status = overall(self.sup, degraded, gpus)
        body = {
            "status": status,
            "units": {u.name: {"state": u.state.value, "reason": unit_reason(u, degraded)}
                      for u in self.sup.units.values()},
            **cgroup_backend(self.sup.cgroups),  # cgroup hook
        }
        if gpus:
            body["gpus"] = gpus  # each GPU with a condition, its status, reason and units
        if getattr(getattr(self.sup, "gpu", None), "kind", None) == "fake":
            body["gpu_backend"] = "fake"  # the developer option (omnid.gpu.fake): never unnoticed
        return web.json_response(body, status=200 if status == "ok" else 503)

    async def live(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "ts": time.time()})

    async def units(self, _req: web.Request) -> web.Response:
        return web.json_response({"units": add_counters(self.sup.snapshot(), self.sup.units),
                                  **cgroup_backend(self.sup.cgroups)})

    async def unit(self, req: web.Request) -> web.Response:
        name = req.match_info["name"]
        u = self.sup.units.get(name)
        if u is None:
            return web.json_response({"error": {"code": "unknown_unit", "message": f"no unit named {name!r}"}},
                                     status=404)
        return web.json_response(add_counters([u.snapshot()], self.sup.units)[0])

    async def metrics(self, _req: web.Request) -> web.Response:
        page = promtext.Page()  # the one writer of the format: families, escaping, values
        units = list(self.sup.units.values())
        f = page.gauge("omnid_unit_state", "1 for the state the unit is in")
        for u in units:
            for st in S:
                f.add(u.state is st, unit=u.name, state=st.value)
        f = page.gauge("omnid_unit_ready", "1 when the unit is active and ready")
        for u in units:
            f.add(int(u.ready), unit=u.name)
        f = page.counter("omnid_unit_restarts_total", "automatic restarts")
        for u in units:
            f.add(u.restarts, unit=u.name)
        f = page.counter("omnid_unit_failures_total", "unrequested exits and failed starts")
        for u in units:
            f.add(u.deaths, unit=u.name)
        f = page.gauge("omnid_unit_last_exit_code", "exit code of the last exit (-1: killed by a signal or none)")
        for u in units:
            f.add(u.last_exit_code if u.last_exit_code is not None else -1, unit=u.name)
        f = page.gauge("omnid_unit_last_exit_signal", "signal number of the last exit (0: none)")
        for u in units:
            f.add(u.last_signal or 0, unit=u.name)
        # The stack's verdict, what GET /health says: one series per verdict, 1 for the current one.
        f = page.gauge("omnid_stack_health", "1 for the verdict GET /health gives now")
        verdict = overall(self.sup, self.degraded(), gpu_view(self.sup))
        for v in HEALTH_VERDICTS:
            f.add(v == verdict, status=v)
        f = page.gauge("omnid_unit_gpu_release_seconds",
                       "after the unit's last stop or failure: until none of its pids held GPU memory")
        for u in units:
            if u.gpu_release_ms is not None:
                f.add(round(u.gpu_release_ms / 1000, 6), unit=u.name)
        f = page.gauge("omnid_unit_gpu_held", "1 when the unit's pids still held GPU memory as the release wait ended")
        for u in units:
            f.add(bool(u.gpu_held), unit=u.name)
        f = page.gauge("omnid_unit_residue_processes", "leftovers (orphans) killed after the unit's last stop")
        for u in units:
            rec = u.last_stop
            f.add(len(rec.residue) if rec else 0, unit=u.name)
        f = page.gauge("omnid_unit_unkillable_processes", "processes that survived SIGKILL at the unit's last stop")
        for u in units:
            rec = u.last_stop
            f.add(len(rec.unkillable) if rec else 0, unit=u.name)
        dm = getattr(self, "daemon_metrics", None)
        if dm is not None:
            dm.death_detection.write(page, "omnid_death_detection_seconds", "pidfd wake-up to failed state, per death")
        f = page.counter("omnid_unit_log_lines_total", "output lines read from the unit")
        for u in units:
            if u.output is not None:
                f.add(u.output.lines_total, unit=u.name)
        f = page.counter("omnid_unit_log_lines_dropped_total",
                         "output lines not echoed into the daemon log (rate limit; kept for omnid logs)")
        for u in units:
            if u.output is not None:
                f.add(u.output.echo_dropped, unit=u.name)
        f = page.counter("omnid_unit_log_lines_truncated_total", "output lines cut at 16 KiB")
        for u in units:
            if u.output is not None:
                f.add(u.output.lines_truncated, unit=u.name)
        rss = page.gauge("omnid_unit_rss_bytes", "resident memory of the unit's processes")
        cpu = page.counter("omnid_unit_cpu_seconds_total", "CPU time of the unit's live processes")
        procs = page.gauge("omnid_unit_processes", "live processes in the unit's tree")
        usage = await self.usage.get(units)  # from a thread, at most once per USAGE_INTERVAL_S
        for name, (rss_bytes, cpu_s, n) in usage.items():
            rss.add(rss_bytes, unit=name)
            cpu.add(round(cpu_s, 3), unit=name)
            procs.add(n, unit=name)
        if self.sup.cgroups:
            self.sup.cgroups.write_metrics(page)  # cgroup hook
        gpu = self.gpu_usage()
        if gpu:
            f = page.gauge("omnid_unit_gpu_memory_bytes", "GPU memory held by the unit's processes (NVML)")
            for name, mib in gpu.items():
                f.add(int(mib * 1048576), unit=name)
        backend = getattr(self.sup, "gpu", None)
        if backend is not None and hasattr(backend, "conditions"):
            page.gauge("omnid_gpu_stuck_threads", "threads blocked in an NVML call past its deadline").add(
                backend.stuck_threads)
            f = page.gauge("omnid_gpu_condition", "a condition of a GPU: Xid, memory health, unreadable")
            for c in backend.conditions():
                f.add(1, gpu=c.to_json()["gpu"], status=c.status, source=c.source, xid=c.xid or "")
        rss, threads = _own_rss_and_threads()
        page.gauge("omnid_daemon_rss_bytes", "resident memory of the daemon").add(rss)
        page.gauge("omnid_daemon_threads", "threads of the daemon process").add(threads)
        # The cyclic GC: off while the daemon starts, on (what the start allocated frozen out of
        # it) once the first tier is out and the rest loaded (omnid.daemon.main).
        page.gauge("omnid_daemon_gc_enabled", "1 when the daemon's cyclic garbage collector runs").add(
            int(gc.isenabled()))
        page.gauge("omnid_daemon_gc_frozen_objects", "objects of the daemon's start kept out of every collection").add(
            gc.get_freeze_count())
        f = page.counter("omnid_daemon_gc_collections_total", "collections of the daemon's cyclic garbage collector")
        for generation, st in enumerate(gc.get_stats()):
            f.add(st.get("collections", 0), generation=str(generation))
        page.counter("omnid_invariant_violations_total", "state/kernel disagreements found after transitions").add(
            len(self.sup.invariant_violations))
        c = self.connections
        page.counter("omnid_health_connections_refused_total", "health connections closed at the cap or silent").add(
            c.refused + c.idle_closed + c.evicted)
        notify = self.notify_counters()  # issue #9: dropped notify datagrams, by reason
        if notify:
            f = page.counter("omnid_notify_datagrams_total", "notify datagrams received, accepted or dropped")
            for what, n in notify.items():
                if what != "paused":
                    f.add(n, outcome=what)
            page.counter("omnid_notify_paused_total", "times the notify socket was not read: fds from outside "
                         "waited to be closed up to their cap").add(notify.get("paused", 0))
        held = getattr(getattr(self.sup, "monitors", None), "held_back", None)
        if held is not None:  # omnid.core.monitors: a silence a stranger made is not judged
            f = page.counter("omnid_notify_deadlines_held_total", "watchdog and ready_timeout deadlines held back "
                             "while the notify socket was not read (once per unit and pause)")
            for deadline, n in held.items():
                f.add(n, deadline=deadline)
        store = getattr(self.sup, "fdstore", None)
        if store is not None:  # omnid.process.fdstore: what units handed over, and what was refused
            f = page.counter("omnid_fdstore_fds_total", "fds sent to the fd store, by outcome")
            for what, n in store.counters.items():
                f.add(n, outcome=what)
            page.gauge("omnid_fdstore_fds", "fds held in the fd store now").add(len(store.fds()))
        cl = closer.status()  # fds from outside closed off the loop (omnid.base.closer)
        f = page.counter("omnid_foreign_fd_closes_total", "fds received from outside and closed, by how")
        for what in ("inline", "threaded", "slow"):
            f.add(cl[what], how=what)
        page.gauge("omnid_foreign_fd_closes_stuck", "closes of fds from outside under way for over a second").add(
            cl["stuck"])
        page.gauge("omnid_foreign_fds_waiting", "fds from outside waiting for a closer thread (the notify socket "
                   "is not read near queued_max)").add(cl["queued"])
        ch = getattr(self.sup, "crosshost", None)
        if ch is not None:  # worker groups across hosts (omnid.cluster)
            from omnid.cluster.metrics import write as cluster_metrics

            cluster_metrics(ch, page)
        return web.Response(text=page.text(), content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": promtext.FORMAT_VERSION})


def _own_rss_and_threads() -> tuple[int, int]:
    """The daemon's resident memory (bytes) and thread count, as psutil reads them
    (/proc/self/statm's resident pages, /proc/self/status's Threads:) without importing it:
    psutil's import (~40-100 ms of CPU here) was the health API's, on a thread holding the GIL
    while the first units start."""
    with open("/proc/self/statm", "rb") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    threads = 0
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"Threads:"):
                threads = int(line.split()[1])
                break
    return rss, threads
