"""The FAKE GPU backend, for tests on machines without a GPU (it says so in its
name and `kind`): driven in memory or from the JSON file named by OMNID_FAKE_GPU."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnid.gpu.backend import GpuInfo, GpuProcess, _say_once

FAKE_GPU_ENV = "OMNID_FAKE_GPU"


class FakeGpuBackend:
    """A fake GPU backend for tests without a GPU (never used unless asked for).

    In memory, or backed by a JSON file that is re-read on every call:

        {"gpus": [{"index": 0, "name": "fake GPU 0", "total_mib": 81920,
                   "free_mib": 1024}],                # free_mib, used_mib optional
         "processes": [{"pid": 4242, "gpu": 0, "used_mib": 2048}],
         "available": true, "reason": "", "pids_local": true}   # all optional

    A GPU's `used_mib` defaults to the sum of its processes and `free_mib` to
    total - used, so setting process memory is enough for most tests; setting
    `free_mib` directly simulates memory taken by someone omnid does not know.
    A missing or invalid file makes the backend unavailable with a reason naming the
    file. Replace the file atomically (`write_fake_gpu_file`) so no reader sees half
    of it; the setters below do that when the backend has a file.
    """

    kind = "fake"

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._doc: dict[str, Any] = {"gpus": [], "processes": []}

    # ---- reading

    def _state(self) -> _FakeState:
        if self.path is None:
            return _parse_fake(self._doc, "fake GPU state")
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError) as err:
            return _FakeState.unavailable(f"fake GPU: cannot read {self.path}: {err}")
        return _parse_fake(doc, str(self.path))

    @property
    def available(self) -> bool:
        return self._state().available

    @property
    def reason(self) -> str:
        return self._state().reason

    @property
    def pids_local(self) -> bool:
        return self._state().pids_local

    def gpus(self) -> list[GpuInfo]:
        state = self._state()
        return state.gpus if state.available else []

    def processes(self) -> list[GpuProcess]:
        state = self._state()
        return state.processes if state.available else []

    # ---- setting (in memory, or load-modify-replace of the file)

    def set_gpu(self, index: int, total_mib: float = 81920.0, *, name: str | None = None,
                free_mib: float | None = None) -> None:
        """Add or replace GPU `index`; `free_mib=None` derives free memory from processes."""
        entry: dict[str, Any] = {"index": index, "name": name or f"fake GPU {index}",
                                 "total_mib": total_mib}
        if free_mib is not None:
            entry["free_mib"] = free_mib

        def change(doc: dict[str, Any]) -> None:
            doc["gpus"] = [g for g in doc.get("gpus", []) if g.get("index") != index] + [entry]
        self._update(change)

    def set_process(self, pid: int, used_mib: float, gpu: int = 0) -> None:
        """Make `pid` hold `used_mib` on `gpu` (replacing what it held there)."""
        def change(doc: dict[str, Any]) -> None:
            doc["processes"] = [p for p in doc.get("processes", [])
                                if (p.get("pid"), p.get("gpu")) != (pid, gpu)]
            doc["processes"].append({"pid": pid, "gpu": gpu, "used_mib": used_mib})
        self._update(change)

    def release(self, pid: int, gpu: int | None = None) -> None:
        """`pid` frees its memory on `gpu`, or on every GPU when `gpu` is None."""
        def change(doc: dict[str, Any]) -> None:
            doc["processes"] = [p for p in doc.get("processes", [])
                                if p.get("pid") != pid or (gpu is not None and p.get("gpu") != gpu)]
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

    @classmethod
    def unavailable(cls, reason: str) -> _FakeState:
        _say_once(f"fake-{reason}", "gpu: fake GPU backend unavailable", reason=reason)
        return cls(False, reason, True, [], [])


def _parse_fake(doc: Any, source: str) -> _FakeState:
    def bad(where: str, expected: str) -> _FakeState:
        return _FakeState.unavailable(f"fake GPU: {source}: {where}: expected {expected}")

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not isinstance(doc, dict):
        return bad("top level", "a JSON object")
    processes = []
    for i, p in enumerate(doc.get("processes", [])):
        if not (isinstance(p, dict) and isinstance(p.get("pid"), int)
                and isinstance(p.get("gpu", 0), int) and number(p.get("used_mib"))):
            return bad(f"processes[{i}]",
                       '{"pid": int, "gpu": int (default 0), "used_mib": number}')
        processes.append(GpuProcess(pid=p["pid"], gpu=p.get("gpu", 0),
                                    used_mib=float(p["used_mib"])))
    gpus = []
    for i, g in enumerate(doc.get("gpus", [])):
        if not (isinstance(g, dict) and isinstance(g.get("index"), int)
                and number(g.get("total_mib"))
                and all(number(g[k]) for k in ("free_mib", "used_mib") if k in g)):
            return bad(f"gpus[{i}]", '{"index": int, "total_mib": number, "name": str, '
                       '"free_mib": number, "used_mib": number} (last three optional)')
        total = float(g["total_mib"])
        if "used_mib" in g:
            used = float(g["used_mib"])
        elif "free_mib" in g:
            used = total - float(g["free_mib"])
        else:
            used = sum(p.used_mib for p in processes if p.gpu == g["index"])
        free = float(g["free_mib"]) if "free_mib" in g else max(total - used, 0.0)
        gpus.append(GpuInfo(index=g["index"], name=str(g.get("name", f"fake GPU {g['index']}")),
                            total_mib=total, free_mib=free, used_mib=used))
    if doc.get("available", True) is not True:
        reason = doc.get("reason") or f"no GPU: fake GPU marked unavailable in {source}"
        return _FakeState(False, str(reason), bool(doc.get("pids_local", True)), [], [])
    return _FakeState(True, "", bool(doc.get("pids_local", True)),
                      sorted(gpus, key=lambda g: g.index), processes)
