"""Reference worker (units/demo/worker.toml): the GPU-owning leaf of the demo stack.

Run as ``python -m omnid.demo.worker``. It loads a "model" (a tensor of
``OMNID_DEMO_MODEL_MIB`` MiB, on CUDA when a GPU is visible, else on the CPU),
connects to the engine, announces ``READY=1`` over sd_notify, then executes
generate jobs as a few hundred milliseconds of real matmuls each.

With ``--compile`` (or ``OMNID_DEMO_COMPILE=1``; off by default) its step is
``torch.compile``'d before READY=1, so that a start pays inductor's compile as
a real engine's does, and a restart with a kept cache (omnid.unit(5)
``cache_dir``) shows what the cache saves.

One thread does everything — engine heartbeats, ``WATCHDOG=1`` pings and the
tensor work, in small slices — so every liveness signal it gives is a proof
that the work loop itself is turning: a SIGSTOPped or wedged worker goes
silent to the engine (which fails its job within ~0.5 s) and to omnid's
watchdog alike. Only this module of omnid imports torch.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import socket
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import zmq

from omnid.base import testswitch
from omnid.demo import protocol
from omnid.demo.sdnotify import Notifier, watchdog_interval

# torch warns at import when numpy is absent; the worker never needs numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402  (after the filter on purpose)

log = protocol.setup_logging("omnid.demo.worker")

# Longest stretch of tensor work between two turns of the loop (heartbeats, signals).
SLICE_S = 0.01
MAX_JOB_MS = 600_000


@dataclass(frozen=True)
class WorkerConfig:
    unit: str
    engine: str
    model_mib: int
    work_ms: int
    dim: int
    device: str  # "auto", "cpu" or "cuda"
    threads: int
    watchdog_s: float
    request_mib: int = 256  # GPU memory a request needs (OMNID_DEMO_REQUEST_MIB)
    compile: bool = False  # torch.compile the step before READY=1 (--compile, OMNID_DEMO_COMPILE=1)

    @classmethod
    def from_env(cls, compile: bool = False) -> "WorkerConfig":
        device = protocol.env_str("OMNID_DEMO_DEVICE", "auto").lower()
        if device not in ("auto", "cpu", "cuda"):
            raise SystemExit(f"OMNID_DEMO_DEVICE={device!r}: expected auto, cpu or cuda")
        # The supervisor's interval wins; without one, ping every second (omnid.unit(5): watchdog_sec).
        interval = watchdog_interval()
        return cls(
            unit=protocol.unit_name("worker@0"),
            engine=protocol.worker_endpoint(),
            model_mib=protocol.env_int("OMNID_DEMO_MODEL_MIB", 64),
            work_ms=protocol.env_int("OMNID_DEMO_WORK_MS", 300, 1),
            dim=protocol.env_int("OMNID_DEMO_DIM", 512, 8),
            device=device,
            threads=protocol.env_int("OMNID_DEMO_THREADS", 1, 1),
            request_mib=protocol.env_int("OMNID_DEMO_REQUEST_MIB", 256),
            watchdog_s=interval / 3 if interval else 1.0,
            compile=compile or protocol.env_str("OMNID_DEMO_COMPILE", "0") == "1",
        )


@dataclass
class Job:
    job: str  # engine-unique id, echoed back
    number: int  # the engine's request number, for messages people read
    prompt: str
    budget_s: float
    started: float
    state: torch.Tensor
    steps: int = 0


class Model:
    """The loaded weights and the work done with them."""

    def __init__(self, config: WorkerConfig) -> None:
        self.device = _pick_device(config.device)
        torch.set_num_threads(config.threads)
        self.dim = config.dim
        elements = max(config.model_mib * (1 << 20) // 4, self.dim * self.dim)
        started = time.monotonic()
        # uniform_ touches every page, so the memory is really held (RSS or GPU), like real weights.
        self.weights = torch.empty(elements, dtype=torch.float32, device=self.device).uniform_(-1.0, 1.0)
        self.matrix = self.weights[: self.dim * self.dim].view(self.dim, self.dim) * (2.0 / math.sqrt(self.dim))
        self.batch = 256 if self.device.type == "cuda" else 32
        self._step: Any = _step
        self.compile_s: float | None = None
        self.cache_hits = self.cache_misses = 0
        if config.compile:
            compiling = time.monotonic()
            self._step = torch.compile(_step, dynamic=False)
            self._step(self._input("compile"), self.matrix)  # the compile (or the cache's load) happens here
            self.compile_s = time.monotonic() - compiling
            from torch._dynamo.utils import counters  # what inductor's FX graph cache said

            self.cache_hits = counters["inductor"]["fxgraph_cache_hit"]
            self.cache_misses = counters["inductor"]["fxgraph_cache_miss"]
        self._run_slice(self._input("warm-up"), deadline=time.monotonic() + 0.05)  # first-call costs (cuBLAS init)
        self.load_s = time.monotonic() - started
        self.mib = elements * 4 / (1 << 20)

    def _input(self, prompt: str) -> torch.Tensor:
        generator = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
        return torch.rand(self.batch, self.dim, generator=generator).to(self.device)

    def start(self, message: dict[str, Any], default_ms: int) -> Job:
        ms = message.get("ms")
        ms = ms if isinstance(ms, int) and 0 < ms <= MAX_JOB_MS else default_ms
        job = Job(
            job=str(message["job"]),
            number=message["n"] if isinstance(message.get("n"), int) else 0,
            prompt=str(message.get("prompt", "")),
            budget_s=ms / 1000,
            started=time.monotonic(),
            state=self._input(str(message.get("prompt", ""))),
        )
        return job

    def step(self, job: Job) -> bool:
        """Work on ``job`` for at most SLICE_S; True when its time budget is spent."""
        end = job.started + job.budget_s
        deadline = min(time.monotonic() + SLICE_S, end)
        job.state, steps = self._run_slice(job.state, deadline)
        job.steps += steps
        return time.monotonic() >= end

    def _run_slice(self, x: torch.Tensor, deadline: float) -> tuple[torch.Tensor, int]:
        steps = 0
        while True:
            x = self._step(x, self.matrix)
            steps += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the slice must measure real work, not queued launches
            if time.monotonic() >= deadline:
                return x, steps

    def answer(self, job: Job) -> str:
        checksum = float(job.state.sum())
        return (f"{job.prompt} -> {job.steps} matmuls {self.batch}x{self.dim}x{self.dim} "
                f"on {self.device.type}, checksum {checksum:.4f}")


def _step(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ matrix)


def _pick_device(preference: str) -> torch.device:
    if preference == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", 0)  # omnid sets CUDA_VISIBLE_DEVICES from the unit's gpus
    if preference == "cuda":
        raise SystemExit("OMNID_DEMO_DEVICE=cuda but torch sees no CUDA device "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return torch.device("cpu")


class EngineLink:
    """The DEALER socket to the engine; sends never block (a message for a dead engine is dropped)."""

    def __init__(self, endpoint: str, wakeup_fd: int) -> None:
        self.context = zmq.Context(io_threads=1)
        self.socket = self.context.socket(zmq.DEALER)
        # Queue nothing for an engine that is not connected: stale jobs must not reach the next one.
        self.socket.setsockopt(zmq.IMMEDIATE, 1)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 100)
        self.socket.connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(wakeup_fd, zmq.POLLIN)

    def send(self, message: dict[str, Any]) -> bool:
        return protocol.send_now(self.socket, [protocol.encode(message)]) is None

    def receive(self, timeout_s: float) -> list[dict[str, Any]]:
        messages = []
        if dict(self.poller.poll(max(0, int(timeout_s * 1000)))).get(self.socket):
            while True:
                try:
                    frame = self.socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = protocol.decode(frame)
                if message is None:
                    log.warning("dropped a malformed message from the engine (%d bytes)", len(frame))
                else:
                    messages.append(message)
        return messages

    def close(self, linger_s: float) -> None:
        self.socket.close(linger=int(linger_s * 1000))
        self.context.term()


class StopRequest:
    """Set by SIGTERM/SIGINT; the handler only records the signal, the loop acts on it.

    The signal also writes a byte to ``wakeup_fd`` (signal.set_wakeup_fd), which the loop
    polls along with the engine socket: a zmq poll is otherwise not cut short by a signal.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._reader, self._writer = socket.socketpair()
        for end in (self._reader, self._writer):
            end.setblocking(False)
        signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    @property
    def wakeup_fd(self) -> int:
        return self._reader.fileno()

    def drain(self) -> None:
        try:
            while self._reader.recv(64):
                pass
        except BlockingIOError:
            pass

    def _handle(self, signum: int, _frame: object) -> None:
        self.signum = signum
        protocol.note_stop_signal(signum)

    def __bool__(self) -> bool:
        return self.signum is not None


