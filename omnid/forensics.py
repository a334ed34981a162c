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
the unit's failure reason. Captures are kept by omnid.capturestore and shown by
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
daemon never forks; omnid.helperproc), killed through a pidfd at the deadline.

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
from datetime import datetime
from typing import TYPE_CHECKING, Any

import structlog

from omnid import helperproc, linux

if TYPE_CHECKING:
    from omnid.capturestore import CaptureStore

log = structlog.get_logger("omnid.forensics")

DEFAULT_BUDGET_S = 3.0  # the unit key capture_timeout's default
MAX_BUDGET_S = 300.0  # the most capture_timeout may say (omnid.unit(5))
DEFAULT_MAX_BYTES = 1 << 20  # one capture, as stored (JSON)
PY_SPY_ENV = "OMNID_PY_SPY"  # path of py-spy, when it is not next to omnid's Python or on PATH
MAX_PROCESSES = 1024  # processes captured per unit; the rest are counted
MAX_THREADS = 1024  # threads listed per process; the rest are counted
KERNEL_STACK_LINES = 48
SPY_PARALLEL = 4  # py-spy runs at once (each is a process, ~50-100 ms of one core)
READ_WORKERS = 4  # /proc reader threads shared by every capture

_STATES = {"R": "running", "S": "sleeping", "D": "uninterruptible", "Z": "zombie", "T": "stopped",
           "t": "traced", "I": "idle", "X": "dead", "P": "parked", "W": "paging"}
_PYTHON_EXE = re.compile(r"(python|pypy)[0-9.]*[a-z]?")


# --------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class Member:
    """A process of the unit and how it belongs to it ("main", "process group 1234",
    "cgroup", "orphan tagged worker@1"); the start time proves the pid is still it."""

    pid: int
    start_time: int
    why: str


@dataclass(frozen=True)
class ThreadState:
    tid: int
    name: str
    state: str  # one letter, as in /proc/PID/task/TID/stat
    wchan: str  # "" while running
    kernel_stack: tuple[str, ...] = ()  # read for threads in D state only


@dataclass(frozen=True)
class PyThread:
    """One Python thread as py-spy saw it; frames innermost first, "func (file.py:12)"."""

    tid: int
    name: str
    active: bool
    gil: bool
    frames: tuple[str, ...]


@dataclass(frozen=True)
class ProcessDump:
    pid: int
    why: str  # how it belongs to the unit
    comm: str
    state: str  # one letter; "?" when it could not be read
    wchan: str
    cmdline: str
    kernel_stack: tuple[str, ...] = ()
    threads: tuple[ThreadState, ...] = ()
    threads_total: int = 0  # more than len(threads) when the list was cut
    python: tuple[PyThread, ...] | None = None  # None: not Python, or not captured (see notes)
    notes: tuple[str, ...] = ()  # what of this process could not be captured, and why

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "why": self.why, "comm": self.comm, "state": self.state, "wchan": self.wchan,
                "cmdline": self.cmdline, "kernel_stack": list(self.kernel_stack),
                "threads": [[t.tid, t.name, t.state, t.wchan, list(t.kernel_stack)] for t in self.threads],
                "threads_total": self.threads_total,
                "python": None if self.python is None else
                [{"tid": t.tid, "name": t.name, "active": t.active, "gil": t.gil, "frames": list(t.frames)}
                 for t in self.python],
                "notes": list(self.notes)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProcessDump:
        py = d.get("python")
        return cls(pid=int(d["pid"]), why=str(d.get("why", "")), comm=str(d.get("comm", "")),
                   state=str(d.get("state", "?")), wchan=str(d.get("wchan", "")), cmdline=str(d.get("cmdline", "")),
                   kernel_stack=tuple(map(str, d.get("kernel_stack", ()))),
                   threads=tuple(ThreadState(int(t[0]), str(t[1]), str(t[2]), str(t[3]), tuple(map(str, t[4])))
                                 for t in d.get("threads", ())),
                   threads_total=int(d.get("threads_total", 0)),
                   python=None if py is None else tuple(
                       PyThread(int(t["tid"]), str(t["name"]), bool(t["active"]), bool(t["gil"]),
                                tuple(map(str, t["frames"]))) for t in py),
                   notes=tuple(map(str, d.get("notes", ()))))


