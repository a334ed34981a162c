"""A client loop for tests: connections opened at a steady rate (FM-34: ~500 a second),
each counted as refused, answered, or failed otherwise (reset, no answer in time)."""

from __future__ import annotations

import errno
import selectors
import socket
import threading
import time


class Clients:
    """Connections opened at `rate` a second from one thread (non-blocking: a connection that
    waits in a backlog does not slow the next), each reading the server's one-line answer.
    Counts: refused (ECONNREFUSED), answered, and anything else (reset, timeout)."""

    def __init__(self, port: int, rate: float = 500.0, host: str = "127.0.0.1", answer_timeout: float = 20.0,
                 http: str | None = None) -> None:
        self.addr = (host, port)
        # A path: send a GET of it, read the response to EOF; any HTTP status is an answer (a
        # body of digits is the answering pid). None: the server's first line is its pid.
        self.http = http
        self.statuses: dict[int, int] = {}
        self.rate = rate
        self.answer_timeout = answer_timeout
        self.refused = self.answered = self.attempts = 0
        self.other: list[str] = []
        self.other_at: list[float] = []
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Clients":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.answer_timeout + 10)

    def _fail(self, what: str) -> None:
        self.other.append(what)
        self.other_at.append(time.monotonic())

    def when(self) -> list[float]:
        """Monotonic times of the failures other than refusals, in order."""
        return list(self.other_at)

    def counts(self) -> dict:
        return {"attempts": self.attempts, "refused": self.refused, "answered": self.answered,
                "other": len(self.other), "other_examples": sorted(set(self.other))[:5], "pids": len(self.pids),
                **({"statuses": dict(self.statuses)} if self.http else {})}

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        period = 1.0 / self.rate
        next_at = time.monotonic()
        open_: dict[socket.socket, tuple[float, bytes]] = {}
        try:
            while not self._stop.is_set() or open_:
                now = time.monotonic()
                if not self._stop.is_set() and now >= next_at:
                    next_at += period
                    self.attempts += 1
                    s = socket.socket()
                    s.setblocking(False)
                    rc = s.connect_ex(self.addr)
                    if rc == errno.ECONNREFUSED:
                        self.refused += 1
                        s.close()
                    elif rc in (0, errno.EINPROGRESS):
                        open_[s] = (now, b"")
                        sel.register(s, selectors.EVENT_WRITE if self.http else selectors.EVENT_READ)
                    else:
                        self._fail(f"connect: {errno.errorcode.get(rc, rc)}")
                        s.close()
                for key, _ in sel.select(timeout=max(0.0, min(period, next_at - time.monotonic()))):
                    s = key.fileobj
                    since, got = open_[s]
                    if key.events & selectors.EVENT_WRITE:
                        err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        if err == 0:
                            s.send(f"GET {self.http} HTTP/1.0\r\nHost: x\r\n\r\n".encode())  # the buffer takes it
                            sel.modify(s, selectors.EVENT_READ)
                            continue
                        if err == errno.ECONNREFUSED:
                            self.refused += 1
                        else:
                            self._fail(f"connect: {errno.errorcode.get(err, err)}")
                        sel.unregister(s)
                        s.close()
                        del open_[s]
                        continue
                    try:
                        chunk = s.recv(4096)
                    except ConnectionRefusedError:
                        self.refused += 1
                        chunk = None
                    except OSError as exc:
                        self._fail(f"recv: {exc}")
                        chunk = None
                    if chunk:
                        got += chunk
                        if self.http or not got.endswith(b"\n"):
                            open_[s] = (since, got)
                            continue
                        self.answered += 1
                        self.pids.add(int(got))
                    elif chunk == b"" and self.http and got.startswith(b"HTTP/1.") and got[9:12].isdigit():
                        self.answered += 1
                        status = int(got[9:12])
                        self.statuses[status] = self.statuses.get(status, 0) + 1
                        body = got.rpartition(b"\r\n\r\n")[2]
                        if body.isdigit():
                            self.pids.add(int(body))
                    elif chunk == b"":
                        self._fail(f"closed without an answer: {got[:60]!r}")
                    sel.unregister(s)
                    s.close()
                    del open_[s]
                for s, (since, _) in list(open_.items()):
                    if time.monotonic() - since > self.answer_timeout:
                        self._fail("no answer in time")
                        sel.unregister(s)
                        s.close()
                        del open_[s]
        finally:
            for s in open_:
                s.close()
            sel.close()
