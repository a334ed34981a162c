"""FM-40 on the real engine: vLLM on a socket omnid holds (issue 35), as `omnid example vllm`
writes it, on vLLM's CPU build with the tiny local model (tests/engines/vllm_env.py finds or
makes both; the module skips with the reason where vLLM cannot run).

  1. one instance: a client connects every 100 ms across two SIGKILLs of the API server ->
     0 connections refused (they wait in omnid's backlog); refused, reset, answered and the
     time to serving again are printed;
  2. `instances = 2` on one held socket: a SIGKILL of one instance's EngineCore (found in
     /proc under that instance's main pid) -> no request that arrives after the kill fails;
     the killed instance's requests in flight fail fast; it comes back by itself, its Worker
     on its own CPUs (the launcher gives each instance its block: vLLM's CPU build put every
     instance's Worker on core 0, where a restart beside a serving instance took 5 min and
     more than 480 s in 2 of 3 runs); with one instance, the same fault for comparison:
     requests wait out the restart in the held backlog.

A vLLM start costs ~45 s of CPU on two cores: the module starts one stack of one instance,
which takes the API server's two SIGKILLs and then the one-instance EngineCore row's (three
restarts on the same held socket), and one of two instances; each fault costs one restart.
Every process is checked in /proc.
"""

from __future__ import annotations

import asyncio
import ast
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.engines import vllm_env
from tests.engines.vllm_stack import (CPU_ENGINE_ARGS, MODEL_NAME, StackSlots, full_tree, port_with_free_probes, serves,
                                      signal_proc)
from omnid.cli.examples import probe_port
from tests.harness import REPO, Daemon, repo_pythonpath, wait_for

# One xdist worker runs the module's rows in turn (each starts its own stack), and each row
# holds a machine-wide slot per vLLM it starts (tests/engines/vllm_stack.StackSlots).
pytestmark = [pytest.mark.timeout(1500), pytest.mark.xdist_group("vllm-socket")]

START_S = 480  # a (re)start on two loaded cores
ADAPTER = REPO / "omnid" / "engines" / "vllm_listenfd.py"


@pytest.fixture(scope="module")
def engine():
    try:
        py = vllm_env.ensure_venv()
        model = vllm_env.ensure_model(py)
    except vllm_env.EngineUnavailable as exc:
        pytest.skip(f"real vLLM cannot run here: {exc}")
    return py, model


