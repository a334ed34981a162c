"""Issue 25: liveness that proves forward progress, and readiness that continues
(omnid.unit(5) `liveness` http/POST and exec forms, `progress`, `ready_interval`).

Real processes: tests/engine_like.py is the unit (an HTTP server with a worker child
whose output is its "generation"), switched between behaviours through a control file;
what the server saw (requests in flight at once, the POST it got) is read from its own
stats file, and processes and fds from /proc. Each test prints what it measured."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from omnid import linux, promtext
from omnid.core.progress import StallRule
from omnid.unitmodel import Progress
from tests.harness import alive, free_port, make_stack, wait_for

PY = sys.executable
ENGINE = str(Path(__file__).resolve().parent / "engine_like.py")


class Engine:
    """The control file and stats of one engine_like unit."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.port = free_port()
        self.ctl_path = tmp / "ctl.json"
        self.state: dict = {}
        self.set()

    def set(self, **kw) -> float:
        self.state.update(kw)
        tmp = self.dir / "ctl.tmp"
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.ctl_path)
        return time.monotonic()

    def exec_line(self) -> str:
        return "exec = " + json.dumps([PY, ENGINE, str(self.port), str(self.ctl_path), str(self.dir)])

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stats(self) -> dict:
        try:
            return json.loads((self.dir / "stats.json").read_text())
        except (OSError, ValueError):
            return {}

    def worker_pid(self) -> int:
        return int((self.dir / "worker.pid").read_text())


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stays(predicate, duration: float, what: str) -> None:
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        assert predicate(), f"{what} stopped holding"
        time.sleep(0.05)


def send_signal(pid: int, sig: int) -> None:
    fd = os.pidfd_open(pid)
    try:
        signal.pidfd_send_signal(fd, sig)
    finally:
        os.close(fd)


def left_active(d, name: str, pid: int) -> dict | None:
    u = d.unit(name)
    return u if u["state"] != "active" or u["pid"] != pid else None


# ------------------------------------------------------------------ pure parts
def test_prometheus_text_sums_over_labels_with_escapes_nan_and_timestamps():
    text = (
        "# HELP c_total Tokens.\n# TYPE c_total counter\n"
        'c_total{a="x \\"quoted\\" {b}, c=1",z="\\\\"} 10.5\n'
        'c_total{a="y"} 2 1700000000000\n'
        'c_created{a="y"} 1.7e9\n'
        "g{a=\"1\"} NaN\n"
        "g{a=\"2\"} 3\n"
        "h +Inf\n"
        "tok_total 7\n"
        '{"my.metric", a="1"} 4\n'
    )
    got = promtext.sums(text, ["c_total", "g", "h", "absent", "tok", "my.metric"])
    assert got == {"c_total": 12.5, "g": 3.0, "h": float("inf"), "absent": None, "tok": 7.0,
                   "my.metric": 4.0}
    with pytest.raises(promtext.MalformedExposition, match="line 2"):
        promtext.sums("ok 1\nbad{a=\"1\" 2\n", ["ok"])


def test_stall_rule_fails_only_a_busy_unit_whose_counter_does_not_move():
    rule = StallRule(Progress(metrics="http://127.0.0.1:1/metrics", counter="tok", busy=("run", "wait"),
                              stall_sec=10, interval=1))
    busy = {"run": 2.0, "wait": None}
    idle = {"run": 0.0, "wait": 0.0}
    assert rule.observe(0, 5, idle) is None
    assert rule.observe(100, 5, idle) is None  # idle for ever: never failed
    assert rule.observe(101, 5, busy) is None  # busy from now: the clock starts here
    assert rule.observe(110, 5, busy) is None  # 9 s < 10 s
    why = rule.observe(111, 5, busy)
    assert why == "progress: tok stuck at 5 for 10.0 s while run = 2", why
    # a reset (the counter goes down) is progress; so is a rise
    rule = StallRule(rule.rule)
    assert rule.observe(0, 50, busy) is None
    assert rule.observe(9, 3, busy) is None
    assert rule.observe(18, 3, busy) is None
    assert rule.observe(19, 3, busy) is not None
    # a failed scrape: no progress while work was last seen waiting, nothing while idle
    rule = StallRule(rule.rule)
    assert rule.observe(0, 1, busy) is None
    assert rule.scrape_failed(5, "timed out") is None
    why = rule.scrape_failed(10, "GET x timed out")
    assert why is not None and why.endswith("; metrics unreadable (GET x timed out)"), why
    rule = StallRule(rule.rule)
    assert rule.observe(0, 1, idle) is None
    assert rule.scrape_failed(50, "refused") is None


# ------------------------------------------------------------------ liveness: POST
def test_liveness_post_sends_body_and_headers_and_fails_on_an_unexpected_status(tmp_path, daemon_factory):
    eng = Engine(tmp_path)
    body = '{"prompt": "%n", "max_tokens": 1}'
    stack = make_stack({"eng": f"""{eng.exec_line()}
ready = {{ http = "{eng.url('/health')}" }}
ready_interval = 0
liveness = {{ http = "{eng.url('/v1/completions')}", method = "POST", body = '{body}', headers = {{ "Content-Type" = "application/json", "X-Probe" = "%n" }}, expect = [200], interval = 0.3, timeout = 1, failures = 2 }}
stop_timeout = 2
"""})
    d = daemon_factory(stack)
    pid = d.wait_state("eng", "active")["pid"]
    post = wait_for(lambda: eng.stats().get("post"), 10, "the engine to get a POST")
    assert post["body"] == '{"prompt": "eng", "max_tokens": 1}', post
    assert post["headers"]["content-type"] == "application/json" and post["headers"]["x-probe"] == "eng", post
    assert post["headers"]["content-length"] == str(len(post["body"])), post
    stays(lambda: d.unit("eng")["state"] == "active", 1.0, "eng active while its POST answers 200")
    t0 = eng.set(gen="500")
    u = wait_for(lambda: left_active(d, "eng", pid), 10, "eng to fail its POST probe")
    took = time.monotonic() - t0
    u = d.wait_state("eng", "failed")
    assert f"POST {eng.url('/v1/completions')} answered 500 (expected 200)" in u["reason"], u["reason"]
    assert "EngineCore died" in u["reason"] and "(2/2)" in u["reason"], u["reason"]
    assert not alive(pid)
    # failures x (interval + answer) at most, with room for a loaded machine
    assert took < 2 * (0.3 + 1) + 2, took
    print(f"\nliveness POST: 500 -> unit failing in {took:.2f} s (failures 2, interval 0.3 s)")
