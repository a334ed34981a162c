"""Reference serve (units/demo/serve.toml): the HTTP front of the demo stack.

Run as ``python -m omnid.demo.serve``. aiohttp on the listening sockets omnid holds for
it (the unit's ``sockets``, passed as systemd does: ``LISTEN_FDS`` from fd 3, for this
process when ``LISTEN_PID`` is its pid), else on ``OMNID_DEMO_SERVE_HOST``:
``OMNID_DEMO_SERVE_PORT`` (127.0.0.1:8000), bound here. On a held socket a restart
refuses no connection: they wait in its backlog for the next process.

- ``POST /v1/generate`` ``{"prompt": str, "max_ms"?: int}`` -> 200
  ``{"text", "worker", "ms"}``, or a 4xx/5xx ``{"error": {"code", "message"}}``;
- ``GET /health`` -> 200 while the engine is connected and has workers, else 503
  with the reason (the readiness probe of the unit);
- ``POST /drain`` -> stop taking work: new requests are refused at once (503
  ``serve_draining``), the accepted ones finish; answers 200 once none is left
  (omnid's `drain` hook: the stop signal comes after).

Failure behaviour (FAILURE_MATRIX "fails fast"): no request ever waits for the
client's own timeout. When the engine's connection closes (socket monitor) or
its heartbeat stops for ~0.5 s, every in-flight request is answered 503 at
once; on SIGTERM/SIGINT the listener closes first, then every in-flight request
is answered 503 and the process exits.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import zmq
import zmq.asyncio
from aiohttp import web
from zmq.utils.monitor import parse_monitor_message

from omnid.demo import protocol
from omnid.demo.sdnotify import Notifier

log = protocol.setup_logging("omnid.demo.serve")

MAX_PROMPT_CHARS = 64 * 1024
DISCONNECT_GRACE_S = 0.05


@dataclass(frozen=True)
class ServeConfig:
    unit: str
    host: str
    port: int
    engine: str
    deadline_s: float

    @classmethod
    def from_env(cls) -> "ServeConfig":
        return cls(
            unit=protocol.unit_name("serve"),
            host=protocol.env_str("OMNID_DEMO_SERVE_HOST", protocol.DEFAULT_HOST),
            port=protocol.env_int("OMNID_DEMO_SERVE_PORT", protocol.DEFAULT_SERVE_PORT, 1),
            engine=protocol.engine_endpoint(),
            deadline_s=protocol.env_float("OMNID_DEMO_DEADLINE_S", 30.0, 0.001),
        )


class RequestFailed(Exception):
    """A request that ends with an HTTP error; ``message`` is never empty."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def _status_for(code: str) -> int:
    # A worker that failed mid-request is a bad upstream answer; anything else means "not now".
    return 502 if code.startswith("worker_") else 503


