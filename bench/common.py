"""Shared machinery for the benchmark: deadline, process janitor, stamps, stats.

Cleanup rule: the harness makes itself a child subreaper, so every process it
starts, and every orphan of those (double-forked grandchildren, children of a
SIGKILLed supervisor), stays its descendant. Cleanup kills descendants by pid
(psutil checks the pid was not reused) and process groups it created; it never
looks processes up by name.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import platform
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable

import psutil

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
MS = 1_000_000  # ns per ms


def now_ns() -> int:
    """CLOCK_MONOTONIC, the clock the child stamps with."""
    return time.monotonic_ns()


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class DeadlineExceeded(Exception):
    pass


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def check(self) -> None:
        if self.left() <= 0:
            raise DeadlineExceeded("global deadline reached")

    def cap(self, seconds: float) -> float:
        """`seconds`, or what is left of the deadline if that is less."""
        return max(0.0, min(seconds, self.left()))


class Budget:
    """A time cap for one part of the run (a scenario for one supervisor)."""

    def __init__(self, seconds: float, deadline: Deadline):
        self.end = time.monotonic() + deadline.cap(seconds)

    def left(self) -> float:
        return self.end - time.monotonic()


# ---------------------------------------------------------------- processes

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except Exception:
        return False


def proc_state(pid: int) -> str | None:
    """Kernel state letter from /proc/PID/stat, None when the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # comm may contain spaces and parens: the state follows the LAST ')'
    return data[data.rindex(b")") + 2:][:1].decode()


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    st = proc_state(pid)
    return st is not None and st not in ("Z", "X")


