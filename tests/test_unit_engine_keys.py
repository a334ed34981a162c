"""The unit keys for real engines (omnid.unit(5)): liveness's POST and exec forms, progress,
ready_interval, kill_mode, leftover_timeout, private_tmp, remove_ipc -- parsed into typed
values, %i/%n expanded, and every mistake named by file and key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from omnid.model.units import KillMode, Liveness, Progress, check_stack, load_stack

pytestmark = pytest.mark.fast


def write(directory: Path, text: str, name: str = "engine") -> Path:
    (directory / f"{name}.toml").write_text(textwrap.dedent(text))
    return directory


def messages(directory: Path) -> dict[str, str]:
    return {e.key: e.message for e in check_stack(directory)}


def test_defaults_are_the_documented_ones(tmp_path: Path) -> None:
    u = load_stack(write(tmp_path, 'exec = ["sleep", "1"]\n'))["engine"]
    assert (u.kill_mode, u.leftover_timeout, u.private_tmp, u.remove_ipc, u.ready_interval) == (
        KillMode.CONTROL_GROUP, 3.0, True, True, 5.0)
    assert u.liveness is None and u.progress is None


def test_a_generating_post_probe_and_a_progress_rule_are_expanded_per_instance(tmp_path: Path) -> None:
    stack = load_stack(write(tmp_path, '''
        exec = ["sleep", "1"]
        instances = 2
        liveness = { http = "http://127.0.0.1:800%i/v1/completions", method = "POST", body = '{"tag": "%n"}', headers = { "Content-Type" = "application/json", "X-Unit" = "%n" }, expect = [200, 201], failures = 2 }
        progress = { metrics = "http://127.0.0.1:800%i/metrics", counter = "vllm:generation_tokens_total", busy = ["vllm:num_requests_running", "vllm:num_requests_waiting"], stall_sec = 20, interval = 2 }
        kill_mode = "mixed"
        leftover_timeout = 0
        private_tmp = false
        remove_ipc = false
        ready_interval = 0
    '''))
    u = stack["engine@1"]
    assert u.liveness == Liveness(url="http://127.0.0.1:8001/v1/completions", failures=2, method="POST",
                                  body='{"tag": "engine@1"}', expect=(200, 201),
                                  headers=(("Content-Type", "application/json"), ("X-Unit", "engine@1")))
    assert u.progress == Progress(metrics="http://127.0.0.1:8001/metrics", counter="vllm:generation_tokens_total",
                                  busy=("vllm:num_requests_running", "vllm:num_requests_waiting"),
                                  stall_sec=20.0, interval=2.0)
    assert (u.kill_mode, u.leftover_timeout, u.private_tmp, u.remove_ipc, u.ready_interval) == (
        KillMode.MIXED, 0.0, False, False, 0.0)
    assert u.liveness.accepts(201) and not u.liveness.accepts(204)


def test_the_exec_probe_takes_an_argv_and_no_http_keys(tmp_path: Path) -> None:
    u = load_stack(write(tmp_path, 'exec = ["sleep", "1"]\nliveness = { exec = ["check", "%n"], timeout = 4 }\n'))
    assert u["engine"].liveness == Liveness(exec=("check", "engine"), timeout=4.0)
    assert not u["engine"].liveness.accepts(302)


def test_each_mistake_is_named_by_its_key(tmp_path: Path) -> None:
    got = messages(write(tmp_path, '''
        exec = ["sleep", "1"]
        liveness = { exec = ["true"], method = "POST" }
        progress = { counter = "not a name", busy = [], interval = 100 }
        kill_mode = "group"
        private_tmp = 1
        remove_ipc = "yes"
        ready_interval = -1
        leftover_timeout = "3"
    '''))
    assert got["liveness.method"] == "applies to the http form only; expected it absent with exec"
    assert got["progress.metrics"].startswith("missing; expected a table { metrics = URL")
    assert "Prometheus metric name" in got["progress.counter"] and '"not a name"' in got["progress.counter"]
    assert got["progress.busy"].startswith("expected at least one gauge name")
    assert got["progress.interval"].startswith("expected seconds <= stall_sec (60)")
    assert got["kill_mode"] == 'expected one of "control-group", "mixed", "process", got string "group"'
    assert got["private_tmp"] == "expected true or false, got integer 1"
    assert got["remove_ipc"] == 'expected true or false, got string "yes"'
    assert got["ready_interval"].endswith("got -1")
    assert got["leftover_timeout"].startswith("expected a number of seconds >= 0")


def test_http_probe_mistakes_cannot_inject_a_request(tmp_path: Path) -> None:
    got = messages(write(tmp_path, '''
        exec = ["sleep", "1"]
        liveness = { http = "http://127.0.0.1:1/", headers = { "X-A" = "a\\r\\nHost: evil" }, body = "x", expect = 700 }
    '''))
    assert got["liveness.headers.X-A"] == "expected an ASCII string without line breaks, got string \"a\\r\\nHost: evil\""
    assert got["liveness.body"].startswith('is sent with method = "POST" only')
    assert got["liveness.expect"].startswith("expected an HTTP status (100 to 599)")
    got = messages(write(tmp_path, 'exec = ["sleep", "1"]\nliveness = { interval = 1 }\n'))
    assert got["liveness.http"].startswith("expected exactly one of http")
    got = messages(write(tmp_path, 'exec = ["sleep", "1"]\nliveness = { http = "x", headers = { Host = "h" } }\n'))
    assert "not Host" in got["liveness.headers.Host"]
    assert got["liveness.http"].startswith("expected an http:// or https:// URL")


def test_probe_urls_and_headers_must_be_ascii_and_the_canary_is_checked_like_a_liveness_post(tmp_path: Path) -> None:
    """They go on the request line and in the head as they are: a character Latin-1 cannot
    encode used to pass the checks and fail every probe at run time."""
    got = messages(write(tmp_path, """
        exec = ["sleep", "1"]
        liveness = { http = "http://127.0.0.1:1/\u20ac", headers = { "X-A" = "\u20acuro" } }
        progress = { metrics = "http://127.0.0.1:1/m", counter = "c", busy = ["b"], canary = { method = "GET", body = "x", headers = { Host = "h" } } }
    """))
    assert got["liveness.http"].startswith("expected a URL in ASCII (percent-encode the rest"), got
    assert got["liveness.headers.X-A"].startswith("expected an ASCII string without line breaks"), got
    assert got["progress.canary.http"].startswith("missing; expected a table { http ="), got
    assert got["progress.canary.body"].startswith('is sent with method = "POST" only'), got
    assert "not Host" in got["progress.canary.headers.Host"], got
    got = messages(write(tmp_path, 'exec = ["sleep", "1"]\nprogress = { metrics = "http://127.0.0.1:1/m", '
                                   'counter = "c", busy = ["b"], canary = "http://127.0.0.1:1/x" }\n'))
    assert got["progress.canary"].startswith("expected a table { http ="), got
