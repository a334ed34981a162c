"""What `omnid status` prints, from a daemon's answer written by hand (no daemon, no
/proc): the verdict and its cause first, then the units by tier. The daemon-backed
tests of the same screen are in test_cli_habits.py."""

from __future__ import annotations

import re
import time

import pytest

from omnid.cli.render import print_units, verdict_lines

pytestmark = pytest.mark.fast

HEADINGS = ("TIER", "UNIT", "STATE", "READY", "PID", "UPTIME", "MEM", "CPU", "TASKS", "GPU", "RESTARTS",
            "LAST EXIT", "REASON")


def unit(name: str, state: str, **kw) -> dict:
    return {"name": name, "state": state, "ready": False, "pid": None, "since": None, "restarts": 0,
            "last_exit": None, "reason": "", **kw}


def cells(text: str) -> list[dict[str, str]]:
    """The table read back by its headings' columns (each heading starts its column)."""
    header, *rows = text.splitlines()
    starts = []
    for h in HEADINGS:
        starts.append(header.index(h, starts[-1] if starts else 0))
    ends = starts[1:] + [None]
    return [{h: row[s:e].strip() for h, s, e in zip(HEADINGS, starts, ends)} for row in rows]


def test_a_failed_stack_says_the_failed_unit_first_then_what_went_down_with_it():
    units = [unit("worker@0", "failed", reason="killed by SIGKILL"), unit("engine", "inactive"),
             unit("serve", "inactive")]
    daemon = {"health": "failed", "down_because": {"engine": "worker@0", "serve": "worker@0"}, "pid": 4242,
              "units_dir": "/srv/stack", "health_listen": "127.0.0.1:9321"}
    assert verdict_lines(units, daemon, colour=False) == [
        "● FAILED: worker@0 failed: killed by SIGKILL",
        "  down with it: engine, serve (require worker@0)",
        "  3 units: 2 inactive, 1 failed; daemon pid 4242, up ?; units /srv/stack",
        "  health http://127.0.0.1:9321/health",
    ]


def test_more_than_three_failures_are_counted_and_named_and_a_missing_reason_is_said():
    units = [unit(n, "failed", reason=f"exited with status {i}") for i, n in enumerate("abcde", 1)]
    units[1]["reason"] = None
    # No verdict from the daemon: the one /health would give, from the units alone.
    assert verdict_lines(units, {}, colour=False) == [
        "● FAILED: a failed: exited with status 1",
        "  and b failed: no reason recorded",
        "  and c failed: exited with status 3",
        "  and 2 more failed: d, e",
        "  5 units: 5 failed; daemon pid ?, up ?; units ?",
    ]


def test_a_healthy_stack_says_ok_and_how_long_the_daemon_has_been_up():
    units = [unit("engine", "active", ready=True), unit("serve", "active", ready=True)]
    daemon = {"health": "ok", "pid": 7, "since": time.time() - 90.2, "units_dir": "/srv/stack"}
    assert verdict_lines(units, daemon, colour=False) == [
        "● OK: 2/2 units active and ready",
        "  2 units: 2 active; daemon pid 7, up 1min 30s; units /srv/stack",
    ]


def test_units_not_up_are_named_with_what_each_is_doing():
    units = [unit("a", "active", ready=True), unit("b", "starting"), unit("c", "active"),
             unit("d", "inactive", goal="inactive")]
    assert verdict_lines(units, {"pid": 7}, colour=False)[0] == (
        "● DEGRADED: 3 of 4 units not up: b (starting), c (not ready), d (stopped by request)")


def test_the_table_groups_units_by_tier_and_says_why_a_unit_never_started(capsys):
    units = [
        unit("worker@0", "active", ready=True, pid=101, gpu_mib=1536.4, reason="started",
             group={"name": "tp", "generation": 3, "state": "running", "hosts": {"a": "up", "b": "up"}}),
        unit("worker@1", "failed", restarts=2, last_exit="killed by SIGKILL (pid 102, while active)",
             reason="killed by SIGKILL"),
        unit("engine", "inactive"),
    ]
    print_units(units, usage=False, colour=False, tiers=[["worker@0", "worker@1"], ["engine"]],
                because={"engine": "worker@1"})
    *table, group = capsys.readouterr().out.splitlines()
    none = {"UPTIME": "-", "MEM": "-", "CPU": "-", "TASKS": "-"}
    assert cells("\n".join(table)) == [
        {"TIER": "0", "UNIT": "worker@0", "STATE": "active", "READY": "yes", "PID": "101", **none,
         "GPU": "1536MiB", "RESTARTS": "0", "LAST EXIT": "-", "REASON": "started"},
        {"TIER": "", "UNIT": "worker@1", "STATE": "failed", "READY": "-", "PID": "-", **none,
         "GPU": "-", "RESTARTS": "2", "LAST EXIT": "killed by SIGKILL", "REASON": "killed by SIGKILL"},
        {"TIER": "1", "UNIT": "engine", "STATE": "inactive", "READY": "-", "PID": "-", **none,
         "GPU": "-", "RESTARTS": "0", "LAST EXIT": "-", "REASON": "not started: requires worker@1, which failed"},
    ]
    assert group == "group tp generation 3 (running): a up, b up"


def test_on_a_terminal_rows_are_cut_at_its_width_and_only_the_state_cell_is_coloured(capsys):
    units = [unit("worker@0", "failed", reason="killed by SIGKILL after " + "a very long story " * 5),
             unit("engine", "active", ready=True, reason="started")]
    print_units(units, usage=False, colour=False)
    plain = capsys.readouterr().out.splitlines()
    width = len(plain[2])  # the terminal as wide as engine's row: worker@0's is longer
    assert len(plain[1]) > width + 50, plain
    print_units(units, usage=False, colour=True, width_limit=width)
    cut = capsys.readouterr().out.splitlines()
    bare = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in cut]
    assert len(cut) == len(plain) == 3, cut  # cut, never wrapped
    assert bare[1] == plain[1][:width - 1] + "…", bare[1]
    assert bare[0] == plain[0] and bare[2] == plain[2], "rows that fit are not touched"
    assert "\x1b[31;1mfailed  \x1b[0m" in cut[1] and "\x1b[32mactive  \x1b[0m" in cut[2], cut
    assert "\x1b" not in cut[0], "the heading is not coloured"
