"""Hang forensics: what a unit that was alive but failed was doing when omnid killed it
(omnid(8) FORENSICS).

Before omnid kills a unit that is *alive but failed* (watchdog expired, liveness failed,
readiness timed out, stop_timeout reached), `capture` records, for every process of the
unit: its state (R/S/D/Z/T), wchan, kernel stack (/proc/PID/stack, root only), every
thread (tid, state, wchan, name; the kernel stack of threads in D state), the command
line, and for Python processes the Python stack of every thread. The capture is bounded
in time (`capture_timeout`, never longer) and in size (cut, and it says so); whatever
could not be captured is recorded as text, never raised. A process in D state (stuck in
a driver, e.g. nvidia_uvm) is named as such first in the one-line summary that goes into
the unit's failure reason. The record itself (text, JSON, summary, size cut) is
omnid.forensics.record; captures are kept by omnid.forensics.store and shown by
`omnid status UNIT` and `omnid dump UNIT [--last N] [--now]`.

Why py-spy (PyPI `py-spy`) for the Python stacks: it reads the target's memory from
outside (process_vm_readv) and walks the interpreter's own thread and frame structures,
so it needs no cooperation from the target: no signal handler or faulthandler installed
in advance, no free GIL, no running thread. It works on a process that is spinning in a
loop, blocked in a syscall, holding the GIL forever, or SIGSTOPped -- exactly the hung
processes omnid kills. `--nonblocking` keeps it from ptrace-stopping the target (which
would not return for a stopped or D-state process). The alternatives need the target's
help (faulthandler through a signal: a stopped or GIL-starved process never runs it) or
stop it and are not a pip install (gdb). py-spy is started with os.posix_spawn (the
daemon never forks; omnid.forensics.helper), killed through a pidfd at the deadline.

/proc reads run on a small pool of worker threads: reading /proc/PID/cmdline takes the
target's memory lock, which a process stuck in D state may hold forever; the event loop
never waits on such a read, and a read still blocked is counted, not repeated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import shutil
import sysconfig
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import structlog

from omnid.forensics import helper as helperproc
from omnid.base import linux
from omnid.forensics.record import Capture, Member, ProcessDump, PyThread, ThreadState, assemble, fit, json_size, summarize

if TYPE_CHECKING:
    from omnid.forensics.store import CaptureStore

log = structlog.get_logger("omnid.forensics.capture")

DEFAULT_BUDGET_S = 3.0  # the unit key capture_timeout's default
MAX_BUDGET_S = 300.0  # the most capture_timeout may say (omnid.unit(5))
DEFAULT_MAX_BYTES = 1 << 20  # one capture, as stored (JSON)
PY_SPY_ENV = "OMNID_PY_SPY"  # path of py-spy, when it is not next to omnid's Python or on PATH
MAX_PROCESSES = 1024  # processes captured per unit; the rest are counted
MAX_THREADS = 1024  # threads listed per process; the rest are counted
KERNEL_STACK_LINES = 48
SPY_PARALLEL = 4  # py-spy runs at once (each is a process, ~50-100 ms of one core)
READ_WORKERS = 4  # /proc reader threads shared by every capture

_PYTHON_EXE = re.compile(r"(python|pypy)[0-9.]*[a-z]?")


# --------------------------------------------------------------------------- reading /proc


class _Readers:
    """The /proc reader threads: a few, shared; a read blocked in the kernel keeps its
    thread, and is counted here instead of getting another one."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.in_flight = 0

    def submit(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(READ_WORKERS, thread_name_prefix="omnid-proc-read")
        with self._lock:
            self.in_flight += 1
        fut = self._pool.submit(fn, *args)
        fut.add_done_callback(self._done)
        return asyncio.wrap_future(fut)

    def _done(self, _fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self.in_flight -= 1

    def close(self) -> None:
        """The idle threads end now; one blocked in the kernel is left to the daemon's end."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


_readers = _Readers()


def close_readers() -> None:
    """At the daemon's end: the /proc reader threads go (a capture later starts them again)."""
    _readers.close()


def _read_text(path: str, limit: int = 1 << 16) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode(errors="replace")


def _kernel_stack(path: str) -> tuple[tuple[str, ...], str | None]:
    """(frames, why not) of a /proc/.../stack file; frames without the "[<0>] " prefix."""
    try:
        text = _read_text(path)
    except PermissionError:
        return (), "kernel stack: permission denied (/proc/PID/stack needs root)"
    except FileNotFoundError:
        return (), "kernel stack: not available (gone, or a kernel without /proc/PID/stack)"
    except OSError as exc:
        return (), f"kernel stack: {exc.strerror or exc}"
    lines = [line.split("] ", 1)[-1].strip() for line in text.splitlines() if line.strip()]
    return tuple(lines[:KERNEL_STACK_LINES]), None


def _wchan_of(path: str) -> str:
    try:
        w = _read_text(path).strip()
    except OSError:
        return "?"
    return "" if w in ("", "0") else w


def _read_task(pid: int, tid: int) -> ThreadState | None:
    base = f"/proc/{pid}/task/{tid}"
    try:
        raw = _read_text(f"{base}/stat")
    except OSError:
        return None  # the thread ended meanwhile
    name = raw[raw.find("(") + 1:raw.rfind(")")]
    state = raw[raw.rfind(")") + 2:][:1] or "?"
    stack: tuple[str, ...] = ()
    if state == "D":
        stack, _why = _kernel_stack(f"{base}/stack")
    return ThreadState(tid, name, state, _wchan_of(f"{base}/wchan"), stack)


def _read_process(m: Member) -> dict[str, Any]:
    """Everything of one process that can be read without its memory lock (a worker
    thread runs this). {"gone": why} when it is not (or no longer) that process."""
    st = linux.read_stat(m.pid)
    if st is None:
        return {"gone": "exited before the capture"}
    if m.start_time and st.start_time != m.start_time:
        return {"gone": "exited before the capture (its pid is now another process)"}
    notes: list[str] = []
    stack, why = _kernel_stack(f"/proc/{m.pid}/stack")
    if why:
        notes.append(why)
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{m.pid}/task"))
    except OSError as exc:
        tids = []
        notes.append(f"threads: {exc.strerror or exc}")
    threads = [t for t in (_read_task(m.pid, tid) for tid in tids[:MAX_THREADS]) if t is not None]
    try:
        exe = os.path.basename(os.readlink(f"/proc/{m.pid}/exe"))
    except OSError:
        exe = ""  # a zombie, a kernel thread, or no permission: not taken for Python
    return {"comm": st.comm, "state": st.state, "wchan": _wchan_of(f"/proc/{m.pid}/wchan"),
            "kernel_stack": stack, "threads": tuple(threads), "threads_total": len(tids), "notes": notes,
            "python": bool(_PYTHON_EXE.fullmatch(exe.removesuffix(" (deleted)")))}


def _read_cmdline(pid: int) -> str:
    """Needs the target's memory lock: may block for as long as a D-state process holds it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)


# --------------------------------------------------------------------------- Python stacks


def find_py_spy() -> str | None:
    """py-spy: $OMNID_PY_SPY, else next to omnid's own Python (a venv's bin/), else PATH."""
    explicit = os.environ.get(PY_SPY_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    here = os.path.join(sysconfig.get_path("scripts"), "py-spy")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("py-spy")


def parse_py_spy(out: bytes, pid: int) -> tuple[PyThread, ...]:
    """py-spy dump --json output -> threads (ValueError when it is not what py-spy prints).
    A process that never imported threading has unnamed threads: its first is MainThread."""
    doc = json.loads(out)
    if not isinstance(doc, list):
        raise ValueError("expected a JSON list of threads")
    threads = []
    for t in doc:
        frames = tuple(f"{f.get('name', '?')} ({f.get('short_filename') or f.get('filename', '?')}:{f.get('line', '?')})"
                       for f in t.get("frames") or ())
        tid = int(t.get("os_thread_id") or t.get("thread_id") or 0)
        threads.append(PyThread(tid=tid, name=str(t.get("thread_name") or ("MainThread" if tid == pid else "?")),
                                active=bool(t.get("active")),
                                gil=bool(t.get("owns_gil")), frames=frames))
    return tuple(threads)


async def _python_stacks(pid: int, spy: str, deadline: float, reap_by: float,
                         cap: int) -> tuple[tuple[PyThread, ...] | None, str | None]:
    """(threads, None) or (None, why not)."""
    argv = [spy, "dump", "--pid", str(pid), "--nonblocking", "--json"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
    try:
        res = await helperproc.run(spy, argv, env, deadline=deadline, max_out=cap, reap_by=reap_by)
    except OSError as exc:
        return None, f"python stacks: cannot start {spy}: {exc.strerror or exc}"
    if res.timed_out:
        return None, "python stacks: py-spy did not finish within capture_timeout (killed)"
    if res.truncated:
        return None, f"python stacks: py-spy printed more than {cap} bytes (cut, not parsed)"
    if res.status is None or not os.WIFEXITED(res.status) or os.WEXITSTATUS(res.status) != 0:
        first = res.err.decode(errors="replace").strip().splitlines()
        why = first[0].removeprefix("Error: ") if first else linux.describe_wait_status(res.status or 0)[2]
        return None, f"python stacks: py-spy: {why}"
    try:
        return parse_py_spy(res.out, pid), None
    except (ValueError, TypeError, AttributeError) as exc:
        return None, f"python stacks: unreadable py-spy output ({exc})"


# --------------------------------------------------------------------------- capture


@dataclass
class _Partial:
    """One process's capture as it comes in; what is here at the deadline is kept."""

    member: Member
    basic: dict[str, Any] | None = None
    cmdline: str | None = None
    python: tuple[PyThread, ...] | None = None
    notes: list[str] = field(default_factory=list)
    spy_started: bool = False


async def _capture_one(p: _Partial, spy: str | None, spies: asyncio.Semaphore, deadline: float, reap_by: float,
                       cap: int) -> None:
    p.basic = await _readers.submit(_read_process, p.member)
    if "gone" in p.basic:
        return

    async def cmdline() -> None:
        p.cmdline = await _readers.submit(_read_cmdline, p.member.pid)

    async def python() -> None:
        if not p.basic or not p.basic["python"]:
            return
        if spy is None:
            p.notes.append(f"python stacks: py-spy not found (pip install py-spy, or set {PY_SPY_ENV})")
            return
        async with spies:
            p.spy_started = True
            p.python, why = await _python_stacks(p.member.pid, spy, deadline, reap_by, cap)
        if why:
            p.notes.append(why)

    await asyncio.gather(cmdline(), python())


def _finish(p: _Partial) -> ProcessDump | None:
    """The process as captured by the deadline; None when it was already gone."""
    m, b = p.member, p.basic
    notes = list(p.notes)
    if b is None:
        return ProcessDump(pid=m.pid, why=m.why, comm="?", state="?", wchan="", cmdline="",
                           notes=("not read within capture_timeout (/proc reads blocked or too slow)",))
    if "gone" in b:
        return None
    notes[:0] = b["notes"]
    if p.cmdline is None:
        notes.append("cmdline: not read within capture_timeout (its memory lock is held?)")
    if b["python"] and p.python is None and not any(n.startswith("python stacks:") for n in notes):
        notes.append("python stacks: not reached within capture_timeout" if not p.spy_started
                     else "python stacks: py-spy did not finish within capture_timeout (killed)")
    return ProcessDump(pid=m.pid, why=m.why, comm=b["comm"], state=b["state"], wchan=b["wchan"],
                       cmdline=p.cmdline or "", kernel_stack=b["kernel_stack"], threads=b["threads"],
                       threads_total=b["threads_total"], python=p.python, notes=tuple(notes))


async def capture(unit: str, members: list[Member], *, why: str, budget_s: float, max_bytes: int) -> Capture:
    """Capture every process of `members` concurrently, within `budget_s` seconds (never
    longer) and `max_bytes` of JSON (cut, and said so). Never raises for a process that
    cannot be read: what is missing is in `missing` and in each process's notes."""
    loop = asyncio.get_running_loop()
    t0, wall = loop.time(), time.time()
    if budget_s <= 0:
        return Capture(unit=unit, why=why, ts=wall, seconds=0.0, summary="not captured (capture_timeout = 0)",
                       missing=["capture off (capture_timeout = 0)"])
    # The end of the budget is kept for killing and reaping py-spy (reap_by), and for
    # assembling the record (the last few ms).
    reserve = min(0.25, budget_s * 0.2)
    work_deadline = t0 + budget_s - reserve
    reap_by = t0 + budget_s - min(0.05, reserve / 3)
    seen: set[int] = set()
    parts = []
    for m in members:
        if m.pid not in seen:
            seen.add(m.pid)
            parts.append(_Partial(m))
    skipped = max(len(parts) - MAX_PROCESSES, 0)
    parts = parts[:MAX_PROCESSES]
    blocked_before = _readers.in_flight
    spy = find_py_spy()
    spies = asyncio.Semaphore(SPY_PARALLEL)
    spy_cap = max(4 * max_bytes, 1 << 20)
    tasks = [loop.create_task(_capture_one(p, spy, spies, work_deadline, reap_by, spy_cap)) for p in parts]
    for t, p in zip(tasks, parts):
        t.add_done_callback(lambda t, pid=p.member.pid: _report(unit, pid, t))
    if tasks:
        _done, pending = await asyncio.wait(tasks, timeout=max(work_deadline - loop.time(), 0.0))
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=max(reap_by - loop.time(), 0.0))
        helperproc.reap_pending()
    dumps = [d for d in map(_finish, parts) if d is not None]
    missing = [f"pid {d.pid}: {n}" for d in dumps for n in d.notes]
    if skipped:
        missing.append(f"{skipped} more processes not captured (at most {MAX_PROCESSES} per unit)")
    blocked = _readers.in_flight
    if blocked and blocked > blocked_before:
        missing.append(f"{blocked} /proc read(s) still blocked in the kernel")
    cap = fit(assemble(unit, why, wall, dumps, missing), max_bytes)
    return replace(cap, seconds=round(loop.time() - t0, 4))


