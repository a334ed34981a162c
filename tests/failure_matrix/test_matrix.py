"""The failure matrix (rows FM-01..FM-22, FM-27, FM-28 and FM-34) on the reference stack: one test per
row, named after it. Every row checks the kernel (/proc), not omnid's word alone.

Figures each row measured (death -> failed, worst in-flight end) are appended
to $OMNID_MATRIX_REPORT when set (python -m tests.failure_matrix collects them).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
import time

import pytest

from omnid.base import linux
from omnid.gpu.fake import write_fake_gpu_file
from tests.failure_matrix.harness import DemoStack, Load
from tests.harness import alive, wait_for

pytestmark = pytest.mark.matrix

PY = sys.executable


def report(row: str, **figures) -> None:
    path = os.environ.get("OMNID_MATRIX_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"row": row, **figures}) + "\n")


@pytest.fixture
def stack_factory(daemon_factory):
    made: list[DemoStack] = []

    def make(restart: str = "no", overrides=None, extra_units=None, env=None):
        s = DemoStack(restart, overrides)
        for name, text in (extra_units or {}).items():
            (s.dir / f"{name}.toml").write_text(text)
        s.env.update(env or {})
        made.append(s)
        d = s.daemon(daemon_factory)
        return s, d

    yield make
    for s in made:
        s.cleanup()


@contextlib.contextmanager
def under_load(s: DemoStack, load: bool):
    """A client keeping >= 4 requests in flight for the duration (None when idle);
    yields once it has seen requests succeed, stops it whatever happens."""
    ld = Load(s.serve_port).start() if load else None
    try:
        if ld:
            ld.wait_successes(4)
        yield ld
    finally:
        if ld:
            ld.stop()


def finish(row: str, ld: Load | None, fault: float, serve_killed: bool = False, **figures) -> None:
    """Under load: every request in flight at the fault ended within 2 s (Load.check_fail_fast).
    Then report."""
    if ld:
        ld.stop()
        figures.update(ld.check_fail_fast(fault, serve_killed=serve_killed))
    report(row, **figures)


def stack_pids(d) -> dict[str, int]:
    return {n: u["pid"] for n, u in d.units().items() if u["pid"]}


def tree_of(pid: int) -> list[int]:
    from omnid.base.linux import children_of

    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children_of(p))
    return out


def no_residue(pids) -> bool:
    return not any(alive(p) for p in pids)


def state_events(d) -> list[dict]:
    return [e for e in d.log_events() if e.get("event") == "unit state"]


def first_event(d, unit: str, to: str, after_ts: str = "") -> dict | None:
    for e in state_events(d):
        if e["unit"] == unit and e["to"] == to and e["timestamp"] >= after_ts:
            return e
    return None


def kill_and_time_failed(d, unit: str, sig: int) -> float:
    """Signal a unit's main process; return ms until omnid published `failed` for it."""
    sub = d.events_socket()  # returns once the daemon counted the subscription: it is live
    pid = d.unit(unit)["pid"]
    t0 = time.monotonic()
    fd = os.pidfd_open(pid)
    signal.pidfd_send_signal(fd, sig)
    os.close(fd)
    try:
        deadline = t0 + 10
        while time.monotonic() < deadline:
            if sub.poll(100):
                ev = json.loads(sub.recv())
                if ev["unit"] == unit and ev["to"] == "failed":
                    return (time.monotonic() - t0) * 1000
        raise AssertionError(f"{unit} not failed 10 s after {signal.Signals(sig).name}")
    finally:
        sub.close(0)


