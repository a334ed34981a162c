"""Drive a real `omnid daemon` process from tests: start it, talk to its control
socket and health API, wait for conditions with deadlines, and always reap it."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import zmq

from omnid.base import linux, testswitch

REPO = Path(__file__).resolve().parent.parent

# omnid's test switches (omnid.base.testswitch) are obeyed only in its own test suite: this is
# it, for this process and every daemon it starts. The suite's daemons are tests wherever the
# suite runs, a CI job in a Kubernetes pod or a Slurm allocation included.
os.environ[testswitch.OPT_IN_ENV] = "1"
for _name in ("KUBERNETES_SERVICE_HOST", "SLURM_JOB_ID"):
    os.environ.pop(_name, None)

# Every /tmp/omst-* and /tmp/omd-* directory this process made, removed at exit even
# when a test failed before its own cleanup (a stack directory has no owner to close it).
_TEMP_DIRS: list[Path] = []


def skip_module_without(module: str, reason: str) -> None:
    """Skip the calling test module when `module` is not installed, without importing it: the
    tests that need torch run it in their units, never in pytest, and an import of torch costs
    each xdist worker's collection ~2 s of CPU (pytest.importorskip imports)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{reason} ({module} is not installed)", allow_module_level=True)


def run_delay_s() -> float:
    """The calling thread's time spent runnable but waiting for a CPU (schedstat's second
    field): what a bound on a wall-clock wait leaves out on a loaded host, where the waiting
    test itself, not the daemon it watches, can be the one kept off the CPU."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def temp_dir(prefix: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    _TEMP_DIRS.append(d)
    return d


@atexit.register
def remove_temp_dirs() -> None:
    while _TEMP_DIRS:
        shutil.rmtree(_TEMP_DIRS.pop(), ignore_errors=True)


def repo_pythonpath() -> str:
    """PYTHONPATH with this repository first and what the environment already had after it
    (where the dependencies live on a machine without a venv)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def cgroup2_for_tests() -> tuple[str | None, str]:
    """(a cgroup v2 mount where the tests can make cgroups, "") or (None, what is missing):
    root, a cgroup2 mount, and that mount and its cgroup.procs writable. The one condition
    every cgroup test skips on, so that they agree on a host."""
    from omnid.process.cgroupfs import cgroup2_mounts

    if os.geteuid() != 0:
        return None, "needs root to create cgroups"
    mounts = cgroup2_mounts()
    if not mounts:
        return None, "no cgroup v2 mount (/proc/self/mountinfo lists none)"
    for m in mounts:
        if os.access(m, os.W_OK) and os.access(os.path.join(m, "cgroup.procs"), os.W_OK):
            return m, ""
    return None, f"no writable cgroup v2 mount (mounted: {', '.join(mounts)}; read-only or cgroup.procs not writable)"


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = _ephemeral_low()
_handed_out: set[int] = set()


def unit_environ(pid: int, timeout: float = 30) -> dict[str, str]:
    """A unit process's environment, once it has one: a `simple` unit is active from its
    spawn, and until the spawner's execve has run, /proc/PID/environ is still the spawner's (a
    read right after `active` got it under load). The unit's own has OMNID_UNIT."""
    def read() -> dict[str, str] | None:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
        env = dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)
        return env if "OMNID_UNIT" in env else None

    return wait_for(read, timeout, f"pid {pid} to have exec'd its unit (OMNID_UNIT in its environment)")


def _port_slice() -> tuple[int, int]:
    """The ports this process hands out: below the ephemeral range, split between the xdist
    workers of a parallel run (PYTEST_XDIST_WORKER gwN of PYTEST_XDIST_WORKER_COUNT), so that two
    workers never hand out one port between its check and its bind."""
    high = _EPHEMERAL_LOW
    low = max(10000, high - 12000)
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        size = (high - low) // int(count)
        low += int(worker[2:]) % int(count) * size
        high = low + size
    return low, high


def free_port() -> int:
    """A port nobody listens on now, for a unit to bind a moment later, taken from below the
    kernel's ephemeral range. A port the kernel picks for bind(0) is one it may also give the
    next outgoing connection as its source port; a unit binding it then gets "Address already
    in use" (CI: the demo engine, right after a load test's thousands of connections). Never
    the same port twice in one test run."""
    import random

    low, high = _port_slice()
    for _ in range(1000):
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high - 1}")


def make_stack(units: dict[str, str], settings: str | None = None) -> Path:
    """Write a stack directory: {unit name: TOML text}."""
    d = temp_dir("omst-")
    for name, text in units.items():
        (d / f"{name}.toml").write_text(textwrap.dedent(text))
    if settings is not None:
        (d / "omnid.toml").write_text(textwrap.dedent(settings))
    return d


