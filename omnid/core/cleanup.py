"""What a unit leaves besides processes, taken away when it is gone: its private
temporary directory (omnid.process.privatetmp) and its IPC objects (omnid.process.ipc). The executor
calls `before_spawn` (a new directory, a fresh IPC record; the previous instance's IPC
objects removed first, so a restart never meets its predecessor's objects, while its old
directory, a tree a restart has no use for, goes beside the new instance), `spawned`,
`gone` (a stop, once the kernel proved the processes gone: the removal is its own step,
stopping/releasing, awaited so that the stop summary names what was removed and how long
that took, on its own clock, never the stop's) and `released` (the unit is inactive or
failed: whatever `gone` did not do yet runs now, as a task, so a death's path to `failed`
does not wait for it). Each removal is one task per instance (`remove`); its result
(`Removal`) goes into the stop's record. The blocking work (a /proc
scan, a tree removal) runs on a thread of its own (omnid.base.ownthreads), and the wait for
it is bounded (REMOVAL_BOUND_S) even where the kernel never answers it: the scan reads every
process's /proc/PID/maps, which can wait as long as that process's memory lock is held, and
a unit's death must never wait on a stranger's process for good. What a removal that did not
return in time would have removed is left, and the log says so; while MAX_STUCK have not
returned, the next removals are not tried at all (each would wait on the same process).

A /dev/shm entry that a live process still holds at the removal is looked at again, on a
backoff, for HELD_RETRY_S: the holder is often the unit's own last process, one the kernel
could not tie to the unit (PostgreSQL's backends call setsid() and overwrite their
environment, and exit when they see the postmaster gone, a moment after omnid saw the unit
go). An entry held for longer, by a consumer that outlives the unit, is kept and logged.

A re-exec hands every removal under way over (`handover`'s `removing`: the directory, the
IPC record, as far as the removal had taken them): the thread doing it ends with the old
program's exec, and the new program does it again from the start (`take_over`), so a
removal is never lost between the two.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from omnid.model import accounts
from omnid.process import cachedir
from omnid.process import ipc
from omnid.process import privatetmp
from omnid.base.ownthreads import Busy, OwnThreads
from omnid.base.tasks import report_crash, unit_task

log = structlog.get_logger("omnid.cleanup")

SETTLE_WAIT_S = 5.0  # a spawn waits at most this long for its predecessor's removal
IPC_BUDGET_S = 5.0  # the /proc scan that proves nobody holds an object (~1 s for 2,000 processes here)
TMP_BUDGET_S = 10.0
# Each part's wait for its thread: its budget is checked between steps, not inside one.
STEP_MARGIN_S = 2.5
IPC_BOUND_S = IPC_BUDGET_S + STEP_MARGIN_S
TMP_BOUND_S = TMP_BUDGET_S + STEP_MARGIN_S
REMOVAL_BOUND_S = IPC_BOUND_S + TMP_BOUND_S
# A tree its first slice could not remove (a compiler's cache of millions of files; 150,000
# at load 26 here) is not left for good: later slices go on with it, one at a time for the
# whole daemon on a thread of their own, a pause between them, until it is gone, a slice ends
# for another reason than its bound, this many entries were walked in all (something refills
# it), or this many slices in a row removed nothing (a slice's thread that gets no CPU before
# its deadline removes nothing: seen with 20 ms slices at load 26, so one is not enough).
TMP_SLICE_S = 5.0
TMP_SLICE_PAUSE_S = 0.1
TMP_MAX_ENTRIES = 50_000_000
TMP_IDLE_SLICES = 10
MAX_STUCK = 2  # removals or looks not returned before the next are not tried
HELD_RETRY_S = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8)  # ~25 s of looks at held /dev/shm entries


class CannotPrepare(Exception):
    """The private directory cannot be made: the spawn fails with this reason."""


@dataclass
class Removal:
    """What one removal of an instance's leftovers did (the stop summary's cleanup step)."""

    seconds: float = 0.0  # its own clock: from its start (a predecessor's wait excluded) to its end
    tmp_entries: int | None = None  # entries of the private tmp directory walked and removed (None: no walk)
    tmp_left: str | None = None  # why the private tmp directory is not (fully) removed
    removed: list[str] = field(default_factory=list)  # IPC objects removed
    kept: list[str] = field(default_factory=list)

    def record_in(self, rec: Any) -> None:
        """Into a StopRecord (omnid.process.termination)."""
        rec.cleanup_seconds = round(self.seconds, 4)
        rec.tmp_entries = self.tmp_entries
        rec.tmp_left = self.tmp_left or ""
        rec.ipc_removed = list(self.removed)


@dataclass
class _Removing:
    """A removal under way: what it removes, as far as it has taken it (handed over at a re-exec)."""

    unit: str
    tmp: privatetmp.TmpDir | None
    remove_ipc: bool
    ipc: ipc.UnitIpc | None = None  # once taken out of the book (on the removal's thread)
    task: asyncio.Task | None = None
    result: Removal | None = None  # once it is over
    # Set once the IPC part is over (done, or given up): what the unit's next spawn waits for.
    ipc_over: asyncio.Event = field(default_factory=asyncio.Event)
    # Set once `result` says what the removal did (its end, or its first slice's bound with the
    # rest going on in the background): what a stop summary and the daemon's end wait for.
    reported: asyncio.Event = field(default_factory=asyncio.Event)
    # Made once the instance is over (the kernel's proof, or a stop's release): a reading of
    # /proc/sysvipc taken after this holds every System V object the instance made.
    since: float = field(default_factory=time.monotonic)

    def to_json(self) -> dict:
        over = self.ipc_over.is_set()  # the IPC part done is not done again by the next program
        return {"unit": self.unit, "tmp": self.tmp.to_json() if self.tmp is not None else None,
                "remove_ipc": self.remove_ipc and not over,
                "ipc": self.ipc.to_json() if self.ipc is not None and not over else None}


def unit_ids(spec: Any) -> tuple[int | None, int | None]:
    """The uid and gid the unit runs as (None: the daemon's own), as resolved when the stack
    was read (omnid.model.accounts: no NSS lookup on the loop). KeyError: no such user/group."""
    account = accounts.of(spec.user, spec.group)
    if account.error:
        raise KeyError(account.error)
    return (account.uid if account.uid >= 0 else None), (account.gid if account.gid >= 0 else None)


class TmpRemovals:
    """How private tmp directories go, beside a unit's removal (UnitCleanup): the empty ones of
    the stack's stop in batches on a thread (`batched`), a tree in slices of
    privatetmp.remove, each bounded; a tree its first slice did not remove, and a previous
    daemon's the start's sweep did not, gone on with one slice at a time for the whole daemon."""

    def __init__(self, record: privatetmp.Record | None) -> None:
        self.record = record
        # The stack's stop (the daemon's end): empty directories are removed in batches on a
        # thread, not one rmdir at a time on the loop (256 units: 256 rmdirs of 0.3-3 ms in
        # /tmp here, between the last unit's exit and the daemon's). A restart keeps its one
        # rmdir on the loop: a thread's hand-off would cost more than it.
        self.batched = False
        self._rmdirs: list[tuple[privatetmp.TmpDir, asyncio.Future[bool]]] = []
        self._rmdir_task: asyncio.Task | None = None
        self._rmdir_threads = OwnThreads(1, kind="removal")
        # Later slices of trees a first slice could not remove (TMP_SLICE_S): one at a time.
        self._slice_threads = OwnThreads(1, kind="removal")
        self._slice_turn = asyncio.Lock()
        self.finishing: dict[asyncio.Task, str] = {}  # a previous daemon's trees gone on with: their paths

    def finish_previous(self, d: privatetmp.TmpDir) -> None:
        """A previous daemon's tree the start's sweep did not remove (recorded again): gone on with."""
        task = report_crash(asyncio.get_running_loop().create_task(self._finish_previous(d)), "private tmp sweep")
        self.finishing[task] = d.path
        task.add_done_callback(lambda t: self.finishing.pop(t, None))

    async def _finish_previous(self, d: privatetmp.TmpDir) -> None:
        t0 = time.monotonic()
        log.info("a previous daemon's private tmp directory is large: its removal goes on in the background",
                 unit=d.unit, path=d.path)
        left, entries = await self.go_on(d.unit, d, 0)
        if left is None:
            if self.record is not None:
                self.record.drop(d)
            log.info("removed a private tmp directory a previous daemon left", unit=d.unit, path=d.path,
                     entries=entries, seconds=round(time.monotonic() - t0, 3))
        else:
            log.warning("a previous daemon's private tmp directory was not removed", unit=d.unit, why=left)

    async def slice(self, unit: str, d: privatetmp.TmpDir, threads: OwnThreads,
                    budget_s: float) -> tuple[str | None, int | None]:
        """One call of privatetmp.remove on a thread of its own, waited for at most its budget
        and a margin: (what is left, the entries it walked)."""
        counted: list[int] = []
        try:
            left = await threads.run(f"{unit}'s private tmp",
                                     lambda: privatetmp.remove(d, deadline_s=budget_s, counted=counted),
                                     budget_s + STEP_MARGIN_S)
        except (TimeoutError, Busy) as exc:
            log.warning("leftovers not removed", unit=unit, private_tmp=d.path, why=str(exc) or (
                f"not returned in {budget_s + STEP_MARGIN_S:g} s (a mount the kernel does not answer?)"))
            left = "its removal did not return"
        return left, (counted[0] if counted else None)

    async def go_on(self, unit: str, d: privatetmp.TmpDir, entries: int) -> tuple[str | None, int]:
        """Slices of TMP_SLICE_S, one at a time for the whole daemon, until the tree is gone, a
        slice ends for another reason than its bound, TMP_MAX_ENTRIES were walked, or
        TMP_IDLE_SLICES slices in a row removed nothing."""
        idle = 0
        while True:
            await asyncio.sleep(TMP_SLICE_PAUSE_S)
            async with self._slice_turn:
                left, n = await self.slice(unit, d, self._slice_threads, TMP_SLICE_S)
            entries += n or 0
            idle = 0 if n else idle + 1
            if not privatetmp.bound_reached(left):
                return left, entries
            if idle >= TMP_IDLE_SLICES:
                return f"{left}; given up after {idle} slices in a row removed nothing", entries
            if entries >= TMP_MAX_ENTRIES:
                return f"{left}; given up after {entries} entries in all (refilled as fast as it is removed?)", entries

    async def remove_if_empty(self, d: privatetmp.TmpDir) -> bool:
        """privatetmp.remove_if_empty: at once, or in the stack stop's next batch."""
        if not self.batched:
            return privatetmp.remove_if_empty(d)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._rmdirs.append((d, fut))
        if self._rmdir_task is None or self._rmdir_task.done():
            self._rmdir_task = report_crash(asyncio.get_running_loop().create_task(self._rmdir_batches()),
                                            "private tmp removals")
        return await fut

    async def _rmdir_batches(self) -> None:
        """What was queued while the previous batch ran goes as the next batch. A batch that
        cannot run or return in time leaves each directory to the full removal (False)."""
        batch: list[tuple[privatetmp.TmpDir, asyncio.Future[bool]]] = []
        try:
            while self._rmdirs:
                batch, self._rmdirs = self._rmdirs, []
                dirs = [d for d, _ in batch]
                try:
                    done = await self._rmdir_threads.run(f"{len(dirs)} empty private tmp directories",
                                                         lambda: [privatetmp.remove_if_empty(d) for d in dirs],
                                                         TMP_BUDGET_S)
                except (TimeoutError, Busy) as exc:
                    log.warning("empty private tmp directories not removed in a batch; each is removed alone",
                                count=len(dirs), why=str(exc) or f"not returned in {TMP_BUDGET_S:g} s")
                    done = [False] * len(dirs)
                for (_, fut), ok in zip(batch, done):
                    if not fut.done():
                        fut.set_result(ok)
        finally:  # never a removal waiting for good on a batch that ended
            for _, fut in [*batch, *self._rmdirs]:
                if not fut.done():
                    fut.set_result(False)


class UnitCleanup:
    def __init__(self, token: str, state_dir: str | None, cache_root: Callable[[], object] | None = None) -> None:
        self.book = ipc.IpcBook(token)
        self.caches = cachedir.UnitCaches(cache_root)  # `cache_dir`: made here, never removed
        self.watch: ipc.ShmWatch | None = None
        self.watch_error: str | None = None
        self.record = privatetmp.Record(state_dir) if state_dir else None
        # Read before this daemon makes any: what a previous one left (swept once started).
        self._previous = self.record.previous() if self.record is not None else []
        self.tmp: dict[str, privatetmp.TmpDir] = {}  # unit -> its live instance's directory
        self._due: set[str] = set()  # units whose instance is gone and not yet cleaned
        self._tasks: dict[str, asyncio.Task] = {}
        self._latest: dict[str, _Removing] = {}  # unit -> its last removal (its task is _tasks')
        # /dev/shm entries a live process held at the removal, looked at again (a task each)
        # One task per unit, whatever number of its instances left held entries (a crash loop).
        self._held: dict[str, list[ipc.UnitIpc]] = {}
        self._held_tasks: dict[str, asyncio.Task] = {}
        self._held_fresh: set[str] = set()  # units with entries newer than their task's backoff
        self._held_taken: list[ipc.UnitIpc] = []  # handed over by the program before a re-exec
        self._last_look = asyncio.Event()  # the daemon stops: every held entry gets its last look now
        self.threads = OwnThreads(MAX_STUCK, kind="removal")
        self._removing: list[_Removing] = []  # removals under way (one per instance)
        self.dirs = TmpRemovals(self.record)  # empty directories in batches, large trees in slices
        self._sysv: ipc.SysvTables | None = None  # the last reading, shared by removals it serves

    # ------------------------------------------------------------ daemon life
    def start(self) -> None:
        """The fanotify listener (a thread: call after the spawner's exec)."""
        self.watch = ipc.ShmWatch(self.book)
        self.watch_error = self.watch.start()
        if self.watch_error is not None:
            self.watch = None
            log.warning("POSIX IPC objects (/dev/shm) will not be attributed to units; System V ones will",
                        reason=self.watch_error)

    async def sweep_previous(self) -> None:
        """Private directories a previous daemon (SIGKILLed) recorded and left; a re-exec's
        live ones are kept. Held /dev/shm entries the program before a re-exec was still
        looking at are looked at again."""
        taken, self._held_taken = self._held_taken, []
        for u in taken:
            self._look_again(u)
        if self.record is not None and self._previous:
            keep = {d.path for d in self.tmp.values()} | {r.tmp.path for r in self._removing if r.tmp is not None}
            previous, self._previous = self._previous, []
            _, unfinished = await asyncio.to_thread(self.record.sweep, previous, keep)
            for d in unfinished:
                self.record.add(d)  # still to remove: a later daemon knows it too
                self.dirs.finish_previous(d)

    async def settle(self, timeout: float = SETTLE_WAIT_S) -> None:
        """Every removal under way finished or gone to the background (the daemon's end, every
        unit stopped), bounded; held entries get their last look at once. A tree still being
        removed in the background is left in the record: the next start's sweep goes on."""
        self._last_look.set()
        waits = [asyncio.ensure_future(w.reported.wait()) for w in self._removing if not w.reported.is_set()]
        tasks = [*waits, *(t for t in self._held_tasks.values() if not t.done())]
        try:
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)
        finally:
            for t in waits:
                t.cancel()
        for t in self._held_tasks.values():
            t.cancel()
        going_on = [w.tmp.path for w in self._removing if w.reported.is_set() and w.tmp is not None]
        going_on += self.dirs.finishing.values()
        if going_on:
            log.warning("private tmp removals not finished at the daemon's end: the next start goes on with them",
                        paths=going_on)

    def flush_record(self) -> None:
        """The private tmp record on disk now, if it changed (before spawn requests leave: a
        directory a child will use is recorded before the child runs)."""
        if self.record is not None:
            self.record.flush()

    def close(self) -> None:
        if self.record is not None:
            self.record.close()  # what changed, on disk; its append fd closed
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    def handover(self) -> dict:
        self.flush_record()
        return {"ipc": self.book.handover(), "tmp": {k: d.to_json() for k, d in self.tmp.items()},
                "due": sorted(self._due), "held": [u.to_json() for us in self._held.values() for u in us]
                + [u.to_json() for u in self._held_taken],
                "removing": [r.to_json() for r in self._removing]}

    def take_over(self, d: object) -> None:
        if not isinstance(d, dict):
            return
        self.book.take_over(d.get("ipc"))
        tmp = d.get("tmp")
        for k, v in (tmp.items() if isinstance(tmp, dict) else ()):
            td = privatetmp.TmpDir.from_json(v)
            if td is not None:
                self.tmp[str(k)] = td
                if self.record is not None:
                    self.record.dirs[td.path] = td
        due = d.get("due")
        self._due.update(str(x) for x in due if isinstance(x, str)) if isinstance(due, list) else None
        held = d.get("held")
        self._held_taken = [ipc.UnitIpc.from_json(u) for u in held] if isinstance(held, list) else []
        removing = d.get("removing")
        for r in removing if isinstance(removing, list) else ():
            self._take_removal(r)

    def _take_removal(self, r: object) -> None:
        """A removal the previous program had under way: done again from the start, now (called
        on the loop, before any unit is resumed: a restart waits for it as for any removal).
        What its thread had not taken out of the IPC book yet is still in the book handed over,
        unless a newer instance of the unit owns the record."""
        if not isinstance(r, dict) or not isinstance(r.get("unit"), str):
            return
        unit = r["unit"]
        td = privatetmp.TmpDir.from_json(r["tmp"]) if r.get("tmp") is not None else None
        u = ipc.UnitIpc.from_json(r["ipc"]) if r.get("ipc") is not None else None
        if u is None and unit not in self._due:
            u = self.book.take(unit)
        if td is not None and self.record is not None:
            self.record.dirs[td.path] = td
        work = _Removing(unit, td, bool(r.get("remove_ipc")), u)
        self._removing.append(work)  # kept out of sweep_previous, handed over again by a re-exec
        self._start(work, handed=True)

    def _start(self, work: _Removing, rt: Any | None = None, handed: bool = False) -> _Removing:
        """work's task, after the unit's removal still under way (an older instance's, bounded)."""
        prev = self._tasks.get(work.unit)
        # A crash is logged by unit_task; the unit's state does not depend on its leftovers.
        work.task = self._tasks[work.unit] = unit_task(self._clean(work, after=prev, rt=rt, handed=handed),
                                                       unit=work.unit, kind="cleanup", on_crash=lambda exc: None)
        self._latest[work.unit] = work
        return work

    # ------------------------------------------------------------ a unit's instance
    async def before_spawn(self, rt: Any) -> dict[str, str]:
        """The previous instance's leftovers removed, a fresh record and directory; returns
        what the unit's environment gains. CannotPrepare says why it cannot start."""
        name, spec = rt.name, rt.spec
        if name in self._due:  # gone, never released (a spawn straight after a stop)
            self.remove(rt)
        prev = self._latest.get(name)
        if prev is not None and not prev.ipc_over.is_set():
            try:
                await asyncio.wait_for(prev.ipc_over.wait(), SETTLE_WAIT_S)
            except TimeoutError:
                pass
        try:
            uid, gid = unit_ids(spec)
        except KeyError as exc:
            raise CannotPrepare(f"unknown user or group {exc}") from None
        try:
            cache_env = await self.caches.before_spawn(spec, uid, gid)
        except cachedir.CacheDirRefused as exc:
            raise CannotPrepare(str(exc)) from None
        self.book.begin(name, os.geteuid() if uid is None else uid)
        if not privatetmp.wanted(spec):
            return cache_env
        try:
            d = privatetmp.create(name, uid, gid)
        except OSError as exc:
            code = errno.errorcode.get(exc.errno or 0, exc.errno)  # named as the output pipes' failure is
            raise CannotPrepare(f"cannot create the private temporary directory under {privatetmp.TMP_ROOT}: "
                                f"{code} ({exc.strerror or exc})") from None
        self.tmp[name] = d
        self._due.add(name)
        if self.record is not None:
            self.record.add(d)
        rt.private_tmp = d.path
        # An operator's TMP or TEMP in `env` stays (TMPDIR there means no directory at all).
        return {**cache_env, **{k: v for k, v in privatetmp.environment(d).items() if k not in spec.env}}

    def spawned(self, rt: Any, pid: int) -> None:
        self.book.add_pid(rt.name, pid)
        self._due.add(rt.name)

    def due(self, name: str) -> bool:
        """Is something of the unit's last instance still to be removed, or being removed?"""
        task = self._tasks.get(name)
        return name in self._due or (task is not None and not task.done())

    def remove(self, rt: Any) -> _Removing | None:
        """The removal of what the unit's last instance left: started now if it is due, else
        the one under way (None: nothing to remove). A removal of an older instance still under
        way is waited for first (bounded), never overtaken."""
        name = rt.name
        if name not in self._due:
            last = self._latest.get(name)
            return last if last is not None and last.task is not None and not last.task.done() else None
        self._due.discard(name)
        work = _Removing(name, self.tmp.pop(name, None), bool(rt.spec.remove_ipc))
        self._removing.append(work)
        return self._start(work, rt)

    async def gone(self, rt: Any, rec: Any | None) -> Removal | None:
        """Nothing of the instance runs any more (the kernel proved it): remove, await (the
        removal bounds itself; this wait too, should it not), and record what it did in rec."""
        work = self.remove(rt)
        if work is None or work.task is None:
            return None
        if rec is None:  # no stop summary to name it: a crash's restart waits for the IPC part only
            try:
                await asyncio.wait_for(work.ipc_over.wait(), SETTLE_WAIT_S + IPC_BOUND_S)
            except TimeoutError:
                pass
            return work.result
        try:  # its end, or its first slice's bound (the rest goes on in the background)
            await asyncio.wait_for(work.reported.wait(), SETTLE_WAIT_S + REMOVAL_BOUND_S)
        except TimeoutError:
            pass
        if work.result is not None:
            work.result.record_in(rec)
        return work.result

    def released(self, rt: Any) -> None:
        """The unit is inactive or failed: whatever is still due goes, as a task."""
        self.remove(rt)

    async def _clean(self, work: _Removing, after: asyncio.Task | None = None, rt: Any | None = None,
                     handed: bool = False) -> None:
        """The instance's IPC objects first, then its private tmp directory. The unit's next
        spawn waits for the first part only (`ipc_over`): a name it makes again must be free,
        but its TMPDIR is a new directory, and a tree left in the old one (a compiler's
        cache, gigabytes) must not hold a restart; an empty one costs it an rmdir (~0.3 ms)."""
        name, d = work.unit, work.tmp
        removed: list[str] = []
        kept: list[str] = []
        held: ipc.UnitIpc | None = None
        tmp_left: str | None = None
        entries: int | None = None
        t0 = time.monotonic()

        def first_slice_over(entries: int) -> None:  # more to remove: said now, gone on with
            took = time.monotonic() - t0
            assert d is not None
            work.result = Removal(took, entries, f"{d.path}: {entries} entries removed in {took:.1f} s; "
                                  "the rest is being removed in the background", removed, kept)
            work.reported.set()
            log.info("private tmp directory is large: its removal goes on in the background", unit=name,
                     path=d.path, entries=entries, seconds=round(took, 3))

        try:
            if after is not None and not after.done():
                await asyncio.wait([after], timeout=SETTLE_WAIT_S)
            t0 = time.monotonic()
            try:
                removed, kept, held = await self._remove_ipc(work, handed)
            finally:
                work.ipc_over.set()
            if rt is not None:  # what `status` says from now on, not once the directory is gone too
                rt.ipc_removed = removed
            if removed or kept:  # said now: a re-exec may hand the rest over before the tmp part ends
                log.info("IPC residue", unit=name, removed=removed, kept=kept,
                         ms=round((time.monotonic() - t0) * 1000, 1),
                         **({"looked_at_again": sorted(held.shm)} if held is not None else {}))
            if d is not None:
                # A restart asks for its spawn in the loop's next two turns (the supervisor's
                # converge, queued behind this task, then the launch it starts): yielded to,
                # so that the old directory goes after that ask, not before it (~0.3 ms).
                for _ in range(2):
                    await asyncio.sleep(0)
                tmp_left, entries = await self._remove_tmp(work, handed, first_slice_over)
            r = work.result = Removal(time.monotonic() - t0, entries, tmp_left, removed, kept)
        finally:
            work.ipc_over.set()
            work.reported.set()
            if work in self._removing:
                self._removing.remove(work)
        if d is not None and self.record is not None and tmp_left is None:
            self.record.drop(d)
        if tmp_left is not None:
            log.warning("private tmp directory not fully removed", unit=name, why=tmp_left)
        if entries or handed:
            log.info("leftovers removed", unit=name, seconds=round(r.seconds, 3), private_tmp_entries=entries,
                     private_tmp_left=tmp_left, ipc_removed=len(removed),
                     **({"handed_over": "by the program before a re-exec"} if handed else {}))
        if held is not None:
            self._look_again(held)

    async def _remove_ipc(self, work: _Removing, handed: bool) -> tuple[list[str], list[str], ipc.UnitIpc | None]:
        """(removed, kept, the /dev/shm entries still held). On the loop when nothing needs a
        thread: no /dev/shm entry to prove unheld, no queued event (a thread's hand-off costs
        a restart ~0.1 s on a loaded host). A handed-over removal took its record in the
        program before (or from the book handed over)."""
        name = work.unit
        if not handed and not self.book.has_entries(name) and (self.watch is None or not self.watch.pending()):
            u = work.ipc = self.book.take(name)
            if u is None or not work.remove_ipc:
                return [], [], None
            removed, kept = ipc.remove_sysv(u, self._sysv_since(work.since))
            return removed, kept, None

        def blocking() -> tuple[list[str], list[str], ipc.UnitIpc | None]:
            # What the unit created just before it died may still be queued: read first.
            if not handed:
                if self.watch is not None:
                    self.watch.drain()
                work.ipc = self.book.take(name)  # the loop reads it only to hand it over
            u = work.ipc
            if u is None or not work.remove_ipc:
                return [], [], None
            gone, kept, shm = ipc.remove_residue(u, IPC_BUDGET_S)
            return gone, kept, (ipc.UnitIpc(u.unit, u.uid, u.since, shm=shm) if shm else None)

        try:
            return await self.threads.run(f"{name}'s IPC residue", blocking, IPC_BOUND_S)
        except (TimeoutError, Busy) as exc:
            log.warning("leftovers not removed", unit=name, why=str(exc) or (
                f"not returned in {IPC_BOUND_S:g} s (a /proc read the kernel does not answer?)"))
            return [], [], None

    async def _remove_tmp(self, work: _Removing, handed: bool,
                          first_slice_over: Callable[[int], None]) -> tuple[str | None, int | None]:
        """(what was left of the private tmp directory, the entries walked): one rmdir on the
        loop when it is empty, else the tree's removal on a thread, bounded; a tree its first
        slice did not remove is gone on with in the background (first_slice_over says so)."""
        d = work.tmp
        assert d is not None
        if not handed and await self.dirs.remove_if_empty(d):
            return None, None
        left, entries = await self.dirs.slice(work.unit, d, self.threads, TMP_BUDGET_S)
        if not privatetmp.bound_reached(left):
            return left, entries
        first_slice_over(entries or 0)
        return await self.dirs.go_on(work.unit, d, entries or 0)

    def _sysv_since(self, since: float) -> ipc.SysvTables:
        """A reading of the System V tables taken at or after `since` (ipc.SysvTables)."""
        if self._sysv is None or self._sysv.taken_at < since:
            self._sysv = ipc.SysvTables.read()
        return self._sysv

    def _look_again(self, u: ipc.UnitIpc) -> None:
        self._held.setdefault(u.unit, []).append(u)
        task = self._held_tasks.get(u.unit)
        if task is not None and not task.done():
            self._held_fresh.add(u.unit)  # its backoff starts over
            return
        self._held_tasks[u.unit] = unit_task(self._held_looks(u.unit), unit=u.unit, kind="cleanup",
                                             on_crash=lambda exc: None)

    async def _held_looks(self, name: str) -> None:
        """A unit's held entries looked at again on a backoff: each removed once nobody holds it."""
        t0 = time.monotonic()
        kept: list[str] = []
        i = 0
        while i < len(HELD_RETRY_S) or name in self._held_fresh:
            if name in self._held_fresh:
                self._held_fresh.discard(name)
                i = 0
            delay = HELD_RETRY_S[i]
            i += 1
            if not self._last_look.is_set():
                try:
                    await asyncio.wait_for(self._last_look.wait(), delay)
                except asyncio.TimeoutError:
                    pass
            kept = []
            for u in list(self._held.get(name, ())):
                try:
                    removed, still, held = await self.threads.run(f"{name}'s held /dev/shm entries",
                                                                  lambda u=u: ipc.remove_posix(u, IPC_BUDGET_S),
                                                                  IPC_BUDGET_S + 5.0)
                except (TimeoutError, Busy) as exc:  # still held, as far as anyone knows
                    why = str(exc) or "the look did not return"
                    removed, still, held = [], [f"/dev/shm/{n} (not looked at: {why})" for n in u.shm], u.shm
                if removed:
                    log.info("IPC residue", unit=name, removed=removed, kept=still,
                             after_s=round(time.monotonic() - t0, 2))
                u.shm = held
                kept += still
            left = self._held[name] = [u for u in self._held.get(name, ()) if u.shm]
            if not left or self._last_look.is_set():
                break
        if self._held.pop(name, None):
            log.warning("IPC residue kept: still held by a live process", unit=name, kept=kept,
                        after_s=round(time.monotonic() - t0, 1))
        self._held_fresh.discard(name)
