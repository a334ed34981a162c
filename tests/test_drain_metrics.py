"""A drain ended by the engine's own metrics (FM-41's mechanism): a unit with a `progress`
rule and a drain hook gets its stop signal once the rule's `busy` gauges read 0 on two
scrapes in a row -- an engine such as vLLM has no drain endpoint and no idle notice, and its
own SIGTERM loses the requests it has not scheduled yet. The unit below serves its gauges on
a metrics page and records every signal and every scrape it gets, with the time: the order
is the kernel's and the unit's, not omnid's."""

from __future__ import annotations

import json
import socket
import textwrap
import time
from pathlib import Path

from tests.harness import free_port, make_stack

UNIT_PY = textwrap.dedent('''
    import json, os, signal, socket, sys, threading, time
    rec, port = os.environ["REC"], int(os.environ["METRICS_PORT"])
    busy_for, gauge = float(os.environ.get("BUSY_FOR", "0")), os.environ.get("GAUGE", "engine_running")
    state = {"busy_until": float("inf")}  # busy until told to drain, then BUSY_FOR seconds more

    def note(what):
        with open(rec, "a") as f:
            f.write(json.dumps([time.time(), what]) + "\\n")

    def on_usr1(n, f):
        note("USR1")
        state["busy_until"] = time.time() + busy_for

    def on_term(n, f):
        note("TERM")
        os._exit(0)

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, on_term)
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port)); srv.listen(8)

    def serve():
        while True:
            c, _ = srv.accept()
            c.recv(4096)
            running = 1 if time.time() < state["busy_until"] else 0
            note(f"scrape {running}")
            page = f"# TYPE {gauge} gauge\\n{gauge} {running}\\n# TYPE tokens_total counter\\ntokens_total 5\\n"
            c.sendall(f"HTTP/1.1 200 OK\\r\\nContent-Length: {len(page)}\\r\\nConnection: close\\r\\n\\r\\n{page}".encode())
            c.close()
    threading.Thread(target=serve, daemon=True).start()
    print("READY", flush=True)
    while True:
        time.sleep(1)
''')



def unit(tmp_path: Path, rec: Path, port: int, drain_timeout: float, **env: str) -> str:
    script = tmp_path / "engine_like.py"
    script.write_text(UNIT_PY)
    envs = ", ".join(f'{k} = "{v}"' for k, v in {"REC": str(rec), "METRICS_PORT": str(port), **env}.items())
    return (f'exec = ["python3", "{script}"]\nready = {{ tcp = "127.0.0.1:{port}" }}\nstop_timeout = 3\n'
            f'env = {{ {envs} }}\ndrain = {{ signal = "SIGUSR1" }}\ndrain_timeout = {drain_timeout}\n'
            f'progress = {{ metrics = "http://127.0.0.1:{port}/metrics", counter = "tokens_total", '
            f'busy = ["engine_running"], stall_sec = 30, interval = 0.2 }}\n')


def record(rec: Path) -> list[tuple[float, str]]:
    if not rec.exists():
        return []
    return [tuple(json.loads(line)) for line in rec.read_text().splitlines() if line.strip()]  # type: ignore[misc]


def test_the_stop_signal_waits_until_the_engines_gauges_read_idle_twice(tmp_path, daemon_factory):
    """Busy for 1.5 s after the drain signal: SIGTERM comes after the first idle scrape and a
    second one, never while a scrape said busy, and long before drain_timeout (20 s)."""
    rec, port = tmp_path / "rec", free_port()
    d = daemon_factory(make_stack({"engine": unit(tmp_path, rec, port, 20, BUSY_FOR="1.5")}))
    d.wait_all_active()
    t0 = time.monotonic()
    d.ok("stop", {"units": ["engine"]}, timeout=30)
    took = time.monotonic() - t0
    r = record(rec)
    what = [w for _t, w in r]
    assert "USR1" in what and what[-1] == "TERM", r
    usr1, term = what.index("USR1"), len(what) - 1
    during = what[usr1 + 1:term]
    assert "scrape 1" in during, f"no busy scrape seen during the drain: {r}"
    # The last two scrapes before the stop signal said idle, and none said busy after them.
    assert during[-2:] == ["scrape 0", "scrape 0"], r
    first_idle = usr1 + 1 + during.index("scrape 0")
    assert r[term][0] - r[usr1][0] >= 1.5, f"SIGTERM {r[term][0] - r[usr1][0]:.2f} s after the drain signal: {r}"
    assert r[term][0] >= r[first_idle][0], r
    assert took < 10, f"the stop took {took:.1f} s (drain_timeout 20 s)"
    ends = [e.get("how", "") for e in d.log_events() if e.get("event") == "drain over"]
    assert ends and "engine_running = 0 on 2 scrapes" in ends[-1], ends


def test_gauges_that_cannot_prove_idle_hold_the_stop_to_drain_timeout_and_say_why(tmp_path, daemon_factory):
    """The page lacks the gauge (a typo in `busy`, an engine that renamed it): nothing proves
    the engine idle, so the drain lasts drain_timeout (1 s), and the log says why once."""
    rec, port = tmp_path / "rec", free_port()
    d = daemon_factory(make_stack({"engine": unit(tmp_path, rec, port, 1, GAUGE="renamed_gauge")}))
    d.wait_all_active()
    d.ok("stop", {"units": ["engine"]}, timeout=30)
    r = record(rec)
    what = [w for _t, w in r]
    assert "USR1" in what and what[-1] == "TERM", r
    waited = r[-1][0] - r[what.index("USR1")][0]
    assert 0.9 <= waited < 3.0, f"SIGTERM {waited:.2f} s after the drain signal (drain_timeout 1 s): {r}"
    said = [e for e in d.log_events() if e.get("event", "").startswith("drain: the engine's metrics cannot prove")]
    assert len(said) == 1 and "engine_running not in" in said[0].get("why", ""), said
