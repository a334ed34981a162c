"""The daemon's fronts: the control socket (ZeroMQ), the health API (aiohttp) and the health
listening socket under it; opened at start-up, closed at the stop, closed and opened again
around a re-exec (omnid.daemon.handover). Each function receives the daemon (omnid.daemon.parts.DaemonParts) that holds
them (`control`, `health`, `zmq`, `health_fd`).

Both imports are heavy and start threads (libzmq's, aiohttp's): they come after the first
tier's spawns are out (omnid.daemon, "Why this order").
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
import socket
from typing import TYPE_CHECKING

import structlog

from omnid.model import settings
from omnid.api.control import ControlError, ControlServer
from omnid.core.lifecycle import Phase
from omnid.base.tasks import DaemonTask, report_crash

if TYPE_CHECKING:
    from omnid.daemon.parts import DaemonParts

log = structlog.get_logger("omnid.daemon.main")

# The health API's import waits for the first tier's spawns to be answered, this long at most.
HEALTH_IMPORT_WAIT_S = 1.0


def bind_listener(listen: str) -> socket.socket:
    """A listening TCP socket on HOST:PORT (numeric host: no resolver thread)."""
    host, port = settings.parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def health_socket(daemon: DaemonParts, inherited_fd: int | None) -> socket.socket | None:
    """Bound now with a plain socket (or the one a previous program left, `inherited_fd`), so
    a busy port fails the daemon before any unit starts (aiohttp, a ~100 ms import, takes it
    over once the first spawns are out). A dup of it is kept for a re-exec: the listening
    socket outlives the program, so no connection is refused while the next one loads.
    None (said why, the daemon stopping with exit 1) when it cannot listen."""
    assert daemon.shutdown_requested is not None
    try:
        if inherited_fd is None:
            sock = bind_listener(daemon.cfg.health_listen)
        else:
            os.set_inheritable(inherited_fd, False)
            sock = socket.socket(fileno=inherited_fd)
            sock.setblocking(False)
    except OSError as exc:
        log.error("health API cannot listen", listen=daemon.cfg.health_listen, error=str(exc))
        daemon.exit_code = 1
        daemon.shutdown_requested.set()
        return None
    daemon.health_fd = os.dup(sock.fileno())
    return sock


def start_health(daemon: DaemonParts, sock: socket.socket) -> None:
    daemon.health_task = report_crash(asyncio.get_running_loop().create_task(_serve_health(daemon, sock)),
                                      "health API start")


async def _serve_health(daemon: DaemonParts, sock: socket.socket) -> None:
    """Import aiohttp (~100 ms of CPU) in a thread once the first tier's spawns are answered
    (at most HEALTH_IMPORT_WAIT_S), while the loop keeps watching pidfds and READY
    messages; then serve on the bound socket. Not during the spawns: an import in a
    thread holds the GIL in slices of the switch interval (5 ms), and the loop would wait
    out a slice between two spawn answers (start 256: ~100 ms)."""
    sup = daemon.sup
    assert sup is not None
    units = sup.units.values()
    await sup.wait_until(lambda: not any(rt.phase is Phase.SPAWNING for rt in units), HEALTH_IMPORT_WAIT_S)
    health_mod = await asyncio.to_thread(importlib.import_module, "omnid.api.health")
    daemon.health = health_mod.HealthServer(sup, daemon.cfg.health_listen, degraded=lambda: sup.degraded_units(),
                                            gpu_usage=lambda: sup.gpu_mib,
                                            notify_counters=lambda: daemon.notify.counters if daemon.notify else {})
    daemon.health.daemon_metrics = daemon.metrics
    await daemon.health.start(sock)
    # Everything allocated so far (modules, sockets, units) lives as long as the
    # daemon: keep it out of the cyclic GC, whose full passes over it cost tens of
    # ms in the middle of a 256-unit stop.
    gc.freeze()


def open_control(daemon: DaemonParts) -> None:
    assert daemon.handlers is not None
    import zmq.asyncio  # after the first tier is out (its import starts libzmq's threads)

    daemon.zmq = zmq.asyncio.Context()
    daemon.control = ControlServer(daemon.zmq, daemon.cfg.control, daemon.handlers.table())
    daemon.control.bind()

    def start_reader() -> asyncio.Task:
        assert daemon.control is not None
        return daemon.control.start()

    # Daemon-wide tasks are supervised: a crash is logged and the task restarted.
    daemon.control_reader = DaemonTask("control reader", start_reader).start()


async def replies_sent(daemon: DaemonParts, timeout: float, poll: float) -> None:
    """Let the replies under way go out (the `shutdown` or `reexec` reply) before the socket closes."""
    deadline = asyncio.get_running_loop().time() + timeout
    while daemon.control is not None and daemon.control.replying and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(poll)


async def _wait_health_started(daemon: DaemonParts) -> None:
    if daemon.health_task is not None:
        try:
            await asyncio.wait_for(daemon.health_task, 10)
        except Exception as exc:  # noqa: BLE001 - report, then go on closing
            log.error("health API start failed", error=str(exc))


async def close(daemon: DaemonParts) -> None:
    """The control socket, the event stream and the health API (its listening socket
    stays open through the dup kept for a re-exec)."""
    if daemon.control_reader is not None:
        daemon.control_reader.close()
    await _wait_health_started(daemon)
    if daemon.health is not None:
        await daemon.health.close()
    if daemon.control is not None:
        await daemon.control.close()
    daemon.zmq.term()


async def close_for_exec(daemon: DaemonParts) -> None:
    """The fronts that cannot be handed over as they are: the ZeroMQ sockets (bound again
    by the next program) and aiohttp (the listening socket itself stays, through its dup)."""
    daemon.stop_gpu_watch()
    await _wait_health_started(daemon)
    daemon.health_task = None
    if daemon.health is not None:
        left = await daemon.health.quiesce(1.0)
        if left:
            log.info("health connections still open at the re-exec (idle keep-alive)", count=left)
        daemon.health = None  # not cleaned up: the program is replaced, its connections close
    await close(daemon)
    daemon.control = None


async def reopen_after_failed_exec(daemon: DaemonParts) -> None:
    open_control(daemon)
    sock = socket.socket(fileno=os.dup(daemon.health_fd))
    sock.setblocking(False)
    start_health(daemon, sock)
    daemon.start_gpu_watch()


async def check_new_program() -> object:
    """For the control socket's `reexec`: the new program's check, its refusal as the reply's
    error (handover is imported only when a re-exec is asked: see its docstring)."""
    from omnid.daemon import handover

    try:
        return await handover.check_new_program()
    except handover.HandoverError as exc:
        raise ControlError("reexec_refused", str(exc)) from None
