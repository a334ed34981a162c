"""IPC residue (unit key `remove_ipc`, omnid.unit(5)): the POSIX shared memory segments
and semaphores (/dev/shm) and the System V shared memory, semaphores and message queues
that are proven a unit instance's, removed once nothing of the unit runs and no live process
holds them. This module reads the kernel's facts and removes; whether an object is the
unit's is decided by omnid.process.proof alone (its table: object kind -> proof -> never
touched). "A process of the unit used it" is never proof.

Facts gathered here:
- POSIX (/dev/shm): a fanotify listener (root; FAN_REPORT_DFID_NAME, FAN_CREATE and
  FAN_MOVED_TO on the /dev/shm directory) reports the pid of every process that creates
  an entry. A thread of its own reads the events (never the event loop) and, at event
  time, reads facts of the creator that take no lock of its own (/proc/PID/stat: its
  ancestors, session, process group; /proc/PID/cgroup). Only a descendant of this daemon
  that none of these ties to a unit has its environment read (this daemon's token
  OMNID_DAEMON and OMNID_UNIT), through omnid.process.tags (a thread of its own per read,
  waited for ENVIRON_WAIT_S): such a read takes the process's memory lock, which its owner
  can hold for good. A stranger's environment is never read. A descendant nothing ties is
  kept (bounded) and tied when its unit's main process is recorded: a spawn's answer can
  reach the daemon after the unit's first creations. The book records (name, inode) for
  the unit, and the pid.
- System V: the /proc/sysvipc rows (a segment's creator pid, owners, times) and, for queues
  and semaphore sets (no creator pid in the kernel), whether the unit's user is a user of
  its own: login.defs, a logind session, a count of that uid's live processes
  (/proc/PID/status, which takes no memory lock).
At removal, off the event loop and bounded: a POSIX entry must still be the same inode,
owned by the unit's user, and neither mapped nor open by any live process (a scan of
/proc/*/maps and /proc/*/fd; an unfinished scan removes nothing); a System V segment must
have nattch 0. Then unlink / IPC_RMID.

Without fanotify (not root, or the kernel refuses) POSIX objects are not attributed and
stay; System V attribution works as above.
"""

from __future__ import annotations

import collections
import ctypes
import os
import select
import struct
import threading
import time
from dataclasses import dataclass, field

import structlog

from omnid.base import linux
from omnid.process import proof
from omnid.process.tags import TagReader

log = structlog.get_logger("omnid.process.ipc")

SHM_DIR = "/dev/shm"
SYSVIPC = "/proc/sysvipc"
MAX_OBJECTS = 4096  # per unit: what a unit creating millions of entries can cost
MAX_PIDS = 4096
MAX_UNRESOLVED = 1024  # creators seen before their unit's main process was recorded
UNRESOLVED_KEEP_S = 30.0  # a spawn's answer comes within 15 s (SPAWN_REPLY_TIMEOUT_S)
ENVIRON_MAX_OUT = 4  # environment reads not returned (a process holding its memory lock) before refusals
ENVIRON_WAIT_S = 0.25  # the listener's wait for one (a readable one takes ~0.1 ms)
STOP_WAIT_S = 2.0  # ShmWatch.stop(): the listener's end and its queue's lock, at most
DRAIN_LOCK_S = 5.0  # a removal's wait for the listener to finish the batch it is attributing
UID_SCAN_S = 1.0  # counting a uid's live processes (queues and semaphore sets of a user of its own)

# fanotify (linux/fanotify.h)
FAN_CLOEXEC, FAN_NONBLOCK, FAN_CLASS_NOTIF = 0x1, 0x2, 0x0
FAN_REPORT_DFID_NAME = 0x400 | 0x800
FAN_CREATE, FAN_MOVED_TO, FAN_Q_OVERFLOW = 0x100, 0x80, 0x4000
FAN_MARK_ADD = 0x1
FAN_EVENT_INFO_TYPE_DFID_NAME = 2
_META = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
IPC_RMID = 0

# The interpreter already links libc: ctypes.util.find_library("c") ran /sbin/ldconfig in a
# subprocess (a fork by the daemon, ~2.5 ms on its way to the first spawn) and loaded tempfile.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
_libc.semctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
_libc.shmctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
_libc.msgctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]


