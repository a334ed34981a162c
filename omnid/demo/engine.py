"""Reference engine (units/demo/engine.toml): the broker between the serve and the workers.

Run as ``python -m omnid.demo.engine``. Two ROUTER sockets: one the workers
connect to (``OMNID_DEMO_WORKER_PORT``), one the serve connects to
(``OMNID_DEMO_ENGINE_PORT``). Each request goes to an idle worker, the one
idle longest (least busy; round-robin under steady load); when all are busy it
waits in a FIFO queue.

What it exists to show (FAILURE_MATRIX): a lost worker is noticed fast —
at once when its connection closes (socket monitor), within ~0.5 s when it
goes silent (SIGSTOP, hang) — and the request it was running is failed
immediately with ``worker_lost``; on SIGTERM every queued and running request
is failed with ``engine_stopping`` before the engine exits. ``READY=1`` goes
out once both sockets are bound and ``OMNID_DEMO_MIN_WORKERS`` workers are
registered.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from omnid.demo import protocol
from omnid.demo.sdnotify import Notifier, watchdog_interval

log = protocol.setup_logging("omnid.demo.engine")

SERVE_LOST_AFTER_S = 1.0
MAX_JOB_MS = 600_000


@dataclass(frozen=True)
class EngineConfig:
    unit: str
    serve_endpoint: str
    worker_endpoint: str
    min_workers: int

    @classmethod
    def from_env(cls) -> "EngineConfig":
        return cls(
            unit=protocol.unit_name("engine"),
            serve_endpoint=protocol.engine_endpoint(),
            worker_endpoint=protocol.worker_endpoint(),
            min_workers=protocol.env_int("OMNID_DEMO_MIN_WORKERS", 1),
        )


@dataclass
class Request:
    number: int
    job: str
    serve: bytes  # routing id of the serve that asked
    rid: Any  # the serve's own id for it, echoed back
    prompt: str
    ms: int | None
    worker: bytes | None = None


@dataclass
class WorkerPeer:
    identity: bytes
    name: str
    pid: int | None
    fd: int | None  # the TCP connection's fd in libzmq, to match monitor DISCONNECTED events
    last_seen: float
    request: Request | None = None
    draining: str | None = None  # a job of a previous engine it still runs; cancelled, not ours


@dataclass
class Broker:
    """Requests, workers and serves; every state change of the engine goes through here."""

    config: EngineConfig
    workers_sock: zmq.asyncio.Socket
    serves_sock: zmq.asyncio.Socket
    epoch: str = field(default_factory=lambda: secrets.token_hex(4))
    workers: dict[bytes, WorkerPeer] = field(default_factory=dict)
    idle: deque[bytes] = field(default_factory=deque)
    queue: deque[Request] = field(default_factory=deque)
    requests: dict[tuple[bytes, Any], Request] = field(default_factory=dict)
    serves: dict[bytes, float] = field(default_factory=dict)
    counter: int = 0

    # ---- sending -------------------------------------------------------------------------

    def to_worker(self, identity: bytes, message: dict[str, Any]) -> None:
        error = protocol.send_now(self.workers_sock, [identity, protocol.encode(message)])
        if error is not None:  # EHOSTUNREACH (gone) or EAGAIN (not reading): the loss checks act on it
            log.warning("cannot send %s to worker %s: %s", message["type"], self._worker_name(identity), error)

    def to_serve(self, identity: bytes, message: dict[str, Any]) -> None:
        error = protocol.send_now(self.serves_sock, [identity, protocol.encode(message)])
        if error is not None:
            log.warning("cannot send %s to serve %s: %s", message["type"], identity.hex(), error)

    def fail(self, request: Request, code: str, message: str) -> None:
        self.requests.pop((request.serve, request.rid), None)
        self.to_serve(request.serve, {"type": "error", "rid": request.rid,
                                      "error": {"code": code, "message": message}})

    def _worker_name(self, identity: bytes) -> str:
        peer = self.workers.get(identity)
        return peer.name if peer else identity.hex()

    def status(self) -> dict[str, Any]:
        return {"workers": len(self.workers), "idle": len(self.idle),
                "queued": len(self.queue), "running": sum(1 for w in self.workers.values() if w.request)}

    # ---- serve side ----------------------------------------------------------------------

    def on_serve(self, identity: bytes, message: dict[str, Any]) -> None:
        if identity not in self.serves:
            log.info("serve %s connected", identity.hex())
        self.serves[identity] = time.monotonic()
        kind = message["type"]
        if kind in ("generate", "cancel") and not isinstance(message.get("rid"), (int, str)):
            log.warning("dropped a %r message without a request id from serve %s", kind, identity.hex())
        elif kind == "generate":
            self.submit(identity, message)
        elif kind == "cancel":
            self.cancel(identity, message.get("rid"), "cancelled by the serve")
        elif kind == "bye":
            self.forget_serve(identity, "serve said bye")
        elif kind != "heartbeat":
            log.warning("ignored a %r message from serve %s", kind, identity.hex())

    def submit(self, serve: bytes, message: dict[str, Any]) -> None:
        self.counter += 1
        ms = message.get("max_ms")
        request = Request(number=self.counter, job=f"{self.epoch}:{self.counter}", serve=serve,
                          rid=message.get("rid"), prompt=str(message.get("prompt", "")),
                          ms=ms if isinstance(ms, int) and 0 < ms <= MAX_JOB_MS else None)
        if not self.workers:
            self.fail(request, "no_workers", f"no worker registered with {self.config.unit}; "
                                             f"request {request.number} not run")
            return
        self.requests[(serve, request.rid)] = request
        self.queue.append(request)
        self.dispatch()

    def cancel(self, serve: bytes, rid: Any, why: str) -> None:
        request = self.requests.pop((serve, rid), None)
        if request is None:
            return
        if request.worker is None:
            self.queue.remove(request)
        else:
            # The worker stays busy until it confirms; it answers a cancel at its next slice.
            self.to_worker(request.worker, {"type": "cancel", "job": request.job})
        log.info("request %d %s", request.number, why)

    def forget_serve(self, identity: bytes, why: str) -> None:
        self.serves.pop(identity, None)
        for serve, rid in [key for key in self.requests if key[0] == identity]:
            self.cancel(serve, rid, f"cancelled: {why}")
        log.info("serve %s gone: %s", identity.hex(), why)

    # ---- worker side ---------------------------------------------------------------------

    def on_worker(self, identity: bytes, fd: int | None, message: dict[str, Any]) -> None:
        peer = self.workers.get(identity)
        if peer is None:
            peer = self.register(identity, fd, message)
            if peer is None:
                return
        peer.last_seen = time.monotonic()
        kind = message["type"]
        if kind == "heartbeat":
            if peer.draining and message.get("busy") is None:
                self.release(peer)
        elif kind in ("result", "error"):
            self.finish(peer, message)
        elif kind == "bye":
            self.lose(peer, f"it stopped on {message.get('reason', 'request')}")
        else:
            log.warning("ignored a %r message from %s", kind, peer.name)

    def register(self, identity: bytes, fd: int | None, message: dict[str, Any]) -> WorkerPeer | None:
        name = message.get("worker")
        if message["type"] != "heartbeat" or not isinstance(name, str):
            # Typically a worker we declared lost (it was stopped, then continued): it registers
            # again with its next heartbeat; what it says before that belongs to a failed request.
            log.info("dropped a %r message from a worker connection that is not registered (%s)",
                     message["type"], name or "unnamed")
            return None
        for other in list(self.workers.values()):
            if other.name == name:  # a restarted worker that reconnected before its old link timed out
                self.lose(other, "it registered again on a new connection")
        peer = WorkerPeer(identity=identity, name=name, pid=message.get("pid"), fd=fd,
                          last_seen=time.monotonic())
        self.workers[identity] = peer
        busy = message.get("busy")
        if busy is not None:
            # Still running a job of a previous engine: cancel it; the worker is ours when it confirms.
            peer.draining = str(busy)
            self.to_worker(identity, {"type": "cancel", "job": busy})
        else:
            self.idle.append(identity)
        self.to_worker(identity, {"type": "welcome", "pid": os.getpid()})
        log.info("worker %s registered (pid %s, %s); %d worker(s)",
                 name, peer.pid, message.get("device"), len(self.workers))
        self.dispatch()
        return peer

    def finish(self, peer: WorkerPeer, message: dict[str, Any]) -> None:
        job = message.get("job")
        request = peer.request
        if request is not None and request.job == job:
            peer.request = None
            if self.requests.pop((request.serve, request.rid), None) is not None:
                if message["type"] == "result":
                    self.to_serve(request.serve, {"type": "result", "rid": request.rid,
                                                  "text": message.get("text", ""), "worker": peer.name,
                                                  "ms": message.get("ms")})
                else:
                    code = str(message.get("code") or "worker_error")
                    text = str(message.get("message") or f"{peer.name} failed request {request.number}")
                    self.to_serve(request.serve, {"type": "error", "rid": request.rid,
                                                  "error": {"code": code, "message": text}})
            if message.get("code") == "worker_stopping":
                # Its "bye" follows; it must not be handed another request in between.
                self.lose(peer, "it is stopping")
                return
            self.release(peer)
        elif peer.draining is not None and peer.draining == job:
            self.release(peer)
        elif message.get("code") != "cancelled":
            log.warning("%s answered job %s, which it was not running", peer.name, job)

    def release(self, peer: WorkerPeer) -> None:
        peer.draining = None
        if peer.identity in self.workers and peer.identity not in self.idle:
            self.idle.append(peer.identity)
        self.dispatch()

    def lose(self, peer: WorkerPeer, why: str) -> None:
        """Forget a worker and fail, at once, what it was running."""
        if self.workers.pop(peer.identity, None) is None:
            return
        if peer.identity in self.idle:
            self.idle.remove(peer.identity)
        request = peer.request
        peer.request = None
        if request is not None and (request.serve, request.rid) in self.requests:
            self.fail(request, "worker_lost",
                      f"{peer.name} lost while running request {request.number} ({why})")
        log.warning("worker %s lost: %s; %d worker(s) left", peer.name, why, len(self.workers))
        if not self.workers:
            while self.queue:
                queued = self.queue.popleft()
                self.fail(queued, "no_workers",
                          f"every worker is lost (last: {peer.name}); request {queued.number} not run")

    def lose_by_fd(self, fd: int) -> None:
        for peer in list(self.workers.values()):
            if peer.fd == fd:
                self.lose(peer, "connection closed")

    def dispatch(self) -> None:
        while self.queue and self.idle:
            request = self.queue.popleft()
            identity = self.idle.popleft()
            peer = self.workers[identity]
            peer.request = request
            request.worker = identity
            message: dict[str, Any] = {"type": "run", "job": request.job, "n": request.number,
                                       "prompt": request.prompt}
            if request.ms is not None:
                message["ms"] = request.ms
            self.to_worker(identity, message)

    # ---- periodic ------------------------------------------------------------------------

    def check(self) -> None:
        now = time.monotonic()
        for peer in list(self.workers.values()):
            if now - peer.last_seen > protocol.LOST_AFTER_S:
                self.lose(peer, f"no heartbeat for {now - peer.last_seen:.2f} s")
        for identity, seen in list(self.serves.items()):
            if now - seen > SERVE_LOST_AFTER_S:
                self.forget_serve(identity, f"no heartbeat for {now - seen:.2f} s")

    def heartbeat(self) -> None:
        message = {"type": "heartbeat", "pid": os.getpid(), **self.status()}
        for identity in self.serves:
            self.to_serve(identity, message)

    def stop(self, why: str) -> None:
        """Fail everything in flight or queued, tell the serves, cancel the workers' jobs."""
        for request in list(self.requests.values()):
            where = f"running on {self._worker_name(request.worker)}" if request.worker else "queued"
            self.fail(request, "engine_stopping",
                      f"engine stopping ({why}) while request {request.number} was {where}")
            if request.worker is not None:
                self.to_worker(request.worker, {"type": "cancel", "job": request.job})
        self.queue.clear()
        for identity in self.serves:
            self.to_serve(identity, {"type": "stopping", "reason": f"engine stopping ({why})"})