def lingering_tcp_socket(linger_s: int) -> tuple[socket.socket, socket.socket, socket.socket]:
    """A TCP socket whose close() waits `linger_s`: SO_LINGER on, its send queue full towards
    a peer that never reads (returns it, the listener and the peer, which the caller closes)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.connect(srv.getsockname())
    peer, _ = srv.accept()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.setblocking(False)
    try:
        while True:
            c.send(b"x" * 65536)
    except BlockingIOError:
        pass
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger_s))
    return c, srv, peer


def wait_for(predicate: Callable[[], Any], timeout: float, what: str | Callable[[], str],
             interval: float = 0.01) -> Any:
    """Poll with a deadline (never a fixed sleep); fail with `what` on timeout. A callable
    `what` is called then, so the message shows what was seen at the end, not at the start."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g} s waiting for {said}")
        time.sleep(interval)


def alive(pid: int) -> bool:
    st = linux.read_stat(pid)
    return st is not None and st.state not in ("Z", "X")


def remove_cgroup_tree(path: str | None, timeout: float = 10.0) -> None:
    """Remove a test's own cgroup root: cgroup.kill what is left in it, wait for
    populated 0, rmdir bottom-up. Fails loudly when it cannot."""
    if not path or not os.path.isdir(path):
        return
    from omnid.process import cgroupfs

    for dirpath, _d, _f in os.walk(path, topdown=False):
        if dirpath != path and cgroupfs.populated(dirpath):
            cgroupfs.kill(dirpath)
    wait_for(lambda: not cgroupfs.populated(path), timeout, f"cgroup {path} to empty")
    assert cgroupfs.remove_tree(path), f"could not remove cgroup root {path}: {os.listdir(path)}"


