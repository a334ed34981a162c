"""The daemon's side of the spawner (omnid/process/spawner.py): `SpawnerClient`, one running spawner.

Takes over the spawner omnid/process/spawnstart.py started by posix_spawn (vfork + exec: safe from a
threaded process, never a fork of the daemon), or the one a previous program left (omnid
reexec), then turns its datagrams (typed by omnid/process/spawnwire.py) into awaitable spawn results
(`Spawned` or `SpawnError`) and exit reports on the daemon's event loop, and asks it to kill
a child no unit could take.

Spawns asked for in one turn of the loop (a tier's units, started together) go out as one
datagram at the end of that turn, their common environment once; a big tier goes out in parts
of PIPELINE_SPAWNS as it is built, so the spawner starts the first children while the loop
builds the rest, and a spawn asked while the spawner has nothing outstanding goes at once (the
first of a tier, a restart). Before a datagram leaves, `before_send` writes what its children
rely on (the private tmp record). The spawner answers what one turn of its own loop learnt in one datagram
too, pidfds attached.

The protocol's values that callers use (SpawnRequest, ExitReport) are defined in
omnid/process/spawnwire.py and imported here, so that callers import the spawner's interface from one
module.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from omnid.base import linux
from omnid.process import spawnstart
from omnid.process.spawnstart import SpawnerProcess
from omnid.process.spawnwire import (MAX_BATCH_BYTES, MAX_BATCH_FDS, MAX_MESSAGE, ExitReport, Hello, ProtocolError,
                             QueuedSpawn, SpawnedMsg, SpawnFailedMsg, SpawnRequest, batch_datagrams, decode,
                             spawn_wire)

log = structlog.get_logger("omnid.process.spawner")


@dataclass(frozen=True)
class Spawned:
    pid: int
    pidfd: int
    start_time: int


class SpawnError(Exception):
    """The child could not be started; the message says which step and why; `errno` is
    exec(2)'s error number when it was exec that failed (else None)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class SpawnerGone(Exception):
    """Caught by the daemon's main (omnid/daemon/main.py) as "spawner failed to start"; nothing raises it today."""


# Requests queued in one turn are sent once this many are ready, the rest at the turn's end.
PIPELINE_SPAWNS = 32


