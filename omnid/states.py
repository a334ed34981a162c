"""Unit states, goals, and the table of legal transitions (DESIGN.md "Unit state machine").

`state` is what the kernel says a unit is; `goal` is what the operator wants.
The supervisor converges the first onto the second. Reading LEGAL tells you
every transition that can happen.
"""

from __future__ import annotations

import enum


class UnitState(str, enum.Enum):
    INACTIVE = "inactive"
    STARTING = "starting"
    ACTIVE = "active"
    STOPPING = "stopping"
    FAILED = "failed"


class Goal(str, enum.Enum):
    ACTIVE = "active"
    INACTIVE = "inactive"


S = UnitState
LEGAL: dict[UnitState, frozenset[UnitState]] = {
    # inactive -> failed: the spawn itself failed (exec error, GPU held by a leftover).
    S.INACTIVE: frozenset({S.STARTING, S.FAILED}),
    # starting -> failed: died before ready, with its group already empty.
    S.STARTING: frozenset({S.ACTIVE, S.STOPPING, S.FAILED}),
    S.ACTIVE: frozenset({S.STOPPING, S.FAILED}),
    # stopping -> failed when the stop was the consequence of a failure (timeout, probe).
    S.STOPPING: frozenset({S.INACTIVE, S.FAILED}),
    # failed -> inactive: an operator's stop clears a failure.
    # failed -> failed: an automatic restart whose spawn failed again.
    S.FAILED: frozenset({S.STARTING, S.INACTIVE, S.FAILED}),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(unit: str, frm: UnitState, to: UnitState) -> None:
    if to not in LEGAL[frm]:
        raise IllegalTransition(f"{unit}: illegal transition {frm.value} -> {to.value}")