class DeathWatch:
    """When each process died, from the kernel: a thread waits on their pidfds (opened before
    the fault) and notes the moment each turns readable. Stop order is read from these, not
    from omnid's log."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.fds = {os.pidfd_open(pid): name for name, pid in pids.items()}
        self.died: dict[str, float] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        _open_watches.append(self)

    def _run(self) -> None:
        # Ahead of every other process, so that the moment noted is the death's and not this
        # thread's turn for a CPU: at load 15, two deaths 10 ms apart were once seen in one
        # wake-up and noted as simultaneous. SCHED_FIFO where allowed (root), else nice -20.
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        except OSError:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -20)
        left = set(self.fds)
        while left:
            ready, _, _ = select.select([*left, self._wake_r], [], [])
            now = time.monotonic()
            if self._wake_r in ready:
                return
            for fd in ready:
                self.died[self.fds[fd]] = now
                left.discard(fd)

    def assert_order(self, *tiers: tuple[str, ...], timeout: float = 15) -> None:
        """Every process of a tier died before any of the next tier's (each tier waited for)."""
        names = [n for tier in tiers for n in tier]
        wait_for(lambda: all(n in self.died for n in names), timeout, f"{names} dead (died: {self.died})")
        for first, then in zip(tiers, tiers[1:]):
            assert max(self.died[n] for n in first) < min(self.died[n] for n in then), \
                f"{then} died before {first} had: {self.died}"

    def close(self) -> None:
        if self not in _open_watches:
            return
        _open_watches.remove(self)
        os.write(self._wake_w, b"x")
        self._thread.join(5)
        for fd in (*self.fds, self._wake_r, self._wake_w):
            os.close(fd)


_open_watches: list[DeathWatch] = []


@pytest.fixture(autouse=True)
def _death_watches_closed():
    """A row that fails midway still closes its DeathWatch (pidfds, pipe) before the leak check."""
    yield
    while _open_watches:
        _open_watches[-1].close()


@contextlib.contextmanager
def death_watch(d, *names: str):
    pids = stack_pids(d)
    w = DeathWatch({n: pids[n] for n in names})
    try:
        yield w
    finally:
        w.close()


# ----------------------------------------------------------------- worker faults


def _worker_fault(stack_factory, row: str, sig: int, restart: str, load: bool) -> None:
    s, d = stack_factory(restart=restart)
    d.wait_all_active(120)
    with under_load(s, load) as ld:
        old = stack_pids(d)
        victim_tree = tree_of(old["worker@0"])
        deaths = DeathWatch({n: old[n] for n in ("serve", "engine")})
        fault = time.monotonic()
        ms = kill_and_time_failed(d, "worker@0", sig)
        w = d.unit("worker@0")
        if restart == "no":  # with on-failure it may be on its way back already: its restart is checked below
            assert w["state"] == "failed", w
        name = signal.Signals(sig).name
        code, body = d.http("/health")
        if restart == "no":
            assert code == 503
            assert name in body["units"]["worker@0"]["reason"]
            wait_for(lambda: d.unit("serve")["state"] == "inactive" and d.unit("engine")["state"] == "inactive",
                     15, "serve and engine stopped")
            deaths.assert_order(("serve",), ("engine",))
            wait_for(lambda: no_residue(victim_tree), 5, "no residue of the worker")
            # The workers are one worker group: the other worker was stopped with it, not left running.
            peer = d.wait_state("worker@1", "inactive", 15)
            assert "worker group workers is down: worker@0 failed" in peer["reason"], peer
            assert not alive(old["worker@1"])
            # Stable: still failed and 503 a while later.
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                assert d.http("/health")[0] == 503
                assert d.unit("worker@0")["state"] == "failed"
                time.sleep(0.1)
        else:
            wait_for(lambda: d.http("/health")[0] == 200, 120, "the stack back to 200 by itself")
            new = stack_pids(d)
            assert new["worker@0"] != old["worker@0"] and d.unit("worker@0")["restarts"] >= 1
            # The group restarted as one: worker@1 is a new process in a new generation.
            assert new["worker@1"] != old["worker@1"] and d.unit("worker@1")["generation"] >= 2
            deaths.assert_order(("serve",), ("engine",))
            assert no_residue(victim_tree)
        deaths.close()
        figures = {"failed_ms": round(ms, 1)}
        finish(row, ld, fault, **figures)


@pytest.mark.parametrize("restart", ["no", "on-failure"])
def test_fm01_sigkill_worker(stack_factory, restart):
    _worker_fault(stack_factory, f"FM-01 ({restart})", signal.SIGKILL, restart, load=False)


