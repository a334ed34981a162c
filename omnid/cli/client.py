"""Talking to a running daemon: the control socket (one request at a time, each
reply awaited with a deadline) and the events socket. Used by omnid.cli."""

from __future__ import annotations

import json
import os
import time

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_DAEMON = 0, 1, 2, 3


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- client
class Client:
    """One request at a time over a DEALER socket, each reply awaited with a deadline."""

    def __init__(self, control: str) -> None:
        from omnid.api.control import ControlError, check_control_dir, socket_is_live
        from omnid.base.ownership import trusted_uids

        self.control = control
        try:  # never talk to a socket another user could have planted
            check_control_dir(control, trusted_uids())
        except ControlError as exc:
            if os.path.lexists(os.path.dirname(os.path.abspath(control))):
                raise CliError(exc.message, EXIT_FAILED) from None
        if not os.path.exists(control) or not socket_is_live(control):
            raise CliError(f"no omnid daemon running (no control socket answering at {control})", EXIT_NO_DAEMON)
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{control}")
        self._n = 0

    def call(self, cmd: str, args: dict | None = None, timeout: float = 30.0):
        self._n += 1
        rid = f"{os.getpid()}-{self._n}"
        self.sock.send(json.dumps({"id": rid, "cmd": cmd, "args": args or {}}).encode())
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CliError(f"no answer to {cmd!r} from the daemon within {timeout:g} s")
            if self.sock.poll(min(left, 0.5) * 1000):
                reply = json.loads(self.sock.recv())
                if reply.get("id") != rid:
                    continue
                if not reply.get("ok"):
                    err = reply.get("error") or {}
                    code = EXIT_USAGE if err.get("code") in ("unknown_unit", "bad_request", "invalid_stack") \
                        else EXIT_FAILED
                    raise CliError(err.get("message") or "the daemon refused the request", code)
                return reply.get("result")
            if not os.path.exists(self.control):
                # The daemon removes its socket right after its last reply (reexec, shutdown),
                # which can still be on its way here: a last look before saying it is gone.
                if self.sock.poll(1000):
                    continue
                raise CliError(f"the daemon went away while answering {cmd!r}")

    def close(self) -> None:
        self.sock.close(0)


def subscribe(control: str):
    import zmq

    from omnid.api.control import events_path

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # connect() returns before the connection exists (ZeroMQ's "slow joiner"): wait
    # (bounded) until it does, so that a snapshot taken next misses no later event.
    from zmq.utils.monitor import recv_monitor_message

    mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
    try:
        sub.connect(f"ipc://{events_path(control)}")
        deadline = time.monotonic() + 2.0
        while (left := deadline - time.monotonic()) > 0 and mon.poll(left * 1000):
            if recv_monitor_message(mon)["event"] == zmq.EVENT_CONNECTED:
                break
    finally:
        sub.disable_monitor()
        mon.close(0)
    return sub
