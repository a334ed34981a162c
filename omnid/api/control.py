"""Control socket (ZeroMQ ROUTER) and event stream (PUB) (omnid-control(7)).

Request  {"id": any, "cmd": str, "args": {...}}
Reply    {"id": same, "ok": true, "result": ...}
      or {"id": same, "ok": false, "error": {"code": str, "message": str}}

Every request runs as its own task, so a long `stop` never blocks a `status`.
A malformed, oversized or unknown request gets an error reply; the daemon never
stops because of a request.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnid.base.ownership import UnsafePath, check_private_dir, owner_name
from omnid.process import proof

import structlog

if TYPE_CHECKING:
    import zmq.asyncio

# zmq is imported where the control socket is made, not here: ControlError is needed by
# modules on the way to the first spawn, and libzmq's import is not (omnid/daemon/main.py).

log = structlog.get_logger("omnid.api.control")

MAX_REQUEST = 1 << 20
SUN_PATH_MAX = 107


class ControlError(Exception):
    """An error reply: code and a message that is never empty."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message or code)
        self.code = code
        self.message = message or code


def events_path(control: str) -> str:
    return control + ".events"


def prepare_socket_dir(control: str, group: str | None = None) -> None:
    """Create the control directory 0700 (0750 with a group); refuse a live socket."""
    path = Path(control)
    if len(str(path)) > SUN_PATH_MAX or len(events_path(str(path))) > SUN_PATH_MAX:
        raise ControlError("bad_path", f"control path {control!r} is longer than {SUN_PATH_MAX - 7} "
                                       "characters (a Unix socket limit); choose a shorter --control")
    directory = path.parent
    mode = 0o750 if group else 0o700
    if not os.path.lexists(directory):
        directory.mkdir(parents=True, mode=mode)
        os.chmod(directory, mode)  # mkdir's mode is filtered by the umask; this one is ours
    # An existing directory is someone's: refuse it unless it is ours alone (sshd StrictModes).
    check_control_dir(str(path))
    for p in (str(path), events_path(str(path))):
        if os.path.exists(p):
            if socket_is_live(p):
                raise ControlError("already_running", f"another omnid daemon answers on {p}")
            # Stale: its daemon is gone. The directory was just checked to be the daemon's alone.
            if not (verdict := _daemon_file(p)):
                raise ControlError("unsafe_path", f"will not remove {p}: {verdict.reason}")
            os.unlink(p)


def check_control_dir(control: str, trusted: tuple[int, ...] | None = None) -> None:
    """The control socket's directory must be ours and writable by no one else, and an
    existing socket in it ours: otherwise another user could answer in the daemon's place.
    Raises ControlError("unsafe_path") naming path, owner and mode."""
    directory = os.path.dirname(os.path.abspath(control))
    try:
        trusted = trusted or (os.geteuid(),)
        check_private_dir(directory, "control directory", trusted)
        for p in (control, events_path(control)):
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            if st.st_uid not in trusted:
                raise UnsafePath(f"refusing control socket {p}: owned by {owner_name(st.st_uid)}, "
                                 f"expected {' or '.join(owner_name(u) for u in trusted)}")
    except UnsafePath as exc:
        raise ControlError("unsafe_path", str(exc)) from None


