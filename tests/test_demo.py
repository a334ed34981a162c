"""The reference stack (omnid/demo) driven directly, without omnid.

Each process is started as a plain subprocess with the environment omnid would
give it (OMNID_UNIT, NOTIFY_SOCKET, ...) on free ports, and checked from the
outside: sd_notify datagrams, HTTP answers, and how fast in-flight requests
fail when a process of the stack dies (FAILURE_MATRIX "fails fast": < 2 s).
Every wait polls with a deadline; every process is stopped in a finally.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.harness import free_port

REPO = Path(__file__).resolve().parents[1]
FAIL_FAST_S = 2.0
START_TIMEOUT_S = 60.0  # torch import on a loaded CI box; normally ~3 s
LONG_MS = 20_000  # a request that is certainly still running when the fault is injected


# ---- helpers ---------------------------------------------------------------------------------



def process_state(pid: int) -> str:
    """The state letter in /proc/PID/stat (R, S, T, Z, ...)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@dataclass(frozen=True)
class Notification:
    at: float
    pid: int | None
    fields: tuple[str, ...]


class NotifyReceiver:
    """The supervisor's end of NOTIFY_SOCKET: a datagram socket that learns each sender's pid.

    A thread reads it all the time, as a supervisor does: the kernel queues as few as 10
    datagrams (net.unix.max_dgram_qlen) before senders block or drop.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.05)
        self.received: list[Notification] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"notify {address}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closing.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            pid = None
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("iII", payload[:12])[0]
            with self._lock:
                self.received.append(Notification(time.monotonic(), pid, tuple(data.decode().split("\n"))))

    def from_pid(self, pid: int, field: str, since: float = 0.0) -> list[Notification]:
        with self._lock:
            return [n for n in self.received if n.pid == pid and field in n.fields and n.at >= since]

    def wait_for(self, pid: int, field: str, timeout: float) -> Notification:
        found = wait_until(lambda: self.from_pid(pid, field), timeout, f"{field} from pid {pid}")
        return found[0]

    def close(self) -> None:
        self._closing.set()
        self._reader.join(5)
        self.sock.close()
        if not self.address.startswith("@"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address)


class DemoProcess:
    """One demo module run as a unit would run it; output goes to a log file shown on failure."""

    def __init__(self, module: str, unit: str, env: dict[str, str], log_dir: Path) -> None:
        self.unit = unit
        self.log_path = log_dir / f"{unit.replace('@', '-')}.log"
        # The unit environment omnid would give; OMNID_TEST_ID (conftest's leak check) is inherited.
        full_env = {k: v for k, v in os.environ.items()
                    if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "OMNID_UNIT", "OMNID_INSTANCE")
                    and not k.startswith("OMNID_DEMO_")}
        full_env.update({"OMNID_UNIT": unit, "OMNID_INSTANCE": unit.partition("@")[2] or "0",
                         "SPT_NOENV": "1", **env})
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen([sys.executable, "-m", f"omnid.demo.{module}"], env=full_env,
                                          cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        self.popen.send_signal(signum)  # Popen will not signal a pid it has already reaped

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


@dataclass
class Answer:
    status: int | None  # None: the connection closed without an HTTP answer
    body: Any
    done_at: float


def post_generate(port: int, body: dict[str, Any], timeout: float = 60.0) -> Answer:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Answer(response.status, json.loads(response.read()), time.monotonic())
    except urllib.error.HTTPError as error:
        return Answer(error.code, json.loads(error.read() or b"null"), time.monotonic())
    except (urllib.error.URLError, ConnectionError, OSError) as error:
        return Answer(None, repr(error), time.monotonic())


def get_health(port: int) -> tuple[int | None, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except (urllib.error.URLError, ConnectionError, OSError):
        return None, None


# ---- fixtures --------------------------------------------------------------------------------


@dataclass
class Workers:
    port: int
    notify: NotifyReceiver
    processes: list[DemoProcess]
    log_dir: Path
    ready_at: dict[str, Notification]

    def env(self) -> dict[str, str]:
        return {"OMNID_DEMO_WORKER_PORT": str(self.port), "OMNID_DEMO_MODEL_MIB": "16",
                "OMNID_DEMO_THREADS": "1", "NOTIFY_SOCKET": self.notify.address}

    def start(self, unit: str, **extra: str) -> DemoProcess:
        process = DemoProcess("worker", unit, {**self.env(), **extra}, self.log_dir)
        self.processes.append(process)
        return process


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """worker@0 and worker@1, loaded and READY, shared by the module (torch import is the slow part)."""
    log_dir = tmp_path_factory.mktemp("demo-workers")
    # An abstract NOTIFY_SOCKET ('@...'), as omnid may hand out; the engine gets a path one.
    notify = NotifyReceiver(f"@omnid-test-demo-{os.getpid()}-{time.monotonic_ns()}")
    pool = Workers(port=free_port(), notify=notify, processes=[], log_dir=log_dir, ready_at={})
    try:
        # worker@1 is told a 300 ms watchdog interval, so it must ping every 100 ms.
        started = [pool.start("worker@0"), pool.start("worker@1", WATCHDOG_USEC="300000")]
        for process in started:
            pool.ready_at[process.unit] = notify.wait_for(process.pid, "READY=1", START_TIMEOUT_S)
        yield pool
    finally:
        for process in pool.processes:
            process.stop()
        for process in pool.processes:
            print(f"--- {process.unit} (pid {process.pid}, exit {process.popen.returncode})\n{process.log()}")
        notify.close()


@dataclass
class Stack:
    workers: Workers
    engine: DemoProcess
    serve: DemoProcess
    serve_port: int
    notify: NotifyReceiver

    def health(self) -> tuple[int | None, Any]:
        return get_health(self.serve_port)

    def wait_running(self, count: int) -> None:
        """Until the engine reports ``count`` requests running on workers (via the serve's /health)."""
        wait_until(lambda: (self.health()[1] or {}).get("engine", {}).get("running") == count,
                   10, f"{count} request(s) running")


@pytest.fixture
def stack(workers: Workers, tmp_path: Path) -> Iterator[Stack]:
    """A fresh engine and serve on new ports, connected to the module's workers."""
    # A path NOTIFY_SOCKET, short enough for sun_path (108 bytes) wherever pytest's tmp_path is.
    sock_dir = Path(tempfile.mkdtemp(prefix="omd-", dir="/tmp"))
    notify = NotifyReceiver(str(sock_dir / "notify"))
    engine_port, serve_port = free_port(), free_port()
    common = {"OMNID_DEMO_WORKER_PORT": str(workers.port), "OMNID_DEMO_ENGINE_PORT": str(engine_port),
              "OMNID_DEMO_SERVE_PORT": str(serve_port), "NOTIFY_SOCKET": notify.address}
    engine = DemoProcess("engine", "engine", common, tmp_path)
    serve = DemoProcess("serve", "serve", common, tmp_path)
    try:
        notify.wait_for(engine.pid, "READY=1", START_TIMEOUT_S)
        wait_until(lambda: workers_registered(serve_port) >= 2, START_TIMEOUT_S, "/health 200 with 2 workers")
        yield Stack(workers, engine, serve, serve_port, notify)
    finally:
        serve.stop()
        engine.stop()
        for process in (engine, serve):
            print(f"--- {process.unit} (pid {process.pid}, exit {process.popen.returncode})\n{process.log()}")
        notify.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def workers_registered(serve_port: int) -> int:
    status, body = get_health(serve_port)
    return body["engine"].get("workers", 0) if status == 200 else 0


def long_requests(port: int, count: int) -> tuple[ThreadPoolExecutor, list[Future[Answer]]]:
    pool = ThreadPoolExecutor(max_workers=count)
    return pool, [pool.submit(post_generate, port, {"prompt": f"long {i}", "max_ms": LONG_MS})
                  for i in range(count)]


# ---- tests -----------------------------------------------------------------------------------


def test_workers_and_engine_send_ready_over_notify_socket(stack: Stack) -> None:
    for process in stack.workers.processes[:2]:
        ready = stack.workers.ready_at[process.unit]
        assert ready.pid == process.pid
        assert any(field.startswith("STATUS=loaded") for field in ready.fields)
    assert stack.notify.from_pid(stack.engine.pid, "READY=1")
    assert stack.notify.wait_for(stack.serve.pid, "READY=1", 5)


def test_worker_pings_watchdog_from_its_work_loop_and_stops_when_stopped(workers: Workers) -> None:
    worker = workers.processes[1]  # WATCHDOG_USEC=300000: a ping every 100 ms
    since = time.monotonic()
    wait_until(lambda: len(workers.notify.from_pid(worker.pid, "WATCHDOG=1", since)) >= 3, 2, "3 watchdog pings")
    worker.signal(signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(worker.pid) == "T", 2, "the worker to be stopped")
        stopped = time.monotonic() + 0.05  # what it sent before stopping is read by then
        # Observe six ping intervals: a stopped work loop must not ping in any of them.
        assert not _pings_during(workers.notify, worker.pid, stopped, stopped + 0.6), "a stopped worker pinged"
    finally:
        worker.signal(signal.SIGCONT)
    resumed = time.monotonic()
    wait_until(lambda: workers.notify.from_pid(worker.pid, "WATCHDOG=1", resumed), 2, "pings after SIGCONT")


def test_generate_answers_200_from_both_workers(stack: Stack) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(lambda i: post_generate(stack.serve_port, {"prompt": f"hello {i}", "max_ms": 200}),
                                range(4)))
    assert [a.status for a in answers] == [200] * 4, answers
    assert all(a.body["text"] and a.body["ms"] >= 200 for a in answers), answers
    assert {a.body["worker"] for a in answers} == {"worker@0", "worker@1"}


