"""The daemon's side of the spawner protocol (see omnid/spawner.py).

Starts the spawner by posix_spawn (vfork + exec: safe from a threaded process,
never a fork of the daemon), then turns its datagrams into awaitable spawn
results and exit reports on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from omnid import linux

log = structlog.get_logger("omnid.spawner")

MAX_MESSAGE = 1 << 20


@dataclass(frozen=True)
class SpawnRequest:
    unit: str
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None = None
    user: str | None = None
    group: str | None = None
    rlimits: tuple[tuple[int, int, int], ...] = ()
    cgroup: str | None = None


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


@dataclass(frozen=True)
class ExitReport:
    pid: int
    status: int
    adopted: bool


class SpawnerGone(Exception):
    pass


# ------------------------------------------------------------- protocol messages
# Typed on both edges: the daemon builds `SpawnRequest.to_wire`, and every datagram
# from the spawner is decoded once, here, into one of the frozen dataclasses below;
# nothing downstream reads a raw dict.

class ProtocolError(ValueError):
    """A spawner message that does not have the shape this module expects."""


@dataclass(frozen=True)
class Hello:
    pid: int


@dataclass(frozen=True)
class SpawnedMsg:
    id: int
    pid: int
    start_time: int


@dataclass(frozen=True)
class SpawnFailedMsg:
    id: int
    error: str
    errno: int = 0  # exec(2)'s errno when exec failed, else 0


SpawnerMessage = Hello | SpawnedMsg | SpawnFailedMsg | ExitReport

_FIELDS: dict[str, tuple[type, tuple[tuple[str, type], ...]]] = {
    "hello": (Hello, (("pid", int),)),
    "spawned": (SpawnedMsg, (("id", int), ("pid", int), ("start_time", int))),
    "spawn_failed": (SpawnFailedMsg, (("id", int), ("error", str), ("errno", int))),
    "exit": (ExitReport, (("pid", int), ("status", int), ("adopted", bool))),
}


def decode(msg: object) -> SpawnerMessage:
    """One spawner datagram (parsed JSON) as its typed message; ProtocolError names the op and field."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"message is a {type(msg).__name__}, not an object")
    op = msg.get("op")
    if op not in _FIELDS:
        raise ProtocolError(f"unknown op {op!r}")
    cls, fields = _FIELDS[op]
    values = []
    for name, typ in fields:
        v = msg.get(name)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise ProtocolError(f"{op}: field {name!r} must be {typ.__name__}, got {v!r}")
        values.append(v)
    return cls(*values)


def spawn_wire(rid: int, req: SpawnRequest) -> dict:
    """The spawn request as the spawner reads it (see omnid/spawner.py)."""
    return {"op": "spawn", "id": rid, "unit": req.unit, "argv": list(req.argv), "env": req.env, "cwd": req.cwd,
            "user": req.user, "group": req.group, "rlimits": [list(r) for r in req.rlimits], "cgroup": req.cgroup}


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
        self._closed = False

    def launch(self) -> None:
        """Start the spawner by exec. Callable before the event loop runs."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        theirs.set_inheritable(True)
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)
        argv = [sys.executable, "-m", "omnid.spawner", str(theirs.fileno()), str(os.getpid())]
        # Its own session: a SIGTERM or Ctrl+C to the daemon's process group must reach
        # the daemon only, which then stops the stack in order.
        self.pid = os.posix_spawn(sys.executable, argv, env, setsid=True)
        self.pidfd = linux.pidfd_open(self.pid)
        self.start_time = linux.start_time_of(self.pid) or 0
        theirs.close()
        ours.setblocking(False)
        self.sock = ours

    async def attach(self, timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        self._hello = loop.create_future()
        assert self.sock is not None
        loop.add_reader(self.sock.fileno(), self._readable)
        loop.add_reader(self.pidfd, self._spawner_died)
        try:
            await asyncio.wait_for(self._hello, timeout)
        except asyncio.TimeoutError as exc:
            raise SpawnerGone(f"spawner (pid {self.pid}) did not answer within {timeout:.0f} s") from exc

    def _spawner_died(self) -> None:
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
                data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 4)
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
            self._dispatch(msg, fds)

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
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(msg.pid)

    def _kill_unowned(self, pid: int) -> None:
        try:
            assert self.sock is not None
            self.sock.send(json.dumps({"op": "kill", "pid": pid}).encode())
        except OSError as exc:
            log.error("cannot ask the spawner to kill an unowned child", pid=pid, error=str(exc))

    async def spawn(self, req: SpawnRequest, out_w: int, err_w: int | None = None) -> Spawned:
        """Spawn one unit process; out_w becomes its stdout, err_w its stderr (out_w when None)."""
        if self._closed or self.sock is None:
            raise SpawnError("spawner is not running")
        rid = next(self._ids)
        msg = spawn_wire(rid, req)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        data = json.dumps(msg).encode()
        if len(data) > MAX_MESSAGE // 2:
            self._pending.pop(rid, None)
            raise SpawnError(f"spawn request too large ({len(data)} bytes): environment or argv too big")
        fds = [out_w] if err_w is None else [out_w, err_w]
        try:
            socket.send_fds(self.sock, [data], fds)
        except BlockingIOError:
            # Socket buffer full: wait until writable, then retry once.
            await self._wait_writable()
            socket.send_fds(self.sock, [data], fds)
        return await fut

    async def _wait_writable(self) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        assert self.sock is not None
        fd = self.sock.fileno()
        loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            loop.remove_writer(fd)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the spawner to exit, wait for it, reap it (it is our only child)."""
        if self.sock is None:
            return
        loop = asyncio.get_running_loop()
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