def test_the_launcher_imports_nothing_of_omnid():
    """It runs in vLLM's environment, where omnid is not installed: stdlib and vllm only."""
    tree = ast.parse(ADAPTER.read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    foreign = sorted(m for m in mods if m.split(".")[0] not in sys.stdlib_module_names
                     and m.split(".")[0] not in ("vllm", "uvicorn", "uvloop"))
    assert not foreign, f"the launcher imports {foreign}: only the stdlib and vLLM's own are there"


def test_the_launcher_without_a_socket_exits_2_naming_the_key(engine):
    py, _ = engine
    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    t0 = time.monotonic()
    r = subprocess.run([str(py), str(ADAPTER), "--model", "x"], capture_output=True, text=True, timeout=60, env=env)
    took = time.monotonic() - t0
    assert r.returncode == 2, r
    assert "no listening socket was passed" in r.stderr and "sockets = [" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert took < 10, f"the check comes before vLLM's imports; took {took:.1f} s"


def _launcher_module():
    """The launcher as a module of its own (it is a script run by vLLM's python, not a package
    module): its helpers that need no vLLM are tested here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_listenfd_under_test", ADAPTER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.fast
@pytest.mark.parametrize("cpus, instances, blocks", [
    ({0, 1}, 2, [{0}, {1}]),
    (set(range(8)), 2, [{0, 1, 2, 3}, {4, 5, 6, 7}]),
    ({0, 1, 2, 3, 4}, 2, [{0, 1, 2}, {3, 4}]),
    ({2, 5, 9}, 3, [{2}, {5}, {9}]),
    ({0, 1}, 3, [{0}, {1}, {0}]),  # fewer CPUs than instances: one each, in turn
])
def test_each_instance_gets_its_own_block_of_cpus(cpus, instances, blocks):
    lf = _launcher_module()
    got = [lf.instance_cpus(cpus, i, instances) for i in range(instances)]
    assert got == blocks
    if len(cpus) >= instances:
        assert set().union(*got) == cpus and sum(map(len, got)) == len(cpus), "every CPU in exactly one block"


@pytest.mark.fast
@pytest.mark.parametrize("env", [
    {},  # not an instanced unit
    {"OMNID_INSTANCE": "0", "OMNID_INSTANCES": "1"},
    {"OMNID_INSTANCE": "1", "OMNID_INSTANCES": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-3"},  # the user placed it
    {"OMNID_INSTANCE": "1", "OMNID_INSTANCES": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    {"OMNID_INSTANCE": "x", "OMNID_INSTANCES": "2"},
])
def test_the_launcher_places_nothing_unless_instanced_and_unplaced(env):
    """These return before vLLM is imported (none is here) and leave the affinity alone."""
    lf = _launcher_module()
    before = os.sched_getaffinity(0)
    assert lf.one_cpu_block_per_instance(dict(env)) is None
    assert os.sched_getaffinity(0) == before


class LongRequest:
    """One completion in a thread of its own: its end (monotonic) and outcome once done."""

    def __init__(self, port: int, max_tokens: int) -> None:
        self.start = time.monotonic()
        self.end: float | None = None
        self.outcome: int | str | None = None
        self._thread = threading.Thread(target=self._run, args=(port, max_tokens), daemon=True, name="long-request")
        self._thread.start()

    def _run(self, port: int, max_tokens: int) -> None:
        import http.client

        body = json.dumps({"model": MODEL_NAME, "prompt": "the supervisor", "max_tokens": max_tokens,
                           "ignore_eos": True, "temperature": 0})
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            self.outcome = r.status
        except (OSError, http.client.HTTPException) as exc:
            self.outcome = type(exc).__name__
        self.end = time.monotonic()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "a long completion still waits"


class KeptInFlight:
    """Long completions kept in flight on `port` by a thread, one per length in `max_tokens`:
    one that ends is replaced at once, up to the kill (stop() right after it: one sent from
    then on is not the killed engine's, and is told apart by its `start`). The lengths differ
    so that they never end together (equal ones, sent together, were batched and finished in
    one step: a kill at load 15 came in that step's last moment and all three were answered
    200). After stop() returns none is sent; `sent` holds every one."""

    def __init__(self, port: int, max_tokens: tuple[int, ...]) -> None:
        self.sent: list[LongRequest] = []
        self._stopped = threading.Event()
        self._args = (port, max_tokens)
        self._thread = threading.Thread(target=self._keep, daemon=True, name="long-requests")
        self._thread.start()

    def _keep(self) -> None:
        port, lengths = self._args
        slots: dict[int, LongRequest] = {}
        while not self._stopped.is_set():
            for i, n in enumerate(lengths):
                if i not in slots or slots[i].end is not None:
                    slots[i] = LongRequest(port, n)
                    self.sent.append(slots[i])
            self._stopped.wait(0.005)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the thread that sends long completions did not stop"


def _running(port: int) -> float:
    """vllm:num_requests_running as the instance on `port` reports it (0 when it cannot say)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def _cpus_of(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list:"))


@pytest.fixture
def vllm_slots(request):
    """One slot per vLLM instance the row starts, held until its daemon is closed (this
    fixture is asked for before daemon_factory, so it is torn down after it)."""
    callspec = getattr(request.node, "callspec", None)
    with StackSlots(callspec.params.get("instances", 1) if callspec else 1) as slots:
        yield slots


def _write_example(tmp: Path, py, model, port: int, instances: int = 1) -> Path:
    """The stack as a user gets it: `omnid example vllm` (the CLI), with the CPU sizes after --."""
    d = tmp / f"vllm-{instances}"
    r = subprocess.run([sys.executable, "-m", "omnid", "example", "vllm", str(d), "--python", str(py),
                        "--model", str(model), "--port", str(port), "--instances", str(instances),
                        "--served-model-name", MODEL_NAME, "--", *CPU_ENGINE_ARGS],
                       capture_output=True, text=True, timeout=60, cwd=str(REPO),
                       env=dict(os.environ, PYTHONPATH=repo_pythonpath()))
    assert r.returncode == 0, r
    c = subprocess.run([sys.executable, "-m", "omnid", "check", str(d)], capture_output=True, text=True,
                       timeout=60, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=repo_pythonpath()))
    assert c.returncode == 0, c
    return d


# --------------------------------------------------------------------------- clients


class Connector:
    """Connects every `every` s and sends one HTTP request on each connection (asyncio, one
    thread: hundreds may wait in the backlog at once). Each outcome: (start, end, what), what
    being the HTTP status or 'refused', 'reset', 'timeout', an exception name."""

    def __init__(self, port: int, request: bytes, every: float = 0.05, timeout: float = 300) -> None:
        self.port, self.request, self.every, self.timeout = port, request, every, timeout
        self.results: list[tuple[float, float, int | str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True, name="connector")

    async def _one(self) -> None:
        t0 = time.monotonic()
        what: int | str
        writer = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), self.timeout)
            writer.write(self.request)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout)
            what = int(head.split(b" ", 2)[1])
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length:
                await asyncio.wait_for(reader.readexactly(length), self.timeout)
        except ConnectionRefusedError:
            what = "refused"
        except (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError):
            what = "reset"
        except asyncio.TimeoutError:
            what = "timeout"
        except OSError as exc:
            what = type(exc).__name__
        finally:
            if writer is not None:
                writer.close()
        self.results.append((t0, time.monotonic(), what))

    async def _main(self) -> None:
        tasks = set()
        while not self._stop.is_set():
            t = asyncio.create_task(self._one())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            await asyncio.sleep(self.every)
        if tasks:
            await asyncio.wait(tasks, timeout=self.timeout + 5)

    def __enter__(self) -> "Connector":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 30)
        assert not self._thread.is_alive(), "the connector still waits on connections"

    def counts(self, since: float = 0.0, until: float = float("inf")) -> dict[str, int]:
        out: dict[str, int] = {}
        for s, _e, what in list(self.results):
            if since <= s < until:
                key = "answered" if what == 200 else str(what)
                out[key] = out.get(key, 0) + 1
        return out