@dataclass
class UnitIpc:
    """What one instance of a unit is known to have: its user, when it started, its pids,
    the /dev/shm entries its processes created (name -> inode)."""

    unit: str
    uid: int
    since: float  # wall clock, at the spawn
    pids: set[int] = field(default_factory=set)
    shm: dict[str, int] = field(default_factory=dict)
    dropped: int = 0  # entries not recorded (the bound)

    def instance(self) -> proof.Instance:
        return proof.Instance(self.unit, self.uid, self.since, frozenset(self.pids))

    def to_json(self) -> dict:
        return {"unit": self.unit, "uid": self.uid, "since": self.since, "pids": sorted(self.pids),
                "shm": dict(self.shm), "dropped": self.dropped}

    @classmethod
    def from_json(cls, d: dict) -> UnitIpc:
        return cls(unit=str(d["unit"]), uid=int(d["uid"]), since=float(d["since"]),
                   pids={int(p) for p in list(d["pids"])[:MAX_PIDS]},
                   shm={str(k): int(v) for k, v in list(d["shm"].items())[:MAX_OBJECTS]}, dropped=int(d["dropped"]))


class IpcBook:
    """Attribution while units live. Written by the fanotify thread and the loop: a lock, held
    only for dictionary work (never across a read of /proc)."""

    def __init__(self, token: str, root_pid: int | None = None) -> None:
        self.token = token
        self.root_pid = os.getpid() if root_pid is None else root_pid  # the units' ancestor: this daemon
        self._lock = threading.Lock()
        self.units: dict[str, UnitIpc] = {}
        self._pid_unit: dict[int, str] = {}  # the pids recorded for live instances
        self._cgroup: dict[str, str] = {}  # unit -> its main process's cgroup, when not the daemon's own
        self._own_cgroup = _cgroup_of(os.getpid())
        self.tags = TagReader(ENVIRON_MAX_OUT, name="shm-creator-tags")
        # creators of ours nothing tied when seen: matched against each main process recorded after
        self._unresolved: collections.deque[tuple[proof.Creator, str, float]] = collections.deque(
            maxlen=MAX_UNRESOLVED)
        self.unattributed = 0  # creators that were gone, or not ours, when their event was read
        self._recorded = 0  # main processes recorded so far (add_pid)

    def begin(self, unit: str, uid: int) -> None:
        """A new instance of `unit` is about to be spawned: a fresh record."""
        with self._lock:
            old = self.units.get(unit)
            if old is not None:
                self._forget(old)
            self.units[unit] = UnitIpc(unit, uid, time.time())

    def add_pid(self, unit: str, pid: int) -> None:
        """The instance's main process (spawned: it joined its cgroup before exec). Creators
        seen before it was recorded, and tied to it, are the unit's now."""
        cg = _cgroup_of(pid)  # small reads that take no lock of the process's
        st = linux.read_stat(pid)
        if cg is not None and st is not None and cg == _cgroup_of(st.ppid):
            cg = None  # the spawner's cgroup (no cgroup of its own): shared by every unit, proves none
        tied: list[tuple[int, str]] = []
        with self._lock:
            u = self.units.get(unit)
            if u is None or len(u.pids) >= MAX_PIDS:
                return
            u.pids.add(pid)
            self._pid_unit[pid] = unit
            self._recorded += 1  # a creator being judged without this pid is judged again (created)
            if cg is not None and cg != self._own_cgroup and cg != "/":
                self._cgroup[unit] = cg
            else:
                cg = None
            horizon = time.monotonic() - UNRESOLVED_KEEP_S
            keep: collections.deque[tuple[proof.Creator, str, float]] = collections.deque(maxlen=MAX_UNRESOLVED)
            for c, name, seen in self._unresolved:
                if seen < horizon:
                    continue
                if proof.creator_tied_to(c, pid, st.start_time if st else None, cg):
                    tied.append((c.pid, name))
                else:
                    keep.append((c, name, seen))
            self._unresolved = keep
        for creator, name in tied:
            self._record(unit, creator, name)

    def _forget(self, u: UnitIpc) -> None:
        for p in u.pids:
            if self._pid_unit.get(p) == u.unit:
                del self._pid_unit[p]
        self._cgroup.pop(u.unit, None)

    def created(self, pid: int, name: str) -> None:
        """An entry appeared in /dev/shm, made by pid (the fanotify thread): attributed by
        omnid.process.proof from facts that take no lock of the creator's; an environment is
        read only for a descendant of this daemon nothing else ties, bounded."""
        facts = _creator_facts(pid, self.root_pid)
        for _judged in range(3):
            with self._lock:
                recorded = self._recorded
                pid_unit = dict(self._pid_unit)
                cgroups: dict[str, str | None] = {}
                for unit, cg in self._cgroup.items():  # a cgroup proves a unit only when no other shares it
                    cgroups[cg] = None if cg in cgroups else unit
            found = proof.creator_unit(facts, pid_unit, {cg: u for cg, u in cgroups.items() if u is not None})
            tag = found.unit
            if tag is None and found.ask_environ:
                # Takes the creator's memory lock: on a thread of its own, waited for a moment at most.
                got = self.tags.get(pid, facts.starts[0], wait=ENVIRON_WAIT_S)
                if got is not None and got.daemon == self.token:
                    tag = got.unit
            if tag is not None or not facts.descends:
                break
            # Perhaps a unit whose spawn's answer has not been read yet: kept for add_pid, unless
            # a main process was recorded while this one was judged (add_pid has then looked
            # through the kept ones without it): judged again, with that process.
            with self._lock:
                if self._recorded == recorded or _judged == 2:  # kept at the last try, never dropped
                    self._unresolved.append((facts, name, time.monotonic()))
                    break
        if tag is None:
            self.unattributed += 1
            if facts.descends:
                # Said once per entry: an entry of one of our units that stays unattributed is a
                # leak at its death, and this line is how to find out why.
                log.info("/dev/shm entry of a descendant not attributed (yet)", entry=name, creator=pid,
                         lineage=list(facts.lineage[:6]), sid=facts.sid, pgid=facts.pgid, why=found.reason)
            else:
                log.debug("/dev/shm entry not attributed", entry=name, creator=pid, why=found.reason)
            return
        log.debug("/dev/shm entry attributed", entry=name, creator=pid, unit=tag,
                  why=found.reason if found.unit is not None else "its environment names the unit")
        self._record(tag, pid, name)

    def _record(self, tag: str, pid: int, name: str) -> None:
        try:
            st = _lstat_in_shm(name)
        except OSError:
            return  # already gone (or not a file of /dev/shm's own: nothing to remove later)
        with self._lock:
            u = self.units.get(tag)
            if u is None:
                return
            if len(u.pids) < MAX_PIDS:
                u.pids.add(pid)  # a creator of the unit's: its System V segments are the unit's too
            if name in u.shm or len(u.shm) < MAX_OBJECTS:
                u.shm[name] = st.st_ino
            else:
                u.dropped += 1

    def has_entries(self, unit: str) -> bool:
        with self._lock:
            u = self.units.get(unit)
            return u is not None and bool(u.shm)

    def take(self, unit: str) -> UnitIpc | None:
        with self._lock:
            u = self.units.pop(unit, None)
            if u is not None:
                self._forget(u)
            return u

    def handover(self) -> dict:
        with self._lock:
            return {k: u.to_json() for k, u in self.units.items()}

    def take_over(self, d: object) -> None:
        if not isinstance(d, dict):
            return
        with self._lock:
            for k, v in d.items():
                try:
                    self.units[str(k)] = UnitIpc.from_json(v)
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    log.warning("IPC attribution of a unit not taken over (malformed)", unit=str(k), error=str(exc))


