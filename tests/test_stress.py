"""Interleaved start/stop/restart/kill requests with random SIGKILLs (in the spirit of
FM-22, bounded for CI): every request is answered, and afterwards every unit's state
matches the kernel, with nothing leaked (the leak fixture checks processes and fds)."""

from __future__ import annotations

import json
import os
import random
import signal
import time

from omnid.base import linux
from omnid.process.handle import UNIT_TAG
from tests.harness import make_stack, wait_for


def kernel_units() -> dict[str, set[int]]:
    """What /proc says runs: unit tag -> live pids carrying it, for this test's processes."""
    me = os.environ["OMNID_TEST_ID"]
    out: dict[str, set[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or linux.read_environ_var(int(name), "OMNID_TEST_ID") != me:
            continue
        unit = linux.read_environ_var(int(name), UNIT_TAG)
        st = linux.read_stat(int(name))
        if unit is not None and st is not None and st.state not in ("Z", "X"):
            out.setdefault(unit, set()).add(int(name))
    return out


def matches_the_kernel(units: dict[str, dict], spawner: int) -> list[str]:
    """Each active unit's main pid is alive in /proc, a child of the spawner, leading its own
    process group, tagged with its name; every tagged process is in its unit's group."""
    problems = []
    running = kernel_units()
    for name, u in units.items():
        pid = u["pid"]
        st = linux.read_stat(pid) if pid else None
        if st is None or st.state in ("Z", "X"):
            problems.append(f"{name}: pid {pid} is not alive in /proc")
            continue
        if st.ppid != spawner or st.pgid != pid or linux.read_environ_var(pid, UNIT_TAG) != name:
            problems.append(f"{name}: pid {pid} has ppid {st.ppid}, pgid {st.pgid}, tag "
                            f"{linux.read_environ_var(pid, UNIT_TAG)!r}")
        for other in running.get(name, set()):
            o = linux.read_stat(other)
            if o is not None and o.pgid != pid:
                problems.append(f"{name}: pid {other} carries its tag outside its group {pid}")
    for tag in set(running) - set(units):
        problems.append(f"processes {sorted(running[tag])} carry tag {tag!r}, which is no unit")
    return problems


def test_interleaved_requests_and_sigkills_leave_state_matching_the_kernel(daemon_factory):
    stack = make_stack({
        "worker": 'exec = ["sleep", "100000"]\ninstances = 3\nrestart = "on-failure"\nrestart_sec = 0.05\n'
                  'start_limit_burst = 1000\nstop_timeout = 1\n',
        "engine": 'exec = ["sleep", "100000"]\nrequires = ["worker"]\nrestart = "on-failure"\n'
                  'restart_sec = 0.05\nstart_limit_burst = 1000\nstop_timeout = 1\n',
        "serve": 'exec = ["sh", "-c", "sleep 100000 & exec sleep 100001"]\nrequires = ["engine"]\n'
                 'restart = "always"\nrestart_sec = 0.05\nstart_limit_burst = 1000\nstop_timeout = 1\n',
    })
    d = daemon_factory(stack)
    d.wait_all_active()
    rng = random.Random(1234)
    names = ["worker@0", "worker@1", "worker@2", "worker", "engine", "serve"]
    sock = d._ctx.socket(__import__("zmq").DEALER)
    sock.setsockopt(__import__("zmq").LINGER, 0)
    sock.connect(f"ipc://{d.control}")
    sent: dict[int, str] = {}
    replies: dict[int, dict] = {}
    deadline = time.monotonic() + 20
    n = 0
    while n < 400 and time.monotonic() < deadline:
        n += 1
        cmd = rng.choice(["start", "stop", "restart", "kill", "status", "kill"])
        unit = rng.choice(names)
        args = {"unit": unit, "signal": rng.choice(["SIGKILL", "SIGTERM"])} if cmd == "kill" else \
            {"units": [unit], "timeout": 10} if cmd != "status" else {}
        sock.send(json.dumps({"id": n, "cmd": cmd, "args": args}).encode())
        sent[n] = cmd
        if rng.random() < 0.2:  # a fault from outside omnid: SIGKILL a unit's main process
            pid = d.unit(rng.choice(names[:3] + names[4:]))["pid"]
            if pid:
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    fd = -1
                if fd >= 0:
                    try:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                    except ProcessLookupError:
                        pass  # it exited between the open and the signal
                    finally:
                        os.close(fd)
        while sock.poll(0):
            r = json.loads(sock.recv())
            replies[r["id"]] = r
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.02)
    end = time.monotonic() + 60
    while len(replies) < len(sent) and time.monotonic() < end:
        if sock.poll(500):
            r = json.loads(sock.recv())
            replies[r["id"]] = r
    sock.close(0)
    assert len(replies) == len(sent), f"{len(sent) - len(replies)} requests never answered"
    for r in replies.values():
        if not r["ok"]:
            assert r["error"]["message"], r
    # Converge to the operator's last word: everything started, then the kernel must agree.
    d.ok("start", {"timeout": 30}, timeout=40)
    d.wait_all_active(30)
    spawner = next(e for e in d.log_events() if e.get("event") == "daemon ready")["spawner_pid"]
    # the kernel's word, not omnid's: wait (bounded) for the last restarts to settle
    wait_for(lambda: not matches_the_kernel(d.units(), spawner), 10,
             f"the units' state to match /proc: {matches_the_kernel(d.units(), spawner)}")
    assert {n for n, u in d.units().items() if u["state"] == "active"} == set(kernel_units())
    assert len(kernel_units()["serve"]) == 2  # its shell's background sleep and the exec'd one
    v = wait_for(lambda: (s := d.ok("status", {"verify": True}))["verify"]["ok"] and s, 5, "verify ok")
    assert not v["verify"]["invariant_violations"], v["verify"]["invariant_violations"]
    summary = d.ok("shutdown", timeout=60)["summary"]
    assert all(not r["unkillable"] for r in summary)
    assert d.wait_exit(30) == 0
    assert kernel_units() == {}, kernel_units()