def test_bad_request_is_400_with_a_message(stack: Stack) -> None:
    answer = post_generate(stack.serve_port, {"text": "no prompt"})
    assert answer.status == 400
    assert answer.body["error"]["code"] == "bad_request" and answer.body["error"]["message"]


def test_killing_a_worker_fails_its_inflight_request_within_2s(stack: Stack) -> None:
    victim = stack.workers.start("worker@7")
    stack.workers.notify.wait_for(victim.pid, "READY=1", START_TIMEOUT_S)
    wait_until(lambda: workers_registered(stack.serve_port) == 3, 10, "worker@7 registered")
    pool, futures = long_requests(stack.serve_port, 3)  # one on each idle worker
    try:
        stack.wait_running(3)
        victim.signal(signal.SIGKILL)
        killed = time.monotonic()
        victim.popen.wait(5)
        first = next(as_completed(futures, timeout=FAIL_FAST_S + 1))
        answer = first.result()
        assert answer.done_at - killed < FAIL_FAST_S, f"failed after {answer.done_at - killed:.2f} s"
        assert answer.status == 502, answer
        assert answer.body["error"]["code"] == "worker_lost"
        assert "worker@7 lost while running request" in answer.body["error"]["message"]
        assert sum(f.done() for f in futures) == 1, "requests on the other workers must keep running"
    finally:
        stack.engine.stop()  # fails the other two long requests at once (engine_stopping)
        pool.shutdown(wait=True)
    assert all(f.result().status == 503 for f in futures if f.result().status != 502)