def _report(unit: str, pid: int, task: asyncio.Task[None]) -> None:
    """No capture task whose exception nobody sees (a bug here, not a process we cannot read)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("capture of one process failed", unit=unit, pid=pid, error=repr(task.exception()))


# --------------------------------------------------------------------------- a unit's members


def member_list(main_pid: int, main_start: int, others: Iterable[Any]) -> list[Member]:
    """Members from a unit's main process and anything with .pid, .start_time and .why
    (process.Survivor, as Target.members() returns them): what the kill path has at hand."""
    out = [Member(main_pid, main_start, "main")]
    out += [Member(s.pid, s.start_time, s.why) for s in others if s.pid != main_pid]
    return out


def _members_now(sup: Any, name: str) -> list[Member]:
    """The live processes of a running unit: main, cgroup, process group, tagged orphans."""
    from omnid.process.handle import find_residue

    u = sup.units[name]
    h = u.proc
    if h is None:
        return []
    out = [Member(h.pid, h.start_time, "main")]
    cgroups = getattr(sup, "cgroups", None)
    cg = cgroups.get(name) if cgroups else None
    if cg is not None:
        for pid in cg.pids():
            st = linux.read_stat(pid)
            if st is not None and pid != h.pid:
                out.append(Member(pid, st.start_time, "cgroup"))
    spawner_pid = getattr(getattr(sup, "spawner", None), "pid", 0) or 0
    for s in find_residue(name, h.pgid, spawner_pid, getattr(sup, "token", None)):
        out.append(Member(s.pid, s.start_time, s.why))
    return out


async def members_of(sup: Any, name: str) -> list[Member]:
    """`_members_now` off the loop (it scans /proc while the unit's group lives)."""
    return await asyncio.to_thread(_members_now, sup, name)


async def capture_unit(sup: Any, name: str, why: str, *, max_bytes: int = DEFAULT_MAX_BYTES,
                       budget_s: float | None = None) -> Capture | None:
    """Capture a running unit within its capture_timeout (None when that is 0 or the unit
    has no process). For the kill path: capture, send the signal, then store the capture."""
    u = sup.units[name]
    budget = u.spec.capture_timeout if budget_s is None else budget_s
    if budget <= 0 or u.proc is None:
        return None
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        members = await asyncio.wait_for(members_of(sup, name), budget / 2)
    except TimeoutError:
        h = u.proc
        members = [Member(h.pid, h.start_time, "main")]
        log.warning("listing a unit's processes took over half its capture budget; capturing its main process",
                    unit=name)
    return await capture(name, members, why=why, budget_s=max(budget - (loop.time() - t0), 0.05),
                         max_bytes=max_bytes)


# --------------------------------------------------------------------------- `dump` control command


async def dump(sup: Any, store: CaptureStore, names: list[str], last: int,
               capture_now: list[str]) -> list[dict[str, Any]]:
    """The `dump` control command's answer (its arguments are checked by omnid.api.handlers): the
    units in `capture_now` are captured first and their captures kept, then the `last` kept
    captures of each of `names`, each {"unit", "text", "capture"} (the JSON form), oldest
    first per unit."""
    if capture_now:
        caps = await asyncio.gather(*(capture_unit(sup, n, "on demand (omnid dump --now)",
                                                   budget_s=sup.units[n].spec.capture_timeout or DEFAULT_BUDGET_S)
                                      for n in capture_now))
        for c in caps:
            if c is not None:
                await store.save_async(c)
    out = []
    for n in names:
        for c in await asyncio.to_thread(store.latest, n, last):
            out.append({"unit": n, "text": c.to_text(), "capture": c.to_json()})
    return out


def add_last_capture(units: list[dict[str, Any]], store: CaptureStore) -> None:
    """Put each unit's last capture ({"ts", "why", "summary"}) into its status object."""
    for u in units:
        last = store.last_summary(u["name"])
        if last is not None:
            u["last_capture"] = last


# The record lives in omnid.forensics.record; these names are part of this module's face too.
__all__ = ["Capture", "DEFAULT_BUDGET_S", "DEFAULT_MAX_BYTES", "MAX_BUDGET_S", "Member", "PY_SPY_ENV", "ProcessDump",
           "PyThread", "ThreadState", "add_last_capture", "capture", "capture_unit", "dump", "find_py_spy",
           "json_size", "member_list", "members_of", "parse_py_spy", "summarize"]