class EngineClient:
    """The DEALER link to the engine, and the requests waiting on it."""

    def __init__(self, config: ServeConfig, on_crash: Callable[[str], None]) -> None:
        self.config = config
        self.on_crash = on_crash
        self.context = zmq.asyncio.Context(io_threads=1)
        self.socket = self.context.socket(zmq.DEALER)
        # Not IMMEDIATE: with it, libzmq drops what the engine sent just before closing (its own
        # error for each request). Requests are only sent while the engine is connected anyway.
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 100)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.socket.connect(config.engine)
        self.pending: dict[int, tuple[asyncio.Future[dict[str, Any]], float]] = {}
        self.ids = itertools.count(1)
        self.link_up = False  # from the monitor: a handshake and no disconnect since
        self.last_heartbeat = 0.0
        self.engine: dict[str, Any] = {}  # the engine's last heartbeat: its worker and queue counts
        self.lost_reason = ""
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def connected(self) -> bool:
        return self.link_up and time.monotonic() - self.last_heartbeat <= protocol.LOST_AFTER_S

    def start(self) -> None:
        self.tasks = [asyncio.create_task(coro, name=coro.__name__)
                      for coro in (self._receive(), self._watch_link(), self._tick())]
        for task in self.tasks:
            task.add_done_callback(self._crashed)

    def _crashed(self, task: asyncio.Task[None]) -> None:
        # Without its receiver or its loss checks the serve would hang requests: exit instead.
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed: %r", task.get_name(), task.exception())
            self.on_crash(f"task {task.get_name()} failed")

    async def close(self) -> None:
        if self.connected:
            self._send({"type": "bye"})  # lets the engine cancel what it still runs for us
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=100)
        self.context.term()

    def health(self) -> tuple[bool, str]:
        if not self.link_up:
            return False, f"engine not connected ({self.config.engine})"
        if not self.connected:
            return False, self.lost_reason or "no heartbeat from the engine yet"
        if not self.engine.get("workers"):
            return False, "engine has no workers"
        return True, "ok"

    async def generate(self, prompt: str, max_ms: int | None) -> dict[str, Any]:
        if not self.connected:
            _, reason = self.health()
            raise RequestFailed(503, "engine_unavailable", reason)
        rid = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        message: dict[str, Any] = {"type": "generate", "rid": rid, "prompt": prompt}
        if max_ms is not None:
            message["max_ms"] = max_ms
        if not self._send(message):
            raise RequestFailed(503, "engine_unavailable", f"engine at {self.config.engine} not accepting requests")
        self.pending[rid] = (future, time.monotonic())
        try:
            return await asyncio.wait_for(future, self.config.deadline_s)
        except asyncio.TimeoutError:
            self._send({"type": "cancel", "rid": rid})
            raise RequestFailed(504, "deadline_exceeded",
                                f"request {rid} not answered within {self.config.deadline_s:g} s") from None
        finally:
            self.pending.pop(rid, None)

    def fail_all(self, code: str, reason: str) -> None:
        """Answer every in-flight request with an error now."""
        waiting = [(rid, future, since) for rid, (future, since) in self.pending.items() if not future.done()]
        if waiting:
            log.warning("failing %d in-flight request(s): %s", len(waiting), reason)
        now = time.monotonic()
        for rid, future, since in waiting:
            future.set_exception(RequestFailed(
                503, code, f"{reason} while request {rid} was in flight ({now - since:.2f} s)"))

    def _send(self, message: dict[str, Any]) -> bool:
        # False on EAGAIN: the queue towards the engine is full (it stopped reading).
        return protocol.send_now(self.socket, [protocol.encode(message)]) is None

    def _lose_engine(self, code: str, reason: str) -> None:
        if self.connected or self.last_heartbeat:
            log.warning("engine lost: %s", reason)
        self.last_heartbeat = 0.0  # only a fresh heartbeat makes it connected again
        self.lost_reason = reason
        self.fail_all(code, reason)

    async def _receive(self) -> None:
        while True:
            frame = await self.socket.recv()
            message = protocol.decode(frame)
            if message is None:
                log.warning("dropped a malformed message from the engine (%d bytes)", len(frame))
                continue
            kind = message["type"]
            if kind == "heartbeat":
                if self.link_up and not self.connected:
                    log.info("engine connected (pid %s, %s worker(s))", message.get("pid"), message.get("workers"))
                self.last_heartbeat = time.monotonic()
                self.engine = message
            elif kind in ("result", "error"):
                rid = message.get("rid")
                entry = self.pending.get(rid) if isinstance(rid, int) else None
                if entry is None or entry[0].done():
                    continue  # answered already (deadline, engine loss): late news is dropped
                if kind == "result":
                    entry[0].set_result(message)
                else:
                    error = message.get("error") or {}
                    code = str(error.get("code") or "engine_error")
                    text = str(error.get("message") or f"engine failed request {message.get('rid')}")
                    entry[0].set_exception(RequestFailed(_status_for(code), code, text))
            elif kind == "stopping":
                self._lose_engine("engine_stopping", str(message.get("reason") or "engine stopping"))
            else:
                log.warning("ignored a %r message from the engine", kind)

    async def _watch_link(self) -> None:
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.link_up = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.link_up = False  # new requests get a 503 from now on
                # The engine's last words (its own errors for each request) may still be queued
                # behind this event; let the receiver read them before failing the rest.
                await asyncio.sleep(DISCONNECT_GRACE_S)
                if not self.link_up:
                    self._lose_engine("engine_lost", "engine connection closed")

    async def _tick(self) -> None:
        next_heartbeat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_heartbeat and self.link_up:  # while down, they would only pile up
                self._send({"type": "heartbeat"})
                next_heartbeat = now + protocol.HEARTBEAT_S
            if self.last_heartbeat and now - self.last_heartbeat > protocol.LOST_AFTER_S:
                self._lose_engine("engine_lost", f"engine silent for {now - self.last_heartbeat:.2f} s")
            await asyncio.sleep(protocol.CHECK_S)


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