@pytest.mark.parametrize("restart", ["no", "on-failure"])
def test_fm02_sigterm_worker(stack_factory, restart):
    _worker_fault(stack_factory, f"FM-02 ({restart})", signal.SIGTERM, restart, load=False)


def test_fm08_sigkill_worker_under_load(stack_factory):
    _worker_fault(stack_factory, "FM-08", signal.SIGKILL, "on-failure", load=True)


def test_fm09_sigterm_worker_under_load(stack_factory):
    _worker_fault(stack_factory, "FM-09", signal.SIGTERM, "on-failure", load=True)


# ------------------------------------------------------------------ serve faults


def _serve_fault(stack_factory, row: str, sig: int, load: bool, restart: str = "on-failure") -> None:
    s, d = stack_factory(restart=restart)
    d.wait_all_active(120)
    with under_load(s, load) as ld:
        old = stack_pids(d)
        serve_tree = tree_of(old["serve"])
        fault = time.monotonic()
        ms = kill_and_time_failed(d, "serve", sig)
        wait_for(lambda: no_residue(serve_tree), 5, "the serve and its children gone")
        assert d.unit("engine")["pid"] == old["engine"]  # the engine does not depend on the serve
        if restart == "no":
            assert d.unit("serve")["state"] == "failed"
            assert signal.Signals(sig).name in d.http("/health")[1]["units"]["serve"]["reason"]
        else:
            wait_for(lambda: d.http("/health")[0] == 200, 60, "the serve back by itself")
        figures = {"failed_ms": round(ms, 1)}
        finish(row, ld, fault, serve_killed=True, **figures)


def test_fm03_sigkill_serve(stack_factory):
    _serve_fault(stack_factory, "FM-03", signal.SIGKILL, load=False, restart="no")


def test_fm04_sigterm_serve(stack_factory):
    _serve_fault(stack_factory, "FM-04", signal.SIGTERM, load=False)


def test_fm05_sigint_serve(stack_factory):
    _serve_fault(stack_factory, "FM-05", signal.SIGINT, load=False)


def test_fm10_sigkill_serve_under_load(stack_factory):
    _serve_fault(stack_factory, "FM-10", signal.SIGKILL, load=True)


def test_fm11_sigterm_serve_under_load(stack_factory):
    _serve_fault(stack_factory, "FM-11", signal.SIGTERM, load=True)


def test_fm12_sigint_serve_under_load(stack_factory):
    _serve_fault(stack_factory, "FM-12", signal.SIGINT, load=True)


# ------------------------------------------------------------ whole-stack faults


def _everything(d) -> list[int]:
    spawner = d.ok("status")["daemon"]["spawner_pid"]
    pids = [d.pid, spawner]
    for p in stack_pids(d).values():
        pids.extend(tree_of(p))
    return pids


def _sigkill_everything(stack_factory, row: str, load: bool, daemon_factory) -> None:
    s, d = stack_factory()
    d.wait_all_active(120)
    with under_load(s, load) as ld:
        pids = _everything(d)
        fault = time.monotonic()
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)  # pids of processes this test's daemon spawned
            except ProcessLookupError:
                pass
        d.wait_exit(10)
        wait_for(lambda: no_residue(pids), 5, "nothing of the stack left")
        figures = {}
        if ld:
            ld.stop()
            figures.update(ld.check_fail_fast(fault))
        # The next start succeeds at once on the same state dir and ports.
        from tests.harness import Daemon

        d2 = Daemon(s.dir, env=s.env)
        d2.workdir, d2.control, d2.state_dir, d2.health_port = d.workdir, d.control, d.state_dir, d.health_port
        d2.log_path = d.workdir / "daemon2.log"
        try:
            d2.start()
            d2.wait_all_active(120)
            assert d2.http("/health")[0] == 200
        finally:
            d2.workdir = d.workdir / "second"
            d2.close()
        report(row, **figures)


def test_fm06_sigkill_every_process(stack_factory, daemon_factory):
    _sigkill_everything(stack_factory, "FM-06", False, daemon_factory)


