"""Drain before stop (FM-28's mechanism): a planned stop tells a unit to stop taking work
(its drain hook), /health says "draining", and the stop signal waits for the drain to be
over -- never longer than drain_timeout, never for a failure elsewhere. The units here
record every signal they get, with the time, in a file: the kernel's order, not omnid's."""

from __future__ import annotations

import json
import socket
import textwrap
import threading
import time
from pathlib import Path

from tests.harness import free_port, make_stack, wait_for

UNIT_PY = textwrap.dedent('''
    import json, os, signal, socket, sys, threading, time
    rec, idle_after = os.environ["REC"], float(os.environ.get("IDLE_AFTER", "-1"))
    port = int(os.environ.get("DRAIN_PORT", "0"))

    def note(what):
        with open(rec, "a") as f:
            f.write(json.dumps([time.time(), what]) + "\\n")

    def notify(msg):
        addr = os.environ.get("NOTIFY_SOCKET")
        if addr:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.sendto(msg.encode(), "\\0" + addr[1:] if addr.startswith("@") else addr)
            s.close()

    def on_usr1(n, f):
        note("USR1")
        if idle_after >= 0:
            threading.Timer(idle_after, lambda: (note("idle"), notify("STATUS=idle"))).start()

    def on_term(n, f):
        note("TERM")
        os._exit(0)

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, on_term)
    if port:  # POST /drain: answers CODE after DELAY seconds
        code, delay = int(os.environ.get("DRAIN_CODE", "200")), float(os.environ.get("DRAIN_DELAY", "0"))
        srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port)); srv.listen(8)

        def serve():
            while True:
                c, _ = srv.accept()
                c.recv(4096)
                note("POST")
                time.sleep(delay)
                c.sendall(f"HTTP/1.1 {code} X\\r\\nContent-Length: 0\\r\\nConnection: close\\r\\n\\r\\n".encode())
                c.close()
        threading.Thread(target=serve, daemon=True).start()
    notify("READY=1")
    while True:
        time.sleep(1)
''')


def unit(tmp_path: Path, rec: Path, extra: str = "", **env: str) -> str:
    script = tmp_path / "drainable.py"
    script.write_text(UNIT_PY)
    envs = ", ".join(f'{k} = "{v}"' for k, v in {"REC": str(rec), **env}.items())
    return f'exec = ["python3", "{script}"]\nready = "notify"\nstop_timeout = 3\nenv = {{ {envs} }}\n{extra}'


def record(rec: Path) -> list[tuple[float, str]]:
    if not rec.exists():
        return []
    return [tuple(json.loads(line)) for line in rec.read_text().splitlines() if line.strip()]  # type: ignore[misc]



def watch_health(d) -> tuple[list[tuple[float, int, str]], threading.Event, threading.Thread]:
    seen: list[tuple[float, int, str]] = []
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            try:
                code, body = d.http("/health")
            except OSError:
                return
            seen.append((time.time(), code, body.get("status", "") if isinstance(body, dict) else ""))
            time.sleep(0.01)

    t = threading.Thread(target=run)
    t.start()
    return seen, done, t


def test_a_signal_drain_waits_for_status_idle_then_the_stop_signal_and_health_says_draining(tmp_path,
                                                                                           daemon_factory):
    rec = tmp_path / "rec"
    d = daemon_factory(make_stack({"api": unit(tmp_path, rec, 'drain = { signal = "SIGUSR1" }\n', IDLE_AFTER="0.6")}))
    d.wait_all_active()
    seen, done, t = watch_health(d)
    try:
        d.ok("stop", {"units": ["api"]})
    finally:
        done.set()
        t.join(10)
    r = record(rec)
    what = [w for _t, w in r]
    assert what == ["USR1", "idle", "TERM"], r
    assert 0.5 <= r[2][0] - r[0][0] < 2.0, "the stop signal came once the unit said idle"
    assert any(st == "draining" and code == 503 for _t, code, st in seen), seen[:20]
    assert d.unit("api")["state"] == "inactive"


def test_an_http_drain_answered_200_is_over_and_the_stop_follows(tmp_path, daemon_factory):
    rec, port = tmp_path / "rec", free_port()
    d = daemon_factory(make_stack({"api": unit(
        tmp_path, rec, f'drain = {{ http = "http://127.0.0.1:{port}/drain" }}\n', DRAIN_PORT=str(port),
        DRAIN_DELAY="0.4")}))
    d.wait_all_active()
    d.ok("stop", {"units": ["api"]})
    r = record(rec)
    assert [w for _t, w in r] == ["POST", "TERM"], r
    assert 0.35 <= r[1][0] - r[0][0] < 2.0, r
    assert any(e.get("event") == "drain over" and "answered 200" in e.get("how", "") for e in d.log_events())


