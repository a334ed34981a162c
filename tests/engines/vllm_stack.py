"""Real vLLM under omnid: the unit, its process tree read from /proc, a request loop, metrics.

Shared by tests/test_engine_vllm.py and bench/vllm_faults.py. Everything here asks the
kernel (/proc) or vLLM itself (its HTTP API), never omnid's bookkeeping, except where a
test is about what omnid says (/health, status).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from omnid.base import linux

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"

# The keys issue 25 adds to the unit contract: the unit below uses each one this omnid's
# `omnid check` accepts (an unknown key would make the whole stack invalid).
NEW_KEYS = {
    "progress": 'progress = { metrics = "http://127.0.0.1:1/metrics", counter = "c", busy = ["b"] }',
    "kill_mode": 'kill_mode = "mixed"',
    "ready_interval": "ready_interval = 2",
    "remove_ipc": "remove_ipc = true",
    "private_tmp": "private_tmp = true",
    "liveness_post": 'liveness = { http = "http://127.0.0.1:1/x", method = "POST", body = "{}", expect = 200 }',
    "progress_canary": 'progress = { metrics = "http://127.0.0.1:1/m", counter = "c", busy = ["b"], '
                       'canary = { http = "http://127.0.0.1:1/x" } }',
}
_known: dict[str, bool] = {}


def knows(key: str) -> bool:
    """Whether this checkout's omnid accepts the unit key (asked of `omnid check`, once)."""
    if key not in _known:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="omkey-") as d:
            Path(d, "u.toml").write_text(f'exec = ["true"]\n{NEW_KEYS[key]}\n')
            proc = subprocess.run([sys.executable, "-m", "omnid", "check", "-u", d], cwd=REPO, capture_output=True,
                                  text=True, timeout=60, stdin=subprocess.DEVNULL,
                                  env=dict(os.environ, PYTHONPATH=str(REPO)))
        _known[key] = proc.returncode == 0
    return _known[key]


# --------------------------------------------------------------------------- memory: stacks at once

STACK_GIB = 3  # one stack of the tiny model on CPU: Worker ~1.5 GiB (its 1 GiB KV cache), API server and EngineCore ~0.45 each


