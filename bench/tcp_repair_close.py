"""Would TCP_REPAIR end the notify socket's pause? How long the last close() of a TCP socket
that lingers (SO_LINGER on, its send queue full towards a peer that never reads) takes,
with and without TCP_REPAIR set on it first, and the ways around it that a local user has.

TCP_REPAIR (root: CAP_NET_ADMIN over the socket's network namespace) turns the close into
a silent abort (tcp_close: `tp->repair` -> disconnect, before the linger). Measured on the
cases an attacker of the notify socket can pick:

- plain lingering socket;                               with TCP_REPAIR set first
- after shutdown(SHUT_WR) (FIN_WAIT1);                  with TCP_REPAIR set first
- TCP_REPAIR, then SO_LINGER set again by a holder;     a uid-65534 holder clearing it
- a socket of the attacker's own user + network namespace, TCP_REPAIR cleared by the
  attacker (it has CAP_NET_ADMIN there) before its last copy goes
- a Unix socket carrying a lingering TCP socket in its queue (TCP_REPAIR cannot reach it)

Run as root: .venv/bin/python -m bench.tcp_repair_close [--linger 2]
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.harness import lingering_tcp_socket  # noqa: E402

TCP_REPAIR = 19
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SIOCSIFFLAGS, IFF_UP, IFF_LOOPBACK = 0x8914, 0x1, 0x8


def repair(s: socket.socket, on: bool = True) -> None:
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1 if on else 0)


def timed_close(s: socket.socket) -> float:
    t0 = time.monotonic()
    s.close()
    return (time.monotonic() - t0) * 1000


def case(linger: int, what: str, prep) -> None:
    c, srv, peer = lingering_tcp_socket(linger)
    try:
        note = prep(c) or ""
    except OSError as exc:
        note = f"refused: {exc}"
    print(f"{what:58s} close {timed_close(c):8.1f} ms  {note}")
    srv.close()
    peer.close()


def unprivileged_clear(c: socket.socket) -> str:
    repair(c)
    r, w = os.pipe()
    pid = os.fork()  # a bench, not the daemon: the uid-65534 holder of a copy
    if pid == 0:
        os.setgid(65534)
        os.setuid(65534)
        try:
            repair(c, False)
            os.write(w, b"cleared it")
        except OSError as exc:
            os.write(w, str(exc).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    said = os.read(r, 200).decode()
    os.close(r)
    return f"uid 65534 clearing TCP_REPAIR: {said}"


def own_namespace(linger: int) -> None:
    """The attacker (uid 65534) in a user + network namespace of its own sends its lingering
    socket, waits for TCP_REPAIR to be set, clears it and drops its copy: ours is the last."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        a.close()
        os.setgid(65534)
        os.setuid(65534)
        if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
            b.send(b"unshare refused")
            os._exit(1)
        fcntl.ioctl(socket.socket(socket.AF_INET, socket.SOCK_DGRAM), SIOCSIFFLAGS,
                    struct.pack("16sh", b"lo", IFF_UP | IFF_LOOPBACK))
        c, srv, peer = lingering_tcp_socket(linger)
        socket.send_fds(b, [b"s"], [c.fileno()])
        b.recv(1)
        repair(c, False)
        c.close()
        b.send(b"c")
        b.recv(1)
        os._exit(0)
    b.close()
    msg, fds, _, _ = socket.recv_fds(a, 100, 1)
    if not fds:
        print(f"{'own user+net namespace':58s} not measured: {msg.decode()}")
        os.waitpid(pid, 0)
        return
    c = socket.socket(fileno=fds[0])
    repair(c)
    a.send(b"r")
    a.recv(1)
    print(f"{'own user+net namespace, TCP_REPAIR cleared by its owner':58s} close {timed_close(c):8.1f} ms")
    a.send(b"e")
    os.waitpid(pid, 0)
    a.close()


def in_a_unix_socket(linger: int) -> None:
    c, srv, peer = lingering_tcp_socket(linger)
    x, y = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    socket.send_fds(x, [b"m"], [c.fileno()])
    c.close()  # the copy in flight is now the only one
    x.close()
    print(f"{'a Unix socket with a lingering TCP socket in its queue':58s} close {timed_close(y):8.1f} ms")
    srv.close()
    peer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--linger", type=int, default=2)
    linger = p.parse_args().linger
    print(f"kernel {os.uname().release}; SO_LINGER {linger} s")
    case(linger, "lingering", lambda c: None)
    case(linger, "lingering, TCP_REPAIR set first", repair)
    case(linger, "shutdown(SHUT_WR) (FIN_WAIT1), then TCP_REPAIR",
         lambda c: (c.shutdown(socket.SHUT_WR), repair(c), None)[2])
    case(linger, "TCP_REPAIR, then SO_LINGER set again",
         lambda c: (repair(c), c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger)))[1])
    case(linger, "TCP_REPAIR, a uid-65534 holder tries to clear it", unprivileged_clear)
    own_namespace(linger)
    in_a_unix_socket(linger)


if __name__ == "__main__":
    main()
