"""DEVELOPER OPTION: the FAKE GPU backend, for omnid's own tests on machines without a GPU.

Never imported by a production daemon: omnid.gpu.open_backend loads it only when the
daemon's environment names a fake GPU file in OMNID_DEVELOPER_FAKE_GPU (omnid(8)
ENVIRONMENT), refuses it in a systemd service and for a file another user could write,
and then says so at every start, in `omnid status` and in /health (its `kind` is
"fake"). Tests build it directly as well (`FakeGpuBackend()` in memory, or on a file).

It answers like the NVML backend, through the same bounded worker thread
(omnid.gpu.bounded), the same Xid event thread and the same conditions
(omnid.gpu.faults), so the tests of a stuck NVML call, of Xid events, of MIG devices and
of memory health exercise the code that runs with a real GPU.

The file format (the FakeGpuBackend docstring) is this module's public API: tests write
it with `write_fake_gpu_file` or the backend's setters; the demo worker reads it through
`FakeGpuBackend(path).gpus()` to pretend to own GPU memory."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnid.gpu.backend import GpuInfo, GpuProcess, MigInfo, say_once
from omnid.gpu.bounded import BoundedCaller
from omnid.gpu.events import XidEvent, XidEventThread
from omnid.gpu.faults import GpuCondition, GpuFaults, read_conditions, remap_condition, stuck_threads
from omnid.gpu.items import GpuItem, is_mig
from omnid.gpu.nvml import nvml_timeout

HANG_POLL_S = 0.02


class FakeGpuBackend:
    """A fake GPU backend for tests without a GPU (a developer option: never used unless asked for).

    In memory, or backed by a JSON file that is re-read on every call:

        {"gpus": [{"index": 0, "name": "fake GPU 0", "total_mib": 81920,
                   "free_mib": 1024,                   # free_mib, used_mib optional
                   "uuid": "GPU-...",                  # optional
                   "migs": [{"uuid": "MIG-...", "total_mib": 10240, "gi": 1, "ci": 0}],
                   "remapped_rows": {"correctable": 0, "uncorrectable": 1,
                                     "pending": true, "failure": false}}],
         "processes": [{"pid": 4242, "gpu": 0, "used_mib": 2048},
                       {"pid": 4243, "mig": "MIG-...", "used_mib": 512}],
         "xid_events": [{"gpu": 0, "xid": 79}, {"gpu": "MIG-...", "xid": 48}],
         "hang": false,             # true: every call never returns; [1]: calls on GPU 1
         "hang_events": false,      # true: the Xid event wait never returns
         "available": true, "reason": "", "pids_local": true}   # all optional

    A GPU's `used_mib` defaults to the sum of its processes (its MIG devices' too) and
    `free_mib` to total - used, so setting process memory is enough for most tests;
    setting `free_mib` directly simulates memory taken by someone omnid does not know.
    Xid events are delivered once each, in order. A "hung" call blocks its worker thread
    until the switch is turned off (then returns): meanwhile the backend is unreadable,
    exactly as with a driver whose NVML call does not return.
    A missing or invalid file makes the backend unavailable with a reason naming the
    file. Replace the file atomically (`write_fake_gpu_file`) so no reader sees half
    of it; the setters below do that when the backend has a file.
    """

    kind = "fake"

    def __init__(self, path: str | os.PathLike[str] | None = None, timeout: float | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._doc: dict[str, Any] = {"gpus": [], "processes": []}
        self._doc_lock = threading.Lock()
        self.faults = GpuFaults()
        self._calls = BoundedCaller("fake", timeout if timeout is not None else nvml_timeout())
        self._events: XidEventThread | None = None
        self._delivered = 0

    # ---- reading the description (not an "NVML call": never hangs)

    def _state(self) -> _FakeState:
        if self.path is None:
            with self._doc_lock:
                return _parse_fake(json.loads(json.dumps(self._doc)), "fake GPU state")
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            return _FakeState.unavailable(f"fake GPU: cannot read {self.path}: {exc}")
        return _parse_fake(doc, str(self.path))

    @property
    def available(self) -> bool:
        return self._state().available and self._calls.stuck() is None

    @property
    def reason(self) -> str:
        stuck = self._calls.stuck()
        return f"GPU reads stuck: {stuck.reason()}" if stuck else self._state().reason

    @property
    def pids_local(self) -> bool:
        return self._state().pids_local

    @property
    def stuck_threads(self) -> int:
        return stuck_threads(self._calls, self._events)

    def conditions(self) -> list[GpuCondition]:
        return read_conditions(self.faults, self._calls, self._events)

    def parent_of(self, item: GpuItem) -> int | None:
        if isinstance(item, int):
            return item
        return self._state().parents.get(item)

    # ---- "NVML calls": on the bounded worker thread, each GPU's one announced

    def _touch(self, call: str, gpu: int | None) -> None:
        """One fake NVML call: announced, then blocked while its hang switch is on."""
        self._calls.note(call, gpu)
        while self._state().hangs(gpu):
            time.sleep(HANG_POLL_S)

    def gpus(self) -> list[GpuInfo]:
        if not self._state().available:
            return []
        return self._calls.run(self._gpus_job)

    def _gpus_job(self) -> list[GpuInfo]:
        state = self._state()
        for g in state.gpus:
            self._touch("nvmlDeviceGetMemoryInfo", g.index)
        return state.gpus if state.available else []

    def processes(self, items: Iterable[GpuItem] | None = None) -> list[GpuProcess]:
        if not self._state().available:
            return []
        return self._calls.run(self._processes_job, None if items is None else list(items))

    def _processes_job(self, items: list[GpuItem] | None) -> list[GpuProcess]:
        state = self._state()
        wanted = None if not items else {i for i in (it if isinstance(it, int) else state.parents.get(it)
                                                     for it in items) if i is not None}
        for g in state.gpus:
            if wanted is None or g.index in wanted:
                self._touch("nvmlDeviceGetComputeRunningProcesses", g.index)
        if not state.available:
            return []
        return [p for p in state.processes if wanted is None or p.gpu in wanted]

    def memory_health(self) -> dict[int, tuple[str, str]]:
        if not self._state().available:
            return {}
        return self._calls.run(self._memory_job)

    def _memory_job(self) -> dict[int, tuple[str, str]]:
        state = self._state()
        out = {}
        for g in state.gpus:
            self._touch("nvmlDeviceGetRemappedRows", g.index)
            rows = state.remapped.get(g.index)
            found = remap_condition(*rows) if rows else None
            if found:
                out[g.index] = found
        return out

    # ---- Xid events

    def start_xid_events(self, deliver: Callable[[XidEvent], None]) -> str | None:
        state = self._state()
        if not state.available:
            return state.reason
        if self._events is None:
            self._events = XidEventThread("fake", self._wait_event, deliver, self._calls.timeout, wait_ms=200)
            self._events.start()
        else:
            self._events.attach(deliver)
        return None

    def _wait_event(self, timeout_ms: int) -> XidEvent | None:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            state = self._state()
            if not state.hang_events:
                if len(state.xid_events) < self._delivered:
                    self._delivered = len(state.xid_events)  # the file was rewritten with fewer
                if len(state.xid_events) > self._delivered:
                    gpu, xid = state.xid_events[self._delivered]
                    self._delivered += 1
                    return XidEvent(gpu, xid, time.time())
                if time.monotonic() >= deadline:
                    return None
            time.sleep(HANG_POLL_S)  # a hung wait ignores its timeout: it never returns

    def stop_xid_events(self, wait_s: float | None = None) -> None:
        """Detach the watch (events are kept for the next one); with `wait_s`, end the
        event thread too (close)."""
        if self._events is None:
            return
        self._events.detach()
        if wait_s is not None and self._events.stop(wait_s):
            self._events = None

    def close(self) -> None:
        self.stop_xid_events(wait_s=2.0)

    # ---- setting (in memory, or load-modify-replace of the file)

    def set_gpu(self, index: int, total_mib: float = 81920.0, *, name: str | None = None,
                free_mib: float | None = None, uuid: str | None = None) -> None:
        """Add or replace GPU `index`; `free_mib=None` derives free memory from processes."""
        entry: dict[str, Any] = {"index": index, "name": name or f"fake GPU {index}", "total_mib": total_mib}
        if free_mib is not None:
            entry["free_mib"] = free_mib
        if uuid is not None:
            entry["uuid"] = uuid

        def change(doc: dict[str, Any]) -> None:
            doc["gpus"] = [g for g in doc.get("gpus", []) if g.get("index") != index] + [entry]
        self._update(change)

    def add_mig(self, gpu: int, uuid: str, total_mib: float = 10240.0, gi: int = 1, ci: int = 0) -> None:
        """Put GPU `gpu` in MIG mode (if it was not) with one more MIG device."""
        def change(doc: dict[str, Any]) -> None:
            for g in doc.get("gpus", []):
                if g.get("index") == gpu:
                    g["migs"] = [m for m in g.get("migs", []) if m.get("uuid") != uuid] + [
                        {"uuid": uuid, "total_mib": total_mib, "gi": gi, "ci": ci}]
        self._update(change)

    def set_process(self, pid: int, used_mib: float, gpu: int = 0, mig: str | None = None) -> None:
        """Make `pid` hold `used_mib` on `gpu` (or on MIG device `mig`), replacing what it held there."""
        def change(doc: dict[str, Any]) -> None:
            doc["processes"] = [p for p in doc.get("processes", [])
                                if (p.get("pid"), p.get("mig")) != (pid, mig)
                                or (mig is None and p.get("gpu", 0) != gpu)]
            entry: dict[str, Any] = {"pid": pid, "gpu": gpu, "used_mib": used_mib}
            if mig is not None:
                entry = {"pid": pid, "mig": mig, "used_mib": used_mib}  # on the MIG device's GPU
            doc["processes"].append(entry)
        self._update(change)

    def release(self, pid: int, gpu: int | None = None) -> None:
        """`pid` frees its memory on `gpu`, or on every GPU when `gpu` is None."""
        def change(doc: dict[str, Any]) -> None:
            doc["processes"] = [p for p in doc.get("processes", [])
                                if p.get("pid") != pid or (gpu is not None and p.get("gpu") != gpu)]
        self._update(change)

    def inject_xid(self, gpu: GpuItem, xid: int) -> None:
        """A critical Xid on GPU `gpu` (an index, a GPU UUID or a MIG device UUID)."""
        def change(doc: dict[str, Any]) -> None:
            doc.setdefault("xid_events", []).append({"gpu": gpu, "xid": xid})
        self._update(change)

    def set_hang(self, hang: bool | list[int]) -> None:
        """True: every fake NVML call never returns; [1]: calls on GPU 1; False: they return."""
        def change(doc: dict[str, Any]) -> None:
            doc["hang"] = hang
        self._update(change)

    def set_hang_events(self, hang: bool) -> None:
        def change(doc: dict[str, Any]) -> None:
            doc["hang_events"] = hang
        self._update(change)

    def set_remapped_rows(self, gpu: int, correctable: int = 0, uncorrectable: int = 0, pending: bool = False,
                          failure: bool = False) -> None:
        def change(doc: dict[str, Any]) -> None:
            for g in doc.get("gpus", []):
                if g.get("index") == gpu:
                    g["remapped_rows"] = {"correctable": correctable, "uncorrectable": uncorrectable,
                                          "pending": pending, "failure": failure}
        self._update(change)

    def set_unavailable(self, reason: str = "no GPU: fake NVML failure") -> None:
        def change(doc: dict[str, Any]) -> None:
            doc["available"] = False
            doc["reason"] = reason
        self._update(change)

    def set_available(self) -> None:
        def change(doc: dict[str, Any]) -> None:
            doc["available"] = True
            doc.pop("reason", None)
        self._update(change)

    def set_pids_local(self, local: bool) -> None:
        def change(doc: dict[str, Any]) -> None:
            doc["pids_local"] = local
        self._update(change)

    def _update(self, change: Callable[[dict[str, Any]], None]) -> None:
        if self.path is None:
            with self._doc_lock:
                change(self._doc)
            return
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            doc = {"gpus": [], "processes": []}
        change(doc)
        write_fake_gpu_file(self.path, doc)


def write_fake_gpu_file(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Write a fake GPU file so that a concurrent reader sees the old or the new one."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(doc, out)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


@dataclass(frozen=True)
class _FakeState:
    available: bool
    reason: str
    pids_local: bool
    gpus: list[GpuInfo]
    processes: list[GpuProcess]
    parents: dict[str, int] = field(default_factory=dict)  # GPU or MIG UUID -> GPU index
    xid_events: list[tuple[GpuItem, int]] = field(default_factory=list)
    hang: bool | frozenset[int] = False
    hang_events: bool = False
    remapped: dict[int, tuple[int, int, bool, bool]] = field(default_factory=dict)

    def hangs(self, gpu: int | None) -> bool:
        if isinstance(self.hang, bool):
            return self.hang
        return gpu in self.hang

    @classmethod
    def unavailable(cls, reason: str) -> _FakeState:
        say_once(f"fake-{reason}", "gpu: fake GPU backend unavailable", reason=reason)
        return cls(False, reason, True, [], [])


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_fake(doc: Any, source: str) -> _FakeState:
    def bad(where: str, expected: str) -> _FakeState:
        return _FakeState.unavailable(f"fake GPU: {source}: {where}: expected {expected}")

    if not isinstance(doc, dict):
        return bad("top level", "a JSON object")
    parents: dict[str, int] = {}
    mig_specs: dict[int, list[dict[str, Any]]] = {}
    for i, g in enumerate(doc.get("gpus", [])):
        if not (isinstance(g, dict) and isinstance(g.get("index"), int) and _number(g.get("total_mib"))
                and all(_number(g[k]) for k in ("free_mib", "used_mib") if k in g)
                and isinstance(g.get("uuid", ""), str) and isinstance(g.get("migs", []), list)):
            return bad(f"gpus[{i}]", '{"index": int, "total_mib": number, "name": str, "free_mib": number, '
                       '"used_mib": number, "uuid": str, "migs": [...]} (all but the first two optional)')
        if g.get("uuid"):
            parents[g["uuid"]] = g["index"]
        for j, m in enumerate(g.get("migs", [])):
            if not (isinstance(m, dict) and isinstance(m.get("uuid"), str) and is_mig(m["uuid"])
                    and _number(m.get("total_mib"))):
                return bad(f"gpus[{i}].migs[{j}]", '{"uuid": "MIG-...", "total_mib": number, "gi": int, "ci": int}')
            parents[m["uuid"]] = g["index"]
        mig_specs[g["index"]] = g.get("migs", [])
    processes = []
    for i, p in enumerate(doc.get("processes", [])):
        mig = p.get("mig") if isinstance(p, dict) else None
        # A process on a MIG device is on that device's GPU, whatever "gpu" says.
        gpu = (parents.get(mig) if isinstance(mig, str) else p.get("gpu", 0)) if isinstance(p, dict) else None
        if not (isinstance(p, dict) and isinstance(p.get("pid"), int) and isinstance(gpu, int)
                and _number(p.get("used_mib")) and (mig is None or (isinstance(mig, str) and mig in parents))):
            return bad(f"processes[{i}]", '{"pid": int, "gpu": int (default 0), "used_mib": number, '
                       '"mig": a MIG UUID of one of the gpus (optional)}')
        processes.append(GpuProcess(pid=p["pid"], gpu=gpu, used_mib=float(p["used_mib"]), mig=mig or ""))
    uuids = {idx: u for u, idx in parents.items() if not is_mig(u)}
    processes = [GpuProcess(p.pid, p.gpu, p.used_mib, p.mig, uuids.get(p.gpu, "")) for p in processes]
    gpus = []
    remapped: dict[int, tuple[int, int, bool, bool]] = {}
    for g in doc.get("gpus", []):
        total = float(g["total_mib"])
        if "used_mib" in g:
            used = float(g["used_mib"])
        elif "free_mib" in g:
            used = total - float(g["free_mib"])
        else:
            used = sum(p.used_mib for p in processes if p.gpu == g["index"])
        free = float(g["free_mib"]) if "free_mib" in g else max(total - used, 0.0)
        migs = []
        for j, m in enumerate(mig_specs.get(g["index"], [])):
            m_used = sum(p.used_mib for p in processes if p.mig == m["uuid"])
            migs.append(MigInfo(uuid=m["uuid"], gpu=g["index"], index=j, total_mib=float(m["total_mib"]),
                                free_mib=max(float(m["total_mib"]) - m_used, 0.0), used_mib=m_used,
                                gpu_instance=int(m.get("gi", -1)), compute_instance=int(m.get("ci", -1))))
        gpus.append(GpuInfo(index=g["index"], name=str(g.get("name", f"fake GPU {g['index']}")),
                            total_mib=total, free_mib=free, used_mib=used, uuid=str(g.get("uuid", "")),
                            migs=tuple(migs)))
        rows = g.get("remapped_rows")
        if isinstance(rows, dict):
            remapped[g["index"]] = (int(rows.get("correctable", 0)), int(rows.get("uncorrectable", 0)),
                                    bool(rows.get("pending")), bool(rows.get("failure")))
    events = []
    for i, e in enumerate(doc.get("xid_events", [])):
        target = e.get("gpu") if isinstance(e, dict) else None
        if not (isinstance(e, dict) and isinstance(e.get("xid"), int) and isinstance(target, (int, str))
                and not isinstance(target, bool)):
            return bad(f"xid_events[{i}]", '{"gpu": index or UUID, "xid": int}')
        if isinstance(target, str) and not is_mig(target):
            target = parents.get(target, target)  # a GPU UUID: the event names the GPU's index
        events.append((target, e["xid"]))
    hang = doc.get("hang", False)
    if not (isinstance(hang, bool) or (isinstance(hang, list) and all(isinstance(x, int) for x in hang))):
        return bad("hang", "true, false or a list of GPU indexes")
    hang_set: bool | frozenset[int] = hang if isinstance(hang, bool) else frozenset(hang)
    extra = dict(parents=parents, xid_events=events, hang=hang_set, hang_events=doc.get("hang_events") is True,
                 remapped=remapped)
    if doc.get("available", True) is not True:
        reason = doc.get("reason") or f"no GPU: fake GPU marked unavailable in {source}"
        return _FakeState(False, str(reason), bool(doc.get("pids_local", True)), [], [], **extra)
    return _FakeState(True, "", bool(doc.get("pids_local", True)), sorted(gpus, key=lambda g: g.index), processes,
                      **extra)


__all__ = ["FakeGpuBackend", "write_fake_gpu_file"]