def _daemon_file(path: str) -> proof.Verdict:
    """A file in the control directory (checked: the daemon's user's alone) is the daemon's
    when it is owned by that user and no link (omnid.process.proof.daemon_file)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return proof.Verdict(True, f"{path} is gone")
    return proof.daemon_file(path, st, (os.geteuid(),))


def socket_is_live(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        return True
    finally:
        s.close()


Handler = Callable[[dict], Awaitable[Any]]


class ControlServer:
    def __init__(self, ctx: zmq.asyncio.Context, control: str, handlers: dict[str, Handler]) -> None:
        import zmq

        self._noblock, self._zmq_error = zmq.NOBLOCK, zmq.ZMQError
        self.control = control
        self.handlers = handlers
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # libzmq drops a peer that sends more than this: the "dropped connection" answer.
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST + 4096)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # XPUB: like PUB, and it hands the daemon every subscription, so `status` can say how
        # many were made (a client's proof that its subscription is live: ZeroMQ's slow joiner).
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 10000)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.subscriptions = 0  # subscribe messages received on the event socket
        # Publishing never waits (NOBLOCK, drop at the high-water mark): a plain socket
        # sharing the same libzmq socket skips the asyncio wrapper's per-send overhead.
        self._pub_now = zmq.Socket.shadow(self.pub.underlying)
        self._tasks: set[asyncio.Task] = set()
        self._reader: asyncio.Task | None = None
        self._subs: asyncio.Task | None = None

    def bind(self) -> None:
        old = os.umask(0o077)
        try:
            self.router.bind(f"ipc://{self.control}")
            self.pub.bind(f"ipc://{events_path(self.control)}")
        finally:
            os.umask(old)

    def start(self) -> asyncio.Task:
        """Start reading requests; the reader's task (the daemon supervises it)."""
        self._reader = asyncio.get_running_loop().create_task(self._serve())
        if self._subs is None or self._subs.done():
            self._subs = asyncio.get_running_loop().create_task(self._count_subscriptions())
        return self._reader

    @property
    def replying(self) -> bool:
        """Are replies still being worked out or sent?"""
        return bool(self._tasks)

    async def _count_subscriptions(self) -> None:
        """Subscriptions arrive once the publisher has applied them: count them. Unsubscribe
        messages (first byte 0) and anything else are read and dropped."""
        while True:
            try:
                msg = await self.pub.recv()
            except asyncio.CancelledError:
                raise
            except self._zmq_error as exc:  # zmq itself is imported for type checking only
                log.warning("event socket receive failed", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            if msg[:1] == b"\x01":
                self.subscriptions += 1
            if self.subscriptions % 64 == 0:
                await asyncio.sleep(0)  # a burst of subscriptions cannot hold the loop

    def publish(self, event: dict) -> None:
        try:
            self._pub_now.send(json.dumps(event).encode(), self._noblock)
        except self._zmq_error as exc:
            log.warning("event not published", error=str(exc))

    async def _serve(self) -> None:
        while True:
            try:
                frames = await self.router.recv_multipart(copy=True)
            except asyncio.CancelledError:
                raise
            except self._zmq_error as exc:
                log.warning("control socket receive failed", error=str(exc))
                continue
            if len(frames) < 2:
                continue
            envelope, payload = frames[:-1], frames[-1]
            task = asyncio.get_running_loop().create_task(self._answer(envelope, payload))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, envelope: list[bytes], payload: bytes) -> None:
        rid: Any = None
        try:
            if len(payload) > MAX_REQUEST:
                raise ControlError("too_large", f"request of {len(payload)} bytes is over the 1 MiB limit")
            try:
                req = json.loads(payload)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ControlError("bad_request", f"request is not valid JSON: {exc}") from None
            if not isinstance(req, dict):
                raise ControlError("bad_request", "request must be a JSON object with \"cmd\"")
            rid = req.get("id")
            cmd = req.get("cmd")
            args = req.get("args", {})
            if not isinstance(cmd, str) or not cmd:
                raise ControlError("bad_request", "request needs \"cmd\": a non-empty string")
            if not isinstance(args, dict):
                raise ControlError("bad_request", f"\"args\" must be an object, got {type(args).__name__}")
            handler = self.handlers.get(cmd)
            if handler is None:
                raise ControlError("unknown_command",
                                   f"unknown command {cmd[:60]!r}; known: {', '.join(sorted(self.handlers))}")
            result = await handler(args)
            reply = {"id": rid, "ok": True, "result": result}
        except ControlError as exc:
            reply = {"id": rid, "ok": False, "error": {"code": exc.code, "message": exc.message}}
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the daemon never dies of a request
            log.exception("control request crashed")
            reply = {"id": rid, "ok": False,
                     "error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}" or "internal error"}}
        try:
            data = json.dumps(reply, default=str).encode()
        except (TypeError, ValueError) as exc:
            data = json.dumps({"id": None, "ok": False,
                               "error": {"code": "internal", "message": f"reply not serialisable: {exc}"}}).encode()
        try:
            await self.router.send_multipart([*envelope, data])
        except self._zmq_error as exc:
            log.info("control client went away before its reply", error=str(exc))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._subs is not None:
            self._subs.cancel()
        for t in list(self._tasks):
            t.cancel()
        # The replies already handed to ZeroMQ (the `reexec` or `shutdown` answer) go out: the
        # context's term() after this waits for them, 0.5 s at most (a peer not reading). With
        # no linger they were dropped when the program was replaced first, and a client on a
        # loaded machine saw "the daemon went away while answering 'reexec'".
        self.router.close(linger=500)
        self.pub.close(linger=100)
        for p in (self.control, events_path(self.control)):
            if not (verdict := _daemon_file(p)):
                log.warning("control socket file not removed", path=p, why=verdict.reason)
                continue
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
