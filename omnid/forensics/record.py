"""The record of a hang capture (omnid.forensics): what each process of a unit was doing,
what could not be captured, the one-line summary for the failure reason, the text of
`omnid dump`, the JSON kept on disk, and the cut to a size bound. No I/O here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

_STATES = {"R": "running", "S": "sleeping", "D": "uninterruptible", "Z": "zombie", "T": "stopped",
           "t": "traced", "I": "idle", "X": "dead", "P": "parked", "W": "paging"}


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


def assemble(unit: str, why: str, wall: float, dumps: list[ProcessDump], missing: list[str]) -> Capture:
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


def fit(cap: Capture, max_bytes: int) -> Capture:
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
