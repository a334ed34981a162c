"""A newcomer's first minutes (issue 20): a typo'd command, the first lines of `omnid events`,
finding the manual pages, reading the logs synopsis, `restart_sec = 0`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime

import pytest

from tests.harness import REPO, make_stack, wait_for

PY = sys.executable


def omnid(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "omnid", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(REPO), env=dict(os.environ, **(env or {})))


def test_mistyped_command_says_which_one_was_meant():
    r = omnid("stauts")
    assert r.returncode == 2
    assert "invalid command 'stauts'; did you mean status?" in r.stderr, r.stderr
    r = omnid("daemon", "--log-format", "jsn")
    assert r.returncode == 2 and "did you mean json?" in r.stderr, r.stderr
    r = omnid("zzzz")
    assert r.returncode == 2 and "did you mean" not in r.stderr and "choose from daemon" in r.stderr


def test_events_starts_with_each_units_state_as_of_its_change_never_none(daemon_factory):
    d = daemon_factory(make_stack({"a": 'exec = ["sleep", "1000"]\n'}))
    since = d.wait_state("a", "active")["since"]
    # Let the clock move on, so the time of this request and of the change differ visibly.
    wait_for(lambda: time.time() - since >= 1.0, 5, "a second to pass since the unit became active")
    proc = subprocess.Popen([PY, "-m", "omnid", "--control", d.control, "events"], stdout=subprocess.PIPE,
                            text=True, cwd=str(REPO))
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()  # type: ignore[union-attr]
    pid = d.unit("a")["pid"]
    stamp = datetime.fromtimestamp(since).strftime("%H:%M:%S.%f")[:-3]
    assert line.startswith(f"{stamp} a pid {pid}: -> active"), (line, stamp)
    assert "None" not in line


@pytest.mark.fast
def test_event_lines_render_a_change_and_a_current_state():
    from omnid.cli.render import format_event

    ts = datetime(2026, 1, 2, 3, 4, 5, 678000).timestamp()
    assert format_event({"ts": ts, "unit": "w@0", "pid": 7, "from": "starting", "to": "active",
                         "reason": "started"}) == "03:04:05.678 w@0 pid 7: starting -> active — started"
    assert format_event({"ts": ts, "unit": "w@0", "pid": None, "from": None, "to": "inactive",
                         "reason": None}) == "03:04:05.678 w@0: -> inactive"


@pytest.mark.parametrize(("page", "title"), [("omnid", "OMNID(8)"), ("omnid.unit", "OMNID.UNIT(5)"),
                                             ("omnid-control", "OMNID-CONTROL(7)")])
def test_man_pages_are_reachable_from_an_editable_install(page, title):
    r = omnid("man", "--path", page)
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip()
    assert os.path.isfile(path) and path.endswith(f"{page}.{title[-2]}"), path
    if shutil.which("man") is None:
        pytest.skip("man is not installed (Debian package man-db)")
    r = omnid("man", page, env={"MANPAGER": "cat", "PAGER": "cat", "MANWIDTH": "80"})
    assert r.returncode == 0, r.stderr
    assert title in r.stdout.splitlines()[0], r.stdout[:200]


def test_logs_synopsis_renders_without_a_stray_quote():
    tool = shutil.which("mandoc")
    if tool is None:
        pytest.skip("mandoc is not installed (Debian package mandoc)")
    r = subprocess.run([tool, "-Tascii", str(REPO / "man" / "omnid.8")], capture_output=True, text=True, timeout=30)
    text = re.sub(r".\x08", "", r.stdout)  # drop overstrike bold/underline
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("logs UNIT")]
    assert lines, text[:2000]
    for line in lines:
        assert '"' not in line and line.endswith("]"), line
    # Lint clean, style messages included.
    for page in ("omnid.8", "omnid.unit.5", "omnid-control.7"):
        r = subprocess.run([tool, "-Tlint", str(REPO / "man" / page)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_restart_sec_zero_restarts_at_once_and_the_start_limit_still_ends_the_loop(daemon_factory):
    d = daemon_factory(make_stack({"crash": 'exec = ["false"]\nrestart = "always"\nrestart_sec = 0\n'
                                            "start_limit_burst = 3\nstart_limit_interval = 60\n"}))
    u = wait_for(lambda: (u := d.unit("crash"))["state"] == "failed" and u.get("gave_up") and u, 15,
                 "the start limit to end the crash loop")
    assert "start limit hit (3 starts" in u["reason"], u
    assert u["restarts"] == 2