def _cgroup_of(pid: int) -> str | None:
    """The cgroup v2 path of a process (/proc/PID/cgroup's "0::" line: no memory lock), or None."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            for line in f.read(65536).splitlines():
                if line.startswith(b"0::"):
                    return os.fsdecode(line[3:]).split(" (deleted)")[0]
    except OSError:
        return None
    return None


def _creator_facts(pid: int, root_pid: int, max_depth: int = 64) -> proof.Creator:
    """What /proc/PID/stat and /proc/PID/cgroup say of a creator and its ancestors (no memory
    lock is taken). A parent that started after its child is a reused pid: the chain ends."""
    st = linux.read_stat(pid)
    if st is None:
        return proof.Creator(pid, gone=True)
    lineage, starts = [pid], [st.start_time]
    descends = pid == root_pid
    cur = st
    while not descends and cur.ppid > 1 and len(lineage) < max_depth:
        parent = linux.read_stat(cur.ppid)
        if parent is None or parent.start_time > cur.start_time:
            break
        lineage.append(parent.pid)
        starts.append(parent.start_time)
        descends = parent.pid == root_pid
        cur = parent
    return proof.Creator(pid, gone=False, lineage=tuple(lineage), starts=tuple(starts), sid=st.sid, pgid=st.pgid,
                         descends=descends, cgroup=_cgroup_of(pid))


class ShmWatch:
    """The fanotify listener on /dev/shm, on a thread of its own."""

    def __init__(self, book: IpcBook, shm_dir: str = SHM_DIR) -> None:
        self.book = book
        self.shm_dir = shm_dir
        self.fd = -1
        self._stop_r = self._stop_w = -1
        self._thread: threading.Thread | None = None
        self._read = threading.Lock()  # the listener's thread and drain() both read the queue
        self.events = 0
        self.overflows = 0

    def start(self) -> str | None:
        """None when it runs; otherwise why POSIX objects will not be attributed."""
        fd = _libc.fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK | FAN_REPORT_DFID_NAME,
                                 os.O_RDONLY | os.O_CLOEXEC)
        if fd < 0:
            return f"fanotify_init: {os.strerror(ctypes.get_errno())}"
        if _libc.fanotify_mark(fd, FAN_MARK_ADD, FAN_CREATE | FAN_MOVED_TO, -100, self.shm_dir.encode()) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            return f"fanotify_mark {self.shm_dir}: {os.strerror(err)}"
        self.fd = fd
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="omnid-shm-watch", daemon=True)
        self._thread.start()
        return None

    def stop(self, timeout: float = STOP_WAIT_S) -> bool:
        """The listener told to end and its fds closed, waiting at most `timeout` (the daemon's
        exit must never hang on it). False when it did not end in time: its fds are then left
        (to the exit, or to a later stop()), since closing them under a reader could hand their
        numbers to another file."""
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout
        os.write(self._stop_w, b"x")
        self._thread.join(timeout=timeout / 2)
        if not self._read.acquire(timeout=max(0.0, deadline - time.monotonic())):
            log.warning("the /dev/shm listener did not end in time; its fds are left to the exit",
                        waited_s=timeout, thread_alive=self._thread.is_alive())
            return False
        try:
            for fd in (self.fd, self._stop_r, self._stop_w):
                os.close(fd)
            self.fd = -1
        finally:
            self._read.release()
        self._thread = None
        return True

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_r in ready:
                return
            if not self.drain():
                return

    def pending(self) -> bool:
        """Are events waiting to be read (a poll, no read)?"""
        if self.fd < 0:
            return False
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        return bool(p.poll(0))

    def drain(self) -> bool:
        """Read and attribute every event queued now (the listener's loop; and the removal,
        so that what a unit created just before it died is in its record). False when the
        queue cannot be read any more."""
        if not self._read.acquire(timeout=DRAIN_LOCK_S):
            # The listener is attributing a batch (each environment read is bounded): what it
            # reads is in the record once it is done; a removal does not wait longer for it.
            log.warning("the /dev/shm listener is busy; removal goes on without its last events",
                        waited_s=DRAIN_LOCK_S)
            return True
        try:
            return self._drain()
        finally:
            self._read.release()

    def _drain(self) -> bool:
        if self.fd < 0:
            return False
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return True
            except OSError as exc:
                log.error("reading fanotify events failed; POSIX IPC no longer attributed", error=str(exc))
                return False
            try:
                for pid, name in parse_events(buf):
                    self.events += 1
                    if name is None:
                        self.overflows += 1
                        log.warning("fanotify queue overflow: some /dev/shm entries are not attributed")
                        continue
                    self.book.created(pid, name)
            except Exception:  # noqa: BLE001 - the listener must outlive a malformed event; said each time
                log.exception("a fanotify event could not be read")


def parse_events(buf: bytes) -> list[tuple[int, str | None]]:
    """(pid, entry name) per event; (pid, None) for a queue overflow."""
    out: list[tuple[int, str | None]] = []
    off = 0
    while off + _META.size <= len(buf):
        ev_len, _vers, _res, meta_len, mask, fd, pid = _META.unpack_from(buf, off)
        if ev_len < _META.size:
            break
        if fd >= 0:
            os.close(fd)
        if mask & FAN_Q_OVERFLOW:
            out.append((pid, None))
        else:
            info = off + meta_len
            end = off + ev_len
            while info + 4 <= end:
                itype, _pad, ilen = struct.unpack_from("=BBH", buf, info)
                if ilen == 0:
                    break
                if itype == FAN_EVENT_INFO_TYPE_DFID_NAME:
                    h = info + 4 + 8  # header, fsid
                    handle_bytes = struct.unpack_from("=I", buf, h)[0]
                    name_at = h + 8 + handle_bytes
                    raw = buf[name_at:info + ilen].split(b"\0", 1)[0]
                    if raw and b"/" not in raw:
                        out.append((pid, os.fsdecode(raw)))
                info += ilen
        off += ev_len
    return out


# ---------------------------------------------------------------- removal (blocking: off the loop)
@dataclass(frozen=True)
class SysvObject:
    kind: str  # "shm", "sem", "msg"
    ident: int
    key: int
    line: tuple[str, ...]  # the /proc/sysvipc line it was read from: re-checked before removal
    size: int = 0

    def describe(self) -> str:
        what = {"shm": "System V shm", "sem": "System V sem", "msg": "System V msg"}[self.kind]
        extra = f", {human(self.size)}" if self.kind == "shm" else ""
        return f"{what} id {self.ident} (key 0x{self.key & 0xffffffff:08x}{extra})"


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _sysv_rows(kind: str) -> list[dict[str, str]]:
    try:
        with open(os.path.join(SYSVIPC, kind)) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    if not lines:
        return []
    head = lines[0].split()
    return [dict(zip(head, ln.split())) for ln in lines[1:] if ln.strip()]


@dataclass(frozen=True)
class SysvTables:
    """The three /proc/sysvipc tables as read at `taken_at` (monotonic). Every object an
    instance made is in a reading taken after the kernel proved the instance gone (a gone
    process makes none), so one reading serves every unit of a stack's stop that was gone
    before it: 256 units read them once, not 768 times on the loop (29 ms here). An object
    removed since is caught by _still_same, which reads afresh before each IPC_RMID."""

    taken_at: float
    rows: dict[str, list[dict[str, str]]]

    @classmethod
    def read(cls) -> SysvTables:
        taken_at = time.monotonic()
        return cls(taken_at, {kind: _sysv_rows(kind) for kind in ("shm", "msg", "sem")})


def _sysv_candidates(u: UnitIpc, tables: SysvTables | None = None) -> list[SysvObject]:
    """The System V objects omnid.process.proof says are the instance's (in `tables`, read
    after the instance was gone; read now when None)."""
    tables = tables or SysvTables.read()
    out: list[SysvObject] = []
    inst = u.instance()
    for r in tables.rows["shm"]:
        if proof.sysv_segment(inst, r):
            out.append(SysvObject("shm", int(r["shmid"]), int(r["key"]), tuple(sorted(r.items())), int(r["size"])))
    # Queues and semaphore sets carry no creator pid: the unit's user must be a user of its
    # own, asked of the host (a /proc count) only when such an object of that user exists.
    user: proof.Verdict | None = None
    for kind, idkey in ((proof.Kind.SYSV_MSG, "msqid"), (proof.Kind.SYSV_SEM, "semid")):
        for r in tables.rows["msg" if kind is proof.Kind.SYSV_MSG else "sem"]:
            if r.get("uid") != str(u.uid) or r.get("cuid") != str(u.uid):
                continue
            if user is None:
                user = proof.own_user(user_facts(u.uid))
                if not user and u.uid != 0:  # root's are never a unit's: no need to say so at every death
                    log.info("System V queues and semaphore sets of the unit's user are not its own to remove",
                             unit=u.unit, why=user.reason)
            if proof.sysv_keyed(kind, inst, r, user):
                out.append(SysvObject("msg" if kind is proof.Kind.SYSV_MSG else "sem", int(r[idkey]), int(r["key"]),
                                      tuple(sorted(r.items()))))
    return out


def sys_uid_max(path: str = "/etc/login.defs") -> int:
    """The highest system uid: SYS_UID_MAX, else UID_MIN - 1, from login.defs (as shadow-utils)."""
    keys: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] in ("SYS_UID_MAX", "UID_MIN"):
                    try:
                        keys[parts[0]] = int(parts[1], 0)
                    except ValueError:
                        continue
    except OSError:
        pass
    if "SYS_UID_MAX" in keys:
        return keys["SYS_UID_MAX"]
    return keys["UID_MIN"] - 1 if "UID_MIN" in keys else proof.SYS_UID_MAX_DEFAULT


def processes_of(uid: int, budget_s: float = UID_SCAN_S) -> int | None:
    """Live processes with `uid` as real, effective, saved or fs uid (/proc/PID/status, which
    takes no memory lock); None when the count did not finish within the budget."""
    deadline = time.monotonic() + budget_s
    want = str(uid).encode()
    n = 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for p in pids:
        if time.monotonic() > deadline:
            return None
        try:
            with open(f"/proc/{p}/status", "rb") as f:
                for line in f.read(8192).splitlines():
                    if line.startswith(b"Uid:"):
                        n += want in line.split()[1:]
                        break
        except OSError:
            continue  # gone meanwhile
    return n


def user_facts(uid: int) -> proof.UserFacts:
    """What proof.own_user needs; the /proc count only for a uid that could be a user of its own
    (never for root or a system user: a root unit's death must not scan /proc on the loop)."""
    sys_max = sys_uid_max()
    session = any(os.path.exists(p) for p in (f"/run/systemd/users/{uid}", f"/run/user/{uid}"))
    countable = uid > sys_max and uid not in proof.NOBODY_UIDS and not session
    return proof.UserFacts(uid, sys_max, processes_of(uid) if countable else None, session)


def _still_same(o: SysvObject) -> bool:
    idkey = {"shm": "shmid", "sem": "semid", "msg": "msqid"}[o.kind]
    for r in _sysv_rows(o.kind):
        if r.get(idkey) == str(o.ident):
            now = dict(r)
            then = dict(o.line)
            # Times and counters of use may move; who made it and whose it is may not.
            stable = ("key", "cuid", "uid", "cpid", "ctime") if o.kind == "shm" else ("key", "cuid", "uid", "ctime")
            if any(now.get(k) != then.get(k) for k in stable):
                return False
            return o.kind != "shm" or now.get("nattch") == "0"
    return False


def _lstat_in_shm(name: str) -> os.stat_result:
    """lstat of /dev/shm/NAME, never of a mount on it: a user may mount FUSE on a directory it
    made in /dev/shm, with a server that never answers (linux.stat_same_mount)."""
    dfd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return linux.stat_same_mount(name, dfd)
    finally:
        os.close(dfd)


def _fd_mount_id(pid: str, fd: str | None) -> int | None:
    """The mount id of a process's open fd (/proc/PID/fdinfo, Linux 3.15), read without touching
    the file; with fd None, that of /dev/shm itself, from an fd of this process."""
    own = None
    try:
        if fd is None:
            own = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fd = str(own)
        with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    finally:
        if own is not None:
            os.close(own)
    return None


def _held(inodes: dict[int, str], dev: int, deadline: float) -> set[int] | None:
    """Which of the /dev/shm inodes a live process maps or holds open; None when the scan
    could not finish by the deadline (nothing may be removed then)."""
    held: set[int] = set()
    want = set(inodes)
    prefix = SHM_DIR + "/"
    shm_mnt = _fd_mount_id("self", None)
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for p in pids:
        if time.monotonic() > deadline:
            return None
        try:
            with open(f"/proc/{p}/maps", "rb") as f:
                for ln in f:
                    if b"/dev/shm/" in ln or b" /SYSV" in ln:
                        parts = ln.split(None, 5)
                        if len(parts) >= 5 and int(parts[4]) in want:
                            held.add(int(parts[4]))
        except (OSError, ValueError):
            pass
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                # Only a file of /dev/shm's own mount is stat'ed: a path under /dev/shm may be a
                # user's FUSE mount, and a stat through the fd would wait on its server.
                if shm_mnt is None or _fd_mount_id(p, fd) != shm_mnt:
                    continue
                try:
                    st = os.stat(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if st.st_dev == dev and st.st_ino in want:
                    held.add(st.st_ino)
    return held


def remove_residue(u: UnitIpc, budget_s: float = 2.0) -> tuple[list[str], list[str], dict[str, int]]:
    """Remove what is proven the unit's and held by nobody. Returns (removed, kept), each
    entry described for people, and the /dev/shm entries kept because a live process held
    them (name -> inode: worth a later look). Blocking: call it off the event loop."""
    removed, kept, held = remove_posix(u, budget_s)
    r2, k2 = remove_sysv(u)
    return removed + r2, kept + k2, held


def remove_posix(u: UnitIpc, budget_s: float = 2.0) -> tuple[list[str], list[str], dict[str, int]]:
    """The /dev/shm part of remove_residue (the same three results)."""
    deadline = time.monotonic() + budget_s
    held_now: dict[str, int] = {}
    removed: list[str] = []
    kept: list[str] = []
    inst = u.instance()
    cands: dict[int, str] = {}
    sizes: dict[int, int] = {}
    dev = -1
    try:
        dfd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        dfd = -1
    try:
        if dfd >= 0:
            dev = os.fstat(dfd).st_dev
            for name, ino in u.shm.items():
                try:
                    st = linux.stat_same_mount(name, dfd)
                except OSError:
                    continue  # unlinked by its program, or something mounted there: nothing to do
                if proof.posix_entry(inst, name, ino, st):
                    cands[ino] = name
                    sizes[ino] = st.st_size
            if cands:
                held = _held(cands, dev, deadline)
                if held is None:
                    kept.extend(f"{SHM_DIR}/{n} (could not prove nobody holds it in time)" for n in cands.values())
                    held_now.update({n: ino for ino, n in cands.items()})
                    cands = {}
                else:
                    for ino in held:
                        name = cands.pop(ino)
                        held_now[name] = ino
                        kept.append(f"{SHM_DIR}/{name} (held by a live process)")
            for ino, name in cands.items():
                try:
                    st = linux.stat_same_mount(name, dfd)
                    if st.st_ino != ino:
                        continue
                    os.unlink(name, dir_fd=dfd)
                except OSError:
                    continue
                what = "POSIX sem" if name.startswith("sem.") else "POSIX shm"
                removed.append(f"{what} {SHM_DIR}/{name} ({human(sizes[ino])})")
    finally:
        if dfd >= 0:
            os.close(dfd)
    return removed, kept, held_now


def remove_sysv(u: UnitIpc, tables: SysvTables | None = None) -> tuple[list[str], list[str]]:
    """The System V part alone: the /proc/sysvipc tables (`tables`, read after the instance
    was gone, or three small reads now) and the IPC_RMIDs."""
    removed: list[str] = []
    kept: list[str] = []
    for o in _sysv_candidates(u, tables):
        if not _still_same(o):
            continue
        ctl = {"shm": _libc.shmctl, "sem": _libc.semctl, "msg": _libc.msgctl}[o.kind]
        rc = ctl(o.ident, IPC_RMID, None) if o.kind != "sem" else _libc.semctl(o.ident, 0, IPC_RMID)
        if rc == 0:
            removed.append(o.describe())
        else:
            kept.append(f"{o.describe()} (IPC_RMID: {os.strerror(ctypes.get_errno())})")
    return removed, kept