def _frame_fd(frame: zmq.Frame) -> int | None:
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None  # heartbeat loss still catches a dead worker, only later


async def _receive_workers(broker: Broker) -> None:
    while True:
        frames = await broker.workers_sock.recv_multipart(copy=False)
        if len(frames) != 2:
            log.warning("dropped a %d-frame message from a worker connection", len(frames))
            continue
        message = protocol.decode(frames[1].bytes)
        if message is None:
            log.warning("dropped a malformed message from a worker connection")
            continue
        broker.on_worker(frames[0].bytes, _frame_fd(frames[1]), message)


async def _receive_serves(broker: Broker) -> None:
    while True:
        frames = await broker.serves_sock.recv_multipart()
        message = protocol.decode(frames[1]) if len(frames) == 2 else None
        if message is None:
            log.warning("dropped a malformed message from a serve connection")
            continue
        broker.on_serve(frames[0], message)


async def _watch_worker_connections(broker: Broker, monitor: zmq.asyncio.Socket) -> None:
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())
        if event["event"] == zmq.EVENT_DISCONNECTED:
            broker.lose_by_fd(int(event["value"]))


async def _tick(broker: Broker, notifier: Notifier) -> None:
    """Loss checks and heartbeats; WATCHDOG=1 from here proves the event loop is turning."""
    interval = watchdog_interval()
    ping_every = interval / 3 if interval else 1.0
    next_heartbeat = next_ping = 0.0
    while True:
        broker.check()
        now = time.monotonic()
        if now >= next_heartbeat:
            broker.heartbeat()
            next_heartbeat = now + protocol.HEARTBEAT_S
        if now >= next_ping:
            notifier.watchdog()
            next_ping = now + ping_every
        await asyncio.sleep(protocol.CHECK_S)


