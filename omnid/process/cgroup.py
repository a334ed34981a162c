"""cgroup v2 per unit: nothing escapes, emptiness is an event, figures come from the kernel.

Where a writable cgroup v2 subtree exists (the *root*), every unit instance runs in
its own cgroup `<root>/<escaped unit name>`, joined by the child between fork and exec
(omnid.process.spawner), so no fork of the unit can escape it. The kill policy
(omnid.process.termination) acts on it through `CgroupTarget`: the stop signal goes to the main
process, its group and every member of the cgroup; escalation writes `cgroup.kill`; the
unit is gone when `cgroup.events` says `populated 0` — observed as an inotify event on
the asyncio loop, never by a sleep loop — and then the directory is removed.

Root discovery (`discover`): `--cgroup-root DIR` / `cgroup_root` in omnid.toml; else,
under systemd with `Delegate=yes`, the daemon's own cgroup, with the daemon moved into a
`daemon/` leaf so units can be its siblings; else None: omnid falls back to process
groups and says so once. Everything below the root except `daemon/` is omnid's, so the
cgroups a previous (killed) daemon left there are killed and removed at start.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import re
import select
import signal
import struct
import time
from dataclasses import dataclass

import structlog

from omnid.base import linux
from omnid.base import promtext
from omnid.process.handle import ProcessHandle, Survivor, group_alive

log = structlog.get_logger("omnid.process.cgroup")

DAEMON_LEAF = "daemon"
# Controllers omnid enables for its units when the root offers them (the figures and the
# memory_max / tasks_max keys need them in the root's cgroup.subtree_control).
WANTED_CONTROLLERS = ("cpu", "memory", "pids")
KEY_CONTROLLER = {"memory_max": "memory", "tasks_max": "pids"}
ZOMBIE_REAP_S = 1.0  # a unit's last zombies, reaped by the spawner after `populated 0`


class CgroupError(Exception):
    """A cgroup root that cannot be used; the message names the path and the reason."""


# ----------------------------------------------------------------------------- paths


def cgroup2_mounts(mounts_file: str = "/proc/mounts") -> list[str]:
    out = []
    with open(mounts_file) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "cgroup2":
                out.append(parts[1].replace("\\040", " "))
    return out


def _mount_of(path: str) -> str | None:
    """The cgroup2 mount point that holds path, or None."""
    best = None
    for m in cgroup2_mounts():
        if (path == m or path.startswith(m.rstrip("/") + "/")) and (best is None or len(m) > len(best)):
            best = m
    return best


_SAFE = re.compile(r"[A-Za-z0-9_.:@-]")


def escape(name: str) -> str:
    """A unit name as one cgroup directory name: bytes outside [A-Za-z0-9_.:@-] as \\xNN
    (systemd's escaping); a leading '.' or a name that could be taken for a control file
    (`cgroup.*`, `memory.*`, ... all contain '.') or the daemon leaf gets a '_' prefix."""
    out = "".join(ch if _SAFE.fullmatch(ch) else "".join(f"\\x{b:02x}" for b in ch.encode()) for ch in name)
    if out.startswith((".", "_")) or "." in out or out == DAEMON_LEAF:
        out = "_" + out
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ENODEV, errno.ENOENT, errno.EOPNOTSUPP):
            return None
        raise


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def populated(path: str) -> bool:
    text = _read(os.path.join(path, "cgroup.events"))
    if text is None:
        return False  # removed: nothing can run in it
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == "populated":
            return v.strip() == "1"
    return False


def procs(path: str) -> list[int]:
    text = _read(os.path.join(path, "cgroup.procs"))
    return [int(x) for x in text.split()] if text else []


def tree_procs(path: str) -> list[int]:
    """Members of path and of every cgroup below it (a unit may create sub-cgroups)."""
    out: list[int] = []
    for dirpath, _dirs, _files in os.walk(path):
        out.extend(procs(dirpath))
    return out


# ----------------------------------------------------------------------- the event


class _Inotify:
    """One inotify instance for the whole daemon (an instance per unit would hit
    fs.inotify.max_user_instances = 128 with a 256-unit stack): IN_MODIFY on each
    waited-for cgroup.events, dispatched from the asyncio loop's reader."""

    IN_MODIFY = 0x2
    IN_IGNORED = 0x8000
    IN_NONBLOCK = os.O_NONBLOCK
    IN_CLOEXEC = os.O_CLOEXEC
    _EV = struct.Struct("iIII")

    def __init__(self) -> None:
        # The interpreter already links libc (ctypes.util.find_library would cost the daemon's
        # start ~2 ms of imports: shutil, tempfile).
        libc = ctypes.CDLL(None, use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        self._rm = libc.inotify_rm_watch
        self._rm.argtypes = (ctypes.c_int, ctypes.c_int)
        fd = libc.inotify_init1(self.IN_NONBLOCK | self.IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_init1: {os.strerror(e)}")
        self.fd = fd
        self._waiters: dict[int, set[asyncio.Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, path: str) -> int:
        wd = self._add(self.fd, path.encode(), self.IN_MODIFY)
        if wd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_add_watch {path}: {os.strerror(e)}")
        return wd

    def _on_readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        off = 0
        while off + self._EV.size <= len(data):
            wd, _mask, _cookie, ln = self._EV.unpack_from(data, off)
            off += self._EV.size + ln
            for ev in self._waiters.get(wd, ()):
                ev.set()

    async def wait_empty(self, path: str, deadline: float) -> bool:
        """Until `populated 0` in path/cgroup.events (an event), or False at the deadline."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self.fd)
            loop.add_reader(self.fd, self._on_readable)
            self._loop = loop
        events = os.path.join(path, "cgroup.events")
        try:
            wd = self.add(events)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return True  # removed: empty by definition
            raise
        ev = asyncio.Event()
        self._waiters.setdefault(wd, set()).add(ev)
        try:
            while populated(path):  # read after the watch is in place: no lost wake-up
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                ev.clear()
                try:
                    await asyncio.wait_for(ev.wait(), left)
                except asyncio.TimeoutError:
                    return not populated(path)
            return True
        finally:
            s = self._waiters.get(wd)
            if s is not None:
                s.discard(ev)
                if not s:
                    del self._waiters[wd]
                    self._rm(self.fd, wd)  # the same wd may be handed out again after this

    def wait_empty_sync(self, path: str, deadline: float) -> bool:
        """The same wait, before the event loop runs (daemon start): poll(2) on the inotify fd."""
        try:
            wd = self.add(os.path.join(path, "cgroup.events"))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return True
            raise
        try:
            p = select.poll()
            p.register(self.fd, select.POLLIN)
            while populated(path):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if p.poll(left * 1000):
                    try:
                        os.read(self.fd, 65536)
                    except BlockingIOError:
                        pass
            return True
        finally:
            self._rm(self.fd, wd)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.fd)
        os.close(self.fd)


# ------------------------------------------------------------------------ the root


@dataclass(frozen=True)
class Limits:
    """Unit keys that become cgroup files (None: not set)."""

    memory_max: int | None = None
    tasks_max: int | None = None


def cgroup_limits(spec) -> Limits | None:
    """The cgroup files a unit's keys ask for (memory_max, tasks_max), or None."""
    lim = Limits(memory_max=getattr(spec, "memory_max", None), tasks_max=getattr(spec, "tasks_max", None))
    return lim if lim != Limits() else None


class UnitCgroup:
    """The cgroup of one unit instance."""

    def __init__(self, root: CgroupRoot, unit: str, path: str) -> None:
        self.root = root
        self.unit = unit
        self.path = path

    def pids(self) -> list[int]:
        return tree_procs(self.path)

    def populated(self) -> bool:
        return populated(self.path)

    def kill(self) -> None:
        """SIGKILL to every process of the cgroup and its sub-cgroups, by the kernel."""
        try:
            _write(os.path.join(self.path, "cgroup.kill"), "1")
        except FileNotFoundError:
            pass

    async def wait_empty(self, deadline: float) -> bool:
        return await self.root.inotify.wait_empty(self.path, deadline)

    def remove(self) -> bool:
        """rmdir once empty (sub-cgroups first); False while something still runs in it."""
        return _rmtree(self.path)

    def figures(self) -> dict:
        return figures(self.path)


def _rmtree(path: str) -> bool:
    if not os.path.isdir(path):
        return True
    for dirpath, dirs, _files in os.walk(path, topdown=False):
        for d in dirs:
            try:
                os.rmdir(os.path.join(dirpath, d))
            except FileNotFoundError:
                pass
            except OSError:
                return False
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def figures(path: str) -> dict:
    """memory.current, memory.peak, cpu.stat usage_usec, pids.current: only those whose
    file exists (a controller on cgroup v1 in a hybrid layout has none; nothing is faked)."""
    out: dict = {}
    for key, fname in (("memory_current", "memory.current"), ("memory_peak", "memory.peak"),
                       ("pids_current", "pids.current")):
        text = _read(os.path.join(path, fname))
        if text is not None and text.strip().isdigit():
            out[key] = int(text)
    text = _read(os.path.join(path, "cpu.stat"))
    if text:
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "usage_usec" and v.strip().isdigit():
                out["cpu_usage_usec"] = int(v)
    return out


class CgroupRoot:
    """A writable cgroup v2 directory that belongs to this omnid daemon."""

    def __init__(self, path: str, source: str) -> None:
        self.path = path
        self.source = source
        self.inotify = _Inotify()
        self.units: dict[str, UnitCgroup] = {}
        self.controllers = self._enable_controllers()

    def _enable_controllers(self) -> frozenset[str]:
        offered = set((_read(os.path.join(self.path, "cgroup.controllers")) or "").split())
        enabled = set((_read(os.path.join(self.path, "cgroup.subtree_control")) or "").split())
        for c in WANTED_CONTROLLERS:
            if c in offered and c not in enabled:
                try:
                    _write(os.path.join(self.path, "cgroup.subtree_control"), f"+{c}")
                    enabled.add(c)
                except OSError as exc:
                    log.warning("cannot enable cgroup controller", root=self.path, controller=c, error=str(exc))
        return frozenset(enabled)

    def describe(self) -> dict:
        return {"backend": "cgroup", "cgroup": self.path, "source": self.source,
                "controllers": sorted(self.controllers)}

    def check_keys(self, unit: str, keys: dict[str, object]) -> list[str]:
        """Errors for memory_max / tasks_max that this root cannot honour."""
        errs = []
        for key, value in keys.items():
            if value is None:
                continue
            c = KEY_CONTROLLER[key]
            if c not in self.controllers:
                errs.append(f"unit {unit}: {key}: needs the {c} controller in cgroup root {self.path}, which "
                            f"offers {', '.join(sorted(self.controllers)) or 'none'} (in a hybrid layout "
                            f"{c} is usually mounted as cgroup v1)")
        return errs

    def create(self, unit: str, limits: Limits | None = None) -> UnitCgroup:
        """The cgroup of a new instance of unit: made empty, limits written, before the spawn."""
        path = os.path.join(self.path, escape(unit))
        if os.path.isdir(path) and populated(path):
            # The previous instance's residue must be killed first (residue() + terminate).
            raise OSError(errno.EBUSY, f"cgroup {path} still holds pids {tree_procs(path)}")
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        if limits is not None:
            if limits.memory_max is not None:
                _write(os.path.join(path, "memory.max"), str(limits.memory_max))
            if limits.tasks_max is not None:
                _write(os.path.join(path, "pids.max"), str(limits.tasks_max))
        cg = UnitCgroup(self, unit, path)
        self.units[unit] = cg
        return cg

    def get(self, unit: str) -> UnitCgroup | None:
        return self.units.get(unit)

    def handover(self) -> dict:
        """For the next program of this daemon (omnid reexec): the root and each unit's cgroup."""
        return {"path": self.path, "source": self.source, "units": {u: cg.path for u, cg in self.units.items()}}

    @classmethod
    def take_over(cls, d: dict) -> CgroupRoot:
        """The root a previous program of this daemon used, with its units' cgroups as they
        are: nothing is cleaned (what runs there is this daemon's own units)."""
        root = cls(str(d["path"]), str(d["source"]))
        for unit, path in d["units"].items():
            if not str(path).startswith(root.path + "/"):
                raise ValueError(f"cgroup {path!r} of unit {unit} is not under the root {root.path}")
            root.units[str(unit)] = UnitCgroup(root, str(unit), str(path))
        return root

    def release(self, unit: str) -> None:
        """The unit is gone: rmdir its cgroup if nothing runs there (else it stays listed)."""
        cg = self.units.get(unit)
        if cg is not None and not cg.populated() and cg.remove():
            del self.units[unit]

    def stale(self) -> list[str]:
        """Cgroups below the root that no unit of this daemon made: a previous daemon's."""
        try:
            names = sorted(os.listdir(self.path))
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            p = os.path.join(self.path, n)
            if n != DAEMON_LEAF and os.path.isdir(p) and not any(cg.path == p for cg in self.units.values()):
                out.append(p)
        return out

    def clean_stale(self, timeout: float = 5.0) -> list[str]:
        """Kill and remove a previous daemon's cgroups (at daemon start, before the loop runs),
        through the one kill policy. They are ours by path: the root is omnid's. Returns what
        could not be removed, described."""
        from omnid.process.termination import terminate

        left = []
        for p in self.stale():
            if populated(p):
                log.warning("killing a previous daemon's unit cgroup", cgroup=p, pids=tree_procs(p))
                asyncio.run(terminate(ResidueCgroupTarget(self, p), signal.SIGKILL, timeout, 0.0, send_cont=False))
            if populated(p) or not _rmtree(p):
                left.append(f"{p} (pids {tree_procs(p)})")
        return left

    def residue(self, unit: str) -> ResidueCgroupTarget | None:
        """What still runs in a unit's cgroup before its next start (an unkillable previous
        instance), as a Target for the kill policy; None when it is empty or absent."""
        path = os.path.join(self.path, escape(unit))
        target = ResidueCgroupTarget(self, path) if os.path.isdir(path) else None
        return target if target is not None and target.procs.left() else None

    def write_metrics(self, page: promtext.Page) -> None:
        """Every unit cgroup's figures onto `page` (omnid.promtext.Page; health.py's /metrics).
        A figure no cgroup has (its controller is not enabled) gets no family at all."""
        names = {"memory_current": ("omnid_unit_cgroup_memory_bytes", page.gauge,
                                    "memory.current of the unit's cgroup"),
                 "memory_peak": ("omnid_unit_cgroup_memory_peak_bytes", page.gauge, "memory.peak of the unit's cgroup"),
                 "cpu_usage_usec": ("omnid_unit_cgroup_cpu_usage_usec_total", page.counter,
                                    "cpu.stat usage_usec of the unit's cgroup"),
                 "pids_current": ("omnid_unit_cgroup_pids", page.gauge, "pids.current of the unit's cgroup")}
        figs = {u: cg.figures() for u, cg in sorted(self.units.items())}
        for key, (metric, declare, help_) in names.items():
            rows = [(u, f[key]) for u, f in figs.items() if key in f]
            if rows:
                fam = declare(metric, help_)
                for u, v in rows:
                    fam.add(v, unit=u)

    def snapshot(self, unit: str) -> dict:
        cg = self.units.get(unit)
        if cg is None:
            return {"cgroup": None}
        return {"cgroup": cg.path, "cgroup_figures": cg.figures()}

    def close(self) -> None:
        self.inotify.close()


def validate(path: str) -> None:
    """Raise CgroupError unless path is a writable cgroup v2 directory."""
    if not os.path.isabs(path):
        raise CgroupError(f"cgroup root {path!r}: must be an absolute path")
    mount = _mount_of(os.path.realpath(path))
    if mount is None:
        raise CgroupError(f"cgroup root {path}: not on a cgroup2 file system (cgroup2 mounts: "
                          f"{', '.join(cgroup2_mounts()) or 'none'})")
    if not os.path.isdir(path):
        parent = os.path.dirname(path.rstrip("/"))
        if not os.path.isdir(parent) or _mount_of(os.path.realpath(parent)) is None:
            raise CgroupError(f"cgroup root {path}: does not exist and its parent is not a cgroup2 directory")
        try:
            os.mkdir(path)
        except OSError as exc:
            raise CgroupError(f"cgroup root {path}: cannot create it: {exc.strerror}") from None
    for f in ("cgroup.procs", "cgroup.kill", "cgroup.events", "cgroup.subtree_control"):
        fp = os.path.join(path, f)
        if not os.path.exists(fp):
            raise CgroupError(f"cgroup root {path}: no {f} (kernel too old, or the cgroup2 root itself; "
                              f"cgroup.kill needs Linux 5.14)")
    if not os.access(path, os.W_OK) or not os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
        raise CgroupError(f"cgroup root {path}: not writable by uid {os.getuid()} (delegate it: Delegate=yes)")


def _own_cgroup() -> str | None:
    """This process's cgroup v2 directory (the `0::` line of /proc/self/cgroup)."""
    text = _read("/proc/self/cgroup") or ""
    for line in text.splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip()
            for m in cgroup2_mounts():
                p = os.path.normpath(m + "/" + rel)
                if os.path.isdir(p):
                    return p
    return None


def _delegated(path: str) -> bool:
    """systemd marks a cgroup it delegated (Delegate=yes) with the trusted.delegate (or,
    for user managers, user.delegate) extended attribute set to 1."""
    for attr in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(path, attr) == b"1":
                return True
        except OSError:
            continue
    return False


MARK = "trusted.omnid.root"


def claim(path: str) -> None:
    """Make sure path is omnid's before anything below it is killed as stale: either it
    carries omnid's mark (trusted.omnid.root, set by an earlier daemon) or it holds no
    cgroup yet, and then it gets the mark. A root shared with others is refused."""
    try:
        if os.getxattr(path, MARK) == b"1":
            return
    except OSError:
        pass
    others = sorted(n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n)) and n != DAEMON_LEAF)
    if others:
        raise CgroupError(f"cgroup root {path}: holds cgroups omnid did not make ({', '.join(others[:5])}); "
                          f"give omnid a directory of its own (omnid kills whatever it finds below its root)")
    try:
        os.setxattr(path, MARK, b"1")
    except OSError as exc:
        log.warning("cannot mark the cgroup root as omnid's", root=path, error=str(exc))


def discover(explicit: str | None, source: str = "--cgroup-root", companions: tuple[int, ...] = ()) -> CgroupRoot | None:
    """The cgroup root to use, or None (process groups). An explicit root that cannot be
    used is an error (CgroupError); the automatic one falls back with one log line.
    `companions`: our own processes already started (the spawner) that move with us."""
    if explicit:
        validate(explicit)
        claim(explicit)
        return CgroupRoot(os.path.abspath(explicit), source)
    own = _own_cgroup()
    under_systemd = bool(os.environ.get("INVOCATION_ID"))
    why = None
    if not under_systemd:
        why = "not started by systemd (no INVOCATION_ID) and no --cgroup-root / cgroup_root given"
    elif own is None:
        why = "no cgroup v2 hierarchy in /proc/self/cgroup"
    elif not _delegated(own):
        why = f"own cgroup {own} is not delegated (set Delegate=yes in the service)"
    else:
        try:
            validate(own)
            leaf = os.path.join(own, DAEMON_LEAF)
            os.makedirs(leaf, exist_ok=True)
            # Move this process and its threads (none yet) into the leaf: units can be
            # siblings only if no process sits in an inner cgroup.
            _write(os.path.join(leaf, "cgroup.procs"), "0")
            for pid in companions:  # single-threaded, and no spawn asked of it yet
                _write(os.path.join(leaf, "cgroup.procs"), str(pid))
            claim(own)
            return CgroupRoot(own, "systemd delegation")
        except (CgroupError, OSError) as exc:
            why = f"delegated cgroup {own} unusable: {exc}"
    log.warning("no cgroup v2 root: omnid falls back to process groups; a unit's process that "
                "calls setsid() and double-forks can escape stop", reason=why)
    return None


# ------------------------------------------------------------------ kill policy seam


def _in_cgroup(pid: int, path: str, mount_rel: str) -> bool:
    text = _read(f"/proc/{pid}/cgroup") or ""
    for line in text.splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip()
            return rel == mount_rel or rel.startswith(mount_rel + "/")
    return False


def _rel_path(path: str) -> str:
    """The cgroup's path as /proc/PID/cgroup names it (relative to its cgroup2 mount)."""
    mount = _mount_of(os.path.realpath(path)) or "/"
    return "/" + os.path.relpath(os.path.realpath(path), mount)


def _signal_members(path: str, rel: str, sig: int) -> None:
    """`sig` to every process of the cgroup (and below): each through a pidfd, and only if
    it is still in the cgroup once its pidfd is open and has not exited after that read
    (linux.pidfd_if: then the read was about the process behind the fd)."""
    for pid in tree_procs(path):
        fd = linux.pidfd_if(pid, lambda p=pid: _in_cgroup(p, path, rel))
        if fd is not None:
            try:
                linux.pidfd_send_signal(fd, sig)
            finally:
                os.close(fd)


def _survivors(path: str) -> list[Survivor]:
    out = []
    for pid in tree_procs(path):
        st = linux.read_stat(pid)
        if st is not None and st.state not in ("Z", "X"):
            out.append(Survivor(pid, st.comm, st.state, "", f"pid {pid} ({st.comm}) in cgroup {path}", st.start_time))
    return out


class CgroupProcesses:
    """omnid.process.unitprocs' cgroup backend: what of a unit is left in its cgroup. Gone = the
    main process reaped (with none: nothing runs in the cgroup), `populated 0` in
    cgroup.events, and the process group empty: `populated 0` comes when the last process
    exits, before its reap, and its zombie still holds the group until the spawner (the
    subreaper) reaps it, moments later."""

    def __init__(self, root: CgroupRoot, path: str, h: ProcessHandle | None = None) -> None:
        self.root = root
        self.path = path
        self.h = h

    def main_gone(self) -> bool:
        return self.h.reaped.is_set() if self.h is not None else not populated(self.path)

    def left(self) -> bool:
        return populated(self.path) or (self.h is not None and group_alive(self.h.pgid))

    def gone(self) -> bool:
        return self.main_gone() and not self.left()

    def members(self) -> list[Survivor]:
        return _survivors(self.path)

    async def wait_gone(self, deadline: float) -> bool:
        if self.h is None:
            return await self.root.inotify.wait_empty(self.path, deadline)
        try:
            await asyncio.wait_for(self.h.reaped.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return False
        if not await self.root.inotify.wait_empty(self.path, deadline):
            return False
        # The cgroup is empty, so what holds the group's number is a zombie of ours; the wait
        # is bounded all the same (ZOMBIE_REAP_S) in case the number was taken since.
        until = min(deadline, time.monotonic() + ZOMBIE_REAP_S)
        while group_alive(self.h.pgid) and time.monotonic() < until:
            await asyncio.sleep(0.005)
        return True


class CgroupTarget:
    """omnid.process.termination's Target for a unit with a cgroup (systemd's KillMode=control-group):
    the signal goes to the main process, its group (as the process-group backend does) and
    every process of the cgroup; kill_all is `cgroup.kill`; gone is CgroupProcesses', seen
    as an event, and then the directory is removed."""

    def __init__(self, unit: str, h: ProcessHandle, token: str | None, cg: UnitCgroup) -> None:
        self.name = unit
        self.h = h
        self.token = token
        self.cg = cg
        self.procs = CgroupProcesses(cg.root, cg.path, h)
        self._rel = _rel_path(cg.path)

    def signal_all(self, sig: int) -> None:
        # The group by number first (one killpg) while its leader proves it ours; once the
        # leader is reaped (the leftovers of a dead main process, the rest under kill_mode
        # mixed / process) the cgroup holds every process of the group, and the group's tagged
        # members would be a scan of all of /proc (0.3-0.7 s on a loaded host) on the loop.
        if not self.h.reaped.is_set():
            self.h.signal_group(sig, self.token)
        if sig == signal.SIGKILL:
            self.cg.kill()
            return
        _signal_members(self.cg.path, self._rel, sig)

    def signal_main(self, sig: int) -> bool:
        return self.h.signal(sig)

    def kill_all(self) -> None:
        self.h.signal(signal.SIGKILL)
        self.cg.kill()

    async def wait_gone(self, deadline: float) -> bool:
        if not await self.procs.wait_gone(deadline):
            return False
        self.cg.root.release(self.name)
        return True

    def members(self) -> list[Survivor]:
        return self.procs.members()


class ResidueCgroupTarget:
    """omnid.process.termination's Target for a cgroup with no main process of ours: a previous
    daemon's unit cgroup, or what an unkillable instance left. Everything in it is
    ours by path (the root is omnid's); kill_all is `cgroup.kill`."""

    def __init__(self, root: CgroupRoot, path: str) -> None:
        self.root = root
        self.path = path
        self.name = f"cgroup {path}"
        self.procs = CgroupProcesses(root, path)

    def signal_all(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self.kill_all()
            return
        _signal_members(self.path, _rel_path(self.path), sig)

    def signal_main(self, sig: int) -> bool:
        self.signal_all(sig)  # no main process of ours: everything is the target
        return populated(self.path)

    def kill_all(self) -> None:
        try:
            _write(os.path.join(self.path, "cgroup.kill"), "1")
        except FileNotFoundError:
            pass

    async def wait_gone(self, deadline: float) -> bool:
        return await self.procs.wait_gone(deadline)

    def members(self) -> list[Survivor]:
        return self.procs.members()


# --------------------------------------------------------------------- daemon hooks


def backend(root: CgroupRoot | None) -> dict:
    """What `omnid status`, /health and /units say about the kill backend."""
    if root is None:
        return {"backend": "process-group", "cgroup": None}
    return {"backend": "cgroup", "cgroup": root.path}


def check_stack_keys(root: CgroupRoot | None, stack) -> None:
    """memory_max / tasks_max that this root (or no root) cannot honour: CgroupError naming
    every unit and key (at daemon start, and for `omnid reload` of an edited stack)."""
    errs = []
    for name, spec in sorted(stack.units.items()):
        keys = {k: getattr(spec, k, None) for k in KEY_CONTROLLER}
        if root is None:
            errs += [f"unit {name}: {k}: needs a cgroup v2 root (--cgroup-root, cgroup_root in omnid.toml or "
                     f"systemd Delegate=yes); omnid runs with process groups here" for k, v in keys.items() if v is not None]
        else:
            errs += root.check_keys(name, keys)
    if errs:
        raise CgroupError("; ".join(errs))


def start(explicit: str | None, origin: str, stack, companions: tuple[int, ...] = ()) -> CgroupRoot | None:
    """At daemon start, before the spawner has spawned anything: discover the root (`explicit`,
    as resolved by omnid.model.settings from `origin`: flag, env or omnid.toml; else delegation; the
    daemon and its `companions` move into its leaf), refuse unit keys it cannot honour
    (CgroupError naming unit and key), clean a previous daemon's cgroups."""
    source = {"flag": "--cgroup-root", "env": "OMNID_CGROUP_ROOT",
              "omnid.toml": f"cgroup_root in {getattr(stack.settings, 'file', 'omnid.toml')}"}.get(origin) \
        if explicit else None
    try:
        root = discover(explicit, source or "", companions)
    except CgroupError as exc:
        raise CgroupError(f"{source}: {exc}") from None
    try:
        check_stack_keys(root, stack)
    except CgroupError:
        if root is not None:
            root.close()
        raise
    if root is not None:
        left = root.clean_stale()
        if left:
            log.error("cgroups of a previous daemon could not be removed", cgroups=left)
        log.info("cgroup v2 per unit", root=root.path, source=root.source, controllers=sorted(root.controllers))
    return root
