"""A unit for the fd store tests (tests/test_fdstore.py): reports what it was given back
(LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID, and what each fd 3.. is: its /proc link, a memory
file's content, whether a socket listens), then, on a start that got nothing back, hands fds
to omnid over NOTIFY_SOCKET with sendmsg (SCM_RIGHTS), as sd_pid_notify_with_fds(3) does.

  fdstore_unit.py REPORT MODE [ARG]
MODE store PORT: a memfd "state" (with content) and a listening socket "listener" on
  127.0.0.1:PORT; then answers each connection on the listener (its own or the one given
  back) with its pid.
MODE many N: N memfds named "m" in one message.
MODE remove: memfds "a" and "b", then FDSTOREREMOVE=1 FDNAME=a.
MODE hup: the read ends of two pipes, "polled" and "unpolled" (FDPOLL=0), then closes both
  write ends (both read ends hang up).
MODE flood N: N FDSTORE=1 datagrams, each with an eventfd, as fast as the socket takes them.
"""

import array
import json
import os
import signal
import socket
import sys
import time


def send(fields: str, fds: list[int] = ()) -> None:
    addr = os.environ["NOTIFY_SOCKET"]
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.connect(addr)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        s.sendmsg([fields.encode()], anc)
    finally:
        s.close()


def given() -> list[dict]:
    out = []
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return out
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    for i in range(int(os.environ.get("LISTEN_FDS", "0"))):
        fd = 3 + i
        d = {"fd": fd, "name": names[i] if i < len(names) else None, "link": os.readlink(f"/proc/self/fd/{fd}"),
             "cloexec": not os.get_inheritable(fd)}
        if d["link"].startswith("/memfd:"):
            d["content"] = os.pread(fd, 100, 0).decode()
        elif d["link"].startswith("socket:"):
            s = socket.socket(fileno=fd)
            d["listening"] = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            s.detach()
        out.append(d)
    return out


def write(path: str, r: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(r, f)
    os.rename(path + ".tmp", path)


def memfd(content: str) -> int:
    fd = os.memfd_create("state")
    os.write(fd, content.encode())
    return fd


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    arg = sys.argv[3] if len(sys.argv) > 3 else ""
    fds = given()
    r = {"pid": os.getpid(), "LISTEN_FDS": os.environ.get("LISTEN_FDS"), "LISTEN_PID": os.environ.get("LISTEN_PID"),
         "LISTEN_FDNAMES": os.environ.get("LISTEN_FDNAMES"), "fds": fds,
         "fd_after": os.path.exists(f"/proc/self/fd/{3 + len(fds)}") and bool(fds), "stored": False}
    listener = None
    if mode == "store":
        back = [d for d in fds if d["name"] == "listener"]
        if back:
            listener = socket.socket(fileno=back[0]["fd"])
        else:
            m = memfd(f"kept by {os.getpid()}")
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past connections' TIME_WAIT
            listener.bind(("127.0.0.1", int(arg)))
            listener.listen(64)
            send("FDSTORE=1\nFDNAME=state", [m])
            send("FDSTORE=1\nFDNAME=listener", [listener.fileno()])
            os.close(m)
    elif fds:
        pass  # the others store on their first start only
    elif mode == "many":
        ms = [memfd(f"m{i}") for i in range(int(arg))]
        send("FDSTORE=1\nFDNAME=m", ms)
        for m in ms:
            os.close(m)
    elif mode == "remove":
        a, b = memfd("a"), memfd("b")
        send("FDSTORE=1\nFDNAME=a", [a])
        send("FDSTORE=1\nFDNAME=b", [b])
        send("FDSTOREREMOVE=1\nFDNAME=a")
        os.close(a), os.close(b)
    elif mode == "hup":
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        r["pipes"] = {"polled": os.readlink(f"/proc/self/fd/{r1}"), "unpolled": os.readlink(f"/proc/self/fd/{r2}")}
        send("FDSTORE=1\nFDNAME=polled", [r1])
        send("FDSTORE=1\nFDNAME=unpolled\nFDPOLL=0", [r2])
        for fd in (r1, w1, r2, w2):
            os.close(fd)
    elif mode == "flood":
        while not os.path.exists(path + ".go"):  # the test counts the daemon's fds first
            time.sleep(0.01)
        ev = os.eventfd(0)
        sent = refused = 0
        addr = os.environ["NOTIFY_SOCKET"]
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.connect("\0" + addr[1:] if addr.startswith("@") else addr)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ev]).tobytes())]
        for i in range(int(arg)):
            try:
                s.sendmsg([b"FDSTORE=1\nFDNAME=flood"], anc)
                sent += 1
            except OSError:  # ETOOMANYREFS: the kernel's bound on fds in flight
                refused += 1
                time.sleep(0.001)
        r["flood"] = {"sent": sent, "refused": refused}
    r["stored"] = True
    write(path, r)
    if listener is None:
        while True:
            signal.pause()
    while True:
        c, _ = listener.accept()
        c.sendall(f"{os.getpid()}\n".encode())
        c.close()


if __name__ == "__main__":
    main()
