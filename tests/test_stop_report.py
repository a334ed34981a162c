"""A stop reports what happened (issue 34, item 2; FAILURE_MATRIX FM-37), and a re-exec loses no
removal under way (item 6).

The exit is the exit: a unit that exits 1 ms after SIGTERM has stopped, whatever its private
TMPDIR holds. The stop's timers end once the kernel proves its processes gone; the removal of
what they left runs after that, bounded, and is reported as its own step with its own time
("cleanup 3.2s: private tmp removed (150000 entries)"), never as an escalation. torch's
inductor cache follows TMPDIR, so trees of this size are what `private_tmp` meets on real hosts.

Checked against the kernel and the filesystem: the unit's pid gone, the directory gone; the
daemon's log for what it says it did (no SIGKILL sent, no "stop timeout")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import alive, make_stack, repo_pythonpath, wait_for

PY = sys.executable
ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(not ROOT, reason="private tmp directories are made and removed as root")

N_FILES = 150_000

# Makes n files in its TMPDIR (300 directories, like a compiler cache), then a marker, then waits:
# SIGTERM makes it exit 0 at once (the 1 ms of the issue), SIGUSR1 exit 1 (a failure of its own).
# Each directory's files are links to its first one: a create of a new inode each cost 0.8 ms on
# the loaded CI host (two minutes for the tree), a link 0.04 ms; the removal unlinks entries alike.
FILLER = r"""
import os, signal, sys, time
n = int(sys.argv[1])
tmp = os.environ["TMPDIR"]
per = 500
for d in range((n + per - 1) // per):
    sub = os.path.join(tmp, f"c{d:03d}")
    os.mkdir(sub)
    first = os.path.join(sub, "f0")
    os.close(os.open(first, os.O_CREAT | os.O_WRONLY, 0o600))
    for i in range(1, min(per, n - d * per)):
        os.link(first, os.path.join(sub, f"f{i}"))
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
signal.signal(signal.SIGUSR1, lambda *_: os._exit(1))
open(os.path.join(tmp, "filled"), "w").close()
print("filled", n, flush=True)
while True:
    time.sleep(1000)
"""


def count_entries(path: str) -> int:
    return sum(len(files) + len(dirs) for _r, dirs, files in os.walk(path))


def unit_tmp(pid: int) -> str:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"TMPDIR="))


def filled_unit(d) -> tuple[int, str]:
    """A unit `u` running FILLER, once its N_FILES are made: (its pid, its TMPDIR)."""
    pid = d.wait_state("u", "active")["pid"]
    path = unit_tmp(pid)
    wait_for(lambda: os.path.exists(os.path.join(path, "filled")), 180,
             lambda: f"{N_FILES} files in {path} (log:\n{d.log()[-2000:]})")
    assert count_entries(path) == N_FILES + 301
    return pid, path


def filler_stack(tmp_path: Path, extra: str = "") -> Path:
    prog = tmp_path / "filler.py"
    prog.write_text(FILLER)
    return make_stack({"u": f'exec = ["{PY}", "{prog}", "{N_FILES}"]\n{extra}'})


def log_lines(d, *events: str) -> list[dict]:
    return [e for e in d.log_events() if e.get("event") in events]


@pytest.mark.timeout(400)
def test_fm37_a_clean_exit_with_150000_files_in_its_tmpdir_is_reported_as_it_happened(daemon_factory, tmp_path):
    """FM-37: exits 1 ms after SIGTERM, 150,000 files in its TMPDIR, stop_timeout = kill_timeout = 1:
    no escalation, no "stop timeout", no UNKILLABLE, exit 0; the removal afterwards, bounded,
    reported as its own step with its own time; the directory gone (the filesystem says so)."""
    d = daemon_factory(filler_stack(tmp_path, "stop_timeout = 1\nkill_timeout = 1\n"))
    pid, path = filled_unit(d)
    t0 = time.monotonic()
    r = subprocess.run([PY, "-m", "omnid", "--control", d.control, "stop", "u"], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=repo_pythonpath()))
    took = time.monotonic() - t0
    seen = f"exit {r.returncode}, stdout:\n{r.stdout}\nstderr:\n{r.stderr}\nlog:\n{d.log()[-3000:]}"
    print(f"\nomnid stop took {took:.2f} s:\n{r.stdout}")
    assert r.returncode == 0, seen
    assert not alive(pid), seen
    assert not os.path.lexists(path), f"{path} outlived the stop; {seen}"
    row = next(line for line in r.stdout.splitlines() if line.startswith("u "))
    assert row.split()[1:4] == ["SIGTERM", row.split()[2], "no"], seen  # UNIT SIGNAL EXIT ESCALATED
    exit_s = float(row.split()[2].rstrip("s"))
    assert exit_s < 0.9, f"the exit took {exit_s} s by the summary; {seen}"
    assert "SIGKILL" not in r.stdout and "UNKILLABLE" not in r.stdout, seen
    cleanup = [line for line in r.stdout.splitlines() if "cleanup" in line and "private tmp removed" in line]
    assert len(cleanup) == 1 and f"({N_FILES + 300 + 1} entries)" in cleanup[0], seen
    assert cleanup[0].split()[0] == "u:" and cleanup[0].split()[2].endswith("s:"), seen
    cleanup_s = float(cleanup[0].split()[2].rstrip("s:"))
    assert 0 < cleanup_s <= took, seen
    print(f"exit {exit_s:.3f} s, cleanup {cleanup_s:.3f} s (its own clock), whole stop {took:.2f} s")
    # What the daemon says it did: no stop timeout, no SIGKILL, no unkillable; the removal, timed.
    said = log_lines(d, "stop timeout: sent SIGKILL", "unkillable processes")
    assert said == [], said
    assert not [e for e in d.log_events() if "timeout" in str(e.get("event")) and e.get("unit") == "u"], seen
    removed = log_lines(d, "leftovers removed")
    assert [(e["unit"], e["private_tmp_entries"]) for e in removed] == [("u", N_FILES + 301)], removed




def test_the_end_of_leftover_timeout_says_it_was_the_leftover_timeout(daemon_factory, tmp_path):
    """A main process that dies by itself leaves a child that ignores SIGTERM: at the end of
    leftover_timeout the log says "leftover timeout: sent SIGKILL" (not "stop timeout"), and
    the child is gone by the kernel."""
    prog = tmp_path / "leaver.py"
    prog.write_text("import os, signal, time\n"
                    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                    "if os.fork() == 0:\n"
                    "    print('child', os.getpid(), flush=True)\n"
                    "    time.sleep(1000)\n"
                    "time.sleep(0.5)\n"
                    "os._exit(3)\n")
    d = daemon_factory(make_stack({"l": f'exec = ["{PY}", "{prog}"]\nrestart = "no"\nleftover_timeout = 1\n'}))
    d.wait_state("l", "failed", timeout=30)
    said = [e for e in d.log_events() if e.get("unit") == "l"]
    child = next(int(e["event"].split()[1]) for e in said if str(e.get("event")).startswith("child "))
    assert not alive(child), d.log()[-3000:]
    sigkill = [e["event"] for e in said if "SIGKILL" in str(e.get("event")) or "timeout" in str(e.get("event"))]
    assert sigkill == ["leftover timeout: sent SIGKILL"], d.log()[-3000:]


@pytest.mark.timeout(400)
def test_a_reexec_hands_a_removal_under_way_over_and_the_new_program_finishes_it(daemon_factory, tmp_path):
    """Item 6: the unit fails by itself (exit 1) with 150,000 files in its TMPDIR and a re-exec
    follows at once: the removal under way is handed over in the re-exec record and the new
    program finishes it (its log says so); the directory is gone afterwards, and the daemon's
    record of private directories no longer names it."""
    d = daemon_factory(filler_stack(tmp_path, 'restart = "no"\n'), env={"PYTHONPATH": repo_pythonpath()})
    pid, path = filled_unit(d)
    os.kill(pid, signal.SIGUSR1)  # it exits 1 by itself; the re-exec's check runs meanwhile
    t0 = time.monotonic()
    d.reexec()
    seen = lambda: f"log:\n{d.log()[-4000:]}"  # noqa: E731
    events = d.log_events()
    execs = [i for i, e in enumerate(events) if e.get("event") == "re-executing"]
    assert len(execs) == 1, seen()
    before = [e for e in events[:execs[0]] if e.get("event") == "leftovers removed"]
    assert before == [], f"the removal ended before the re-exec: nothing was handed over; {seen()}"
    assert d.unit("u")["state"] == "failed" and not alive(pid), seen()
    wait_for(lambda: not os.path.lexists(path), 60, lambda: f"{path} to go after the re-exec; {seen()}")
    took = time.monotonic() - t0
    done = wait_for(lambda: [e for e in d.log_events() if e.get("event") == "leftovers removed"], 10, seen)
    assert [(e["unit"], e.get("handed_over"), e["private_tmp_left"]) for e in done] == \
        [("u", "by the program before a re-exec", None)], done
    print(f"\nhanded over and finished by the new program: {done[0]['private_tmp_entries']} entries in "
          f"{done[0]['seconds']} s; gone {took:.2f} s after the re-exec began")
    wait_for(lambda: path not in (d.state_dir / "tmpdirs.json").read_text(), 10,
             lambda: f"the record to drop {path}: {(d.state_dir / 'tmpdirs.json').read_text()}")