async def _announce_ready(broker: Broker, notifier: Notifier) -> None:
    if broker.config.min_workers:
        log.info("waiting for %d worker(s) on %s", broker.config.min_workers, broker.config.worker_endpoint)
    while len(broker.workers) < broker.config.min_workers:
        await asyncio.sleep(protocol.CHECK_S)
    notifier.ready(status=f"{len(broker.workers)} worker(s); serving on {broker.config.serve_endpoint}")
    log.info("ready: %d worker(s), serving on %s", len(broker.workers), broker.config.serve_endpoint)


async def serve_forever(config: EngineConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[str] = []

    def on_signal(signum: signal.Signals) -> None:
        received.append(signum.name)
        protocol.note_stop_signal(signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    context = zmq.asyncio.Context(io_threads=1)
    workers_sock = context.socket(zmq.ROUTER)
    serves_sock = context.socket(zmq.ROUTER)
    for sock in (workers_sock, serves_sock):
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer is an error, not a silent drop
        sock.setsockopt(zmq.LINGER, 0)
    monitor = workers_sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        workers_sock.bind(config.worker_endpoint)
        serves_sock.bind(config.serve_endpoint)
    except zmq.ZMQError as exc:
        log.error("cannot bind (%s / %s): %s", config.worker_endpoint, config.serve_endpoint, exc)
        context.destroy(linger=0)
        return 1
    log.info("%s bound: workers %s, serve %s", config.unit, config.worker_endpoint, config.serve_endpoint)

    broker = Broker(config=config, workers_sock=workers_sock, serves_sock=serves_sock)
    notifier = Notifier.from_env()
    tasks = [asyncio.create_task(coro, name=coro.__name__) for coro in (
        _receive_workers(broker), _receive_serves(broker),
        _watch_worker_connections(broker, monitor), _tick(broker, notifier), _announce_ready(broker, notifier))]
    stopped = asyncio.create_task(stop.wait())
    pending = {stopped, *tasks}
    status = 0
    while not stop.is_set() and status == 0:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stopped and task.exception() is not None:
                # A broken loop is a crash, never a silent hang: say so and exit non-zero.
                log.error("task %s failed: %r", task.get_name(), task.exception())
                status = 1
    stopped.cancel()
    stopping_since = time.monotonic()
    why = received[0] if received else "internal error"
    notifier.stopping()
    broker.stop(why)
    log.info("stopping (%s)", why)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    workers_sock.disable_monitor()
    monitor.close(linger=0)
    # Give the engine_stopping errors a moment to reach the serve before the sockets go.
    serves_sock.close(linger=300)
    workers_sock.close(linger=300)
    context.term()
    notifier.close()
    log.info("stopped in %.3f s", time.monotonic() - stopping_since)
    return status


def main() -> None:
    protocol.exit_process(asyncio.run(serve_forever(EngineConfig.from_env())))


if __name__ == "__main__":
    main()
