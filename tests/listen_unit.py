"""A unit for the held-socket tests (tests/test_sockets.py): reports what systemd's protocol
gave it (LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID, and what fds 3.. are), then answers each
connection on its first socket with its pid, until stopped.

  listen_unit.py REPORT_FILE [--ignore] [--child] [--bind HOST:PORT]
--ignore: never accept (a unit that does not use its fds); --child: run a grandchild that
reports too (it must not take the fds as its own: LISTEN_PID is not its pid); --bind: no
held socket, bind the port itself (what a restart refuses connections with)."""

import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys


def report(path: str) -> dict:
    n = int(os.environ.get("LISTEN_FDS", "0"))
    fds = []
    for fd in range(3, 3 + n):
        try:
            st = os.fstat(fd)
        except OSError:
            fds.append(None)
            continue
        s = socket.socket(fileno=fd) if stat.S_ISSOCK(st.st_mode) else None
        fds.append({"sock": s is not None, "family": int(s.family) if s else None,
                    "listening": bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)) if s else None,
                    "name": s.getsockname() if s else None, "cloexec": not os.get_inheritable(fd)})
        if s is not None:
            s.detach()
    mine = os.environ.get("LISTEN_PID") == str(os.getpid())
    r = {"pid": os.getpid(), "LISTEN_FDS": os.environ.get("LISTEN_FDS"), "LISTEN_PID": os.environ.get("LISTEN_PID"),
         "LISTEN_FDNAMES": os.environ.get("LISTEN_FDNAMES"), "mine": mine, "fds": fds,
         "fd_after": os.path.exists(f"/proc/self/fd/{3 + n}")}
    with open(path + ".tmp", "w") as f:
        json.dump(r, f)
    os.rename(path + ".tmp", path)
    return r


def main() -> None:
    path = sys.argv[1]
    r = report(path)
    if "--grandchild" in sys.argv:
        return
    if "--child" in sys.argv:  # inherits the environment (LISTEN_*) and, here, the fds too
        subprocess.run([sys.executable, __file__, path + ".child", "--grandchild"], check=False, close_fds=False)
    if "--ignore" in sys.argv:
        while True:
            signal.pause()
    if "--bind" in sys.argv:
        host, _, port = sys.argv[sys.argv.index("--bind") + 1].rpartition(":")
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, int(port)))
        srv.listen(1024)
    else:
        assert r["mine"] and int(r["LISTEN_FDS"]) >= 1, r
        srv = socket.socket(fileno=3)
        srv.setblocking(True)
    pid = str(os.getpid()).encode() + b"\n"
    # A graceful stop, as a real server's: SIGTERM ends the loop between two connections,
    # never with one accepted and not answered (what is still in the backlog waits there).
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    srv.setblocking(False)
    while not stop:
        if not select.select([srv], [], [], 0.05)[0]:
            continue
        try:
            conn, _ = srv.accept()
        except BlockingIOError:
            continue
        conn.setblocking(True)
        try:
            conn.sendall(pid)
        except OSError:
            pass
        conn.close()


if __name__ == "__main__":
    main()
