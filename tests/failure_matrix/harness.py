"""The reference stack under test, and a client that keeps it under load.

`DemoStack` copies units/demo into a fresh directory, moves every port to a free
one (units inherit the daemon's environment: OMNID_DEMO_* reach serve, engine
and workers) and can override keys per row (restart policy, watchdog). `Load`
keeps N concurrent generate requests in flight and records, for each one, when
it started, when it ended and how (status code, or the connection error).
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import REPO, Daemon, free_port, wait_for

DEMO_UNITS = REPO / "units" / "demo"
FAIL_FAST_S = 2.0


class DemoStack:
    def __init__(self, restart: str = "no", overrides: dict[str, dict[str, str | None]] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="omfm-", dir="/tmp"))
        self.serve_port = free_port()
        self.engine_port = free_port()
        self.worker_port = free_port()
        for src in DEMO_UNITS.glob("*.toml"):
            text = src.read_text()
            text = text.replace("127.0.0.1:8000", f"127.0.0.1:{self.serve_port}")
            text = _set_key(text, "restart", json.dumps(restart)) if src.stem != "omnid" else text
            for key, value in (overrides or {}).get(src.stem, {}).items():
                text = _set_key(text, key, value)
            (self.dir / src.name).write_text(text)
        self.env = {
            "OMNID_DEMO_SERVE_PORT": str(self.serve_port),
            "OMNID_DEMO_ENGINE_PORT": str(self.engine_port),
            "OMNID_DEMO_WORKER_PORT": str(self.worker_port),
        }

    def daemon(self, factory) -> Daemon:
        return factory(self.dir, env=self.env)

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _set_key(text: str, key: str, value: str | None) -> str:
    """Set a top-level TOML key (replace its line, or add it before the first table);
    None removes it."""
    pattern = re.compile(rf"^{re.escape(key)}\s*=.*$", re.M)
    if value is None:
        return pattern.sub("", text)
    if pattern.search(text):
        return pattern.sub(f"{key} = {value}", text, count=1)
    return f"{key} = {value}\n" + text


@dataclass
class Outcome:
    started: float
    ended: float = 0.0
    status: int | None = None  # HTTP status, or None for a connection error
    error: str = ""
    body: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class Load:
    """Keeps `concurrency` generate requests in flight until stopped."""

    port: int
    concurrency: int = 4
    work_ms: int = 300
    client_timeout: float = 30.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _conns: dict[str, http.client.HTTPConnection] = field(default_factory=dict)

    def start(self) -> "Load":
        for i in range(self.concurrency):
            t = threading.Thread(target=self._run, name=f"load-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            o = Outcome(started=time.monotonic())
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.client_timeout)
                self._conns[threading.current_thread().name] = conn
                try:
                    conn.request("POST", "/v1/generate", body=json.dumps({"prompt": "hi", "max_ms": self.work_ms}),
                                 headers={"Content-Type": "application/json"})
                    resp = conn.getresponse()
                    o.status = resp.status
                    o.body = resp.read().decode(errors="replace")[:300]
                finally:
                    conn.close()
            except (OSError, http.client.HTTPException) as exc:
                o.error = f"{type(exc).__name__}: {exc}"
            o.ended = time.monotonic()
            with self._lock:
                self.outcomes.append(o)
            if o.status is None:
                # Connection refused (the serve is down): do not spin.
                self._stop.wait(0.05)

    def stop(self) -> None:
        """Stop sending; a request still waiting now is cut (a connection queued on a held
        socket while the serve is down would wait for the client's whole timeout): what a
        row checks ended before this."""
        self._stop.set()
        for conn in list(self._conns.values()):
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for t in self._threads:
            t.join(self.client_timeout + 5)

    def wait_successes(self, n: int, timeout: float = 60.0) -> None:
        wait_for(lambda: sum(o.ok for o in list(self.outcomes)) >= n, timeout, f"{n} successful requests")

    def in_flight_at(self, t: float) -> list[Outcome]:
        """Requests that had started before t and ended after it."""
        with self._lock:
            done = list(self.outcomes)
        return [o for o in done if o.started <= t < o.ended]

    def check_fail_fast(self, fault_at: float, serve_killed: bool = False) -> dict:
        """Every request in flight at the fault ended within FAIL_FAST_S of it; none
        waited for the client's own timeout. Returns figures for the report.

        `serve_killed`: the fault killed the serve, whose listening socket omnid holds. A
        request then answered with an HTTP status more than FAIL_FAST_S after the fault was
        answered by the serve's replacement (the killed one answers nothing after its death):
        its connection waited in the held socket's backlog, never in the dead serve, which is
        what the held socket is for. It is counted apart (`queued`), not as a slow failure.
        (FM-10 at load 15: +5.87 s, a 503 from the new serve still joining the engine.)"""
        flying = self.in_flight_at(fault_at)
        queued = [o for o in flying if serve_killed and o.status is not None and o.ended - fault_at > FAIL_FAST_S]
        flying = [o for o in flying if o not in queued]
        slow = [o for o in flying if o.ended - fault_at > FAIL_FAST_S]
        assert not slow, "requests still waiting more than 2 s after the fault: " + "; ".join(
            f"ended +{o.ended - fault_at:.2f}s status={o.status} {o.error or o.body[:80]}" for o in slow)
        failed = [o for o in flying if not o.ok]
        for o in failed:
            # An error is a 5xx with a non-empty JSON error, or a closed connection.
            if o.status is not None:
                assert o.status >= 500, (o.status, o.body)
                err = json.loads(o.body).get("error", {})
                assert err.get("message"), o.body
        worst = max((o.ended - fault_at for o in flying), default=0.0)
        figures = {"in_flight": len(flying), "failed": len(failed), "worst_end_s": round(worst, 3)}
        if queued:
            figures.update(queued_for_the_replacement=len(queued),
                           queued_worst_s=round(max(o.ended - fault_at for o in queued), 3))
        return figures


def serve_refuses(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) != 0
