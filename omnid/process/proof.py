"""Proof before touch: is this object this unit instance's (or the daemon's own)? Answered from
kernel facts alone, never from a name, never from "nothing listens on it", and never from "a
process of the unit used it" (every root service's objects are root's, and anyone may use an
object its mode allows). Every signal, unlink, rmdir, chown and chmod omnid makes on a host
object asks one function here first; reading this module tells every rule.

The callers read the facts (a stat, a /proc/sysvipc row, /proc/PID/stat and /proc/PID/cgroup,
none of which takes another process's memory lock; a process's tags only through
omnid.process.tags, bounded, off the loop) and act only on a `Verdict` that says ours; its
reason is for people (a log line, a unit's failure reason), never parsed. The acts stay at
their sites, right after the verdict, because each is bound to what the site holds for it: a
pidfd kept open from the proof to the signal, a walk's dir_fd, a socket's O_PATH fd.

| object kind           | proof used                                          | never touched                      |
|-----------------------|-----------------------------------------------------|------------------------------------|
| process               | its spawn's pidfd; a pid read somewhere through     | a bare pid; one whose start time   |
|                       | linux.pidfd_if with `same_process` (start time) or  | differs; a stranger's environment  |
|                       | its cgroup; a scanned one of the unit's own also    | (never read); an untagged or       |
|                       | `unit_tag`; a previous daemon's `previous_daemons`; | unread one; a reaped child         |
|                       | a helper child before its pidfd `own_child`         |                                    |
| process group         | `process_group`: leader running or unreaped, or a   | a number whose leader is reaped    |
|                       | proven member held by pidfd                         | with no member held                |
| cgroup directory      | `cgroup_dir`: directly under the claimed root, a    | anything outside the root; the     |
|                       | cgroup (cgroup.events), not the daemon's leaf       | daemon's own leaf                  |
| private tmp directory | `tmp_dir`: device, inode, owner recorded at mkdir   | an unrecorded or replaced one      |
| unit socket file      | `unit_socket`: device, inode, change time recorded  | another program's socket, even     |
|                       | at the bind; `bound_now` for its mode and owner;    | with nothing listening             |
|                       | inherited, unrecorded: `bound_by` (sock_diag)       |                                    |
| the daemon's files    | `daemon_file`: in its checked own directory, its    | a link; another user's file        |
|                       | user's, no link                                     |                                    |
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
import secrets
import stat
from collections.abc import Container, Mapping
from dataclasses import dataclass
from pathlib import Path

CLOCK_SLACK_S = 2.0  # wall clock (an object's ctime) against the spawn time
NOBODY_UIDS = frozenset({65534, 65535, 0xFFFFFFFF})  # shared by many services: never a user of its own
DAEMON_LEAF = "daemon"  # the daemon's own leaf below a delegated root (omnid.process.cgroupfs)
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


# ------------------------------------------------------------------ processes
def same_process(pid: int, start_time: int, now: int | None) -> Verdict:
    """A pid read somewhere names the process proven before only while its start time is the
    same: pid + start time name a process uniquely. Read with a pidfd open on it
    (omnid.base.linux.pidfd_if: the fd opened first, this read, then the fd checked alive), so
    the answer is about the process the fd holds."""
    if now is None:
        return _no(f"pid {pid} is gone")
    if now != start_time:
        return _no(f"pid {pid} is another process now (started at {now}, not {start_time})")
    return _yes(f"pid {pid}, started at {start_time}")


def unit_tag(pid: int, unit: str, tag_unit: str | None, tag_daemon: str | None, token: str | None) -> Verdict:
    """A process among the unit's own (its group, its session, the spawner's descendants)
    carries its OMNID_UNIT and this daemon's OMNID_DAEMON token or none: read bounded, off the
    loop (omnid.process.tags), never of a stranger. A process whose tags are not read in time
    (`tag_unit` None) is not proven."""
    if tag_unit != unit:
        return _no(f"pid {pid} carries no tag of {unit}" if tag_unit is None else f"pid {pid} is {tag_unit}'s")
    if token is not None and tag_daemon not in (token, None):
        return _no(f"pid {pid} is tagged by another omnid daemon")
    return _yes(f"pid {pid} carries {unit}'s tag")


def previous_daemons(pid: int, tag_daemon: str | None, token: str | None) -> Verdict:
    """A leftover of the daemon before this one (state.json's token, readable by root alone):
    its environment carries that token, whatever its pid and start time say (a pid and a start
    time can be copied from /proc; the token cannot)."""
    if not token:
        return _no("the previous daemon recorded no token")
    if tag_daemon != token:
        return _no(f"pid {pid} does not carry the previous daemon's token")
    return _yes(f"pid {pid} carries the previous daemon's token")


def own_child(pid: int) -> Verdict:
    """A child this process spawned and has not reaped: the kernel keeps its pid for it until
    the wait, so the number cannot name anyone else (waitid WNOWAIT asks without reaping)."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return _no(f"pid {pid} is not an unreaped child of this process")
    return _yes(f"pid {pid} is this process's child, not reaped yet")


def process_group(pgid: int, *, leader_running: bool = False, leader_zombie: bool = False,
                  member_held: bool = False) -> Verdict:
    """A process group's number is the unit's while something of the unit holds it: the kernel
    frees a number only once no process uses it as pid, group or session. The caller says
    which holds it, cheapest first: the leader (the unit's main process) running, its pidfd not
    readable; the leader exited but not reaped (a zombie of the same start time keeps its pid);
    a member proven the unit's (tag, start time) held by a pidfd and read in the group after
    the fd was opened. None of these: the number may be a stranger's group now, and only
    members proven one by one are signalled, each through a pidfd."""
    if pgid <= 1:
        return _no(f"process group {pgid} is never a unit's")
    if leader_running:
        return _yes(f"its leader, the unit's main process, is running (pidfd): group {pgid}")
    if leader_zombie:
        return _yes(f"its leader exited and is not reaped: group {pgid} cannot have been reused")
    if member_held:
        return _yes(f"a member proven the unit's holds group {pgid} (pidfd)")
    return _no(f"the leader of group {pgid} is gone and no member is held: the number may be another group's")


# ------------------------------------------------------------------ cgroups
def cgroup_dir(path: str, root: str, st: os.stat_result | None, is_cgroup: bool) -> Verdict:
    """A unit's cgroup directory: a child of the root omnid claimed (flag, omnid.toml or
    systemd's delegation, where no other program makes cgroups), not the daemon's own leaf,
    a directory that the kernel's cgroup.events file shows to be a cgroup (a cgroup file
    system has no links). Sub-cgroups below it are the unit's too: only its processes could
    make them."""
    parent, name = os.path.split(path.rstrip("/"))
    if os.path.normpath(parent) != os.path.normpath(root):
        return _no(f"{path} is not directly under the claimed cgroup root {root}")
    if name in ("", ".", "..", DAEMON_LEAF):
        return _no(f"{path} is the daemon's own cgroup, never a unit's")
    if st is None:
        return _no(f"{path} is gone")
    if not stat.S_ISDIR(st.st_mode):
        return _no(f"{path} is not a directory")
    if not is_cgroup:
        return _no(f"{path} has no cgroup.events: not a cgroup")
    return _yes(f"{name} is a cgroup under the claimed root {root}")


# ------------------------------------------------------------------ files omnid made
def tmp_dir(path: str, st: os.stat_result, dev: int, ino: int, uid: int) -> Verdict:
    """A unit's private tmp directory: the directory omnid made (recorded at the mkdir in the
    state directory's tmpdirs.json: device, inode, the owner it gave). A name alone is anyone's
    (/tmp is everyone's); the inode number is checked with the owner because a number can be
    reused once the directory is gone, and only its owner (or root) could remove it from the
    sticky /tmp and make another of that name. What is below it is its own: walked by fds,
    never through a link, never into another mount."""
    if not stat.S_ISDIR(st.st_mode):
        return _no("not a directory")
    if (st.st_dev, st.st_ino) != (dev, ino):
        return _no("not the directory omnid made (replaced)")
    if uid >= 0 and st.st_uid != uid:
        return _no(f"owned by uid {st.st_uid}, not {uid} as omnid made it (replaced)")
    return _yes(f"{path} is the directory omnid made")


@dataclass(frozen=True)
class MadeSocket:
    """A unit's Unix socket file as omnid bound it: its device, inode and change time, read
    once its mode and owner were set (no one but root can set a change time)."""

    dev: int
    ino: int
    ctime_ns: int


def unit_socket(path: str, st: os.stat_result, made: MadeSocket | None) -> Verdict:
    """A unit's socket file at its listen path: omnid's only when it is the one omnid bound,
    as recorded at the bind (in the state directory, so a daemon after a SIGKILL or a re-exec
    knows its predecessor's). "Nothing listens" proves nothing: another service's socket
    reads the same while that service is down."""
    if not stat.S_ISSOCK(st.st_mode):
        return _no(f"{path} is not a socket")
    if made is None:
        return _no(f"{path} is a socket omnid has no record of binding")
    if (st.st_dev, st.st_ino) != (made.dev, made.ino):
        return _no(f"{path} is another socket file now (inode {st.st_ino}, not {made.ino})")
    if st.st_ctime_ns != made.ctime_ns:
        return _no(f"{path} was changed since omnid bound it (mode, owner or links)")
    return _yes(f"{path} is the socket file omnid bound")


def bound_now(path: str, st: os.stat_result, euid: int) -> Verdict:
    """The name just bound, opened O_PATH without following a link, right after the bind in
    a directory only root can write (omnid.base.ownership.open_directory): the daemon's socket
    when it is a socket owned by the daemon's user. Its mode and owner are then set through
    that fd, never through the name."""
    if not stat.S_ISSOCK(st.st_mode):
        return _no(f"{path} is not a socket")
    if st.st_uid != euid:
        return _no(f"{path} is owned by uid {st.st_uid}, not the daemon's {euid}")
    return _yes(f"{path} is the socket the daemon just bound")


def bound_by(path: str, st: os.stat_result, bound: tuple[int, int] | None) -> Verdict:
    """A socket omnid holds (inherited across a re-exec with no record of its file): the file at
    its listen path is its own when the kernel's record of the socket (sock_diag UNIX_DIAG_VFS:
    the device and inode, low 32 bits, it was bound to) names that file."""
    if not stat.S_ISSOCK(st.st_mode):
        return _no(f"{path} is not a socket")
    if bound is None:
        return _no(f"the kernel did not say which file the held socket was bound to ({path})")
    if (st.st_dev, st.st_ino & 0xFFFFFFFF) != bound:
        return _no(f"{path} is not the file the held socket was bound to (replaced)")
    return _yes(f"{path} is the file the socket omnid holds was bound to")


def daemon_file(path: str, st: os.stat_result, uids: Container[int]) -> Verdict:
    """A file in the daemon's own directory (the state directory, the control socket's
    directory), which the caller has checked to be owned by the daemon's user and writable by
    no one else: a file there not owned by a trusted uid, or a link, is no file of the daemon's."""
    if stat.S_ISLNK(st.st_mode):
        return _no(f"{path} is a symbolic link")
    if st.st_uid not in uids:
        return _no(f"{path} is owned by uid {st.st_uid}, not the daemon's")
    return _yes(f"{path} is the daemon's, in its own directory")


def read_daemon_file(path: Path, limit: int) -> bytes | None:
    """What the daemon wrote at `path` in its own directory, None when nothing is there; read
    with O_NOFOLLOW and trusted only as a regular file of the daemon's user of at most `limit`
    bytes. OSError: unreadable; ValueError: not a small file of the daemon's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit or st.st_uid != os.geteuid():
            raise ValueError(f"{path} is not a small file of the daemon's")
        return os.read(fd, limit + 1)
    finally:
        os.close(fd)


def replace_daemon_file(path: Path, data: bytes) -> None:
    """Put `data` at `path`, in the daemon's own directory, through a fresh temporary file beside
    it (O_EXCL|O_NOFOLLOW, 0600: never another's file, never through a link) and a rename, so a
    reader never sees half a record. On failure the temporary file goes (it is this call's,
    `daemon_file`) and the error is raised."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            if daemon_file(str(tmp), os.lstat(tmp), (os.geteuid(),)):
                os.unlink(tmp)
        except OSError:
            pass
        raise