def test_fm13_sigkill_every_process_under_load(stack_factory, daemon_factory):
    _sigkill_everything(stack_factory, "FM-13", True, daemon_factory)


def _sigterm_everything(stack_factory, row: str, load: bool) -> None:
    s, d = stack_factory()
    d.wait_all_active(120)
    with under_load(s, load) as ld:
        pids = _everything(d)
        fault = time.monotonic()
        for p in pids:
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass
        assert d.wait_exit(60) == 0
        wait_for(lambda: no_residue(pids), 5, "nothing of the stack left")
        figures = {}
        finish(row, ld, fault, **figures)


def test_fm07_sigterm_every_process(stack_factory):
    _sigterm_everything(stack_factory, "FM-07", False)


def test_fm14_sigterm_every_process_under_load(stack_factory):
    _sigterm_everything(stack_factory, "FM-14", True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("load", [False, True])
def test_fm15_sigterm_or_sigint_to_daemon_is_an_ordered_stop(stack_factory, sig, load):
    s, d = stack_factory()
    d.wait_all_active(120)
    with under_load(s, load) as ld:
        pids = _everything(d)[1:]
        with death_watch(d, "serve", "engine", "worker@0", "worker@1") as deaths:
            fault = time.monotonic()
            os.kill(d.pid, sig)
            assert d.wait_exit(60) == 0
            assert no_residue(pids)
            deaths.assert_order(("serve",), ("engine",), ("worker@0", "worker@1"))
        figures = {}
        finish(f"FM-15 ({signal.Signals(sig).name}, {'load' if load else 'idle'})", ld, fault, **figures)


@pytest.mark.parametrize("load", [False, True])
def test_fm16_sigkill_daemon_takes_every_unit_within_1s(stack_factory, load):
    s, d = stack_factory()
    d.wait_all_active(120)
    with under_load(s, load) as ld:
        pids = _everything(d)[1:]
        fault = time.monotonic()
        os.kill(d.pid, signal.SIGKILL)
        d.wait_exit(10)
        wait_for(lambda: no_residue(pids), 1.0, "every unit process gone within 1 s")
        gone_ms = (time.monotonic() - fault) * 1000
        figures = {"all_gone_ms": round(gone_ms, 1)}
        finish(f"FM-16 ({'load' if load else 'idle'})", ld, fault, **figures)


# ----------------------------------------------------------------- GPU, hangs, stop


@pytest.mark.parametrize("load", [False, True])
def test_fm17_fake_gpu_memory_taken_degrades_then_recovers(stack_factory, tmp_path, load):
    fake = tmp_path / "gpu.json"
    gpus = [{"index": 0, "total_mib": 16000, "free_mib": 15000}, {"index": 1, "total_mib": 16000, "free_mib": 15000}]
    write_fake_gpu_file(fake, {"gpus": gpus, "processes": []})
    s, d = stack_factory(overrides={"worker": {"gpu_min_free_mib": "2000"}},
                         env={"OMNID_DEVELOPER_FAKE_GPU": str(fake), "OMNID_GPU_INTERVAL": "0.2"})
    d.wait_all_active(120)
    with under_load(s, load) as ld:
        taken = [dict(g, free_mib=100) for g in gpus]
        fault = time.monotonic()
        write_fake_gpu_file(fake, {"gpus": taken, "processes": []})
        code, body = wait_for(lambda: (r := d.http("/health"))[0] == 503 and r, 0.2 + 1.0,
                              "503 within one GPU probe interval")
        assert body["status"] == "degraded" and "gpu_min_free_mib" in body["units"]["worker@0"]["reason"]
        figures = {"degraded_ms": round((time.monotonic() - fault) * 1000, 1)}
        if ld:
            # Requests while the GPU is full fail fast with a 5xx; none hangs.
            wait_for(lambda: any(o.started > fault + 0.5 and o.status and o.status >= 500
                                 for o in list(ld.outcomes)), 10, "a 5xx for a request on a full GPU")
            late = [o for o in list(ld.outcomes) if o.started > fault + 0.5]
            assert all(o.ended - o.started < 2.0 for o in late)
        write_fake_gpu_file(fake, {"gpus": gpus, "processes": []})
        wait_for(lambda: d.http("/health")[0] == 200, 10, "200 once the memory is free again")
        finish(f"FM-17 ({'load' if load else 'idle'}, fake GPU)", ld, fault, **figures)


@pytest.mark.parametrize("load", [False, True])
def test_fm18_hung_worker_is_caught_by_the_watchdog_and_killed(stack_factory, load):
    s, d = stack_factory(overrides={"worker": {"watchdog_sec": "2", "stop_timeout": "1"}})
    d.wait_all_active(120)
    with under_load(s, load) as ld:
        pid = d.unit("worker@1")["pid"]
        deaths = DeathWatch({n: p for n, p in stack_pids(d).items() if n in ("serve", "engine")})
        fault = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        u = d.wait_state("worker@1", "failed", timeout=15)
        caught_s = time.monotonic() - fault
        assert u["reason"].startswith("watchdog:"), u["reason"]
        assert u["last_signal"] == "SIGKILL"
        assert not alive(pid)
        wait_for(lambda: d.unit("serve")["state"] == "inactive", 15, "serve stopped")
        deaths.assert_order(("serve",), ("engine",))
        deaths.close()
        assert d.http("/health")[0] == 503
        figures = {"caught_s": round(caught_s, 2)}
        finish(f"FM-18 ({'load' if load else 'idle'})", ld, fault, **figures)


def test_fm19_unit_ignoring_sigterm_is_sigkilled_exactly_at_stop_timeout(stack_factory):
    _s, d = stack_factory(extra_units={"stubborn": (
        'exec = ["sh", "-c", "trap \'\' TERM; while :; do sleep 0.05; done"]\n'
        'stop_timeout = 1\nrequires = ["engine"]\n')})
    d.wait_all_active(120)
    pid = d.unit("stubborn")["pid"]
    summary = d.ok("shutdown", timeout=120)["summary"]
    rec = next(r for r in summary if r["unit"] == "stubborn")
    assert rec["escalated"] and rec["signal"] == "SIGTERM"
    assert 1.0 <= rec["seconds"] < 1.5, rec
    assert not alive(pid)
    report("FM-19", escalation_error_ms=round((rec["seconds"] - 1.0) * 1000, 1))


GRANDCHILDREN = """
import os, sys, time
for _ in range(2):
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "1000"])
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "1001"])
    os._exit(0)
while True:
    time.sleep(3600)
"""


@pytest.mark.parametrize("how", ["stop", "failure"])
def test_fm20_grandchildren_and_double_forked_do_not_survive(stack_factory, tmp_path, how):
    prog = tmp_path / "gc.py"
    prog.write_text(GRANDCHILDREN)
    _s, d = stack_factory(extra_units={"sidecar": f'exec = ["{PY}", "{prog}"]\nrequires = ["engine"]\n'})
    d.wait_all_active(120)
    main = d.unit("sidecar")["pid"]
    tagged = lambda: [p.pid for p in linux.scan() if p.pid != os.getpid() and p.state != "Z"  # noqa: E731
                      and linux.read_environ_var(p.pid, "OMNID_UNIT") == "sidecar"
                      and linux.read_environ_var(p.pid, "OMNID_TEST_ID") == os.environ["OMNID_TEST_ID"]]
    wait_for(lambda: len(tagged()) >= 4, 10, "sidecar and its 3 grandchildren")
    before = tagged()
    if how == "stop":
        d.ok("stop", {"units": ["sidecar"]}, timeout=60)
    else:
        os.kill(main, signal.SIGKILL)
        d.wait_state("sidecar", "failed")
    wait_for(lambda: no_residue(before), 5, "no grandchild left")
    report(f"FM-20 ({how})", killed=len(before))


def test_fm21_crash_loop_backs_off_then_fails_for_good(stack_factory):
    _s, d = stack_factory(extra_units={"crasher": (
        'exec = ["sh", "-c", "exit 3"]\nrestart = "on-failure"\nrestart_sec = 0.1\n'
        'start_limit_burst = 4\nstart_limit_interval = 60\n')})
    u = d.wait_state("crasher", "failed", timeout=30)
    wait_for(lambda: "start limit" in (u := d.unit("crasher"))["reason"] and u, 30, "the start limit")
    starts = [e["timestamp"] for e in state_events(d) if e["unit"] == "crasher" and e["to"] == "starting"]
    assert len(starts) == 4
    from datetime import datetime

    t = [datetime.fromisoformat(x).timestamp() for x in starts]
    gaps = [b - a for a, b in zip(t, t[1:])]
    # 0.1, 0.2, 0.4 (+ up to a quarter of jitter): backoff. What the daemon scheduled is in its
    # log ("restarting in X s"): it doubles; each start came no sooner than scheduled. (Gaps
    # measured alone are not compared with each other: on a loaded machine a start comes late.)
    import re

    delays = [float(m.group(1)) for e in state_events(d) if e["unit"] == "crasher" and e["to"] == "failed"
              for m in [re.search(r"restarting in ([0-9.]+) s", e.get("reason", ""))] if m]
    assert len(delays) == 3, (delays, gaps)
    for k, base in enumerate((0.1, 0.2, 0.4)):
        assert base - 0.01 <= delays[k] <= base * 1.25 + 0.01, (delays, gaps)
        assert gaps[k] >= delays[k] - 0.01, (delays, gaps)
    code, body = d.http("/health")
    assert code == 503 and "start limit" in body["units"]["crasher"]["reason"]
    assert "exited with code 3" in body["units"]["crasher"]["reason"]
    # Idle: no new start, almost no CPU.
    cpu0 = _cpu(d.pid)
    time_end = time.monotonic() + 1.0
    while time.monotonic() < time_end:
        assert d.unit("crasher")["state"] == "failed"
        time.sleep(0.1)
    assert _cpu(d.pid) - cpu0 < 0.15
    report("FM-21", gaps_s=[round(g, 3) for g in gaps])


def _cpu(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stop_under_load_watching_health(d, ld):
    """`omnid stop` (the control command) while the load runs; /health is polled meanwhile.
    Returns (the moment the stop was asked, [(t, status code, status)] of /health)."""
    import threading

    seen: list[tuple[float, int, str]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                code, body = d.http("/health")
            except OSError:  # the daemon closed its health port at the end of the stop
                return
            seen.append((time.monotonic(), code, body.get("status", "") if isinstance(body, dict) else ""))
            if code == 0:
                return

    t = threading.Thread(target=watch)
    t.start()
    try:
        asked = time.monotonic()
        d.ok("shutdown", timeout=120)
    finally:
        done.set()
        t.join(15)
    return asked, seen


def test_fm28_stop_of_a_serving_stack_drains_first_accepted_requests_finish_new_ones_refused(stack_factory):
    s, d = stack_factory()
    d.wait_all_active(120)
    pids = _everything(d)[1:]
    deaths = DeathWatch({n: p for n, p in stack_pids(d).items()})
    ld = Load(s.serve_port, concurrency=6, work_ms=400).start()
    try:
        ld.wait_successes(6)
        asked, seen = _stop_under_load_watching_health(d, ld)
    finally:
        ld.stop()
    assert d.wait_exit(60) == 0
    assert no_residue(pids)
    deaths.assert_order(("serve",), ("engine",), ("worker@0", "worker@1"))
    deaths.close()
    statuses = [st for _t, code, st in seen if code == 503]
    assert statuses and statuses[0] == "draining", seen[:10]
    with ld._lock:
        outcomes = list(ld.outcomes)
    accepted = [o for o in outcomes if o.started < asked]  # in flight (or earlier) when the drain began
    lost = [o for o in accepted if not o.ok]
    assert not lost, [(round(o.ended - asked, 3), o.status, o.error or o.body[:80]) for o in lost]
    later = [o for o in outcomes if o.started >= asked]
    for o in later:  # refused cleanly: a 503 saying why, or no connection once the listener closed
        assert o.status in (503, None) and o.ended - o.started < 2, (o.status, o.error, o.body[:80])
        if o.status == 503:
            assert json.loads(o.body)["error"]["code"] in ("serve_draining", "serve_stopping"), o.body
    report("FM-28", accepted=len(accepted), lost=len(lost), refused=len(later),
           draining_first=True)


def test_fm28_without_a_drain_hook_accepted_requests_are_failed_fast_not_finished(stack_factory):
    """The counterpart: the same stop with the serve's drain hook removed ends the accepted
    requests with 503 serve_stopping (fail fast) - what the drain saves."""
    s, d = stack_factory(overrides={"serve": {"drain": None}})
    d.wait_all_active(120)
    assert not any(line.startswith("drain =") for line in (s.dir / "serve.toml").read_text().splitlines())
    ld = Load(s.serve_port, concurrency=6, work_ms=400).start()
    try:
        ld.wait_successes(6)
        asked, _seen = _stop_under_load_watching_health(d, ld)
    finally:
        ld.stop()
    assert d.wait_exit(60) == 0
    with ld._lock:
        in_flight = [o for o in ld.outcomes if o.started < asked < o.ended]
    lost = [o for o in in_flight if not o.ok]
    report("FM-28 (no drain hook)", in_flight=len(in_flight), lost=len(lost))
    print(f"\nwithout a drain hook: {len(lost)} of {len(in_flight)} requests in flight failed at the stop")


# ------------------------------------------------------------ FM-34: restarts refuse no connection


# Ten restarts and a re-exec in a row, each under ~500 connections a second: 8.6 s quiet, 95 s in
# a fresh-clone run at load 15, and past the suite's 120 s at load 15-20 (the serve, starved
# beside its clients, met its 5 s stop_timeout in restart after restart). Each restart keeps
# its own 120 s bound; the row as a whole gets 10 of them at that pace and a margin.
@pytest.mark.timeout(480)
@pytest.mark.parametrize("held", [True, False], ids=["held-socket", "own-bind"])
def test_fm34_restart_serve_ten_times_and_reexec_under_load(stack_factory, held):
    """~500 connections a second (GET /health: any HTTP answer counts, a 503 while the new
    serve connects to the engine too) while `restart serve` runs ten times, then a re-exec:
    0 refused with the serve on a socket omnid holds. Without it (the serve binds its own
    port) the same run refuses some: the figure the held socket is measured against."""
    from tests.clients import Clients
    from tests.harness import repo_pythonpath

    s, d = stack_factory(restart="on-failure", overrides=None if held else {"serve": {"sockets": None}},
                         env={"PYTHONPATH": repo_pythonpath()})  # the re-exec runs this tree's omnid
    d.wait_all_active(120)
    with Clients(s.serve_port, http="/health") as c:
        wait_for(lambda: c.answered > 50, 30, "answers before the restarts")
        marks = []
        for _ in range(10):
            marks.append(time.monotonic())
            res = d.ok("restart", {"units": ["serve"]}, timeout=120)
            assert res["ok"], res
            marks.append(time.monotonic())
            n = c.answered
            wait_for(lambda: c.answered > n + 50, 30, "answers after a restart")
        d.reexec()
        n = c.answered
        wait_for(lambda: c.answered > n + 50, 30, "answers after the re-exec")
    counts = c.counts()
    report(f"FM-34 ({'held socket' if held else 'own bind'})", **{k: v for k, v in counts.items()
                                                                    if k != "other_examples"})
    print(f"\nFM-34 {'held socket' if held else 'own bind'}: {counts}")
    if counts["other"]:  # when, against each restart's [request, reply]
        print("restarts:", [round(m - marks[0], 2) for m in marks], "failures at:",
              sorted({round(t - marks[0], 1) for t in c.when()}))
    if held:
        # The row: no connection refused. Resets (a burst in one restart of ten in some runs
        # on a loaded 2-core machine, while the new serve takes a full backlog at once) are
        # reported above with their times, not part of the row.
        assert counts["refused"] == 0, counts
    else:
        assert counts["refused"] > 0, counts