def py_stacks(pid: int) -> str:
    """The Python stacks of a process's threads, read from outside (py-spy, as omnid's forensics):
    what a daemon that does not exit is doing, for the warning that reports it."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    try:
        r = subprocess.run([spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                           timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy: {exc})"
    return (r.stdout + r.stderr)[-4000:]


class Daemon:
    def __init__(self, units_dir: Path | str, env: dict[str, str] | None = None, python: str | None = None,
                 cgroup_root: str | None = None, cwd: Path | str | None = None) -> None:
        self.units_dir = Path(units_dir)
        self.workdir = temp_dir("omd-")
        self.control = str(self.workdir / "c.sock")
        self.state_dir = self.workdir / "state"
        self.health_port = free_port()
        self.log_path = self.workdir / "daemon.log"
        # The daemons under test at the suite's own priority (not the default, 10 steps ahead): a
        # test's observers (clients, flooders, the leftovers it watches) share the CPU with them
        # as before, and eight workers' busy daemons do not starve the rest of a parallel run.
        # tests/test_daemon_priority.py and the cluster hosts (tests/netns.py) run the default.
        self.env = dict(os.environ, **{"OMNID_DAEMON_NICE": "0", **(env or {})})
        self.python = python or sys.executable
        self.cwd = str(cwd or REPO)  # `python -m omnid` runs the omnid found here first
        self.proc: subprocess.Popen | None = None
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._n = 0
        # cgroup backend (issue #10): an explicit root, or with OMNID_TEST_CGROUP=1 a fresh one
        # per daemon below the cgroup2 mount, removed by close().
        self.cgroup_root = cgroup_root
        self._own_cgroup_root = False
        if cgroup_root is None and self.env.get("OMNID_TEST_CGROUP") == "1":
            mount, missing = cgroup2_for_tests()
            assert mount is not None, f"OMNID_TEST_CGROUP=1 but {missing}"
            self.cgroup_root = os.path.join(mount, f"omnid-test-{self.workdir.name}")
            self._own_cgroup_root = True

    # -- life ---------------------------------------------------------------
    def argv(self) -> list[str]:
        return [self.python, "-m", "omnid", "--control", self.control, "daemon", "-u", str(self.units_dir),
                "--state-dir", str(self.state_dir), "--health-listen", f"127.0.0.1:{self.health_port}",
                "--log-format", "json", *(["--cgroup-root", self.cgroup_root] if self.cgroup_root else [])]

    def start(self, wait: bool = True) -> "Daemon":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                     env=self.env, cwd=self.cwd)
        if wait:
            wait_for(lambda: self.proc.poll() is not None or os.path.exists(self.control), 20,
                     "the daemon's control socket")
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            # The health API comes up after the control socket (its aiohttp import waits for the
            # first tier's spawns, then runs on a thread): a test that reads /health around a
            # fault must not take its first answer late, after the fault is over.
            wait_for(lambda: self.proc.poll() is not None or self._health_served(), 30,
                     "the health API's first answer")
        return self

    def _health_served(self) -> bool:
        """The health API answered (a connection made before aiohttp serves waits in the
        backlog of the socket the daemon bound first, so this returns once it does)."""
        try:
            self.http("/health/live")
        except OSError:  # refused, reset or timed out: not yet
            return False
        return True

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_events(self) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def logged_pid(self, unit: str, to: str) -> int:
        """The pid of `unit` the first time the daemon logged it entering state `to`: for a
        state that may be over before a test's first look on a loaded host."""
        for e in self.log_events():
            if e.get("event") == "unit state" and e.get("unit") == unit and e.get("to") == to:
                return e["pid"]
        raise AssertionError(f"the daemon never logged {unit} entering {to}:\n{self.log()[-3000:]}")

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Stop the daemon (SIGTERM = ordered stop), SIGKILL if it hangs, reap it."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                # An ordered stop that outlived 60 s: shown in the run's warnings summary (with
                # what the daemon was doing), though the test itself passed.
                import warnings

                warnings.warn(f"omnid daemon pid {self.proc.pid} still running 60 s after SIGTERM (killed); "
                              f"its log ends:\n{self.log()[-3000:]}\nits threads now:\n{py_stacks(self.proc.pid)}",
                              stacklevel=2)
                self.proc.kill()
                self.proc.wait(10)
        if self.proc is not None:
            self.proc.wait(10)
        self._ctx.term()
        if hasattr(self, "_log"):
            self._log.close()
        self.closed_log = self.log()
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self._own_cgroup_root:
            remove_cgroup_tree(self.cgroup_root)

    def invariant_violations(self) -> list[str]:
        """State/kernel disagreements the daemon logged after its transitions
        (tests run daemons with OMNID_CHECK_INVARIANTS=1)."""
        text = getattr(self, "closed_log", None) or self.log()
        return [line for line in text.splitlines() if "invariant violated" in line]

    # -- control socket --------------------------------------------------------
    def raw(self, payload: bytes, timeout: float = 10.0) -> dict:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            # a re-executed daemon binds its socket again: retry the connect every 10 ms, not 100
            self._sock.setsockopt(zmq.RECONNECT_IVL, 10)
            self._sock.connect(f"ipc://{self.control}")
        self._sock.send(payload)
        if not self._sock.poll(timeout * 1000):
            raise AssertionError(f"no control reply within {timeout} s")
        return json.loads(self._sock.recv())

    def call(self, cmd: str, args: dict | None = None, timeout: float = 30.0) -> dict:
        self._n += 1
        return self.raw(json.dumps({"id": self._n, "cmd": cmd, "args": args or {}}).encode(), timeout)

    def ok(self, cmd: str, args: dict | None = None, timeout: float = 30.0) -> Any:
        reply = self.call(cmd, args, timeout)
        assert reply["ok"], reply
        return reply["result"]

    def units(self) -> dict[str, dict]:
        return {u["name"]: u for u in self.ok("status")["units"]}

    def unit(self, name: str) -> dict:
        return self.units()[name]

    def wait_state(self, name: str, state: str, timeout: float = 15.0) -> dict:
        return wait_for(lambda: (u := self.unit(name))["state"] == state and u, timeout,
                        f"{name} to be {state} (log:\n{self.log()[-3000:]})")

    def wait_all_active(self, timeout: float = 30.0) -> dict[str, dict]:
        def check():
            us = self.units()
            return us if all(u["state"] == "active" and u["ready"] for u in us.values()) else None

        return wait_for(check, timeout, "every unit active")

    # -- health HTTP -------------------------------------------------------------
    def http(self, path: str) -> tuple[int, Any]:
        url = f"http://127.0.0.1:{self.health_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                body = r.read()
                code = r.status
        except urllib.error.HTTPError as e:
            body = e.read()
            code = e.code
        try:
            return code, json.loads(body)
        except ValueError:
            return code, body.decode()

    def reexec(self, timeout: float = 60.0) -> None:
        """`reexec` over the control socket (no CLI process), until the new program answers.
        The old program's socket is gone: a fresh DEALER reconnects to the new one."""
        since = self.ok("reexec")["program_since"]

        def answered() -> bool:
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None
            try:
                return self.ok("status", timeout=0.3)["daemon"]["program_since"] > since
            except AssertionError:
                return False

        wait_for(answered, timeout, "the re-executed program to answer")

    def events_socket(self, live: bool = True, timeout: float = 5.0) -> zmq.Socket:
        """A subscription to the daemon's events; with `live`, returned only once the daemon
        has counted it (its subscription count went up): no event published after this
        returns can be missed (ZeroMQ's slow joiner)."""
        before = self.ok("status")["daemon"]["events"]["subscriptions"] if live else 0
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{self.control}.events")
        if live:
            try:
                wait_for(lambda: self.ok("status")["daemon"]["events"]["subscriptions"] > before, timeout,
                         "the daemon to count the event subscription")
            except AssertionError:
                sub.close(0)
                raise
        return sub
