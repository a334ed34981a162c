"""Wire protocol and settings shared by the reference stack (units/demo).

serve --(DEALER -> ROUTER, tcp 127.0.0.1:OMNID_DEMO_ENGINE_PORT)--> engine
engine <--(ROUTER <- DEALER, tcp 127.0.0.1:OMNID_DEMO_WORKER_PORT)-- worker@N

Every message is one ZeroMQ frame holding one JSON object with a ``type``
(the ROUTER side also sees the peer's routing id in front of it). Every peer
sends a heartbeat every ``HEARTBEAT_S``; a peer silent for ``LOST_AFTER_S`` is
lost, and what it was doing is failed at once (FAILURE_MATRIX "fails fast").

This module must stay free of torch: the engine and the serve import it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any, NoReturn

import zmq

HEARTBEAT_S = 0.1
LOST_AFTER_S = 0.5
# How often the loss checks run: a lost peer is noticed within LOST_AFTER_S + CHECK_S.
CHECK_S = 0.05

DEFAULT_HOST = "127.0.0.1"
DEFAULT_ENGINE_PORT = 5600
DEFAULT_WORKER_PORT = 5601
DEFAULT_SERVE_PORT = 8000

MAX_MESSAGE_BYTES = 1 << 20


def env_str(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


def env_int(name: str, default: int, minimum: int = 0) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r}: expected an integer") from None
    if value < minimum:
        raise SystemExit(f"{name}={raw!r}: expected an integer >= {minimum}")
    return value


def env_float(name: str, default: float, minimum: float = 0.0) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r}: expected a number") from None
    if value < minimum:
        raise SystemExit(f"{name}={raw!r}: expected a number >= {minimum}")
    return value


def host() -> str:
    """Numeric address every demo socket binds or connects to (no resolver threads)."""
    return env_str("OMNID_DEMO_HOST", DEFAULT_HOST)


def engine_endpoint() -> str:
    """Where the engine listens for the serve."""
    return f"tcp://{host()}:{env_int('OMNID_DEMO_ENGINE_PORT', DEFAULT_ENGINE_PORT, 1)}"


def worker_endpoint() -> str:
    """Where the engine listens for workers."""
    return f"tcp://{host()}:{env_int('OMNID_DEMO_WORKER_PORT', DEFAULT_WORKER_PORT, 1)}"


def unit_name(default: str) -> str:
    """This process's unit name, as omnid sets it (omnid.unit(5), ENVIRONMENT OF A UNIT)."""
    return env_str("OMNID_UNIT", default)


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(frame: bytes) -> dict[str, Any] | None:
    """The JSON object in ``frame``, or None when it is not one (the caller logs and drops it)."""
    if len(frame) > MAX_MESSAGE_BYTES:
        return None
    try:
        message = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        return None
    return message


def send_now(sock: zmq.Socket, frames: list[bytes]) -> zmq.ZMQError | None:
    """Send without ever waiting; the error (EAGAIN, EHOSTUNREACH) is returned, not raised.

    A zmq.asyncio socket reports send errors on the Future it returns; with NOBLOCK that
    Future is already resolved, so reading it here keeps the error from going unseen.
    """
    try:
        outcome = sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        return exc
    if isinstance(outcome, asyncio.Future):
        if not outcome.done():  # not expected with NOBLOCK; never leave an error unseen
            outcome.add_done_callback(lambda f: f.cancelled() or f.exception())
            return None
        exc = outcome.exception()
        return exc if isinstance(exc, zmq.ZMQError) else None
    return None


def setup_logging(name: str) -> logging.Logger:
    """Line-per-event logs on stderr: omnid reads unit output line by line and adds the unit name."""
    logging.basicConfig(
        stream=sys.stderr,
        level=env_str("OMNID_DEMO_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    return logging.getLogger(name)


# --------------------------------------------------------------------------- exiting
_terminated_by: int | None = None


def note_stop_signal(signum: int) -> None:
    """Remember the first stop signal, so the process can exit *by* it (see exit_process)."""
    global _terminated_by
    if _terminated_by is None:
        _terminated_by = int(signum)


def exit_process(status: int) -> NoReturn:
    """Leave now. After a clean stop on a signal, die by that signal (default action
    restored, then raised): the Unix convention (bash does it too), so the supervisor
    sees "killed by SIGTERM" and can say which signal ended the process."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if _terminated_by is not None and status == 0:
        signal.signal(_terminated_by, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [_terminated_by])
        os.kill(os.getpid(), _terminated_by)
    os._exit(status)
