"""Interleaved start/stop/restart/kill requests with random SIGKILLs (in the spirit of
FM-22, bounded for CI): every request is answered, and afterwards every unit's state
matches the kernel, with nothing leaked (the leak fixture checks processes and fds)."""

from __future__ import annotations

import json
import os
import random
import signal
import time

from tests.harness import make_stack, wait_for


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
    v = wait_for(lambda: (s := d.ok("status", {"verify": True}))["verify"]["ok"] and s, 5, "verify ok")
    assert not v["verify"]["invariant_violations"], v["verify"]["invariant_violations"]
    summary = d.ok("shutdown", timeout=60)["summary"]
    assert all(not r["unkillable"] for r in summary)
    assert d.wait_exit(30) == 0