class ServeApp:
    def __init__(self, config: ServeConfig, engine: EngineClient) -> None:
        self.config = config
        self.engine = engine
        self.stopping: str | None = None
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Transports that got an answer: at a stop, a connection accepted but not answered yet
        # is waited for, an idle keep-alive one is not (its transport is in here).
        self.answered: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()
        self.app = web.Application(client_max_size=1 << 20)
        self.app.on_response_prepare.append(self._answered)
        self.app.add_routes([web.post("/v1/generate", self.generate), web.get("/health", self.health),
                             web.post("/drain", self.drain)])

    async def _answered(self, request: web.Request, _response: web.StreamResponse) -> None:
        if request.transport is not None:
            self.answered.add(request.transport)

    def unanswered(self, connections: list) -> int:
        """Accepted connections that have not had an answer yet (their request may still be
        in the kernel's buffer: closing them now would reset them)."""
        return sum(1 for c in connections if c.transport is not None and c.transport not in self.answered)

    async def drain(self, _request: web.Request) -> web.Response:
        """Stop taking work; answer once every accepted request is answered."""
        self.draining = True
        log.info("%s draining: %d request(s) in flight", self.config.unit, self.in_flight)
        started = time.monotonic()
        await self._idle.wait()
        return web.json_response({"status": "drained", "seconds": round(time.monotonic() - started, 3)})

    async def generate(self, request: web.Request) -> web.Response:
        if self.stopping:
            return _error(503, "serve_stopping", f"{self.config.unit} stopping ({self.stopping})")
        if self.draining:
            return _error(503, "serve_draining", f"{self.config.unit} is draining before a stop; retry elsewhere")
        self.in_flight += 1
        self._idle.clear()
        try:
            return await self._generate(request)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    async def _generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "bad_request", "body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            return _error(400, "bad_request", 'expected {"prompt": string, "max_ms"?: integer}')
        prompt = body["prompt"]
        max_ms = body.get("max_ms")
        if max_ms is not None and (not isinstance(max_ms, int) or isinstance(max_ms, bool) or max_ms <= 0):
            return _error(400, "bad_request", "max_ms must be a positive integer")
        if len(prompt) > MAX_PROMPT_CHARS:
            return _error(400, "bad_request", f"prompt longer than {MAX_PROMPT_CHARS} characters")
        started = time.monotonic()
        try:
            answer = await self.engine.generate(prompt, max_ms)
        except RequestFailed as failure:
            return _error(failure.status, failure.code, failure.message)
        return web.json_response({"text": answer.get("text", ""), "worker": answer.get("worker"),
                                  "ms": answer.get("ms"),
                                  "latency_ms": round((time.monotonic() - started) * 1000)})

    async def health(self, _request: web.Request) -> web.Response:
        if self.stopping:
            return web.json_response({"status": "stopping", "reason": self.stopping}, status=503)
        if self.draining:
            return web.json_response({"status": "draining", "in_flight": self.in_flight}, status=503)
        ok, reason = self.engine.health()
        engine = {k: v for k, v in self.engine.engine.items() if k != "type"} if self.engine.connected else {}
        return web.json_response({"status": "ok" if ok else "unavailable", "reason": reason, "engine": engine},
                                 status=200 if ok else 503)