def _slot_count() -> int:
    """How many vLLM stacks this machine holds at once beside the rest of a parallel run: a
    quarter of its memory kept for everything else (eight stacks at once took every byte of
    a 24 GiB machine)."""
    try:
        with open("/proc/meminfo") as f:
            total_gib = int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1]) / (1 << 20)
    except (OSError, StopIteration, ValueError):
        return 1
    return max(1, int(total_gib * 0.75 // STACK_GIB))


class StackSlots:
    """Slots for vLLM stacks, machine-wide (flock on files under /tmp, so every xdist worker and
    every other run on the machine shares them): a test takes one per stack it starts and holds
    them until its stacks are gone; past the machine's count it waits, then fails naming who
    holds them. The kernel drops a dead holder's locks."""

    DIR = Path("/tmp/omnid-test-vllm-slots")

    def __init__(self, n: int = 1, timeout: float = 1800) -> None:
        self.n, self.timeout = n, timeout
        self.fds: list[int] = []

    def __enter__(self) -> "StackSlots":
        import fcntl

        count = _slot_count()
        if self.n > count:
            raise AssertionError(f"{self.n} vLLM stacks at once do not fit this machine's memory ({count} do)")
        self.DIR.mkdir(mode=0o700, exist_ok=True)
        deadline = time.monotonic() + self.timeout
        while True:
            for k in range(count):
                if len(self.fds) == self.n:
                    return self
                fd = os.open(self.DIR / f"slot-{k}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} {os.environ.get('PYTEST_CURRENT_TEST', '')}".encode())
                self.fds.append(fd)
            if len(self.fds) == self.n:
                return self
            self.__exit__(None, None, None)  # none held while waiting: two tests wanting two never block each other
            if time.monotonic() > deadline:
                holders = [(self.DIR / f"slot-{k}").read_text(errors="replace") for k in range(count)]
                raise AssertionError(f"no vLLM slot free in {self.timeout:.0f} s; held by: {holders}")
            time.sleep(0.5)

    def __exit__(self, *_exc) -> None:
        for fd in self.fds:
            os.close(fd)  # closing the fd drops its lock
        self.fds.clear()


def port_with_free_probes(instances: int) -> int:
    """A free port whose instances' probe ports (omnid.cli.examples.probe_port: its tens + 1,
    then the number) are free too."""
    import socket

    from omnid.cli.examples import probe_port
    from tests.harness import free_port

    for _ in range(50):
        port = free_port()
        if port > 65000:
            continue
        socks = []
        try:
            for i in range(instances):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", probe_port(port, i)))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no port with free probe ports found")


# The suite's sizes for vLLM's CPU build and a tiny model on two loaded cores; everything else
# is what `omnid example vllm` writes (omnid.cli.examples).
CPU_ENGINE_ARGS = (
    # On CPU the fraction is of RAM; the KV cache is VLLM_CPU_KVCACHE_SPACE GiB.
    "--gpu-memory-utilization", "0.1", "--max-model-len", "512",
    # No torch.compile warm-up: a restart is import + load (~30 s), not + compile (~60 s).
    "--enforce-eager",
)


def stack(python: Path | str, model: Path | str, port: int, *, stall_sec: int = 8, extra: str = "",
          kill_mode: bool = True, progress: bool = True, ready_interval: bool = True,
          liveness: bool = True, instances: int = 1, held_socket: bool = True):
    """The suite's vLLM stack (omnid.cli.examples.VllmStack) with its CPU sizes and bounds."""
    from omnid.cli.examples import VllmStack

    return VllmStack(
        python=str(python), model=str(model), port=port, instances=instances, served_name=MODEL_NAME,
        engine_args=CPU_ENGINE_ARGS, env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        ready_timeout=400,
        # 4 s is ample for this model's requests (a few hundred ms each on CPU). vLLM 0.32 was
        # seen to wait out the whole bound after a SIGTERM or SIGINT of its API server under
        # load, so each such row pays it (10 s before: ~20 s of CI a run).
        shutdown_timeout=4, stop_timeout=30,
        # A hung tree never finishes that drain (seen: 60 s with stop_timeout = 60): 5 s.
        abort_timeout=5, kill_timeout=20,
        # One module-scoped stack takes a fault per row: the backoff doubling to its default
        # 60 s cap would cost a minute a row from the 7th restart on.
        restart_sec=1, restart_max_sec=2, start_limit_burst=30, start_limit_interval=3600,
        stall_sec=stall_sec, liveness=liveness,
        progress=progress and knows("progress"), canary=knows("progress_canary"),
        kill_mode=kill_mode and knows("kill_mode"), ready_interval=ready_interval and knows("ready_interval"),
        held_socket=held_socket, extra=textwrap.dedent(extra) if extra else "")


def unit_toml(python: Path | str, model: Path | str, port: int, *, stall_sec: int = 8, extra: str = "",
              kill_mode: bool = True, progress: bool = True, ready_interval: bool = True,
              liveness: bool = True, instances: int = 1, held_socket: bool = True) -> str:
    """The API server (which starts EngineCore, which starts the Worker) as one unit, as
    `omnid example vllm` writes it (omnid.cli.examples.vllm_unit; the launcher run in place
    from the package), on a socket omnid holds unless `held_socket` is False (vLLM binds its
    port itself: the layout before issue 35).

    Probes: `ready` on vLLM's /health; `liveness` on it too (an API server that closed its
    port and never exits: seen after a SIGINT, its shutdown hung for minutes with EngineCore
    and Worker alive); `progress` on its Prometheus counters (the hang detector: tokens must
    be generated while requests are running), with a one-token completion as its `canary`
    for a Worker that hangs between two batches (vLLM publishes its gauges per engine step:
    they freeze at 0 running, and the rule alone sees an idle engine). Keys this omnid does
    not know yet are left out (their tests are expected failures)."""
    from omnid.cli.examples import vllm_unit

    return vllm_unit(stack(python, model, port, stall_sec=stall_sec, extra=extra, kill_mode=kill_mode,
                           progress=progress, ready_interval=ready_interval, liveness=liveness,
                           instances=instances, held_socket=held_socket))


# --------------------------------------------------------------------------- the tree, from /proc


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int
    comm: str
    ppid: int

    def alive(self) -> bool:
        st = linux.read_stat(self.pid)
        return st is not None and st.start_time == self.start and st.state not in ("Z", "X")

    def present(self) -> bool:
        """Still in /proc at all (a zombie counts: an orphan not yet reaped is residue too)."""
        st = linux.read_stat(self.pid)
        return st is not None and st.start_time == self.start


@dataclass
class Tree:
    api: Proc
    procs: list[Proc] = field(default_factory=list)  # the API server and every descendant

    def role(self, prefix: str) -> Proc:
        found = [p for p in self.procs if p.comm.startswith(prefix)]
        assert found, f"no {prefix} process in the vLLM tree: {self.describe()}"
        return found[0]

    @property
    def engine(self) -> Proc:
        return self.role("VLLM::EngineCor")  # comm keeps 15 characters of VLLM::EngineCore

    @property
    def worker(self) -> Proc:
        return self.role("VLLM::Worker")

    def left(self) -> list[Proc]:
        return [p for p in self.procs if p.present()]

    def describe(self, procs: list[Proc] | None = None) -> str:
        return ", ".join(f"{p.pid} {p.comm} (ppid {p.ppid})" for p in (self.procs if procs is None else procs))

    def shm(self) -> set[str]:
        """/dev/shm objects any process of the tree has mapped or open (the resource
        tracker's segments and semaphores among them)."""
        out: set[str] = set()
        for p in self.procs:
            out |= shm_of(p.pid)
        return out


def shm_of(pid: int) -> set[str]:
    out = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/"):
                    out.add(path.split(" (deleted)")[0])
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                out.add(target.split(" (deleted)")[0])
    except OSError:
        pass
    return out


def tree_of(api_pid: int) -> Tree:
    st = linux.read_stat(api_pid)
    assert st is not None, f"API server pid {api_pid} is gone"
    api = Proc(st.pid, st.start_time, st.comm, st.ppid)
    procs, todo = [api], [api_pid]
    while todo:
        for child in linux.children_of(todo.pop()):
            cst = linux.read_stat(child)
            if cst is not None:
                procs.append(Proc(cst.pid, cst.start_time, cst.comm, cst.ppid))
                todo.append(child)
    return Tree(api, procs)


def full_tree(api_pid: int, timeout: float = 60) -> Tree:
    """The tree once EngineCore and Worker are both there (a fresh start may still be spawning)."""
    deadline = time.monotonic() + timeout
    while True:
        t = tree_of(api_pid)
        names = [p.comm for p in t.procs]
        if any(n.startswith("VLLM::EngineCor") for n in names) and any(n.startswith("VLLM::Worker") for n in names):
            return t
        if time.monotonic() > deadline:
            raise AssertionError(f"vLLM tree of {api_pid} never had EngineCore and Worker: {t.describe()}")
        time.sleep(0.2)


def signal_proc(p: Proc, sig: int) -> None:
    """By pidfd, checked against the start time read from /proc (never by name)."""
    assert linux.signal_checked(p.pid, p.start, sig), f"could not signal {p.pid} ({p.comm}): gone already"


# --------------------------------------------------------------------------- HTTP to vLLM


def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"} if body is not None else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def complete(port: int, max_tokens: int = 16, timeout: float = 60) -> tuple[int, int]:
    """One completion: (HTTP status, tokens generated)."""
    code, body = request(port, "POST", "/v1/completions",
                         {"model": MODEL_NAME, "prompt": "the supervisor", "max_tokens": max_tokens,
                          "ignore_eos": True, "temperature": 0}, timeout)
    if code != 200:
        return code, 0
    return code, json.loads(body)["usage"]["completion_tokens"]


def serves(port: int) -> bool:
    try:
        return complete(port, 4, timeout=30) == (200, 4)
    except OSError:
        return False


def metrics(port: int) -> dict[str, float]:
    """vLLM's Prometheus text, each metric summed over its labels."""
    code, body = request(port, "GET", "/metrics", timeout=10)
    assert code == 200, f"vLLM /metrics answered {code}"
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def vllm_health(port: int) -> int | None:
    try:
        return request(port, "GET", "/health", timeout=5)[0]
    except OSError:
        return None


class Load:
    """`clients` threads sending completions back to back (FAILURE_MATRIX "under load").
    Each result is (start, end, status or exception name, tokens)."""

    def __init__(self, port: int, clients: int = 4, max_tokens: int = 24, timeout: float = 120) -> None:
        self.port, self.max_tokens, self.timeout = port, max_tokens, timeout
        self.results: list[tuple[float, float, int | str, int]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"load-{i}") for i in range(clients)]

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                code, tokens = complete(self.port, self.max_tokens, self.timeout)
                outcome: int | str = code
            except OSError as exc:
                outcome, tokens = type(exc).__name__, 0
                self._stop.wait(0.05)  # refused while restarting: do not spin
            with self._lock:
                self.results.append((t0, time.monotonic(), outcome, tokens))

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 150) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        stuck = [t.name for t in self._threads if t.is_alive()]
        assert not stuck, f"load clients still waiting on a request after {timeout} s: {stuck}"

    def ok_after(self, t: float) -> int:
        with self._lock:
            return sum(1 for s, _e, o, n in self.results if s >= t and o == 200 and n == self.max_tokens)

    def snapshot(self) -> list[tuple[float, float, int | str, int]]:
        with self._lock:
            return list(self.results)


