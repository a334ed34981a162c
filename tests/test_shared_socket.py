"""One held socket for the instances of a unit (omnid.unit(5) `sockets`, FM-40's second half
without an engine): `instances = 2` on one TCP address without reuseport get the same kernel
socket as fd 3, the daemon holds it once, and connections waiting in it when one instance is
SIGKILLed are answered by the other. What a socket is, is read from /proc."""

from __future__ import annotations

import os
import socket
import sys

from omnid.base import linux
from omnid.model.units import check_stack
from tests.harness import free_port, make_stack, wait_for

PY = sys.executable

# Accepts on fd 3 and answers its pid; with HOLD set in its directory, it accepts one
# connection and then sleeps (busy, as an engine on a long request).
ACCEPTOR = r'''
import os, socket, sys, time
s = socket.socket(fileno=3)
s.setblocking(True)
hold = sys.argv[1]
while True:
    c, _ = s.accept()
    if os.path.exists(hold):
        time.sleep(3600)
    c.sendall(f"{os.getpid()}\n".encode())
    c.close()
'''


def _inode(pid: int, fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None


def _socket_inodes(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        link = _inode(pid, int(fd))
        if link and link.startswith("socket:"):
            out.append(link)
    return out


def _stack(tmp_path, port: int, extra: str = "") -> tuple:
    script = tmp_path / "acceptor.py"
    script.write_text(ACCEPTOR)
    hold = tmp_path / "hold-%i"
    return make_stack({"w": f'exec = ["{PY}", "{script}", "{hold}"]\ninstances = 2\nrestart = "always"\n'
                            f'restart_sec = 0.2\nsockets = [{{ listen = "127.0.0.1:{port}" }}]\n{extra}'}), tmp_path


def test_instances_on_one_address_share_one_socket_unless_reuseport(tmp_path):
    port = free_port()
    shared, _ = _stack(tmp_path, port)
    assert check_stack(shared) == ()
    two = make_stack({"a": f'exec = ["true"]\nsockets = [{{ listen = "127.0.0.1:{port}" }}]\n',
                      "b": f'exec = ["true"]\nsockets = [{{ listen = "127.0.0.1:{port}" }}]\n'})
    errors = [str(e) for e in check_stack(two)]
    assert any(f'"127.0.0.1:{port}" is also a socket of a' in e for e in errors), errors


def test_instances_accept_on_one_held_socket_and_a_killed_one_leaves_its_backlog_to_the_other(
        daemon_factory, tmp_path):
    port = free_port()
    st, d_tmp = _stack(tmp_path, port)
    d = daemon_factory(st)
    p0 = d.wait_state("w@0", "active")["pid"]
    p1 = d.wait_state("w@1", "active")["pid"]
    s0, s1 = _inode(p0, 3), _inode(p1, 3)
    held = _socket_inodes(d.pid)
    assert s0 == s1 and s0 is not None, f"w@0 fd 3 {s0}, w@1 fd 3 {s1}: expected one socket"
    assert held.count(s0) == 1, f"the daemon holds {held.count(s0)} fds on {s0} (expected 1): {held}"

    # Both accept: each pid answers some of 40 connections.
    seen = set()
    for _ in range(40):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            seen.add(int(c.recv(64)))
    assert seen == {p0, p1}, f"answers came from {seen}, expected both instances {p0}, {p1}"

    # w@0 takes one connection and hangs on it; w@1 is stopped (SIGSTOP): the next connections
    # wait in the shared backlog. Then w@0 is SIGKILLed and w@1 resumed: the waiting ones are
    # answered by w@1; the one w@0 had accepted is lost with it.
    (d_tmp / "hold-0").write_text("")
    os.kill(p1, 19)
    # Until w@1 has stopped, it still sleeps in accept(): the kernel would hand it the wake-up
    # for the next connection (one sleeper woken per connection), w@0 would sleep on, and the
    # connection wait in the backlog (seen under load).
    wait_for(lambda: (st := linux.read_stat(p1)) is not None and st.state == "T", 30, "w@1 stopped")
    try:
        first = socket.create_connection(("127.0.0.1", port), timeout=5)
        wait_for(lambda: (_inode(p0, 4) or "").startswith("socket:"), 30,
                 "w@0 to accept the first connection (its fd 4)", interval=0.02)
        waiting = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        os.kill(p0, 9)
        wait_for(lambda: not os.path.exists(f"/proc/{p0}/fd/3"), 10, "w@0 gone")
    finally:
        os.kill(p1, 18)
    answers = []
    for c in waiting:
        try:
            answers.append(int(c.recv(64) or b"0"))
        except OSError as exc:
            answers.append(type(exc).__name__)
        c.close()
    first.settimeout(5)
    try:
        lost = first.recv(64)
    except OSError as exc:
        lost = type(exc).__name__
    first.close()
    print(f"waiting connections answered by: {answers}; the one w@0 had accepted: {lost!r}")
    assert answers == [p1] * 20, f"expected all 20 answered by w@1 ({p1}), got {answers}"
    assert lost in (b"", "ConnectionResetError"), f"w@0's accepted connection: {lost!r}"
    os.unlink(d_tmp / "hold-0")
    p0b = wait_for(lambda: (u := d.unit("w@0"))["state"] == "active" and u["pid"] not in (p0, None) and u["pid"],
                   15, "w@0 back after its SIGKILL")
    assert _inode(p0b, 3) == s1, "the new w@0 accepts on the same socket"
    d.ok("stop", {"units": ["w@0"]})
    assert s1 in _socket_inodes(d.pid), "a stopped instance leaves the shared socket held (w@1 still accepts)"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        assert int(c.recv(64)) == p1