def run(config: WorkerConfig) -> int:
    stop = StopRequest()
    notifier = Notifier.from_env()
    log.info("%s loading %d MiB (device preference %s)", config.unit, config.model_mib, config.device)
    model = Model(config)
    log.info("%s loaded %.0f MiB on %s in %.2f s", config.unit, model.mib, model.device, model.load_s)
    if model.compile_s is not None:
        log.info("%s compiled its step in %.2f s (inductor's FX graph cache: %d hit, %d miss; "
                 "TORCHINDUCTOR_CACHE_DIR=%s)", config.unit, model.compile_s, model.cache_hits, model.cache_misses,
                 os.environ.get("TORCHINDUCTOR_CACHE_DIR", "unset: under TMPDIR"))
    link = EngineLink(config.engine, stop.wakeup_fd)
    if stop:  # told to stop while loading: leave without claiming readiness
        link.close(linger_s=0)
        return 0
    # READY does not wait for the engine: the engine `requires` the workers, so omnid starts it
    # only once every worker is ready; the worker registers as soon as the engine is up.
    notifier.ready(status=f"loaded {model.mib:.0f} MiB on {model.device}; engine {config.engine}")
    log.info("%s ready; connecting to engine at %s", config.unit, config.engine)

    job: Job | None = None
    next_heartbeat = next_ping = time.monotonic()
    pid = os.getpid()
    while not stop:
        now = time.monotonic()
        if now >= next_heartbeat:
            link.send({"type": "heartbeat", "worker": config.unit, "pid": pid,
                       "device": str(model.device), "busy": job.job if job else None})
            next_heartbeat = now + protocol.HEARTBEAT_S
        if now >= next_ping:
            notifier.watchdog()
            next_ping = now + config.watchdog_s
        wait = 0.0 if job else max(0.0, min(next_heartbeat, next_ping) - time.monotonic())
        for message in link.receive(wait):
            job = _handle(message, job, model, link, config)
        stop.drain()
        if job and model.step(job):
            elapsed_ms = round((time.monotonic() - job.started) * 1000)
            link.send({"type": "result", "job": job.job, "text": model.answer(job),
                       "ms": elapsed_ms, "steps": job.steps})
            job = None

    stopping_since = time.monotonic()
    name = signal.Signals(stop.signum).name if stop.signum else "stop"
    log.info("%s stopping on %s", config.unit, name)
    notifier.stopping()
    if job:
        link.send({"type": "error", "job": job.job, "code": "worker_stopping",
                   "message": f"{config.unit} stopping ({name}) while running request {job.number}"})
    link.send({"type": "bye", "worker": config.unit, "reason": name})
    link.close(linger_s=0.5)
    notifier.close()
    log.info("%s stopped in %.3f s", config.unit, time.monotonic() - stopping_since)
    return 0