def cmdline_has(pid: int, token: str) -> bool:
    """True when one of the process's arguments is exactly `token`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return token.encode() in f.read().split(b"\0")
    except OSError:
        return False


def read_environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


class Janitor:
    """Owns every process the harness starts; kills them by pid / pgid."""

    def __init__(self):
        self.popens: list[subprocess.Popen] = []
        self.lock = threading.Lock()
        self.me = psutil.Process()

    def spawn(self, argv: list[str], **kw) -> subprocess.Popen:
        """Popen in a new session (its own process group), registered for cleanup."""
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(argv, **kw)
        with self.lock:
            self.popens.append(p)
        return p

    def _popen_pids(self) -> set[int]:
        return {p.pid for p in self.popens if p.returncode is None}

    def reap(self) -> None:
        """Reap zombies among our direct children (orphans re-parented to us)."""
        for p in list(self.popens):
            p.poll()
        mine = self._popen_pids()
        try:
            kids = self.me.children()
        except psutil.Error:
            return
        for k in kids:
            if k.pid in mine:
                continue
            try:
                os.waitpid(k.pid, os.WNOHANG)
            except ChildProcessError:
                pass
            except OSError:
                pass

    def descendants_alive(self) -> list[psutil.Process]:
        out = []
        try:
            kids = self.me.children(recursive=True)
        except psutil.Error:
            return out
        for k in kids:
            try:
                if k.status() != psutil.STATUS_ZOMBIE:
                    out.append(k)
            except psutil.Error:
                pass
        return out

    def sweep(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL every live descendant (by pid) and the process groups we
        created; reap; repeat until nothing is left or `timeout`. Returns the
        pids that could not be killed (e.g. stuck in D state)."""
        end = time.monotonic() + timeout
        for p in self.popens:
            if p.returncode is None and p.poll() is None:
                # unreaped, so its pid (= its pgid) cannot have been reused
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        left: list[psutil.Process] = []
        while True:
            left = self.descendants_alive()
            for proc in left:
                try:
                    proc.kill()  # psutil refuses if the pid was reused
                except psutil.Error:
                    pass
            time.sleep(0.02)
            self.reap()
            left = self.descendants_alive()
            if not left or time.monotonic() > end:
                break
        for p in list(self.popens):
            if p.returncode is None:
                try:
                    p.wait(timeout=max(0.05, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        with self.lock:
            self.popens = [p for p in self.popens if p.returncode is None]
        return [p.pid for p in left]


# ---------------------------------------------------------------- stamps

class Stamps:
    """Reads the child's stamp files: NAME = KIND.PID.NS (see child.c)."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def read(self) -> dict[str, dict[int, list[int]]]:
        out: dict[str, dict[int, list[int]]] = {"s": {}, "t": {}, "g": {}}
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return out
        for name in names:
            parts = name.split(".")
            if len(parts) != 3 or parts[0] not in out:
                continue
            try:
                pid, ns = int(parts[1]), int(parts[2])
            except ValueError:
                continue
            out[parts[0]].setdefault(pid, []).append(ns)
        for kind in out.values():
            for v in kind.values():
                v.sort()
        return out

    def starts(self) -> dict[int, int]:
        return {pid: v[0] for pid, v in self.read()["s"].items()}

    def wait_starts(self, n: int, timeout: float, poll: float = 0.01,
                    after_ns: int = 0) -> dict[int, int] | None:
        """Wait until >= n children started after `after_ns`; None on timeout."""
        end = time.monotonic() + timeout
        while True:
            st = {p: t for p, t in self.starts().items() if t >= after_ns}
            if len(st) >= n:
                return st
            if time.monotonic() > end:
                return None
            time.sleep(poll)


def cpu_ns(pid: int) -> int:
    """CPU time of a process, all its threads, in ns (/proc/PID/task/*/schedstat,
    nanosecond resolution, unlike the 10 ms ticks of /proc/PID/stat)."""
    tot = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                tot += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return tot


def open_pidfds(pids: Iterable[int]) -> dict[int, int]:
    """pid -> pidfd (pids already gone are left out)."""
    out = {}
    for pid in pids:
        try:
            out[pid] = os.pidfd_open(pid)
        except OSError:
            pass
    return out


def wait_pidfds(fds: dict[int, int], timeout: float) -> dict[int, int]:
    """Wait until each process exits (its pidfd turns readable: it is a zombie
    or reaped). Returns pid -> monotonic ns when seen gone; closes the fds.
    Processes still alive at timeout are missing from the result."""
    gone: dict[int, int] = {}
    poller = select.poll()
    by_fd = {fd: pid for pid, fd in fds.items()}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    end = time.monotonic() + timeout
    try:
        while len(gone) < len(by_fd):
            left_ms = int((end - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            events = poller.poll(min(left_ms, 200))
            t = now_ns()
            for fd, _ev in events:
                gone[by_fd[fd]] = t
                poller.unregister(fd)
    finally:
        for fd in by_fd:
            try:
                os.close(fd)
            except OSError:
                pass
    return gone


# ---------------------------------------------------------------- stats

def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(xs: list[float], target: int | None = None) -> dict:
    d = {
        "n": len(xs),
        "median": percentile(xs, 50),
        "p95": percentile(xs, 95),
        "p99": percentile(xs, 99),
        "min": min(xs) if xs else None,
        "max": max(xs) if xs else None,
        "samples": [round(x, 3) for x in xs],
    }
    if target is not None:
        d["target"] = target
    return d


# ---------------------------------------------------------------- misc

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_info() -> dict:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "mem_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "hostname": platform.node(),
    }


def build_child(kind: str, outdir: Path) -> tuple[list[str], str]:
    """Return (argv prefix for the child, description). kind: auto|c|python."""
    if kind in ("auto", "c") and shutil.which("gcc"):
        exe = outdir / "child"
        for flags in (["-static"], []):
            r = subprocess.run(["gcc", "-O2", *flags, "-o", str(exe), str(BENCH_DIR / "child.c")],
                               capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                return [str(exe)], "c-static" if flags else "c-dynamic"
        if kind == "c":
            raise RuntimeError(f"gcc failed: {r.stderr}")
    elif kind == "c":
        raise RuntimeError("--child c: gcc not found")
    return [sys.executable, "-S", str(BENCH_DIR / "child.py")], "python"


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False))
    tmp.replace(path)