def test_killing_the_engine_fails_serve_inflight_requests_within_2s(stack: Stack) -> None:
    pool, futures = long_requests(stack.serve_port, 2)
    try:
        stack.wait_running(2)
        stack.engine.signal(signal.SIGKILL)
        killed = time.monotonic()
        answers = [f.result(timeout=FAIL_FAST_S + 5) for f in futures]
    finally:
        pool.shutdown(wait=True)
    for answer in answers:
        assert answer.done_at - killed < FAIL_FAST_S, f"failed after {answer.done_at - killed:.2f} s"
        assert answer.status == 503 and answer.body["error"]["code"] == "engine_lost", answer
        assert answer.body["error"]["message"]
    status, body = wait_until(lambda: (h := stack.health())[0] == 503 and h, 2, "/health 503")
    assert "engine" in body["reason"]


def test_sigterm_to_the_serve_fails_inflight_fast_and_exits(stack: Stack) -> None:
    pool, futures = long_requests(stack.serve_port, 2)
    try:
        stack.wait_running(2)
        stack.serve.signal(signal.SIGTERM)
        signalled = time.monotonic()
        answers = [f.result(timeout=FAIL_FAST_S + 5) for f in futures]
    finally:
        pool.shutdown(wait=True)
    for answer in answers:
        assert answer.done_at - signalled < FAIL_FAST_S, f"failed after {answer.done_at - signalled:.2f} s"
        assert answer.status == 503 and answer.body["error"]["code"] == "serve_stopping", answer
    # A clean stop on SIGTERM ends *by* SIGTERM, so the supervisor can name the signal.
    assert stack.serve.popen.wait(FAIL_FAST_S) == -signal.SIGTERM
    assert get_health(stack.serve_port) == (None, None), "the listener must be closed"


def test_serve_without_engine_is_unhealthy_and_fails_fast(tmp_path: Path) -> None:
    port = free_port()
    serve = DemoProcess("serve", "serve", {"OMNID_DEMO_ENGINE_PORT": str(free_port()),
                                           "OMNID_DEMO_SERVE_PORT": str(port)}, tmp_path)
    try:
        status, body = wait_until(lambda: (h := get_health(port))[0] is not None and h, START_TIMEOUT_S,
                                  "the serve to listen")
        assert status == 503 and "engine" in body["reason"]
        started = time.monotonic()
        answer = post_generate(port, {"prompt": "anyone?"})
        assert answer.status == 503 and answer.body["error"]["code"] == "engine_unavailable"
        assert answer.done_at - started < 1.0
    finally:
        serve.stop()
    assert serve.popen.returncode == -signal.SIGTERM, serve.log()  # a clean stop, ended by the signal


def test_engine_and_serve_never_import_torch() -> None:
    probe = "import sys, omnid.demo.engine, omnid.demo.serve; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def _pings_during(notify: NotifyReceiver, pid: int, start: float, end: float) -> list[Notification]:
    """WATCHDOG=1 datagrams from ``pid`` read in [start, end], once ``end`` has passed."""
    wait_until(lambda: time.monotonic() > end, end - time.monotonic() + 1, "the observation window to pass")
    return [n for n in notify.from_pid(pid, "WATCHDOG=1", start) if n.at <= end]