def test_a_drain_that_never_ends_is_cut_at_drain_timeout(tmp_path, daemon_factory):
    rec = tmp_path / "rec"
    d = daemon_factory(make_stack({"api": unit(tmp_path, rec, 'drain = { signal = "SIGUSR1" }\ndrain_timeout = 1\n')}))
    d.wait_all_active()
    t0 = time.time()
    d.ok("stop", {"units": ["api"]})
    r = record(rec)
    assert [w for _t, w in r] == ["USR1", "TERM"], r
    assert 0.9 <= r[1][0] - r[0][0] < 2.5, r
    assert time.time() - t0 < 5


def test_a_broken_drain_hook_does_not_hold_the_stop(tmp_path, daemon_factory):
    rec, port = tmp_path / "rec", free_port()  # nothing listens there
    d = daemon_factory(make_stack({"api": unit(
        tmp_path, rec, f'drain = {{ http = "http://127.0.0.1:{port}/drain" }}\ndrain_timeout = 20\n')}))
    d.wait_all_active()
    t0 = time.time()
    d.ok("stop", {"units": ["api"]})
    assert time.time() - t0 < 5
    assert [w for _t, w in record(rec)] == ["TERM"]
    assert any(e.get("event") == "drain request failed; stopping now" for e in d.log_events())


def test_a_failure_elsewhere_cuts_a_drain_short(tmp_path, daemon_factory):
    rec = tmp_path / "rec"
    d = daemon_factory(make_stack({
        "base": 'exec = ["sleep", "1000"]\n',
        "api": unit(tmp_path, rec, 'drain = { signal = "SIGUSR1" }\ndrain_timeout = 20\nrequires = ["base"]\n')}))
    d.wait_all_active()
    import os
    import signal

    # The stop is asked by another process (a control socket is one thread's): the CLI.
    import subprocess
    import sys

    from tests.harness import REPO, repo_pythonpath

    stopper = subprocess.Popen([sys.executable, "-m", "omnid", "--control", d.control, "stop", "api"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO),
                               env=dict(os.environ, PYTHONPATH=repo_pythonpath()))
    try:
        wait_for(lambda: [w for _t, w in record(rec)] == ["USR1"], 10, "api draining")
        fd = os.pidfd_open(d.unit("base")["pid"])
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        os.close(fd)
        t_kill = time.time()
        wait_for(lambda: "TERM" in [w for _t, w in record(rec)], 10, "api stopped once base failed")
        term_at = next(t for t, w in record(rec) if w == "TERM")
        assert term_at - t_kill < 2, term_at - t_kill
    finally:
        out, _ = stopper.communicate(timeout=60)
    assert stopper.returncode == 0, out


def test_a_stack_stop_keeps_the_drain_while_other_units_stop_beside_it(tmp_path, daemon_factory):
    """A stop of the whole stack gives every unit the goal `inactive`, the drained unit's
    requirement included: that is not a failure under it. Units stopping beside it (each
    one's end runs the converge again) must not cut its drain short."""
    rec = tmp_path / "rec"
    d = daemon_factory(make_stack({
        "base": 'exec = ["sleep", "1000"]\n',
        "beside": 'exec = ["sleep", "1000"]\n',
        "api": unit(tmp_path, rec, 'drain = { signal = "SIGUSR1" }\ndrain_timeout = 20\nrequires = ["base"]\n',
                    IDLE_AFTER="1.5")}))
    d.wait_all_active()
    beside = d.unit("beside")["pid"]
    d.proc.send_signal(15)
    assert d.wait_exit(30) == 0, d.log()[-3000:]
    r = record(rec)
    assert [w for _t, w in r] == ["USR1", "idle", "TERM"], (r, d.log()[-3000:])
    assert r[2][0] - r[0][0] >= 1.4, (r, "the stop signal came before the drain was over", d.log()[-3000:])
    assert not (Path("/proc") / str(beside)).exists()


def test_drain_sec_turns_health_to_draining_before_any_stop_signal(tmp_path, daemon_factory):
    rec = tmp_path / "rec"
    d = daemon_factory(make_stack({"api": unit(tmp_path, rec)}, settings="drain_sec = 1\n"))
    d.wait_all_active()
    seen, done, t = watch_health(d)
    t0 = time.time()
    try:
        d.proc.send_signal(15)
        assert d.wait_exit(30) == 0
    finally:
        done.set()
        t.join(10)
    term_at = next(t for t, w in record(rec) if w == "TERM")
    draining = [ts for ts, code, st in seen if st == "draining" and code == 503]
    assert draining and draining[0] < t0 + 0.5, seen[:10]
    assert term_at - t0 >= 0.95, "the stop signal came only after drain_sec"