@dataclass(frozen=True)
class Capture:
    """What one unit's processes were doing at one moment, and what could not be seen."""

    unit: str
    why: str  # what made omnid capture: "watchdog expired", "on demand (omnid dump --now)", ...
    ts: float  # wall clock, start of the capture
    seconds: float  # how long it took (never more than its budget)
    summary: str  # one line for the failure reason and `omnid status`
    dstate: list[str] = field(default_factory=list)  # processes / threads in D state, described
    missing: list[str] = field(default_factory=list)  # what could not be captured, and why
    processes: tuple[ProcessDump, ...] = ()
    truncated: bool = False  # cut to stay under max_bytes (said in `missing`)

    def to_json(self) -> dict[str, Any]:
        return {"unit": self.unit, "why": self.why, "ts": self.ts, "seconds": self.seconds,
                "summary": self.summary, "dstate": list(self.dstate), "missing": list(self.missing),
                "truncated": self.truncated, "processes": [p.to_json() for p in self.processes]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Capture:
        """The inverse of to_json; ValueError/KeyError/TypeError on a malformed document."""
        return cls(unit=str(d["unit"]), why=str(d["why"]), ts=float(d["ts"]), seconds=float(d["seconds"]),
                   summary=str(d["summary"]), dstate=[str(x) for x in d.get("dstate", ())],
                   missing=[str(x) for x in d.get("missing", ())], truncated=bool(d.get("truncated", False)),
                   processes=tuple(ProcessDump.from_json(p) for p in d.get("processes", ())))

    def to_text(self) -> str:
        """The whole capture for people (`omnid dump`)."""
        when = datetime.fromtimestamp(self.ts).strftime("%Y-%m-%d %H:%M:%S")
        out = [f"capture of {self.unit} at {when}: {self.why} (took {self.seconds:.2f} s)",
               f"summary: {self.summary}"]
        out += [f"D state: {d}" for d in self.dstate]
        out += [f"not captured: {m}" for m in self.missing]
        for p in self.processes:
            out.append("")
            out.append(f"pid {p.pid} ({p.comm}) [{p.why}] state {p.state} ({_STATES.get(p.state, '?')})"
                       + (f" in {p.wchan}" if p.wchan else ""))
            if p.cmdline:
                out.append(f"  cmdline: {p.cmdline}")
            out += [f"  note: {n}" for n in p.notes]
            if p.kernel_stack:
                out.append("  kernel stack:")
                out += [f"    {line}" for line in p.kernel_stack]
            if p.threads:
                more = f", {p.threads_total - len(p.threads)} not listed" if p.threads_total > len(p.threads) else ""
                out.append(f"  threads ({p.threads_total}{more}):")
                for t in p.threads:
                    out.append(f"    {t.tid} {t.name} {t.state}" + (f" in {t.wchan}" if t.wchan else ""))
                    out += [f"        {line}" for line in t.kernel_stack]
            if p.python is not None:
                out.append(f"  python threads ({len(p.python)}):")
                for t in p.python:
                    flags = ", ".join(f for f, on in (("active", t.active), ("holds the GIL", t.gil)) if on)
                    out.append(f"    thread {t.tid} \"{t.name}\"" + (f" ({flags})" if flags else " (idle)"))
                    out += [f"      {f}" for f in t.frames]
        return "\n".join(out) + "\n"


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


_readers = _Readers()


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
    cap = _assemble(unit, why, wall, dumps, missing)
    cap = _fit(cap, max_bytes)
    return replace(cap, seconds=round(loop.time() - t0, 4))


def _report(unit: str, pid: int, task: asyncio.Task[None]) -> None:
    """No capture task whose exception nobody sees (a bug here, not a process we cannot read)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("capture of one process failed", unit=unit, pid=pid, error=repr(task.exception()))


def _assemble(unit: str, why: str, wall: float, dumps: list[ProcessDump], missing: list[str]) -> Capture:
    dstate = []
    for d in dumps:
        stuck = [t for t in d.threads if t.state == "D" and t.tid != d.pid]
        if d.state == "D":
            dstate.append(_describe_d(d.pid, d.comm, d.wchan, d.kernel_stack))
        for t in stuck:
            dstate.append(_describe_d(d.pid, d.comm, t.wchan, t.kernel_stack, tid=t.tid))
    return Capture(unit=unit, why=why, ts=wall, seconds=0.0, summary=summarize(dumps, missing), dstate=dstate,
                   missing=missing, processes=tuple(dumps))


def _describe_d(pid: int, comm: str, wchan: str, stack: tuple[str, ...], tid: int | None = None) -> str:
    who = f"pid {pid} ({comm})" + (f" thread {tid}" if tid else "")
    top = " < ".join(line.split("+", 1)[0] for line in stack[:4])
    return f"{who} in uninterruptible sleep (D) in {wchan or '?'}" + (f" [kernel: {top}]" if top else "")


def _where(d: ProcessDump) -> str:
    if d.state == "R":
        return "running"
    if d.state in ("T", "t"):
        return "stopped"
    if d.state == "Z":
        return "zombie"
    return f"in {d.wchan}" if d.wchan else ""


def _python_hint(d: ProcessDump) -> str:
    if not d.python:
        return ""
    busy = [t for t in d.python if t.gil or t.active]
    main = [t for t in d.python if t.name == "MainThread"]
    t = (busy or main or list(d.python))[0]
    where = f" in {t.frames[0]}" if t.frames else ""
    return f" (python: {t.name}{where})"


def summarize(dumps: list[ProcessDump], missing: list[str], show: int = 4) -> str:
    """One line: how many processes, where the first few were (D state first), what is missing."""
    if not dumps:
        text = "no process left to capture"
    else:
        order = sorted(dumps, key=lambda d: (d.state != "D" and not any(t.state == "D" for t in d.threads),
                                             d.why != "main"))
        parts = []
        for d in order[:show]:
            stuck = next((t for t in d.threads if t.state == "D" and t.tid != d.pid), None)
            extra = f", thread {stuck.tid} D in {stuck.wchan or '?'}" if stuck else ""
            parts.append(f"pid {d.pid} {d.state} {_where(d)}".rstrip() + extra + _python_hint(d))
        more = f"; +{len(dumps) - show} more" if len(dumps) > show else ""
        text = f"{len(dumps)} process{'es' if len(dumps) != 1 else ''}: " + "; ".join(parts) + more
    if missing:
        text += f" [not captured: {missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "") + "]"
    return text


def json_size(cap: Capture) -> int:
    return len(json.dumps(cap.to_json(), separators=(",", ":")))


def _shorten(d: ProcessDump, frames: int, threads: int, stack: int, cmd: int) -> ProcessDump:
    py = None if d.python is None else tuple(replace(t, frames=t.frames[:frames]) for t in d.python)
    keep = [t for t in d.threads if t.state == "D"] + [t for t in d.threads if t.state != "D"]
    return replace(d, python=py, threads=tuple(replace(t, kernel_stack=t.kernel_stack[:stack]) for t in keep[:threads]),
                   kernel_stack=d.kernel_stack[:stack], cmdline=d.cmdline[:cmd])


def _fit(cap: Capture, max_bytes: int) -> Capture:
    """Cut a capture to `max_bytes` of JSON: shorter Python stacks and thread lists first,
    then details of all but the D-state and main processes, then whole processes."""
    size = json_size(cap)
    if size <= max_bytes:
        return cap
    levels = [(48, 256, 32, 2048), (16, 64, 16, 512), (4, 16, 8, 160), (1, 4, 4, 80)]
    procs = list(cap.processes)
    for frames, threads, stack, cmd in levels:
        procs = [_shorten(d, frames, threads, stack, cmd) for d in procs]
        trial = replace(cap, processes=tuple(procs))
        if json_size(trial) <= max_bytes:
            return _cut(trial, size, "Python stacks, thread lists and kernel stacks shortened")
    # Keep what matters most: D-state processes and the main process, then the rest bare.
    ranked = sorted(procs, key=lambda d: (d.state != "D" and not any(t.state == "D" for t in d.threads),
                                          d.why != "main"))
    bare = [replace(d, python=None if d.python is None else (), threads=(), kernel_stack=(), notes=d.notes[:2])
            for d in ranked]
    kept: list[ProcessDump] = []
    trial = replace(cap, processes=())
    for d in bare:
        nxt = replace(cap, processes=(*kept, d))
        if json_size(nxt) > max_bytes * 0.9:
            break
        kept.append(d)
        trial = nxt
    dropped = len(procs) - len(kept)
    return _cut(trial, size, "details dropped" + (f", {dropped} processes not shown" if dropped else ""))


def _cut(cap: Capture, size: int, how: str) -> Capture:
    note = f"output over max_bytes ({size} bytes of JSON): {how}"
    return replace(cap, truncated=True, missing=[*cap.missing, note],
                   summary=cap.summary if "[not captured" in cap.summary else cap.summary + f" [{how}]")


# --------------------------------------------------------------------------- a unit's members


def member_list(main_pid: int, main_start: int, others: Iterable[Any]) -> list[Member]:
    """Members from a unit's main process and anything with .pid, .start_time and .why
    (process.Survivor, as Target.members() returns them): what the kill path has at hand."""
    out = [Member(main_pid, main_start, "main")]
    out += [Member(s.pid, s.start_time, s.why) for s in others if s.pid != main_pid]
    return out


def _members_now(sup: Any, name: str) -> list[Member]:
    """The live processes of a running unit: main, cgroup, process group, tagged orphans."""
    from omnid.process import find_residue

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


MAX_LAST = 100


async def handle_dump(sup: Any, store: CaptureStore, args: dict[str, Any]) -> dict[str, Any]:
    """The `dump` control command: {"unit": U, "last": N, "now": bool} -> {"captures": [...]},
    each {"unit", "text", "capture"} (the JSON form), oldest first per unit."""
    from omnid.control import ControlError

    unit = args.get("unit")
    if not isinstance(unit, str) or not unit:
        raise ControlError("bad_request", "dump needs \"unit\": a unit name")
    last = args.get("last", 1)
    if isinstance(last, bool) or not isinstance(last, int) or not 1 <= last <= MAX_LAST:
        raise ControlError("bad_request", f"\"last\" must be a whole number from 1 to {MAX_LAST}, got {str(last)[:40]!r}")
    now = args.get("now", False)
    if not isinstance(now, bool):
        raise ControlError("bad_request", f"\"now\" must be true or false, got {str(now)[:40]!r}")
    try:
        names = sup.expand([unit], whole_groups=False)
    except KeyError:
        raise ControlError("unknown_unit", f"no unit named {unit[:100]!r}; units: "
                                           f"{', '.join(list(sup.units)[:20])}") from None
    if now:
        running = [n for n in names if sup.units[n].proc is not None]
        if not running:
            raise ControlError("not_running", f"unit {unit!r} has no running process to capture "
                                              f"(`omnid dump {unit}` shows the captures omnid kept)")
        caps = await asyncio.gather(*(capture_unit(sup, n, "on demand (omnid dump --now)",
                                                   budget_s=sup.units[n].spec.capture_timeout or DEFAULT_BUDGET_S)
                                      for n in running))
        for c in caps:
            if c is not None:
                await store.save_async(c)
    out = []
    for n in names:
        for c in await asyncio.to_thread(store.latest, n, last):
            out.append({"unit": n, "text": c.to_text(), "capture": c.to_json()})
    return {"captures": out}


def add_last_capture(units: list[dict[str, Any]], store: CaptureStore) -> None:
    """Put each unit's last capture ({"ts", "why", "summary"}) into its status object."""
    for u in units:
        last = store.last_summary(u["name"])
        if last is not None:
            u["last_capture"] = last