def abort_storm(port: int, n: int = 300, max_tokens: int = 48, abort_every: int = 3) -> dict[str, int]:
    """`n` streaming completions at once; all but every `abort_every`-th drop their connection
    after two chunks (a client gone mid-stream), the rest read to the end. Returns outcome
    counts: "aborted", "completed", and anything else by its description."""
    import asyncio

    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"

    async def one(session, i: int) -> str:
        abort = i % abort_every != 0
        # The final chunk carries the usage (tokens generated): under load one chunk may carry
        # several tokens, so chunks are not tokens.
        body = {"model": MODEL_NAME, "prompt": f"storm {i}", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        chunks, tokens = 0, None
        try:
            async with session.post(url, json=body) as r:
                if r.status != 200:
                    return f"http {r.status}"
                async for line in r.content:
                    line = line.strip()
                    if line == b"data: [DONE]":
                        return "completed" if tokens == max_tokens else f"short {tokens}"
                    if line.startswith(b"data: "):
                        chunks += 1
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            tokens = usage.get("completion_tokens")
                        if abort and chunks >= 2:
                            r.close()  # the client goes away mid-stream
                            return "aborted"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"error {type(exc).__name__}"
        return f"ended after {chunks}"

    async def storm() -> list[str]:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
            return await asyncio.gather(*(one(s, i) for i in range(n)))

    outcomes = asyncio.run(storm())
    return {k: outcomes.count(k) for k in sorted(set(outcomes))}
