"""What a unit is right now (its runtime record), as opposed to what its unit file says
(`omnid.units.Unit`, the spec). The record holds plain values only -- state, phase,
goal, the process handle's numbers, counters, the last failure -- so that it can be
written out and read back (`to_json` / `from_json`) when the daemon re-executes
itself. Live things (timers, tasks, readers) belong to the executor, never here.

A worker group's members share one `RestartBook`: backoff, start limit and
generation count the group as one thing.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, fields
from typing import Any

from omnid.core.lifecycle import Cause, Goal, Phase, UnitState
from omnid.process.output import UnitOutput
from omnid.process.handle import ProcessHandle
from omnid.process.termination import StopRecord
from omnid.model.units import Unit as UnitSpec


@dataclass
class RestartBook:
    """Restart bookkeeping of one unit, or of a worker group (shared by its members)."""

    start_times: collections.deque = field(default_factory=collections.deque)  # monotonic
    consecutive_failures: int = 0
    restart_at: float = 0.0  # monotonic; no automatic start before
    restart_pending: bool = False  # the policy said: again, at restart_at
    gave_up: bool = False  # the start limit was hit: not again until `omnid start`
    generation: int = 0  # starts so far (a worker group's start counts once)
    # Worker groups only: `up` while a generation is open and none of its members failed;
    # `down_reason` names the member whose failure took the generation down.
    up: bool = False
    down_reason: str | None = None
    failure_counted: bool = False
    ever_up: bool = False  # a start became active since the operator's last start

    def to_json(self) -> dict:
        return {"start_times": list(self.start_times), "consecutive_failures": self.consecutive_failures,
                "restart_at": self.restart_at, "restart_pending": self.restart_pending, "gave_up": self.gave_up,
                "generation": self.generation, "up": self.up, "down_reason": self.down_reason,
                "failure_counted": self.failure_counted, "ever_up": self.ever_up}

    @classmethod
    def from_json(cls, d: dict) -> RestartBook:
        return cls(start_times=collections.deque(float(x) for x in d["start_times"]),
                   consecutive_failures=int(d["consecutive_failures"]), restart_at=float(d["restart_at"]),
                   restart_pending=bool(d["restart_pending"]), gave_up=bool(d["gave_up"]),
                   generation=int(d["generation"]), up=bool(d["up"]),
                   down_reason=None if d["down_reason"] is None else str(d["down_reason"]),
                   failure_counted=bool(d["failure_counted"]), ever_up=bool(d["ever_up"]))


# Fields of UnitRuntime written out as they are (plain values).
_PLAIN = ("reason", "since", "last_pgid", "ready", "restarts", "deaths", "last_exit", "last_exit_code",
          "last_signal", "cause_text", "stop_reason", "active_since", "status_text", "stopping_notified",
          "notified_ready", "watchdog_last", "ready_deadline", "death_detect_ms", "gpu_release_ms", "gpu_held",
          "goal_seq", "goal_by", "epoch", "spawn_errno", "capture_summary", "last_exit_what")


@dataclass
class UnitRuntime:
    spec: UnitSpec
    book: RestartBook
    output: UnitOutput
    state: UnitState = UnitState.INACTIVE
    phase: Phase = Phase.IDLE
    goal: Goal = Goal.ACTIVE
    cause: Cause | None = None  # why it stops, while it stops (and why it last stopped)
    reason: str = ""  # for people: never parsed
    since: float = field(default_factory=time.time)
    proc: ProcessHandle | None = None
    last_pgid: int = 0
    ready: bool = False
    restarts: int = 0
    deaths: int = 0
    last_exit: str = ""
    last_exit_code: int | None = None
    last_signal: int | None = None
    cause_text: str = ""  # the last failure without its pid: what dependents' reasons name
    stop_reason: str = ""  # what the current stop is for, the reason it ends with
    active_since: float = 0.0  # monotonic
    status_text: str = ""  # sd_notify STATUS=
    stopping_notified: bool = False  # sd_notify STOPPING=1 seen
    notified_ready: bool = False  # sd_notify READY=1 seen (before or while starting)
    watchdog_last: float = 0.0  # monotonic: the last WATCHDOG=1
    ready_deadline: float = 0.0  # monotonic: NOT_READY at this moment
    last_stop: StopRecord | None = None
    death_detect_ms: float | None = None  # pidfd wake-up -> `failed`, last death
    # After the last stop or failure: ms until its pids held no GPU memory (None: could not tell
    # or still held), and what was still held at the deadline.
    gpu_release_ms: float | None = None
    gpu_held: list[str] = field(default_factory=list)
    goal_seq: int = 0  # bumped by every operator start/stop: a waiter sees it was overtaken
    goal_by: str = ""  # "start" or "stop": the last operator request on this unit
    epoch: int = 0  # bumped at every change of position: a timer or outcome of an older one is void
    spawn_errno: int | None = None  # the last spawn failed in exec(2) with this errno
    capture_summary: str = ""  # the last capture of its stacks before a kill, in a line
    last_exit_what: str = ""  # how the main process ended: "killed by SIGKILL (pid 12, while active)"
    start_requested: bool = False  # an operator's start is pending: the next start is no automatic restart
    private_tmp: str = ""  # the instance's TMPDIR (omnid.process.privatetmp); "" = none
    ipc_removed: list[str] = field(default_factory=list)  # IPC objects removed when it was last gone
    # Taken out by a rolling restart (omnid.core.requests.roll): its dependents do not count it
    # as down, since its sibling instances serve them; cleared by the next operator start/stop.
    rolling: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def busy(self) -> bool:
        """Something is under way for it (a spawn, a stop, a GPU release wait)."""
        return self.phase is not Phase.IDLE or self.state is UnitState.STOPPING

    @property
    def dead(self) -> bool:
        """Its main process exited (pidfd readable) and nobody asked: from this moment on
        it counts as failed for /health, before the failure is recorded."""
        return (self.proc is not None and self.proc.exited.is_set()
                and self.state in (UnitState.STARTING, UnitState.ACTIVE))

    # ------------------------------------------------------------- status object
    def snapshot(self) -> dict:
        p = self.proc
        from omnid.base import linux
        from omnid.process import numa

        return {
            "name": self.name,
            "role": self.spec.role,
            "description": self.spec.description,
            "state": self.state.value,
            "phase": self.phase.value,
            "goal": self.goal.value,
            "pid": p.pid if p else None,
            "pgid": p.pgid if p else None,
            "restarts": self.restarts,
            "since": self.since,
            "reason": self.reason,
            "ready": self.ready,
            "status_text": self.status_text,
            "last_exit": self.last_exit,
            "last_exit_code": self.last_exit_code,
            "last_signal": linux.signal_name(self.last_signal) if self.last_signal else None,
            "gave_up": self.book.gave_up,
            "instance": self.spec.instance,
            "gpus": list(self.spec.gpus),
            "generation": self.book.generation,
            "gpu_release_ms": self.gpu_release_ms,
            "gpu_held": list(self.gpu_held),
            "private_tmp": self.private_tmp or None,
            "ipc_removed": list(self.ipc_removed),
            **({"worker_group": self.spec.worker_group} if self.spec.worker_group else {}),
            "placement": numa.status(self.spec),
        }

    # ------------------------------------------------------------- re-exec record
    def to_json(self) -> dict[str, Any]:
        """Everything of the record but the spec, the book and the output (written beside
        it by whoever writes the record) as JSON values; the pidfd as its fd number."""
        out: dict[str, Any] = {k: getattr(self, k) for k in _PLAIN}
        out.update(name=self.name, state=self.state.value, phase=self.phase.value, goal=self.goal.value,
                   cause=self.cause.value if self.cause else None,
                   proc=None if self.proc is None else self.proc.to_json(),
                   last_stop=None if self.last_stop is None else self.last_stop.to_json(),
                   start_requested=self.start_requested,
                   private_tmp=self.private_tmp, ipc_removed=list(self.ipc_removed),
                   rolling=self.rolling)
        return out

    def load_json(self, d: dict[str, Any]) -> None:
        """Take over a record written by to_json (by a previous program of this daemon).
        Raises KeyError/ValueError/TypeError on anything malformed: the caller decides."""
        known = {f.name: f for f in fields(self)}
        for k in _PLAIN:
            if k not in known:
                raise KeyError(k)
            setattr(self, k, d[k])
        self.state = UnitState(d["state"])
        self.phase = Phase(d["phase"])
        self.goal = Goal(d["goal"])
        self.cause = None if d["cause"] is None else Cause(d["cause"])
        self.proc = None if d["proc"] is None else ProcessHandle.from_json(self.name, d["proc"])
        self.last_stop = None if d["last_stop"] is None else StopRecord.from_json(d["last_stop"])
        self.start_requested = bool(d.get("start_requested", False))  # absent from older programs' records
        # Absent in a record of a program without them: nothing to take over.
        self.private_tmp = str(d.get("private_tmp", ""))
        self.ipc_removed = [str(x) for x in d.get("ipc_removed", [])]
        self.rolling = bool(d.get("rolling", False))
