"""The daemon's state file: which processes it started (ARCHITECTURE.md, "Stopping":
a restarted daemon kills any leftover of the previous instance it can prove is its own).

Proof of ownership: a recorded pid whose start time still matches, or a live
process carrying the previous daemon's OMNID_DAEMON token in its environment.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import structlog

from omnid.base import linux
from omnid.process import proof
from omnid.process.tags import DAEMON_TAG, TagReader, Tags

log = structlog.get_logger("omnid.state")


MAX_STATE_BYTES = 1 << 20  # a state file bigger than this was not written by omnid


@dataclass(frozen=True)
class Leftover:
    pid: int
    unit: str
    how: str  # why we know it is ours
    start_time: int = 0  # checked again once its pidfd is open (omnid.termination.LeftoverTarget)

    def describe(self) -> str:
        return f"{self.unit}: pid {self.pid} ({self.how})"


@dataclass(frozen=True)
class Recorded:
    """One process the previous daemon recorded: typed, from untrusted JSON."""

    unit: str
    pid: int
    start_time: int


@dataclass(frozen=True)
class PreviousState:
    token: str | None
    processes: tuple[Recorded, ...]


def parse_state(data: object, path: Path | str = "state.json") -> PreviousState | None:
    """Untrusted JSON -> typed values. What cannot be trusted is ignored, said once."""
    if not isinstance(data, dict):
        log.warning("state file is not a JSON object; ignoring it", path=str(path), got=type(data).__name__)
        return None
    ignored: list[str] = []
    token = data.get("token")
    if not (isinstance(token, str) and 8 <= len(token) <= 128 and token.isalnum()):
        if token is not None:
            ignored.append("token (not a short alphanumeric string)")
        token = None
    procs = data.get("processes", {})
    recs: list[Recorded] = []
    if not isinstance(procs, dict):
        ignored.append(f"processes (a {type(procs).__name__}, expected an object)")
        procs = {}
    for name, rec in procs.items():
        pid = rec.get("pid") if isinstance(rec, dict) else None
        start = rec.get("start_time") if isinstance(rec, dict) else None
        if (isinstance(pid, int) and not isinstance(pid, bool) and 1 < pid < (1 << 22)
                and isinstance(start, int) and not isinstance(start, bool) and start > 0):
            recs.append(Recorded(str(name)[:200], pid, start))
        else:
            ignored.append(f"processes[{str(name)[:60]!r}]")
    if ignored:
        log.warning("state file entries ignored (malformed)", path=str(path), ignored=ignored[:20],
                    count=len(ignored))
    return PreviousState(token, tuple(recs))


class StateFile:
    """state.json in a directory only the daemon can write (checked at start: omnid.base.ownership).
    Written through a fresh O_EXCL|O_NOFOLLOW temporary file, read with O_NOFOLLOW and a size cap."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / "state.json"

    def write(self, record: dict) -> None:
        proof.replace_daemon_file(self.path, json.dumps(record).encode())

    def read(self) -> PreviousState | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("state file unreadable; ignoring it", path=str(self.path), error=str(exc))
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_STATE_BYTES:
                log.warning("state file is not a regular file under 1 MiB; ignoring it", path=str(self.path),
                            size=st.st_size)
                return None
            if st.st_uid != os.geteuid():
                log.warning("state file owned by another user; ignoring it", path=str(self.path),
                            uid=st.st_uid)
                return None
            raw = os.read(fd, MAX_STATE_BYTES + 1)
        except OSError as exc:
            log.warning("state file unreadable; ignoring it", path=str(self.path), error=str(exc))
            return None
        finally:
            os.close(fd)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            log.warning("state file is not valid JSON; ignoring it", path=str(self.path), error=str(exc)[:200])
            return None
        return parse_state(data, self.path)

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


# The scan below reads every process's environment on the host: each read on a thread of its
# own (omnid.process.tags), waited for at most LEFTOVER_READ_S, and once MAX_OUT reads are out
# no more wait at all: a stranger's process that keeps its memory lock costs the start at most
# LEFTOVER_READ_S, all of them together MAX_OUT times that.
LEFTOVER_READ_S = 0.2
_host_tags = TagReader(name="leftover-scan")


def find_leftovers(previous: PreviousState) -> list[Leftover]:
    """Live processes of a previous daemon instance, proven ours: a recorded pid counts only
    if its start time matches AND it carries the previous daemon's token in its environment
    (a pid alone, or a pid and a start time an attacker copied from /proc, prove nothing).
    A process whose environment is not read in time is not proven ours (a log line names it)."""
    token = previous.token
    if not token:
        return []
    found: dict[int, Leftover] = {}
    me = os.getpid()

    def tags(st: linux.ProcStat) -> Tags | None:
        return _host_tags.get(st.pid, st.start_time, wait=LEFTOVER_READ_S)

    for rec in previous.processes:
        st = linux.read_stat(rec.pid)
        if (st is not None and rec.pid != me and st.start_time == rec.start_time and st.state not in ("Z", "X")
                and (t := tags(st)) is not None and proof.previous_daemons(rec.pid, t.daemon, token)):
            found[rec.pid] = Leftover(rec.pid, rec.unit, "pid, start time and token match the state file",
                                      st.start_time)
    for st in linux.scan():
        if st.pid in found or st.pid == me or st.state in ("Z", "X"):
            continue
        if (t := tags(st)) is not None and proof.previous_daemons(st.pid, t.daemon, token):
            found[st.pid] = Leftover(st.pid, t.unit or "?", f"carries {DAEMON_TAG} of the previous daemon",
                                     st.start_time)
    return list(found.values())


def kill_leftovers(leftovers: list[Leftover], deadline_s: float = 5.0) -> list[str]:
    """SIGKILL each proven leftover through a pidfd (the one kill policy, omnid.process.termination);
    returns descriptions of what still lives after deadline_s."""
    from omnid.process.termination import terminate_leftovers

    return terminate_leftovers(leftovers, deadline_s)