def held_sockets() -> list[socket.socket]:
    """The listening sockets omnid (or systemd) holds for this process: fds 3.. as
    LISTEN_FDS says, only when LISTEN_PID is this process (a child that inherited the
    environment is not meant). [] when none were given: the serve binds its own port."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return []
    try:
        n = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return []
    out = []
    for fd in range(3, 3 + max(0, min(n, 64))):
        s = socket.socket(fileno=fd)
        if s.type == socket.SOCK_STREAM:
            out.append(s)
        else:
            s.detach()  # not ours to serve on (a stored fd of another kind)
    return out


# asyncio's create_server(sock=...) calls listen() again: ask for no less than omnid's default.
HELD_BACKLOG = 1024
# At a stop signal: longest wait for the connections accepted before the listener closed to be
# answered (503). asyncio accepts up to a backlog's worth (1024) in one turn, and a process that
# took a burst just before the stop (the backlog a restart left) may need seconds on a loaded
# host to answer each; one closed before its request is read is reset. Below the unit's
# stop_timeout (5 s in units/demo/serve.toml), so that the stop never ends in a SIGKILL.
STOP_SETTLE_S = 3.0


async def serve_forever(config: ServeConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[str] = []  # why we stop: a signal name, or the internal failure
    crashed: list[str] = []

    def on_signal(signum: signal.Signals) -> None:
        received.append(signum.name)
        protocol.note_stop_signal(signum)
        stop.set()

    def on_crash(why: str) -> None:
        received.append(why)
        crashed.append(why)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    engine = EngineClient(config, on_crash)
    engine.start()
    serve = ServeApp(config, engine)
    # shutdown_timeout bounds the wait for handlers after the listener closes; by then they are answered.
    runner = web.AppRunner(serve.app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    held = held_sockets()
    sites: list[web.BaseSite] = [web.SockSite(runner, s, backlog=HELD_BACKLOG) for s in held] or \
        [web.TCPSite(runner, config.host, config.port)]
    where = ", ".join(_name(s) for s in held) + " (held by omnid)" if held else f"{config.host}:{config.port}"
    try:
        for site in sites:
            await site.start()
    except OSError as exc:
        log.error("cannot listen on %s: %s", where, exc)
        await runner.cleanup()
        await engine.close()
        return 1

    async def stop_accepting(settle_s: float = 0.0) -> None:
        # Accept no more, then let the connections asyncio accepted in its last batch attach to
        # the server before it closes: a connection whose accept task runs after Server.close()
        # is neither served nor closed (asyncio's Server._attach asserts the server is open, and
        # _accept_connection2 swallows the error), and is reset when the process exits.
        for site in sites:
            server = getattr(site, "_server", None)  # the asyncio Server behind an aiohttp site
            for s in getattr(server, "sockets", None) or ():
                loop.remove_reader(s.fileno())
        deadline = loop.time() + 1.0
        while any(_accepting(t) for t in asyncio.all_tasks()) and loop.time() < deadline:
            await asyncio.sleep(0)
        for site in sites:
            await site.stop()
        sites.clear()
        # asyncio accepts a whole backlog's worth at once: connections taken but not read yet
        # are answered before the process goes, not reset (on a held socket the rest of the
        # backlog waits for the next process).
        # A batch accepted in the loop's last turn becomes connections only once its tasks run.
        deadline = loop.time() + settle_s
        if settle_s:
            await asyncio.sleep(min(settle_s, 0.05))
        while runner.server is not None and serve.unanswered(runner.server.connections) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        left = serve.unanswered(runner.server.connections) if runner.server is not None else 0
        if settle_s and left:
            log.warning("%d accepted connection(s) still unanswered after %.1f s: closed", left, settle_s)

    notifier = Notifier.from_env()  # only used when the unit says ready = "notify"
    notifier.ready(status=f"listening on {where}")
    log.info("%s listening on %s, engine %s", config.unit, where, config.engine)

    await stop.wait()
    why = received[0] if received else "stop"
    serve.stopping = why
    started = time.monotonic()
    notifier.stopping()
    await stop_accepting()  # first, so no new request slips in behind the failures
    engine.fail_all("serve_stopping", f"{config.unit} stopping ({why})")
    await stop_accepting(settle_s=STOP_SETTLE_S)  # what was accepted is answered (503), not reset
    await runner.cleanup()
    await engine.close()
    notifier.close()
    log.info("stopped on %s in %.3f s", why, time.monotonic() - started)
    return 1 if crashed else 0


def _accepting(task: asyncio.Task) -> bool:
    """A task of asyncio's that turns an accepted connection into a transport, not done yet."""
    return not task.done() and getattr(task.get_coro(), "__name__", "") == "_accept_connection2"


def _name(s: socket.socket) -> str:
    addr = s.getsockname()
    if not isinstance(addr, tuple):
        return f"unix:{addr}"
    return f"http://[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"http://{addr[0]}:{addr[1]}"


def main() -> None:
    protocol.exit_process(asyncio.run(serve_forever(ServeConfig.from_env())))


if __name__ == "__main__":
    main()
