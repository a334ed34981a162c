"""Proof before touch: is this object this unit instance's? Answered from kernel facts alone,
never from a name, and never from "a process of the unit used it" (every root service's
objects are root's, and anyone may use an object its mode allows).

The callers read the facts (omnid.process.ipc: /proc/sysvipc rows, a stat of the entry, the
creator's /proc/PID/stat and /proc/PID/cgroup, none of which takes another process's memory
lock) and act only on a `Verdict` that says ours; its reason is for people, never parsed.

| object kind           | proof used                                          | never touched                      |
|-----------------------|-----------------------------------------------------|------------------------------------|
| System V segment      | the kernel's creator pid (cpid) is one of the       | a segment someone is attached to;  |
|                       | instance's pids, made (ctime) after its spawn,      | one another process created, even  |
|                       | owner = creator = the unit's user                   | if the unit attached to it         |
| System V queue,       | none in the object (the kernel keeps no creator     | anything of root, of a system user |
| semaphore set         | pid): the unit's user is a user of its own (not     | (uid <= SYS_UID_MAX) or nobody; of |
|                       | root, not a system user, not nobody, no other live  | a user with a login session or any |
|                       | process, no login session), owner = creator = that  | live process; a queue or set the   |
|                       | user, made after the spawn (as systemd's RemoveIPC=)| unit only sent to / operated on    |
| /dev/shm entry        | fanotify named its creator and the creator was      | an entry held (mapped, open) by a  |
|                       | proven the unit's (`creator_unit`); at removal the  | live process; a replaced name (new |
|                       | same inode, owned by the unit's user, a regular file| inode), a mount point              |

A creator is the unit's when, with no environment read: it is a pid recorded for the
instance, or it descends from this daemon (its spawner is the units' subreaper) and its
session, process group or an ancestor (start times checked, so a reused pid breaks the
chain) is a recorded pid, or it sits in the unit's own cgroup; one seen before the unit's
main process was recorded is tied to it when it is (`creator_tied_to`). Only a descendant of
this daemon that none of these ties is worth its environment (this daemon's token and
OMNID_UNIT), which the caller reads bounded, off the loop; a stranger's is never read.
"""

from __future__ import annotations

import enum
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

CLOCK_SLACK_S = 2.0  # wall clock (an object's ctime) against the spawn time
NOBODY_UIDS = frozenset({65534, 65535, 0xFFFFFFFF})  # shared by many services: never a user of its own
SYS_UID_MAX_DEFAULT = 999  # /etc/login.defs: SYS_UID_MAX, else UID_MIN - 1 (UID_MIN defaults to 1000)


class Kind(enum.Enum):
    SYSV_SHM = "System V shm"
    SYSV_SEM = "System V sem"
    SYSV_MSG = "System V msg"
    POSIX = "/dev/shm entry"


@dataclass(frozen=True)
class Verdict:
    """Ours or not, and why (for people)."""

    ours: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ours


def _yes(reason: str) -> Verdict:
    return Verdict(True, reason)


def _no(reason: str) -> Verdict:
    return Verdict(False, reason)


@dataclass(frozen=True)
class Instance:
    """What the kernel told omnid about one instance of a unit."""

    unit: str
    uid: int
    since: float  # wall clock at its spawn
    pids: frozenset[int]  # its main process and the creators proven its own


# ------------------------------------------------------------------ System V
def sysv_segment(inst: Instance, row: Mapping[str, str]) -> Verdict:
    """A /proc/sysvipc/shm row: the unit's only when one of its processes created it."""
    try:
        uid, cuid, cpid = int(row["uid"]), int(row["cuid"]), int(row["cpid"])
        ctime, nattch = int(row["ctime"]), int(row["nattch"])
    except (KeyError, ValueError):
        return _no("row unreadable")
    if uid != inst.uid or cuid != inst.uid:
        return _no(f"owner {uid} / creator {cuid} is not the unit's user {inst.uid}")
    if cpid not in inst.pids:
        return _no(f"created by pid {cpid}, not a process of the unit")
    if ctime < inst.since - CLOCK_SLACK_S:
        return _no("created before the instance started (a reused pid)")
    if nattch != 0:
        return _no(f"{nattch} attached")
    return _yes(f"created by the unit's pid {cpid}")


@dataclass(frozen=True)
class UserFacts:
    """What the host says of a uid at the removal."""

    uid: int
    sys_uid_max: int
    processes: int | None  # live processes with this uid (real, effective, saved or fs); None: not counted
    session: bool  # logind knows a session or a runtime directory of the user


def own_user(f: UserFacts) -> Verdict:
    """Is `uid` a user of its own, whose queues and semaphore sets can only be the unit's?"""
    if f.uid == 0:
        return _no("the unit runs as root")
    if f.uid <= f.sys_uid_max:
        return _no(f"uid {f.uid} is a system user (<= {f.sys_uid_max})")
    if f.uid in NOBODY_UIDS:
        return _no(f"uid {f.uid} is nobody's, shared by many services")
    if f.session:
        return _no(f"uid {f.uid} has a login session")
    if f.processes is None:
        return _no(f"the processes of uid {f.uid} could not be counted in time")
    if f.processes:
        return _no(f"{f.processes} other live process(es) of uid {f.uid}")
    return _yes(f"uid {f.uid} is a user of its own with nothing else alive")