def _stopped_accepting(d, unit: str, t_kill: float) -> float:
    """When the killed instance's API server closed its listener (monotonic, as its launcher
    printed it; omnid.engines.vllm_listenfd), from the unit's kept output."""
    from omnid.engines.vllm_listenfd import STOPPED_ACCEPTING

    lines = d.ok("logs", {"unit": unit, "n": 2000})[unit]
    times = [float(m.group(1)) for ln in lines if STOPPED_ACCEPTING in str(ln)
             for m in [re.search(r"\(monotonic ([0-9.]+)\)", str(ln))] if m]
    times = [t for t in times if t >= t_kill]
    assert times, f"{unit}: no '{STOPPED_ACCEPTING}' line after the kill in its output: {lines[-30:]}"
    return times[0]


def health_request(port: int) -> bytes:
    return f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()


def completion_request(port: int, max_tokens: int = 8) -> bytes:
    body = json.dumps({"model": MODEL_NAME, "prompt": "the supervisor", "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


# --------------------------------------------------------------------------- the daemon


def _daemon(daemon_factory, stack_dir: Path, backend: str):
    env = {"OMNID_CHECK_INVARIANTS": "1", "INVOCATION_ID": "", "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMNID_TEST_CGROUP": "1" if backend == "cgroup" else "0"}
    d = daemon_factory(stack_dir, env=env)
    d.ok("status")
    return d


def _serving(d, unit: str, port: int, not_pid: int | None = None, timeout: float = START_S) -> int:
    def up():
        u = d.unit(unit)
        if u["state"] == "failed" and "restarting" not in (u.get("reason") or ""):
            raise AssertionError(f"{unit} failed for good: {u['reason']}\n{d.log()[-3000:]}")
        return u["state"] == "active" and u["ready"] and u["pid"] != not_pid and u["pid"]

    def seen() -> str:
        lines = [line for line in d.log().splitlines() if f'"{unit}"' in line and '"GET /' not in line
                 and '"POST /' not in line]
        return f"{unit} active and ready; last: {d.unit(unit)}\n" + "\n".join(lines[-25:])

    pid = wait_for(up, timeout, seen, interval=0.2)
    wait_for(lambda: serves(port), 60, f"a completion from {unit} on port {port}", interval=0.2)
    return pid


def _tree_gone(procs, timeout: float = 60) -> None:
    wait_for(lambda: not any(p.present() for p in procs), timeout,
             lambda: "the killed tree gone: left " + ", ".join(f"{p.pid} {p.comm}" for p in procs if p.present()))


class OneInstance:
    """The one-instance stack (pgroup) that the API-server row and then the one-instance
    EngineCore row take their faults on, in file order: a fresh vLLM start is ~45 s of CPU
    and, in a parallel run, minutes of this module's worker, which is the run's longest."""

    def __init__(self, engine, module_test_id: str, workdir: Path) -> None:
        py, model = engine
        self.port = port_with_free_probes(1)
        env = {"OMNID_CHECK_INVARIANTS": "1", "INVOCATION_ID": "", "VLLM_CPU_KVCACHE_SPACE": "1",
               "OMNID_TEST_CGROUP": "0", "OMNID_TEST_ID": module_test_id}
        self.slot = StackSlots(1).__enter__()
        self.d = Daemon(_write_example(workdir, py, model, self.port), env=env)
        try:
            self.d.start()
            self.d.ok("status")  # the control socket opened now, before a row's fd baseline
        except BaseException:
            self.close()
            raise
        self.closed = False

    def for_row(self, request) -> Daemon:
        request.node.omnid_daemons = [self.d]  # its log's tail in a failing row's report
        return self.d

    def close(self) -> None:
        """After its last row (or at the module's end): its daemon stopped, its state checked."""
        if getattr(self, "closed", False):
            return
        self.closed = True
        try:
            self.d.close()
            bad = self.d.invariant_violations()
            assert not bad, "the daemon's state disagreed with the kernel:\n" + "\n".join(bad[:10])
        finally:
            self.slot.__exit__(None, None, None)


@pytest.fixture(scope="module")
def one_instance(engine, module_test_id, tmp_path_factory):
    stack = OneInstance(engine, module_test_id, tmp_path_factory.mktemp("one-instance"))
    yield stack
    stack.close()


def test_fm40_api_server_sigkill_twice_refuses_no_connection(one_instance, request):
    backend = "pgroup"
    d, port = one_instance.for_row(request), one_instance.port
    pid = _serving(d, "vllm", port)
    kills = []
    # 10 connections a second: the held backlog (4096) waits out 400 s of a restart, which a
    # parallel run's load can make last minutes (at 20 a second it overflowed there: clients
    # whose SYNs the full backlog dropped timed out, none was refused).
    with Connector(port, health_request(port), every=0.1) as conn:
        wait_for(lambda: conn.counts().get("answered", 0) > 20, 30, "the client answered before the kills")
        for n in range(2):
            tree = full_tree(pid)
            t_kill = time.monotonic()
            signal_proc(tree.api, signal.SIGKILL)
            _tree_gone(tree.procs)
            gone = time.monotonic() - t_kill
            pid = _serving(d, "vllm", port, not_pid=pid)
            # Serving again: the first answer from the new API server to a connection made after the kill.
            again = min((e for s, e, w in list(conn.results) if s >= t_kill and w == 200), default=None)
            kills.append({"kill": n + 1, "tree_gone_s": round(gone, 2),
                          "serving_again_s": round(again - t_kill, 1) if again else None,
                          **conn.counts(since=t_kill)})
            wait_for(lambda: conn.counts(since=time.monotonic() - 2).get("answered", 0) > 5, 60,
                     "answers again after the restart")
    totals = conn.counts()
    print(f"\nFM-40 {backend}, one instance on a held socket, a connection every {conn.every * 1000:.0f} ms:")
    for k in kills:
        print(f"  API server SIGKILL: {k}")
    print(f"  all: {totals}")
    assert totals.get("refused", 0) == 0, f"connections refused: {totals}; per kill: {kills}"
    for k in kills:
        assert k["serving_again_s"] is not None, f"never answered after kill {k}"
    assert not [w for _s, _e, w in conn.results if w not in (200, 503, "reset")], \
        f"outcomes other than an answer, a 503 while starting, or a reset of an accepted connection: {totals}"


@pytest.mark.parametrize("backend", ["pgroup"])
@pytest.mark.parametrize("instances", [1, 2])
def test_fm40_enginecore_sigkill_on_one_held_socket_fails_no_request_after_it(
        engine, request, tmp_path, backend, instances):
    """With two instances the survivor answers what arrives after the kill at once; with one,
    it waits in the held backlog for the restart (the same assertion, another latency). One
    instance: the API-server row's stack, its third restart on the same held socket."""
    if instances == 1:
        one = request.getfixturevalue("one_instance")
        d, port = one.for_row(request), one.port
    else:
        request.getfixturevalue("vllm_slots")  # asked before daemon_factory: torn down after it
        port = port_with_free_probes(instances)
        d = _daemon(request.getfixturevalue("daemon_factory"), _write_example(tmp_path, engine[0], engine[1], port,
                                                                             instances=instances), backend)
    names = [f"vllm@{i}" for i in range(instances)] if instances > 1 else ["vllm"]
    pids = {u: _serving(d, u, port, timeout=START_S * instances) for u in names}
    fd3 = {u: os.readlink(f"/proc/{p}/fd/3") for u, p in pids.items()}
    assert len(set(fd3.values())) == 1, f"the instances accept on different sockets: {fd3}"
    workers = {u: _cpus_of(full_tree(p).worker.pid) for u, p in pids.items()}
    if instances > 1 and len(os.sched_getaffinity(0)) >= instances:
        assert len(set(workers.values())) == instances, f"the instances' Workers share CPUs: {workers}"
    victim_unit = names[0]
    # One-token completions, 5 a second (each instance computes on its own CPUs, but a client
    # 4x busier starved the restart on this 2-core VM all the same).
    own = probe_port(port, 0) if instances > 1 else port  # the victim's own address
    with Connector(port, completion_request(port, max_tokens=1), every=0.2, timeout=300) as conn:
        wait_for(lambda: conn.counts().get("answered", 0) > 20, 60, "completions answered before the kill")
        tree = full_tree(pids[victim_unit])
        victim = tree.engine
        # Requests the killed instance is sure to hold: long completions sent to its own
        # address, running when the kill comes. They must fail, and fast.
        # On a quiet machine one is done within a second, and at load 20 the test was seen
        # descheduled past both of a pair between seeing them run and the kill: three of
        # different lengths are kept in flight, each that ends replaced at once, up to the kill
        # and stopped right after it: stopped just before it (fresh-clone run 24, load ~26), two
        # had ended unreplaced by the kill, and the third was answered 200 30 ms after it, its
        # last tokens sent before the engine died: none was left to fail.
        long = KeptInFlight(own, max_tokens=(480, 330, 190))
        wait_for(lambda: _running(own) >= 1, 10, f"long completions running on {victim_unit}", interval=0.02)
        t_kill = time.monotonic()
        signal_proc(victim, signal.SIGKILL)
        long.stop()
        _tree_gone(tree.procs)
        gone = time.monotonic() - t_kill
        try:
            new0 = _serving(d, victim_unit, port, not_pid=pids[victim_unit], timeout=START_S)
        except AssertionError:
            print(f"\nFM-40 {backend}, {instances} instance(s): {victim_unit} not back; arriving after the kill "
                  f"so far: {conn.counts(since=t_kill)}; in flight at the kill: "
                  f"{[(round(e - t_kill, 2), w) for s, e, w in conn.results if s < t_kill < e]}")
            raise
        back = time.monotonic() - t_kill
        t_closed = _stopped_accepting(d, victim_unit, t_kill)
        assert _cpus_of(full_tree(new0).worker.pid) == workers[victim_unit], \
            f"the restarted {victim_unit}'s Worker left its CPUs ({workers[victim_unit]})"
        for other in names[1:]:
            assert d.unit(other)["pid"] == pids[other], f"{other} was restarted too"
        wait_for(lambda: conn.counts(since=time.monotonic() - 2).get("answered", 0) > 5, 60, "answers after")
    for r in long.sent:
        r.join(30)
    # In flight at the kill: the long completions on the victim, and the client's that were.
    before = [(s, e, w) for s, e, w in conn.results if s < t_kill and e > t_kill]
    # In flight at the kill: sent before it, not ended by it (those that ended before it were answered).
    doomed = [r for r in long.sent if r.start < t_kill < r.end]
    assert doomed, f"no long completion was in flight at the kill: {[(r.end - t_kill, r.outcome) for r in long.sent]}"
    before += [(t_kill, r.end, r.outcome) for r in doomed]
    # vLLM learns of its engine's death some ms after the kill (seen: 60 ms at load 3, 190 ms
    # at load 20); a connection the victim accepted before that is its own, in flight, and
    # fails like the others: "after the kill" starts when vLLM failed the first of them. A
    # long completion whose last tokens the engine had sent before it died is answered in
    # that moment (seen: 200 at 21 ms after the kill, in a CI run at load 20): finished, not
    # in flight; one answered after vLLM failed another is the failure.
    failed = [r for r in doomed if r.outcome != 200]
    assert failed, f"no long completion on the killed {victim_unit} failed: {[(r.end - t_kill, r.outcome) for r in doomed]}"
    t_dead = min(r.end for r in failed)
    finished = [r for r in doomed if r.outcome == 200]
    assert all(r.end <= t_dead for r in finished), \
        f"a long completion on the killed {victim_unit} was answered after vLLM knew of the death: " \
        f"{[(r.end - t_kill, r.outcome) for r in doomed]}"
    before += [(s, e, w) for s, e, w in conn.results if t_kill <= s < t_dead]
    failed_in_flight = [(round(e - t_kill, 2), w) for s, e, w in before if w != 200]
    # Until the killed instance's API server closed its listener (the launcher says when, within
    # 20 ms of vLLM marking its engine dead; later under load, as that process is scheduled),
    # it accepted what came and answered as vLLM does for a dead engine (500): vLLM's window,
    # not omnid's. From then on every connection waits on the held socket for a live server.
    window = conn.counts(since=t_dead, until=t_closed)
    after = conn.counts(since=t_closed)
    waits = sorted(e - s for s, e, w in conn.results if s >= t_closed)
    print(f"\nFM-40 {backend}, {instances} instance(s) on one socket, EngineCore of {victim_unit} SIGKILLed: vLLM knew "
          f"{t_dead - t_kill:.2f} s after the kill, tree gone {gone:.2f} s, serving again {back:.1f} s; arriving after the kill answered within "
          f"{waits[len(waits) // 2]:.2f} s (median), {waits[-1]:.1f} s (max); in flight at the kill: {len(before)}, failed "
          f"{len(failed_in_flight)} (seconds after the kill, outcome: {failed_in_flight}); the killed API server "
          f"stopped accepting {t_closed - t_kill:.2f} s after the kill, answering {window} before that; arriving "
          f"after that: {after}; all: {conn.counts()}; Workers' CPUs {workers}; load {os.getloadavg()[0]:.1f}")
    (tmp_path.parent / f"fm40-{instances}-instances.json").write_text(json.dumps(
        {"t_kill": t_kill, "gone": gone, "back": back, "results": conn.results}))
    assert after.get("answered", 0) > 0 and set(after) == {"answered"}, \
        f"requests that arrived after the killed API server stopped accepting and failed: {after}"
    assert set(window) <= {"answered", "500"} and t_closed - t_dead < 5, \
        f"in vLLM's window ({t_closed - t_dead:.2f} s): {window} (only its own 500s belong there)"
    assert all(t < 5 for t, _w in failed_in_flight), f"the dead instance's requests did not fail fast: {failed_in_flight}"
    assert os.readlink(f"/proc/{new0}/fd/3") == fd3[victim_unit], f"the new {victim_unit} accepts on the held socket"
    if instances == 1:
        request.getfixturevalue("one_instance").close()  # its last row: its vLLM's memory and slot go now