# omnid's developer option for its fake GPU backend, from omnid.base.testswitch (where it is
# defined once) rather than omnid.gpu: importing omnid.gpu costs a worker ~150 ms.
FAKE_GPU_ENV = testswitch.FAKE_GPU_ENV


@functools.cache
def _fake_gpu(path: str) -> Any:
    """One fake GPU backend for the worker's life (each has a reader thread of its own),
    read through the fake's public API (omnid.gpu.fake: the file format and its reader)."""
    from omnid.gpu.fake import FakeGpuBackend

    return FakeGpuBackend(path)


def gpu_full(model: Model, config: WorkerConfig) -> str | None:
    """Why this worker's GPU cannot take a request now, or None.

    On CUDA: torch's own view of free memory. Without a GPU, when omnid runs with its
    FAKE GPU backend (the developer option OMNID_DEVELOPER_FAKE_GPU, for omnid's tests),
    the same file omnid reads, so a "GPU taken by another job" fault reaches the worker
    as it would on real hardware."""
    need = config.request_mib
    if model.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(model.device)
        free_mib = free / 2**20
        where = f"GPU {model.device}"
    elif os.environ.get(FAKE_GPU_ENV) and os.environ.get("CUDA_VISIBLE_DEVICES", "").isdigit():
        index = int(os.environ["CUDA_VISIBLE_DEVICES"])
        gpus = {g.index: g for g in _fake_gpu(os.environ[FAKE_GPU_ENV]).gpus()}
        if index not in gpus:
            return None
        free_mib = gpus[index].free_mib
        where = f"FAKE GPU {index}"
    else:
        return None
    if free_mib < need:
        return f"{where} out of memory: {free_mib:.0f} MiB free, a request needs {need} MiB"
    return None


def _handle(message: dict[str, Any], job: Job | None, model: Model, link: EngineLink,
            config: WorkerConfig) -> Job | None:
    kind = message["type"]
    if kind == "run":
        if not isinstance(message.get("job"), str):
            log.warning("ignored a run message without a job id")
            return job
        if job is not None:
            link.send({"type": "error", "job": message.get("job"), "code": "worker_busy",
                       "message": f"{config.unit} is busy with request {job.number}"})
            return job
        full = gpu_full(model, config)
        if full:
            # Fail at once, as a CUDA out-of-memory would: the request gets a 5xx, never a hang.
            link.send({"type": "error", "job": message["job"], "code": "worker_gpu_out_of_memory",
                       "message": f"{config.unit}: {full}"})
            return job
        return model.start(message, config.work_ms)
    if kind == "cancel":
        if job is not None and message.get("job") == job.job:
            link.send({"type": "error", "job": job.job, "code": "cancelled",
                       "message": f"request {job.number} cancelled on {config.unit}"})
            return None
        return job
    if kind == "welcome":
        log.info("%s registered with engine (pid %s)", config.unit, message.get("pid"))
        return job
    log.warning("ignored a %r message from the engine", kind)
    return job


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omnid.demo.worker", description="omnid's reference worker")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the step before READY=1 (also OMNID_DEMO_COMPILE=1)")
    args = parser.parse_args()
    status = run(WorkerConfig.from_env(compile=args.compile))
    # Sockets are closed and the engine told; what is left is the interpreter's teardown, which
    # with torch loaded takes ~0.5 s and frees nothing the kernel would not free at exit anyway.
    protocol.exit_process(status)


if __name__ == "__main__":
    main()
