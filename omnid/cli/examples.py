"""`omnid example vllm DIR`: a working real-engine stack written for the user (omnid(8),
EXAMPLES), the same one the test suite runs (tests/engines/vllm_stack.py calls vllm_unit).

A single-unit vLLM (API server, EngineCore and Worker in one unit) on a socket omnid holds:
the launcher omnid/engines/vllm_listenfd.py (package data, written beside the unit) serves
vLLM's API server on it, so a crash or restart refuses no connection. Every key is written
with a comment saying why; nothing here starts anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

UNIT = "vllm"
ADAPTER = "vllm_listenfd.py"
MAX_INSTANCES = 10  # an instance's probe port is the shared port's tens digit + %i (see probe_listen)
HTTP_BACKLOG = 4096  # the held socket's listen backlog: what waits out a restart (see the unit's comment)


class ExampleError(Exception):
    """An argument that cannot make a stack; the message names it and says why."""


@dataclass(frozen=True)
class VllmStack:
    """What the written unit serves and how; the defaults are for a GPU host and a real model
    (the suite passes its CPU-sized values)."""

    python: str
    model: str
    port: int
    instances: int = 1
    served_name: str = ""  # --served-model-name; empty: vLLM's default (the model as given)
    engine_args: tuple[str, ...] = ()  # more of vLLM's arguments, passed through as given
    env: dict[str, str] = field(default_factory=dict)  # more environment (the CPU build's KV cache size)
    ready_timeout: int = 1800  # weights load and graphs are captured before /health answers
    shutdown_timeout: int = 25  # vLLM's drain on SIGTERM, below stop_timeout
    stop_timeout: int = 30
    abort_timeout: int = 10
    kill_timeout: int = 30
    restart_sec: float = 1
    restart_max_sec: float | None = None
    start_limit_burst: int | None = None
    start_limit_interval: int | None = None
    stall_sec: int = 60
    liveness: bool = True
    progress: bool = True
    canary: bool = True
    kill_mode: bool = True
    ready_interval: bool = True
    held_socket: bool = True  # False: vLLM binds its port itself (the layout before the launcher)
    extra: str = ""  # more TOML lines, appended as given

    def check(self) -> None:
        """ExampleError naming the argument when the stack cannot be written as asked."""
        if not 1 <= self.port <= 65535:
            raise ExampleError(f"--port {self.port}: expected a TCP port from 1 to 65535")
        if not 1 <= self.instances <= MAX_INSTANCES:
            raise ExampleError(f"--instances {self.instances}: expected 1 to {MAX_INSTANCES}")
        if self.instances > 1 and not self.held_socket:
            raise ExampleError("--instances: more than one instance needs the held socket they share")
        if self.instances > 1:
            last = probe_port(self.port, self.instances - 1)
            if last > 65535:
                raise ExampleError(f"--port {self.port}: with --instances {self.instances} each instance's probe "
                                   f"port ({probe_port(self.port, 0)}..{last}) must be below 65536; choose a "
                                   "lower port")
        if not self.model:
            raise ExampleError("--model: expected a model name or directory, got nothing")
        if not os.path.isabs(self.python):
            raise ExampleError(f"--python {self.python}: expected an absolute path (a unit's PATH is omnid's, "
                               "not vLLM's environment)")


def probe_port(port: int, instance: int) -> int:
    """Instance N's own probe port: the shared port's tens, plus one, then N (8000 -> 8010, 8011)."""
    return (port // 10 + 1) * 10 + instance


def probe_listen(port: int) -> str:
    """The same, as a `sockets` address that %i expands per instance."""
    return f"127.0.0.1:{port // 10 + 1}%i"


def adapter_source() -> str:
    """The launcher's text, as shipped in the package (omnid/engines/vllm_listenfd.py)."""
    return resources.files("omnid.engines").joinpath(ADAPTER).read_text()


def adapter_path() -> Path:
    """Where the package's launcher is, for a unit that runs it in place (the suite)."""
    return Path(str(resources.files("omnid.engines").joinpath(ADAPTER)))


