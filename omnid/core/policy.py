"""The restart policy, pure: after a failure, start again (after how long) or not.

systemd's Restart=/RestartSec=/StartLimitBurst= with exponential backoff, bounded
random jitter (so units or hosts that fail together do not restart in lockstep),
a start limit that ends a crash loop in a stable `failed`, and one rule of our own:
a unit whose very first start after an operator's start cannot even be executed
(ENOENT, EACCES, ENOEXEC) is not retried -- waiting through the whole backoff to
say "no such file" helps nobody.
"""

from __future__ import annotations

import enum
import errno
import random
from dataclasses import dataclass

from omnid.core.runtime import RestartBook
from omnid.model.units import RestartPolicy
from omnid.model.units import Unit as UnitSpec

# The share of a backoff delay added at random (0 .. JITTER x delay): never sooner than
# the configured delay, at most a quarter later.
JITTER = 0.25
# exec(2) errors that the same exec will meet again: the program is missing, not
# executable, or not a program.
DETERMINISTIC_EXEC_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR, errno.ELOOP,
                                       errno.ENAMETOOLONG, errno.EISDIR})


class Outcome(str, enum.Enum):
    NONE = "none"  # restart = "no", the unit's goal is inactive, or the stack is stopping
    AGAIN = "again"  # after `delay` seconds
    GAVE_UP = "gave_up"  # the start limit is hit (or the program cannot be executed)
    COUNTED = "counted"  # a worker group's failure already decided by another member


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    delay: float = 0.0
    note: str = ""  # what the failure reason gains: "restarting in 2 s", "start limit hit ..."


@dataclass(frozen=True)
class Failure:
    """What the policy needs to know of the failure itself."""

    now: float  # monotonic
    wanted: bool  # the unit's goal is active and the stack is not stopping
    ran_for: float | None  # seconds it was active before failing, None if it never was
    exec_errno: int | None = None  # the spawn failed in exec(2) with this errno
    first_start: bool = False  # no start of it succeeded since the operator's start


def starts_in_window(book: RestartBook, spec: UnitSpec, now: float) -> int:
    """Starts within start_limit_interval (older ones are forgotten)."""
    while book.start_times and now - book.start_times[0] > spec.start_limit_interval:
        book.start_times.popleft()
    return len(book.start_times)


def backoff(spec: UnitSpec, failures: int, rand: float) -> float:
    """restart_sec doubling per consecutive failure up to restart_max_sec, plus jitter;
    `rand` in [0, 1)."""
    base = min(spec.restart_sec * (2 ** max(0, failures - 1)), spec.restart_max_sec)
    return base * (1.0 + JITTER * rand)


def decide(spec: UnitSpec, book: RestartBook, f: Failure, rand: float | None = None) -> Decision:
    """Decide, and write the decision into the book (consecutive failures, restart time,
    gave_up). Pure apart from that book; `rand` defaults to random.random()."""
    if spec.worker_group:
        if book.failure_counted:  # one failure of the group, seen again through another member
            return Decision(Outcome.COUNTED, note=f"worker group {spec.worker_group} already down: "
                                                  f"{book.down_reason}")
        book.failure_counted = True
    if f.ran_for is not None and f.ran_for >= spec.restart_max_sec:
        book.consecutive_failures = 0  # it ran long enough: this is a new story, not a crash loop
    book.consecutive_failures += 1
    book.restart_pending = False
    if spec.restart is RestartPolicy.NO or not f.wanted:
        return Decision(Outcome.NONE)
    if f.exec_errno in DETERMINISTIC_EXEC_ERRNOS and f.first_start:
        book.gave_up = True
        return Decision(Outcome.GAVE_UP, note="not restarting: the program cannot be executed (fix the unit "
                                              "file, then `omnid start`)")
    starts = starts_in_window(book, spec, f.now)
    if starts >= spec.start_limit_burst:
        book.gave_up = True
        return Decision(Outcome.GAVE_UP, note=f"start limit hit ({starts} starts within "
                                              f"{spec.start_limit_interval:g} s), not restarting until `omnid start`")
    delay = backoff(spec, book.consecutive_failures, random.random() if rand is None else rand)
    book.restart_pending = True
    book.restart_at = f.now + delay
    return Decision(Outcome.AGAIN, delay, f"restarting in {_seconds(delay)} s")


def _seconds(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x < 10 else f"{x:.1f}".rstrip("0").rstrip(".")
