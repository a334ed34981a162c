"""The daemon's state file: which processes it started (DESIGN.md "Stopping a stack":
a restarted daemon kills any leftover of the previous instance it can prove is its own).

Proof of ownership: a recorded pid whose start time still matches, or a live
process carrying the previous daemon's OMNID_DAEMON token in its environment.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from omnid import linux
from omnid.process import DAEMON_TAG, UNIT_TAG

log = structlog.get_logger("omnid.state")


@dataclass(frozen=True)
class Leftover:
    pid: int
    unit: str
    how: str  # why we know it is ours

    def describe(self) -> str:
        return f"{self.unit}: pid {self.pid} ({self.how})"


class StateFile:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "state.json"

    def write(self, record: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.path)

    def read(self) -> dict | None:
        try:
            with open(self.path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("state file unreadable; ignoring it", path=str(self.path), error=str(exc))
            return None

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def find_leftovers(previous: dict) -> list[Leftover]:
    """Live processes of a previous daemon instance, proven ours."""
    token = previous.get("token")
    found: dict[int, Leftover] = {}
    procs = previous.get("processes", {})
    for name, rec in procs.items():
        pid, start = rec.get("pid"), rec.get("start_time")
        st = linux.read_stat(pid) if isinstance(pid, int) else None
        if st is not None and st.start_time == start and st.state not in ("Z", "X"):
            found[pid] = Leftover(pid, name, "pid and start time match the state file")
    if token:
        me = os.getpid()
        for st in linux.scan():
            if st.pid in found or st.pid == me or st.state in ("Z", "X"):
                continue
            if linux.read_environ_var(st.pid, DAEMON_TAG) == token:
                unit = linux.read_environ_var(st.pid, UNIT_TAG) or "?"
                found[st.pid] = Leftover(st.pid, unit, f"carries {DAEMON_TAG} of the previous daemon")
    return list(found.values())


def kill_leftovers(leftovers: list[Leftover], deadline_s: float = 5.0) -> list[str]:
    """SIGKILL each proven leftover through a pidfd; returns descriptions of what still lives."""
    handles = []
    for lo in leftovers:
        try:
            fd = os.pidfd_open(lo.pid)
        except ProcessLookupError:
            continue
        linux.pidfd_send_signal(fd, signal.SIGKILL)
        handles.append((lo, fd))
    deadline = time.monotonic() + deadline_s
    alive = []
    for lo, fd in handles:
        p = select.poll()
        p.register(fd, select.POLLIN)
        if not p.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            alive.append(lo.describe())
        os.close(fd)
    return alive
