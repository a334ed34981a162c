"""kill_mode and leftover_timeout (omnid.unit(5), "Stopping"; issue 25), on both kill backends,
checked against the kernel: when each process of a unit left /proc (a watcher thread reads
/proc/PID/stat every 2 ms), and what each process itself saw (the units append their own
signals to a file: the order the kernel delivered them, not omnid's bookkeeping).

- mixed: stop_signal to the main process alone; it finishes a piece of work that needs its
  child alive; the child is SIGKILLed right after the main process exits (it never sees the
  stop signal). control-group: the child gets the stop signal at once and the work fails.
- process: the child gets stop_signal once the main process has exited.
- stop_timeout bounds every mode: SIGKILL for everything at stop_timeout.
- a hung unit (SIGSTOP, caught by the watchdog) under mixed is still signalled whole.
- leftovers of a main process that died get stop_signal and leftover_timeout: the issue's
  repro, a child holding 40 multiprocessing.shared_memory segments when its parent dies,
  leaves 0 of 40 in /dev/shm; with leftover_timeout = 0 (SIGKILL at once) it leaves them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.harness import alive, make_stack, wait_for

BACKENDS = {"process-group": {"OMNID_TEST_CGROUP": "0"}, "cgroup": {"OMNID_TEST_CGROUP": "1"}}

CHILD_PY = textwrap.dedent('''
    import json, os, signal, sys, time
    rec = os.environ["REC"]

    def note(what):
        with open(rec, "a") as f:
            f.write(json.dumps([time.time(), what]) + "\\n")

    def on_term(n, f):
        note("child TERM")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term if os.environ.get("CHILD", "term") == "term" else signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, lambda n, f: note("child USR1"))
    note("child ready")  # its handlers are in place: a test that signals it waits for this
    for line in sys.stdin:  # an engine: answers its server's requests
        sys.stdout.write("pong\\n")
        sys.stdout.flush()
    while True:  # its server is gone: an engine that does not notice, and waits to be killed
        time.sleep(1)
''')

MAIN_PY = textwrap.dedent('''
    import json, os, signal, socket, subprocess, sys, time
    rec, mode = os.environ["REC"], os.environ.get("MAIN", "work")

    def note(what):
        with open(rec, "a") as f:
            f.write(json.dumps([time.time(), what]) + "\\n")

    def notify(msg):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        addr = os.environ["NOTIFY_SOCKET"]
        s.sendto(msg.encode(), "\\0" + addr[1:] if addr.startswith("@") else addr)
        s.close()

    child = subprocess.Popen([sys.executable, os.environ["CHILD_PY"]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, bufsize=1)

    def ping():
        child.stdin.write("ping\\n")
        child.stdin.flush()
        return child.stdout.readline() == "pong\\n"

    assert ping()
    with open(os.environ["PIDS"] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(os.environ["PIDS"] + ".tmp", os.environ["PIDS"])
    termed = []
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda n, f: termed.append("TERM"))
    signal.signal(signal.SIGUSR1, lambda n, f: termed.append("USR1"))  # a drain signal
    notify("READY=1")
    while not termed:
        if mode == "watchdog":
            notify("WATCHDOG=1")
        time.sleep(0.05)
    note(f"main {termed[0]}")
    # The request in flight: it needs the child for one more second.
    ok, end = True, time.monotonic() + float(os.environ.get("WORK_S", "1"))
    while ok and time.monotonic() < end:
        try:
            ok = ping()
        except OSError:
            ok = False
        time.sleep(0.05)
    note("work done" if ok else "work failed")
    os._exit(0)  # without waiting for the child: its server's job ends here
''')


class Watch:
    """When each pid left /proc (dead: gone or a zombie), seen every 2 ms from a thread, and
    when it was last seen alive: the death lies between the two (under a parallel run's load
    this thread's passes come late, and `gone` with them)."""

    def __init__(self, pids: list[int]) -> None:
        self.gone: dict[int, float] = {}
        self.last_alive: dict[int, float] = {}
        self._pids = pids
        self._done = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._done.is_set() and len(self.gone) < len(self._pids):
            for p in self._pids:
                if p in self.gone:
                    continue
                now = time.time()
                if alive(p):
                    self.last_alive[p] = now
                else:
                    self.gone[p] = now
            time.sleep(0.002)

    def wait(self, timeout: float) -> dict[int, float]:
        wait_for(lambda: len(self.gone) == len(self._pids), timeout, f"pids {self._pids} to leave /proc "
                                                                      f"(gone so far: {self.gone})")
        self._done.set()
        self._t.join(5)
        return self.gone


def record(rec: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    if rec.exists():
        for line in rec.read_text().splitlines():
            ts, what = json.loads(line)
            out.setdefault(what, ts)
    return out


def unit_text(tmp_path: Path, mode: str, *, main: str = "work", child: str = "term", stop_timeout: float = 5,
              extra: str = "") -> str:
    (tmp_path / "main.py").write_text(MAIN_PY)
    (tmp_path / "child.py").write_text(CHILD_PY)
    env = {"REC": tmp_path / "rec", "PIDS": tmp_path / "pids", "CHILD_PY": tmp_path / "child.py", "MAIN": main,
           "CHILD": child}
    envs = ", ".join(f'{k} = "{v}"' for k, v in env.items())
    return (f'exec = ["{sys.executable}", "{tmp_path / "main.py"}"]\nready = "notify"\nrestart = "no"\n'
            f'kill_mode = "{mode}"\nstop_timeout = {stop_timeout}\nkill_timeout = 3\nenv = {{ {envs} }}\n{extra}')


def pids(tmp_path: Path) -> tuple[int, int]:
    main, child = wait_for(lambda: (tmp_path / "pids").exists() and (tmp_path / "pids").read_text().split(), 10,
                           "the unit's pids")
    return int(main), int(child)


def start(daemon_factory, tmp_path: Path, backend: str, text: str):
    d = daemon_factory(make_stack({"u": text}), env=BACKENDS[backend])
    d.wait_state("u", "active")
    assert d.ok("status")["daemon"]["backend"] == backend
    main, child = pids(tmp_path)
    assert alive(main) and alive(child)
    return d, main, child


def why(d, rec: Path) -> str:
    return f"record: {record(rec)}\nunits: {d.units()}\nlog tail:\n{d.log()[-2500:]}"


# ------------------------------------------------------------------ mixed vs control-group
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_lets_the_main_process_finish_its_work_then_sigkills_the_rest_at_once(
        tmp_path, daemon_factory, no_leaks, backend):
    d, main, child = start(daemon_factory, tmp_path, backend, unit_text(tmp_path, "mixed"))
    watch = Watch([main, child])
    t0 = time.time()
    rec = d.ok("stop", {"units": ["u"]})["summary"][0]
    gone = watch.wait(10)
    seen = record(tmp_path / "rec")
    assert "work done" in seen and "child TERM" not in seen, why(d, tmp_path / "rec")
    # the child lived through the main process's last second of work, and died right after it
    assert gone[child] - t0 >= 1.0, (gone, t0)
    lag = gone[child] - gone[main]
    assert -0.005 <= lag < 0.5, f"child gone {lag * 1000:.0f} ms after the main process ({gone})"
    assert rec["to"] == "main" and rec["rest"] == "SIGKILL" and rec["escalated"] is False, rec
    assert 1.0 <= rec["main_seconds"] < 4, rec
    assert d.unit("u")["state"] == "inactive"
    print(f"\nmixed ({backend}): main exited {rec['main_seconds']:.3f} s after SIGTERM, child SIGKILLed "
          f"{lag * 1000:.1f} ms after it (from /proc)")


@pytest.mark.parametrize("backend", BACKENDS)
def test_control_group_signals_the_child_at_once_and_the_work_in_flight_fails(
        tmp_path, daemon_factory, no_leaks, backend):
    d, main, child = start(daemon_factory, tmp_path, backend, unit_text(tmp_path, "control-group"))
    watch = Watch([main, child])
    rec = d.ok("stop", {"units": ["u"]})["summary"][0]
    watch.wait(10)
    seen = record(tmp_path / "rec")
    assert "child TERM" in seen and "work failed" in seen, why(d, tmp_path / "rec")
    assert abs(seen["child TERM"] - seen["main TERM"]) < 0.5, seen
    assert rec["to"] == "" and rec["rest"] == "" and rec["escalated"] is False, rec


# ------------------------------------------------------------------ process
@pytest.mark.parametrize("backend", BACKENDS)
def test_process_gives_the_rest_the_stop_signal_once_the_main_process_has_exited(
        tmp_path, daemon_factory, no_leaks, backend):
    d, main, child = start(daemon_factory, tmp_path, backend, unit_text(tmp_path, "process"))
    watch = Watch([main, child])
    rec = d.ok("stop", {"units": ["u"]})["summary"][0]
    gone = watch.wait(10)
    seen = record(tmp_path / "rec")
    assert "work done" in seen and "child TERM" in seen, why(d, tmp_path / "rec")
    assert seen["child TERM"] > seen["work done"], seen  # after the main process's last act
    # the child's own handler has to run (a Python interpreter on a loaded host): a looser bound
    assert gone[child] - gone[main] < 1.5, gone
    assert rec["to"] == "main" and rec["rest"] == "SIGTERM" and rec["escalated"] is False, rec


# ------------------------------------------------------------------ stop_timeout bounds every mode
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["control-group", "mixed", "process"])
def test_stop_timeout_sigkills_everything_whatever_the_kill_mode(tmp_path, daemon_factory, no_leaks, backend, mode):
    """A main process that ignores SIGTERM, and a child that does too."""
    d, main, child = start(daemon_factory, tmp_path, backend,
                           unit_text(tmp_path, mode, main="stubborn", child="ignore", stop_timeout=1))
    watch = Watch([main, child])
    t0 = time.time()
    rec = d.ok("stop", {"units": ["u"]})["summary"][0]
    gone = watch.wait(10)
    for pid in (main, child):
        assert 0.95 <= gone[pid] - t0 < 2.5, f"pid {pid} gone {gone[pid] - t0:.3f} s after the stop ({rec})"
    assert rec["escalated"] is True and rec["signal"] == "SIGTERM", rec
    assert "child TERM" not in record(tmp_path / "rec")


@pytest.mark.parametrize("backend", BACKENDS)
def test_process_mode_rest_that_ignores_the_stop_signal_dies_at_stop_timeout_from_the_stops_start(
        tmp_path, daemon_factory, no_leaks, backend):
    d, main, child = start(daemon_factory, tmp_path, backend,
                           unit_text(tmp_path, "process", child="ignore", stop_timeout=2))
    watch = Watch([main, child])
    t0 = time.time()
    rec = d.ok("stop", {"units": ["u"]})["summary"][0]
    gone = watch.wait(10)
    assert 1.0 <= gone[main] - t0 < 1.9, (gone, t0)  # its second of work
    assert 1.95 <= gone[child] - t0 < 3.0, f"child gone {gone[child] - t0:.3f} s after the stop began"
    assert rec["to"] == "main" and rec["rest"] == "SIGTERM" and rec["escalated"] is True, rec


# ------------------------------------------------------------------ a hung unit
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hung_unit_under_mixed_is_still_signalled_whole(tmp_path, daemon_factory, no_leaks, backend):
    text = unit_text(tmp_path, "mixed", main="watchdog", stop_timeout=2, extra="watchdog_sec = 1\ncapture_timeout = 0\n")
    d, main, child = start(daemon_factory, tmp_path, backend, text)
    watch = Watch([main, child])
    fd = os.pidfd_open(main)
    try:
        t0 = time.time()
        signal.pidfd_send_signal(fd, signal.SIGSTOP)
    finally:
        os.close(fd)
    u = d.wait_state("u", "failed", timeout=15)
    gone = watch.wait(10)
    seen = record(tmp_path / "rec")
    assert u["reason"].startswith("watchdog"), u["reason"]
    # The child got the stop signal with the main process (stopped, SIGTERM pending): not only
    # once the main process had gone, as a planned stop under mixed would do.
    assert "child TERM" in seen and "main TERM" not in seen, why(d, tmp_path / "rec")
    assert seen["child TERM"] < gone[main] - 1.0, (seen, gone)
    assert 2.5 <= gone[main] - t0 < 6, (gone, t0)  # watchdog 1 s (+ ping interval) + stop_timeout 2 s


# ------------------------------------------------------------------ leftovers of a dead main process
SHM_PY = textwrap.dedent('''
    import multiprocessing as mp, os, time
    from multiprocessing import shared_memory

    def holder(path, n):
        segs = [shared_memory.SharedMemory(create=True, size=1 << 16) for _ in range(n)]
        with open(path + ".tmp", "w") as f:
            f.write("\\n".join(s.name for s in segs))
        os.rename(path + ".tmp", path)
        while True:
            time.sleep(1)

    if __name__ == "__main__":
        p = mp.get_context("spawn").Process(target=holder, args=(os.environ["NAMES"], 40))
        p.start()
        while not os.path.exists(os.environ["NAMES"]):
            time.sleep(0.02)
        with open(os.environ["PIDS"], "w") as f:
            f.write(f"{os.getpid()} {p.pid}")
        while not os.path.exists(os.environ["GO"]):  # the test watches /proc and /health first
            time.sleep(0.01)
        os._exit(3)  # the parent dies; its child and the resource tracker are left
''')


class Health:
    """When /health first answered 503, polled every 5 ms from a thread (an HTTP GET: cheap for
    the daemon, unlike a status call, whose process-tree figures read all of /proc)."""

    def __init__(self, d) -> None:
        self.first_503: float | None = None
        self.answered = False  # the health API listens (it starts a moment after the daemon)
        self._d = d
        self._done = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._done.is_set() and self.first_503 is None:
            try:
                code = self._d.http("/health")[0]
            except OSError:
                code = None
            if code is not None and self.answered and code == 503:
                self.first_503 = time.time()
            self.answered = self.answered or code == 200
            time.sleep(0.005)

    def stop(self) -> float | None:
        # a unit that failed stays failed (restart = "no"): /health stays 503 until it is seen
        wait_for(lambda: self.first_503 is not None or not self._t.is_alive(), 10, "/health 503")
        self._done.set()
        self._t.join(10)
        return self.first_503


def published(d, name: str) -> dict[str, float]:
    """When the daemon published each state of the unit (the `unit state` log lines' stamps)."""
    out: dict[str, float] = {}
    for e in d.log_events():
        if e.get("event") == "unit state" and e.get("unit") == name:
            out.setdefault(e["to"], datetime.fromisoformat(e["timestamp"]).timestamp())
    return out


def shm_left(names: list[str]) -> list[str]:
    return [n for n in names if os.path.exists(f"/dev/shm/{n.lstrip('/')}")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("leftover_timeout", [3, 0])
def test_leftovers_of_a_dead_main_get_time_to_unlink_their_shared_memory(
        tmp_path, daemon_factory, no_leaks, backend, leftover_timeout):
    """The issue's repro. Default leftover_timeout: the child gets SIGTERM, the resource tracker
    (which ignores SIGTERM) sees its last user gone and unlinks the 40 segments: 0 of 40 left.
    leftover_timeout = 0: SIGKILL at once kills the tracker with them: the segments stay (an
    IPC sweep, remove_ipc, is another mechanism; off here)."""
    (tmp_path / "shm.py").write_text(SHM_PY)
    names_file = tmp_path / "names"
    text = (f'exec = ["{sys.executable}", "{tmp_path / "shm.py"}"]\nrestart = "no"\nremove_ipc = false\n'
            f'leftover_timeout = {leftover_timeout}\n'
            f'env = {{ NAMES = "{names_file}", PIDS = "{tmp_path / "pids"}", GO = "{tmp_path / "go"}" }}\n')
    d = daemon_factory(make_stack({"u": text}), env=BACKENDS[backend])
    main, child = pids(tmp_path)
    names = names_file.read_text().split()
    assert len(names) == 40 and len(shm_left(names)) == 40
    watch, health = Watch([main, child]), Health(d)
    wait_for(lambda: health.answered, 30, "/health to answer")
    (tmp_path / "go").touch()
    # Waited for in the daemon's log: a status call reads all of /proc for its figures, and
    # polling it would hold the daemon's loop while /health is measured.
    seen = wait_for(lambda: (p := published(d, "u")) and "failed" in p and p, 15, f"u failed\n{d.log()[-2000:]}")
    gone, first_503, u = watch.wait(10), health.stop(), d.unit("u")
    left = shm_left(names)
    try:
        assert u["reason"].startswith("exited with code 3"), u["reason"]
        if leftover_timeout:
            assert "what outlived it gets SIGTERM, SIGKILL after 3 s" in u["last_exit"], u["last_exit"]
            assert left == [], f"{len(left)} of 40 segments left in /dev/shm"
            # the failure was reported at the death, not when the leftovers were gone
            assert seen["stopping"] - gone[main] < 0.5 and first_503 - gone[main] < 0.5, (seen, first_503, gone)
            assert gone[child] - gone[main] < leftover_timeout, gone
        else:
            assert "killing what outlived it" in u["last_exit"], u["last_exit"]
            assert len(left) == 40, f"{len(left)} of 40 segments left after SIGKILL at once"
        print(f"\nleftover_timeout={leftover_timeout} ({backend}): {len(left)} of 40 segments left; child gone "
              f"{(gone[child] - gone[main]) * 1000:.0f} ms after the main process; /health 503 "
              f"{(first_503 - gone[main]) * 1000:.0f} ms, stopping published {(seen['stopping'] - gone[main]) * 1000:.0f} ms, "
              f"failed {(seen['failed'] - gone[main]) * 1000:.0f} ms after it")
    finally:
        for n in left:  # exact names this test's unit created, nothing else
            os.unlink(f"/dev/shm/{n.lstrip('/')}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_leftovers_that_ignore_the_stop_signal_are_sigkilled_at_leftover_timeout(
        tmp_path, daemon_factory, no_leaks, backend):
    """The grace is bounded: a child that ignores SIGTERM dies leftover_timeout after its parent;
    /health is 503 and the failure is recorded from the death on, `failed` comes at the end."""
    (tmp_path / "child.py").write_text(CHILD_PY)
    prog = tmp_path / "dies.py"
    prog.write_text(textwrap.dedent(f'''
        import os, subprocess, sys, time
        c = subprocess.Popen([sys.executable, "{tmp_path / "child.py"}"], stdin=subprocess.PIPE)
        with open("{tmp_path / "pids"}", "w") as f:
            f.write(f"{{os.getpid()}} {{c.pid}}")
        while not os.path.exists(os.environ["GO"]):  # the test watches /proc and /health first
            time.sleep(0.01)
        os._exit(1)
    '''))
    text = (f'exec = ["{sys.executable}", "{prog}"]\nrestart = "no"\nleftover_timeout = 1.5\n'
            f'env = {{ REC = "{tmp_path / "rec"}", CHILD = "ignore", GO = "{tmp_path / "go"}" }}\n')
    d = daemon_factory(make_stack({"u": text}), env=BACKENDS[backend])
    main, child = pids(tmp_path)
    watch, health = Watch([main, child]), Health(d)
    wait_for(lambda: health.answered, 30, "/health to answer")
    # Under load the child's interpreter can take seconds to start: until it ignores SIGTERM, the
    # grace's SIGTERM would end it at once.
    wait_for(lambda: "child ready" in record(tmp_path / "rec"), 60, "the child to ignore SIGTERM")
    (tmp_path / "go").touch()
    # Waited for in the daemon's log: a status call reads all of /proc for its figures, and
    # polling it would hold the daemon's loop while /health is measured.
    seen = wait_for(lambda: (p := published(d, "u")) and "failed" in p and p, 15, f"u failed\n{d.log()[-2000:]}")
    gone, first_503, u = watch.wait(10), health.stop(), d.unit("u")
    assert u["last_exit"].startswith("exited with code 1") and "what outlived it gets SIGTERM, SIGKILL after 1.5 s" in u["last_exit"], u
    # /health 503 and `stopping` (the failure recorded) at the death; `failed` once the child is gone
    assert first_503 - gone[main] < 0.5 and seen["stopping"] - gone[main] < 0.5, (seen, first_503, gone)
    assert 1.4 <= gone[child] - gone[main] < 2.5, f"child gone {gone[child] - gone[main]:.3f} s after its parent"
    # Never `failed` while the child was still seen alive (its death is after last_alive).
    assert seen["failed"] >= watch.last_alive[child], (seen, gone, watch.last_alive)
    assert "child TERM" not in record(tmp_path / "rec")


# ------------------------------------------------------------------ the drain signal follows the mode
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["control-group", "mixed"])
def test_a_drain_signal_goes_where_the_stop_signal_would(tmp_path, daemon_factory, no_leaks, backend, mode):
    """drain = { signal = "SIGUSR1" }: the main process drains (one more second of work with its
    child), then exits by itself. Under mixed the child never sees the drain signal and is
    SIGKILLed once the main process has exited; under control-group it gets the signal too."""
    d, main, child = start(daemon_factory, tmp_path, backend,
                           unit_text(tmp_path, mode, extra='drain = { signal = "SIGUSR1" }\ndrain_timeout = 10\n'))
    watch = Watch([main, child])
    rec = d.ok("stop", {"units": ["u"]})["summary"][0]
    gone = watch.wait(10)
    seen = record(tmp_path / "rec")
    assert "main USR1" in seen and "work done" in seen, why(d, tmp_path / "rec")
    if mode == "mixed":
        assert "child USR1" not in seen and "child TERM" not in seen, seen
        assert -0.005 <= gone[child] - gone[main] < 0.5, gone
        assert rec["signal"] == "-" and rec["rest"] == "SIGKILL" and rec["escalated"] is False, rec
    else:
        assert "child USR1" in seen and abs(seen["child USR1"] - seen["main USR1"]) < 0.5, seen
        assert rec["to"] == "" and rec["rest"] == "", rec
