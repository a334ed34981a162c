"""A reaped process's exit status read from its pidfd (omnid.linux.pidfd_exit_status,
PIDFD_INFO_EXIT): what lets the daemon record a death without waiting for the spawner's
report. Checked against real children here, and through the daemon on a crash loop."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import sys

import pytest

from omnid.base import linux
from tests.harness import make_stack, wait_for


def _child(code: str) -> tuple[int, int]:
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", code], os.environ)
    return pid, os.pidfd_open(pid)


def test_the_status_is_there_once_reaped_and_never_before():
    pid, fd = _child("import sys; sys.exit(7)")
    try:
        assert linux.pidfd_exit_status(fd) is None  # alive
        select.select([fd], [], [], 30)
        assert linux.pidfd_exited(fd)
        assert linux.pidfd_exit_status(fd) is None  # a zombie: its parent has not reaped it
        _, status = os.waitpid(pid, 0)
        got = linux.pidfd_exit_status(fd)
        if got is None and not linux._pidfd_info:
            pytest.skip(f"this kernel ({os.uname().release}) has no PIDFD_INFO_EXIT (Linux 6.15)")
        assert got == status and os.WEXITSTATUS(got) == 7
    finally:
        os.close(fd)


def test_a_signalled_death_reads_as_the_signal():
    pid, fd = _child("import time; time.sleep(60)")
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        os.waitpid(pid, 0)
        got = linux.pidfd_exit_status(fd)
        if got is None and not linux._pidfd_info:
            pytest.skip(f"this kernel ({os.uname().release}) has no PIDFD_INFO_EXIT (Linux 6.15)")
        assert os.WIFSIGNALED(got) and os.WTERMSIG(got) == signal.SIGKILL
    finally:
        os.close(fd)


def test_a_crash_loop_records_every_exit_status_right(tmp_path, daemon_factory):
    # Exit statuses come from the pidfd or from the spawner's report, whichever is first. Each
    # of 30 quick restarts must be recorded with its own process's status (the process writes
    # its pid and status before it exits), none "unknown", none taken from another process.
    told = tmp_path / "told"
    script = f'c=$(( $$ % 50 + 3 )); echo "$$ $c" >> {told}; exit $c'
    stack = make_stack({"crashy": f'exec = ["sh", "-c", {json.dumps(script)}]\n'
                                  'restart = "always"\nrestart_sec = 0\nstart_limit_burst = 1000\n'})
    d = daemon_factory(stack)
    recorded: dict[int, int] = {}

    def thirty() -> bool:
        for ev in d.log_events():
            m = re.search(r"exited with code (\d+) \(pid (\d+)", str(ev.get("reason", "")))
            if m:
                recorded[int(m.group(2))] = int(m.group(1))
        return len(recorded) >= 30

    wait_for(thirty, 60, "30 exits of crashy recorded")
    d.ok("stop", {"units": ["crashy"]})
    truth = dict(map(int, line.split()) for line in told.read_text().split("\n") if line)
    wrong = {pid: (code, truth.get(pid)) for pid, code in recorded.items() if truth.get(pid) != code}
    assert not wrong, f"recorded status != the process's own: {wrong}\n{d.log()[-3000:]}"
    assert "status unknown" not in d.log(), d.log()[-3000:]