class SpawnerClient:
    """One running spawner process and the socket to it."""

    def __init__(self, on_exit: Callable[[ExitReport], None], on_gone: Callable[[], None]) -> None:
        self._on_exit = on_exit
        self._on_gone = on_gone
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.sock: socket.socket | None = None
        self.pid = 0
        self.pidfd = -1
        self.start_time = 0
        self._hello: asyncio.Future | None = None
        # How the spawner sets a child up between fork and exec, from its hello (or the handover).
        self.exec_path: str | None = None
        self._closed = False
        self._queue: list[QueuedSpawn] = []  # spawns of this turn of the loop, not sent yet
        self._kills: list[int] = []  # children no unit owns, to be killed by the spawner, not asked yet
        self._flush_scheduled = False
        self._writer = False  # waiting for room in the socket buffer
        self._hello_timer: asyncio.TimerHandle | None = None
        # Called before spawn requests leave: what their children may use is on disk first
        # (the private tmp record, written once for a batch: omnid.core.cleanup).
        self.before_send: Callable[[], None] | None = None

    def launch(self, started: SpawnerProcess | None = None) -> None:
        """Start the spawner by exec (or take over one `omnid.spawnstart.launch` started).
        Callable before the event loop runs."""
        started = started or spawnstart.launch()
        started.adopted = True
        self.pid, self.pidfd, self.start_time, self.sock = started.pid, started.pidfd, started.start_time, started.sock

    async def attach(self, timeout: float = 10.0) -> None:
        """Watch the spawner's socket and pidfd from the loop. Spawn requests may be sent at
        once (the kernel holds them until the spawner reads); a spawner that has not said
        hello within `timeout` is given up as gone."""
        loop = asyncio.get_running_loop()
        self._hello = loop.create_future()
        assert self.sock is not None
        loop.add_reader(self.sock.fileno(), self._readable)
        loop.add_reader(self.pidfd, self._spawner_died)
        self._hello_timer = loop.call_later(timeout, self._no_hello, timeout)

    async def wait_ready(self, timeout: float = 10.0) -> int:
        """Until the spawner has said hello (its pid); spawns need not wait for this."""
        assert self._hello is not None, "attach() first"
        return await asyncio.wait_for(asyncio.shield(self._hello), timeout)

    def _no_hello(self, timeout: float) -> None:
        if self._hello is None or self._hello.done() or self._closed:
            return
        log.error("the spawner did not answer; giving it up", pid=self.pid, seconds=timeout)
        linux.pidfd_send_signal(self.pidfd, signal.SIGKILL)  # its death runs _spawner_died

    def adopt(self, pid: int, pidfd: int, sock_fd: int, start_time: int, exec_path: str | None = None) -> None:
        """Take over the spawner a previous program of this daemon started (omnid reexec):
        same process, same socket; what it said meanwhile is waiting in the socket."""
        self.pid, self.pidfd, self.start_time = pid, pidfd, start_time
        self.exec_path = exec_path
        for fd in (pidfd, sock_fd):
            os.set_inheritable(fd, False)
        self.sock = socket.socket(fileno=sock_fd)
        self.sock.setblocking(False)
        loop = asyncio.get_running_loop()
        loop.add_reader(self.sock.fileno(), self._readable)
        loop.add_reader(self.pidfd, self._spawner_died)

    def handover(self) -> dict:
        assert self.sock is not None
        return {"pid": self.pid, "pidfd": self.pidfd, "sock": self.sock.fileno(), "start_time": self.start_time,
                "exec_path": self.exec_path}

    def _spawner_died(self) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.pidfd)
        # Read what it still had to say (exit reports) before declaring it gone.
        self._readable()
        self._fail_pending(f"spawner (pid {self.pid}) died")
        self._closed = True
        if self.sock is not None:
            loop.remove_reader(self.sock.fileno())
        self._on_gone()

    def _fail_pending(self, why: str) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(SpawnError(why))
        self._pending.clear()

    def _readable(self) -> None:
        assert self.sock is not None
        while True:
            try:
                data, fds = linux.recv_fds(self.sock, MAX_MESSAGE, MAX_BATCH_FDS + 3)
            except BlockingIOError:
                return
            except OSError as exc:
                log.error("spawner socket error", error=str(exc))
                return
            if not data:
                return
            try:
                msg = json.loads(data)
            except ValueError:
                log.error("spawner sent a malformed message", data=data[:200])
                for fd in fds:
                    os.close(fd)
                continue
            if isinstance(msg, dict) and msg.get("op") == "batch":
                self._dispatch_batch(msg, fds)
            else:
                self._dispatch(msg, fds)

    def _dispatch_batch(self, msg: dict, fds: list[int]) -> None:
        """The events of one turn of the spawner's loop, in order; each "spawned" takes the
        next pidfd."""
        events = msg.get("events")
        if not isinstance(events, list):
            log.error("spawner sent a malformed message", error="batch without a list of events")
            events = []
        at = 0
        for ev in events:
            own: list[int] = []
            if isinstance(ev, dict) and ev.get("op") == "spawned" and at < len(fds):
                own, at = [fds[at]], at + 1
            self._dispatch(ev, own)
        for fd in fds[at:]:
            os.close(fd)

    def _dispatch(self, raw: dict, fds: list[int]) -> None:
        try:
            msg = decode(raw)
        except ProtocolError as exc:
            log.error("spawner sent a malformed message", error=str(exc))
            for fd in fds:
                os.close(fd)
            return
        if isinstance(msg, ExitReport):
            self._on_exit(msg)
        elif isinstance(msg, SpawnedMsg):
            fut = self._pending.pop(msg.id, None)
            if fut is None or fut.done() or not fds:
                # No pidfd (the kernel dropped it: EMFILE here) or no one waiting: a process
                # no unit owns must not run. The spawner kills its own unreaped child.
                for fd in fds:
                    os.close(fd)
                self._kill_unowned(msg.pid)
                if fut is not None and not fut.done():
                    fut.set_exception(SpawnError(
                        "spawn failed: EMFILE: the daemon could not receive the process's pidfd (too many "
                        f"open files); pid {msg.pid} was killed"))
                return
            fut.set_result(Spawned(msg.pid, fds[0], msg.start_time))
            for fd in fds[1:]:
                os.close(fd)
        elif isinstance(msg, SpawnFailedMsg):
            fut = self._pending.pop(msg.id, None)
            if fut is not None and not fut.done():
                fut.set_exception(SpawnError(msg.error, msg.errno or None))
        elif isinstance(msg, Hello):
            self.exec_path = msg.exec_path
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(msg.pid)
                if self._hello_timer is not None:
                    self._hello_timer.cancel()

    def _kill_unowned(self, pid: int) -> None:
        """Ask the spawner to kill a child no unit owns. The socket is non-blocking: on a full
        buffer the request waits in `_kills` (sent first by _flush, when there is room), never
        dropped -- else the child would run with no pidfd and no unit."""
        self._kills.append(pid)
        self._flush()

    async def spawn(self, req: SpawnRequest, out_w: int, err_w: int | None = None) -> Spawned:
        """Spawn one unit process; out_w becomes its stdout, err_w its stderr (out_w when None).
        The caller keeps its fds open until this returns (they are sent at the end of this turn
        of the loop, with the other spawns asked for in it; see the module docstring)."""
        return await self.ask(req, out_w, err_w)

    def ask(self, req: SpawnRequest, out_w: int, err_w: int | None = None) -> asyncio.Future[Spawned]:
        """`spawn`, queued now (no turn of the loop in between): the answer's future. Cancelling
        it takes the request back while it is not sent (the caller may then close its fds)."""
        if self._closed or self.sock is None:
            raise SpawnError("spawner is not running")
        rid = next(self._ids)
        wire = spawn_wire(rid, req)
        env = wire.pop("env")
        # What JSON makes of it, near enough for a guard (escapes aside).
        size = sum(len(a) + 4 for a in req.argv) + sum(len(k) + len(v) + 6 for k, v in env.items())
        if size > MAX_BATCH_BYTES:
            raise SpawnError(f"spawn request too large ({size} bytes): environment or argv too big")
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        queued = QueuedSpawn(rid, wire, env, [out_w] if err_w is None else [out_w, err_w])
        queued.fds.extend(req.listen_fds)  # after stdio: the spawner counts them from the end
        self._queue.append(queued)

        def taken_back(f: asyncio.Future) -> None:
            # The caller's fds travel by reference until sent: a caller that gives up first
            # (and closes them) takes its request back; once sent, the kernel holds copies.
            if f.cancelled() and queued in self._queue:
                self._queue.remove(queued)
                self._pending.pop(rid, None)

        fut.add_done_callback(taken_back)
        if (len(self._queue) >= PIPELINE_SPAWNS or len(self._pending) == 1) and not self._writer:
            # A big tier goes out in parts as it is built: the spawner starts the first
            # children while this loop builds the next requests (two CPUs at work, not one).
            # A spawn while the spawner has nothing to do goes at once: the first of a tier is
            # not held back by its 31 next units' preparation (nor a restart by a turn).
            self._flush()
        elif not self._flush_scheduled and not self._writer:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return fut

    @property
    def queued(self) -> int:
        """Spawn requests asked for and not sent yet."""
        return len(self._queue)

    def _flush(self) -> None:
        """Send what this turn of the loop queued; on a full socket buffer, the rest waits
        for room (add_writer) and goes out in order."""
        self._flush_scheduled = False
        loop = asyncio.get_running_loop()
        while self._kills and self.sock is not None and not self._closed:
            try:
                self.sock.send(json.dumps({"op": "kill", "pid": self._kills[0]}).encode())
            except BlockingIOError:
                if not self._writer:
                    self._writer = True
                    loop.add_writer(self.sock.fileno(), self._flush)
                return  # the kill and the spawns after it wait for room, in order
            except OSError as exc:
                # The spawner is gone: its children die with it (PDEATHSIG).
                log.error("cannot ask the spawner to kill an unowned child", pid=self._kills[0], error=str(exc))
            del self._kills[0]
        if self._queue and self.sock is not None and not self._closed:
            if self.before_send is not None:
                self.before_send()
            for data, fds, taken in batch_datagrams(self._queue):
                try:
                    socket.send_fds(self.sock, [data], fds)
                except BlockingIOError:
                    if not self._writer:
                        self._writer = True
                        loop.add_writer(self.sock.fileno(), self._flush)
                    return  # the rest stays queued, in order
                except OSError as exc:
                    log.error("cannot send spawn requests to the spawner", error=str(exc))
                    for q in taken:
                        self._fail_queued(q, f"spawn failed: the spawner cannot be reached: {exc.strerror}")
                    del self._queue[:len(taken)]
                    continue
                del self._queue[:len(taken)]
        if self._writer:
            self._writer = False
            if self.sock is not None:
                loop.remove_writer(self.sock.fileno())
        for q in self._queue:  # the spawner went away with these still queued
            self._fail_queued(q, "spawner is not running")
        self._queue.clear()

    def _fail_queued(self, q: QueuedSpawn, why: str) -> None:
        fut = self._pending.pop(q.rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(SpawnError(why))

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the spawner to exit, wait for it, reap it (it is our only child)."""
        if self.sock is None:
            return
        loop = asyncio.get_running_loop()
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self._writer:
            self._writer = False
            loop.remove_writer(self.sock.fileno())
        for q in self._queue:
            self._fail_queued(q, "spawner is shutting down")
        self._queue.clear()
        if not self._closed:
            self._closed = True
            try:
                self.sock.send(json.dumps({"op": "shutdown"}).encode())
            except OSError:
                pass
            loop.remove_reader(self.sock.fileno())
            loop.remove_reader(self.pidfd)
        exited = loop.create_future()
        loop.add_reader(self.pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, timeout)
        except asyncio.TimeoutError:
            log.warning("spawner did not exit; killing it", pid=self.pid)
            linux.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            await asyncio.wait_for(exited, timeout)
        finally:
            loop.remove_reader(self.pidfd)
        self.reap()

    def reap(self) -> None:
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        if self.sock is not None:
            self.sock.close()
            self.sock = None