def vllm_unit(s: VllmStack, adapter: str | Path | None = None) -> str:
    """The unit file's text: `adapter` is the launcher's path (default: the package's own)."""
    s.check()
    shared = s.instances > 1
    base = f"http://127.0.0.1:{s.port}"
    # Each instance is probed on its own address: through the shared one, any instance could answer.
    probe = f"http://{probe_listen(s.port)}" if shared else base
    if s.held_socket:
        argv = [s.python, str(adapter or adapter_path()), "--model", s.model]
    else:
        argv = [s.python, "-m", "vllm.entrypoints.openai.api_server", "--model", s.model,
                "--host", "127.0.0.1", "--port", str(s.port)]
    if s.served_name:
        argv += ["--served-model-name", s.served_name]
    argv += ["--shutdown-timeout", str(s.shutdown_timeout), *s.engine_args]
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **s.env}
    env_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
    name = s.served_name or s.model
    out = [
        f"# vLLM's OpenAI API server, its EngineCore and Worker in one unit (written by `omnid example vllm`).",
        'description = "vLLM OpenAI API server, EngineCore and Worker"',
        'role = "serve"',
    ]
    if s.held_socket:
        out += [
            f"# {ADAPTER} serves vLLM's API server on the socket below (vLLM binds its own port",
            "# otherwise): omnid holds it across every crash and restart, so a client that connects",
            "# while vLLM restarts waits in its backlog instead of being refused. Every argument after",
            "# the launcher's path is vLLM's own. The backlog (4096, the kernel's usual somaxconn) is",
            "# what waits out a restart: at 20 new connections a second it holds 200 s of one; past it,",
            "# new connections wait on their SYN retries and time out instead.",
        ]
    else:
        out.append("# vLLM binds its port itself: between a crash and the next start, connections are refused.")
    out.append(f"exec = {json.dumps(argv)}")
    out += [
        "# spawn: a worker forked from a threaded parent can deadlock on a lock copied mid-use.",
        "# Offline: the weights are on disk; a (re)start must not wait on the network.",
        f"env = {{ {env_toml} }}",
    ]
    if s.held_socket:
        if shared:
            out += [
                f"# {s.instances} engines behind one address: the instances share ONE socket on 127.0.0.1:{s.port}",
                "# (an instance whose EngineCore dies stops accepting at once; the others take every new",
                "# connection while it restarts), and each has its own probe address, %i being its number",
                f"# ({probe_port(s.port, 0)}, {probe_port(s.port, 1)}, ...), so that omnid asks that instance and no other.",
                "# On vLLM's CPU build the launcher runs each instance on its own block of this host's CPUs",
                "# (vLLM binds every instance's Worker to core 0: a restarting instance would load on the",
                "# core the others serve on); VLLM_CPU_OMP_THREADS_BIND in `env` places them yourself.",
                f"instances = {s.instances}",
                f'sockets = [{{ listen = "127.0.0.1:{s.port}", name = "http", backlog = {HTTP_BACKLOG} }}, '
                f'{{ listen = "{probe_listen(s.port)}", name = "probe" }}]',
            ]
        else:
            out.append(f'sockets = [{{ listen = "127.0.0.1:{s.port}", name = "http", backlog = {HTTP_BACKLOG} }}]')
    out += [
        "# vLLM's /health answers 200 once the engine is up and the server listens.",
        f'ready = {{ http = "{probe}/health" }}',
        "# The weights load (and, without --enforce-eager, graphs compile) before that.",
        f"ready_timeout = {s.ready_timeout}",
    ]
    if s.ready_interval:
        out += ["# Readiness is asked again while it runs: omnid's /health turns 503 as soon as vLLM's does.",
                "ready_interval = 1"]
    if s.liveness:
        out += ["# An API server that closed its port and never exits (seen after a SIGINT: its shutdown",
                "# hung with EngineCore and Worker alive): 3 failures 2 s apart, each given 5 s.",
                f'liveness = {{ http = "{probe}/health", interval = 2, timeout = 5, failures = 3 }}']
    if s.progress:
        canary = ""
        if s.canary:
            body = json.dumps({"model": name, "prompt": "ping", "max_tokens": 1})
            canary = (f', canary = {{ http = "{probe}/v1/completions", '
                      f'headers = {{ "Content-Type" = "application/json" }}, body = {json.dumps(body)} }}')
        out += ["# A hung Worker behind a /health that still says 200: tokens must be generated while",
                "# requests run. vLLM's gauges freeze with its engine (a Worker hung between two batches",
                "# says \"0 running\"), so once idle for stall_sec the canary asks for one token.",
                f'progress = {{ metrics = "{probe}/metrics", counter = "vllm:generation_tokens_total", '
                f'busy = ["vllm:num_requests_running"], stall_sec = {s.stall_sec}, interval = 1{canary} }}']
    if s.kill_mode:
        out += ["# A stop sends SIGTERM to the API server alone: it finishes what it accepted (for up to",
                f"# --shutdown-timeout {s.shutdown_timeout} s; vLLM's default 0 aborts it with 500s), then its",
                "# EngineCore and Worker are SIGKILLed. The default would SIGTERM all three at once.",
                'kill_mode = "mixed"']
    out += [
        f"# Above the drain (--shutdown-timeout {s.shutdown_timeout}).",
        f"stop_timeout = {s.stop_timeout}",
        "# A hung tree never finishes that drain: SIGKILL this long after its SIGTERM instead.",
        f"abort_timeout = {s.abort_timeout}",
        "# Time for the processes to free the GPU after a SIGKILL.",
        f"kill_timeout = {s.kill_timeout}",
        "# A crash (the API server, EngineCore or Worker dies: the whole tree goes) restarts it.",
        'restart = "on-failure"',
        f"restart_sec = {s.restart_sec:g}",
    ]
    if s.restart_max_sec is not None:
        out.append(f"restart_max_sec = {s.restart_max_sec:g}")
    if s.start_limit_burst is not None:
        out.append(f"start_limit_burst = {s.start_limit_burst}")
    if s.start_limit_interval is not None:
        out.append(f"start_limit_interval = {s.start_limit_interval}")
    if s.extra:
        out.append(s.extra.strip("\n"))
    return "\n".join(out) + "\n"


def write_vllm(directory: str | Path, s: VllmStack) -> list[Path]:
    """DIR/vllm.toml and DIR/vllm_listenfd.py (the launcher the unit runs); the paths written.
    ExampleError names the argument at fault: DIR when it is a file or holds other units."""
    s.check()
    d = Path(directory).absolute()
    if d.exists() and not d.is_dir():
        raise ExampleError(f"DIR {d}: is not a directory")
    others = sorted(p.name for p in d.glob("*.toml") if p.name != f"{UNIT}.toml") if d.is_dir() else []
    if others:
        raise ExampleError(f"DIR {d}: already holds other units ({', '.join(others)}); give an empty or new "
                           "directory (every .toml there would be part of the stack)")
    try:
        d.mkdir(parents=True, exist_ok=True)
        written = []
        if s.held_socket:
            adapter = d / ADAPTER
            adapter.write_text(adapter_source())
            written.append(adapter)
            unit = vllm_unit(s, adapter)
        else:
            unit = vllm_unit(s)
        (d / f"{UNIT}.toml").write_text(unit)
        written.insert(0, d / f"{UNIT}.toml")
    except OSError as exc:
        raise ExampleError(f"DIR {d}: cannot write there: {exc.strerror}") from None
    return written
