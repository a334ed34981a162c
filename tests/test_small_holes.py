"""Issue 34, item 6: the smaller holes through which a neighbour could fill or stall a root
daemon, or a test switch reach production. One test per behaviour, each able to fail on the
code before the fix: fds past 1024 (poll, not select), a kernel without /proc children lists,
test switches outside the test suite, the kill of a probe's or an operator's group without a
scan of the host's /proc on the loop, the sweep's wait woken by the kernel, `status --verify`
and a group number reused by a stranger, and a Unix socket's directory and file."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import structlog.testing

from omnid.base import linux, testswitch
from omnid.process.handle import Survivor
from tests.harness import make_stack, wait_for

SLEEP = 'exec = ["sleep", "1000"]\nstop_timeout = 2\nkill_timeout = 1\nrestart = "no"\n'


# --------------------------------------------------------------------------- fds from 1024 on
def test_any_readable_polls_a_pidfd_numbered_past_1024() -> None:
    """select() refuses fds from 1024 on (ValueError), which a daemon holding a pidfd and two
    pipes per unit reaches at ~340 units: the zero-timeout look must use poll."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}: no fd 1500 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    child = subprocess.Popen(["sleep", "1000"])
    pidfd = os.pidfd_open(child.pid)
    high = os.dup2(pidfd, 1500, inheritable=False)
    try:
        assert asyncio.run(linux.any_readable([high], 0)) is False  # alive: not readable
        child.kill()
        child.wait(10)
        assert asyncio.run(linux.any_readable([high], 0)) is True  # exited: readable
    finally:
        os.close(high)
        os.close(pidfd)
        child.kill()
        child.wait(10)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --------------------------------------------------------------------------- no /proc children lists
def test_children_of_falls_back_to_parents_where_the_kernel_has_no_children_lists(monkeypatch) -> None:
    """Without CONFIG_PROC_CHILDREN every children file is missing: a live tree must not read as
    empty (a live group declared gone); the parents in /proc are read instead, and the daemon
    has a sentence to say so at start."""
    tree = subprocess.Popen(["sh", "-c", "sleep 1000 & sleep 1000 & wait"])
    try:
        want = wait_for(lambda: len(kids := linux.children_of(tree.pid)) == 2 and sorted(kids), 10,
                        "the shell's two children")
        assert linux.proc_children_note() is None  # this kernel has them
        monkeypatch.setattr(linux, "PROC_CHILDREN", False)
        assert sorted(linux.children_of(tree.pid)) == want
        assert sorted(p.pid for p in linux.descendants(tree.pid)) == want
        note = linux.proc_children_note()
        assert note is not None and "CONFIG_PROC_CHILDREN" in note, note
    finally:
        for pid in linux.children_of(tree.pid):
            os.kill(pid, signal.SIGKILL)
        tree.wait(10)


# --------------------------------------------------------------------------- test switches
@pytest.mark.parametrize("where, env, says", [
    ("outside the test suite", {testswitch.OPT_IN_ENV: ""}, "only in omnid's own test suite"),
    ("in a Kubernetes pod", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "Kubernetes"),
    ("in a Slurm job", {"SLURM_JOB_ID": "4242"}, "Slurm"),
])
def test_a_fault_injection_switch_is_ignored_outside_the_test_suite(daemon_factory, where, env, says) -> None:
    """OMNID_TEST_INJECT_FAULT makes the victim's spawn raise (its unit fails) in the test
    suite; elsewhere the daemon ignores it and says so once, naming the variable and why."""
    d = daemon_factory(make_stack({"victim": SLEEP}), env={testswitch.INJECT_FAULT_ENV: "spawn:victim", **env})
    d.wait_state("victim", "active")
    ignored = [e for e in d.log_events() if e.get("event") == "test switch ignored"]
    assert [e["env"] for e in ignored] == [testswitch.INJECT_FAULT_ENV], d.log()[-3000:]
    assert says in ignored[0]["reason"] and ignored[0]["level"] == "error", ignored
    assert "internal error" not in json.dumps(d.unit("victim")), d.unit("victim")
    assert not any(e.get("event") == "TEST FAULT INJECTION IS ON: an action will raise" for e in d.log_events())


def test_the_same_fault_injection_is_obeyed_in_the_test_suite(daemon_factory) -> None:
    """The other side of the gate (so the test above can fail): with the harness's opt-in."""
    d = daemon_factory(make_stack({"victim": SLEEP}), env={testswitch.INJECT_FAULT_ENV: "spawn:victim"})
    wait_for(lambda: d.unit("victim")["state"] == "failed", 20, f"victim failed (log:\n{d.log()[-3000:]})")
    assert not any(e.get("event") == "test switch ignored" for e in d.log_events())


def test_the_handover_corruption_switch_is_ignored_outside_the_test_suite(monkeypatch) -> None:
    from omnid.daemon import record

    monkeypatch.setenv(record.FAULT_ENV, "corrupt")
    for env, corrupt in (({}, True), ({"SLURM_JOB_ID": "7"}, False), ({testswitch.OPT_IN_ENV: "0"}, False)):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            fd = record.write({"format": record.FORMAT})
            try:
                data = os.read(fd, 1 << 16)
            finally:
                os.close(fd)
        assert data.startswith(b"\x00") is corrupt, (env, data[:40])


def test_the_fake_gpu_is_refused_in_a_kubernetes_pod(tmp_path: Path, monkeypatch) -> None:
    from omnid import gpu
    from omnid.gpu.fake import write_fake_gpu_file

    path = tmp_path / "gpu.json"
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "total_mib": 1000}], "processes": []})
    monkeypatch.setenv(gpu.FAKE_GPU_ENV, str(path))
    monkeypatch.delenv("SYSTEMD_EXEC_PID", raising=False)
    monkeypatch.setattr(gpu, "DRIVER_PATHS", ("/nonexistent/omnid-test-no-driver",))
    assert gpu.open_backend().kind == "fake"  # the suite's own opt-in: obeyed
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with structlog.testing.capture_logs() as logs:
        backend = gpu.open_backend()
    assert backend.kind == "none", backend
    [refused] = [e for e in logs if "refused" in e["event"]]
    assert "Kubernetes" in refused["reason"] and refused["log_level"] == "error", logs
