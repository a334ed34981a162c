"""supervisord event listener used by the bench (runs under supervisord's venv).

    python sd_listener.py SOCKET_PATH

Speaks supervisord's listener protocol on stdin/stdout and forwards every
event, stamped with CLOCK_MONOTONIC ns at the moment it was read, as one JSON
datagram to the harness's Unix datagram socket SOCKET_PATH. Sends a
{"hello": true} datagram first so the harness knows it is connected.
"""
import json
import socket
import sys
import time


def main() -> int:
    path = sys.argv[1]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def send(obj) -> None:
        try:
            sock.sendto(json.dumps(obj).encode(), path)
        except OSError:
            pass  # the harness is gone or busy: never block supervisord

    send({"hello": True, "ts": time.monotonic_ns()})
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        stdout.write(b"READY\n")
        stdout.flush()
        line = stdin.readline()
        if not line:
            return 0
        ts = time.monotonic_ns()
        header = dict(tok.split(":", 1) for tok in line.decode().split())
        body = stdin.read(int(header.get("len", 0))).decode()
        payload = {}
        first = body.split("\n", 1)[0]
        for tok in first.split():
            if ":" in tok:
                k, v = tok.split(":", 1)
                payload[k] = v
        send({"ts": ts, "event": header.get("eventname"), "payload": payload})
        stdout.write(b"RESULT 2\nOK")
        stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