def sysv_keyed(kind: Kind, inst: Instance, row: Mapping[str, str], user: Verdict) -> Verdict:
    """A /proc/sysvipc/msg or sem row: no creator pid in the kernel, so the unit's only when
    its user is a user of its own (`own_user`) that owns and created it after the spawn."""
    if kind not in (Kind.SYSV_MSG, Kind.SYSV_SEM):
        raise ValueError(f"sysv_keyed is for queues and semaphore sets, not {kind.value} (it has a creator pid)")
    try:
        uid, cuid, ctime = int(row["uid"]), int(row["cuid"]), int(row["ctime"])
    except (KeyError, ValueError):
        return _no("row unreadable")
    if uid != inst.uid or cuid != inst.uid:
        return _no(f"owner {uid} / creator {cuid} is not the unit's user {inst.uid}")
    if not user:
        return _no(f"{kind.value} carries no creator pid and {user.reason}")
    if ctime < inst.since - CLOCK_SLACK_S:
        return _no("made before the instance started")
    return _yes(user.reason)


# ------------------------------------------------------------------ /dev/shm
@dataclass(frozen=True)
class Creator:
    """Kernel facts about the process fanotify named as an entry's creator, none of which
    takes its memory lock (/proc/PID/stat, /proc/PID/cgroup)."""

    pid: int
    gone: bool  # its /proc/PID/stat could not be read
    lineage: tuple[int, ...] = ()  # pid, its parent, ... (each started no later than its child)
    starts: tuple[int, ...] = ()  # their start times (clock ticks since boot), in the same order
    sid: int = 0
    pgid: int = 0
    descends: bool = False  # the lineage reaches this daemon
    cgroup: str | None = None  # its cgroup v2 path


@dataclass(frozen=True)
class Attribution:
    unit: str | None
    reason: str
    ask_environ: bool = False  # a descendant of this daemon nothing else ties: its environment may say


def creator_unit(c: Creator, pid_unit: Mapping[int, str], cgroup_unit: Mapping[str, str]) -> Attribution:
    """Which live instance's process created the entry, from `Creator` facts; `pid_unit` are
    the recorded pids of live instances, `cgroup_unit` the cgroups that belong to one unit
    alone."""
    if c.gone:
        # The main process SIGKILLed right after the creation: its pid is still recorded for
        # the live instance, and the spawner (its parent) has not let the number go.
        unit = pid_unit.get(c.pid)
        return Attribution(unit, "a recorded pid, already gone" if unit else "the creator was gone")
    if not c.descends:
        return Attribution(None, f"pid {c.pid} does not descend from this daemon")
    for p in c.lineage:
        if p in pid_unit:
            return Attribution(pid_unit[p], f"pid {p}, recorded for the instance, is the creator or its ancestor")
    for what, p in (("session", c.sid), ("process group", c.pgid)):
        if p in pid_unit:
            return Attribution(pid_unit[p], f"its {what} is the instance's pid {p}")
    if c.cgroup is not None:
        for cg, unit in cgroup_unit.items():
            if c.cgroup == cg or c.cgroup.startswith(cg + "/"):
                return Attribution(unit, f"it is in the unit's cgroup {cg}")
    return Attribution(None, "a descendant of this daemon that no pid or cgroup ties to a unit", ask_environ=True)


def creator_tied_to(c: Creator, pid: int, start_time: int | None, cgroup: str | None) -> Verdict:
    """A creator seen before the unit's main process was recorded (a spawn's answer can reach
    the daemon after the unit's first creations): is it that process (same start time), one
    of its descendants, in its session or process group, or in its own cgroup?"""
    if c.gone or not c.descends:
        return _no("not a live descendant of this daemon when seen")
    if start_time is not None:
        for p, st in zip(c.lineage, c.starts):
            if p == pid and st == start_time:
                return _yes(f"pid {pid}, the instance's main process, is the creator or its ancestor")
    # A session or group leader started no later than its member: a number reused since is not it.
    if start_time is not None and c.starts and start_time <= c.starts[0]:
        for what, p in (("session", c.sid), ("process group", c.pgid)):
            if p == pid:
                return _yes(f"its {what} is the instance's pid {pid}")
    if cgroup is not None and c.cgroup is not None and (c.cgroup == cgroup or c.cgroup.startswith(cgroup + "/")):
        return _yes(f"it is in the unit's cgroup {cgroup}")
    return _no(f"nothing ties it to pid {pid}")


def posix_entry(inst: Instance, name: str, recorded_ino: int, st: os.stat_result) -> Verdict:
    """At removal: the entry is still the one the unit's process created (same inode), owned
    by the unit's user, a regular file. (That nobody holds it is the caller's scan.)"""
    if st.st_ino != recorded_ino:
        return _no(f"{name} is another file now (inode {st.st_ino}, not {recorded_ino})")
    if st.st_uid != inst.uid:
        return _no(f"{name} is owned by uid {st.st_uid}, not the unit's {inst.uid}")
    if not stat.S_ISREG(st.st_mode):
        return _no(f"{name} is not a regular file")
    return _yes(f"{name} was created by a process of the unit")
