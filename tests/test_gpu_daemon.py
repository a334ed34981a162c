"""GPU truth wired into the daemon, with the FAKE GPU backend (this machine has no
GPU; the NVML path is covered by the @pytest.mark.gpu test in test_gpu.py)."""

from __future__ import annotations

import re
import subprocess


from omnid.gpu.fake import write_fake_gpu_file
from tests.harness import make_stack, wait_for


def test_fake_gpu_min_free_mib_degrades_health_and_recovers(tmp_path, daemon_factory):
    fake = tmp_path / "gpu.json"
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000, "free_mib": 8000}], "processes": []})
    stack = make_stack({"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\ngpu_min_free_mib = 1000\n'})
    d = daemon_factory(stack, env={"OMNID_DEVELOPER_FAKE_GPU": str(fake), "OMNID_GPU_INTERVAL": "0.1"})
    d.wait_state("worker", "active")
    wait_for(lambda: d.http("/health")[0] == 200, 5, "200 with enough free GPU memory")
    # Another job takes the GPU's memory.
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000, "free_mib": 500}], "processes": []})
    code, body = wait_for(lambda: (r := d.http("/health"))[0] == 503 and r, 5, "503 when the GPU is full")
    assert body["status"] == "degraded"
    assert "GPU 0" in body["units"]["worker"]["reason"] and "gpu_min_free_mib" in body["units"]["worker"]["reason"]
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000, "free_mib": 7000}], "processes": []})
    wait_for(lambda: d.http("/health")[0] == 200, 5, "200 again once the memory is freed")


def test_fake_gpu_developer_option_is_said_at_start_in_health_and_in_status(tmp_path, daemon_factory):
    """The fake backend cannot go unnoticed: an error in the log at every start, `gpu_backend`
    in /health, a line in `omnid status`."""
    import sys

    from tests.harness import REPO, repo_pythonpath

    fake = tmp_path / "gpu.json"
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000}], "processes": []})
    d = daemon_factory(make_stack({"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\n'}),
                       env={"OMNID_DEVELOPER_FAKE_GPU": str(fake)})
    d.wait_state("worker", "active")
    said = [e for e in d.log_events() if e.get("event", "").startswith("gpu: FAKE GPU BACKEND")]
    assert [(e.get("level"), e.get("path")) for e in said] == [("error", str(fake))], d.log()[-2000:]
    code, body = wait_for(lambda: (r := d.http("/health"))[0] == 200 and r, 5, "200 from /health")
    assert body["gpu_backend"] == "fake", body
    out = subprocess.run([sys.executable, "-m", "omnid", "--control", d.control, "status"], capture_output=True,
                         text=True, timeout=30, cwd=str(REPO), env=dict(__import__("os").environ,
                                                                        PYTHONPATH=repo_pythonpath()))
    assert "GPU: FAKE GPU backend (developer option OMNID_DEVELOPER_FAKE_GPU): not real GPUs" in out.stdout, out


def test_fake_gpu_held_by_a_leftover_refuses_to_start_naming_the_pid(tmp_path, daemon_factory):
    import os

    leftover = subprocess.Popen(["sleep", "1000"], env=dict(os.environ, OMNID_UNIT="worker@0"))
    try:
        fake = tmp_path / "gpu.json"
        write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000}],
                                   "processes": [{"pid": leftover.pid, "gpu": 0, "used_mib": 2048}]})
        stack = make_stack({"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\n'})
        d = daemon_factory(stack, env={"OMNID_DEVELOPER_FAKE_GPU": str(fake)})
        u = d.wait_state("worker", "failed")
        assert f"pid {leftover.pid}" in u["reason"] and "GPU 0" in u["reason"] and "refusing" in u["reason"]
    finally:
        leftover.kill()
        leftover.wait()


def _held_by(fake, pid: int, mib: int = 2048) -> None:
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000}],
                               "processes": [{"pid": pid, "gpu": 0, "used_mib": mib}]})


def test_fake_gpu_restart_waits_until_the_dead_workers_memory_is_released(tmp_path, daemon_factory):
    """The driver frees a killed process's GPU memory some time after its death (hundreds of
    ms for a large model). `failed` is published at once, but the restart waits for the
    release, so the new worker does not start on a GPU the corpse still fills."""
    import os
    import signal
    import time

    fake = tmp_path / "gpu.json"
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000}], "processes": []})
    stack = make_stack({"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\nrestart = "on-failure"\n'
                                  'restart_sec = 0.1\nkill_timeout = 10\n'})
    d = daemon_factory(stack, env={"OMNID_DEVELOPER_FAKE_GPU": str(fake)})
    old = d.wait_state("worker", "active")["pid"]
    _held_by(fake, old)  # what NVML shows while the worker runs, and after its death
    fault = time.monotonic()
    os.kill(old, signal.SIGKILL)
    d.wait_state("worker", "failed", timeout=5)
    failed_s = time.monotonic() - fault
    # While the dead pid still holds memory, no new worker may start (observed for 0.6 s).
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        u = d.unit("worker")
        assert u["pid"] in (None, old) and u["state"] == "failed", f"restarted on a held GPU: {u}"
        time.sleep(0.02)
    released = time.monotonic()
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000}], "processes": []})
    u = wait_for(lambda: (x := d.unit("worker"))["state"] == "active" and x["pid"] != old and x, 10,
                 f"the restart once the memory is free\n{d.log()[-2000:]}")
    assert u["gpu_release_ms"] >= 600, u
    assert u["gpu_held"] == []
    assert failed_s < 1.0, f"failed published {failed_s:.3f} s after the kill: it must not wait for the GPU"
    assert time.monotonic() - released < 10


def test_fake_gpu_memory_still_held_after_stop_is_reported_by_pid(tmp_path, daemon_factory):
    """A stop (and a failure) waits at most kill_timeout for the GPU; what is still held then
    is named, pid and MiB, in the stop summary, the unit's status and the daemon's log."""
    import os
    import signal

    fake = tmp_path / "gpu.json"
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000}], "processes": []})
    stack = make_stack({"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\nkill_timeout = 0.5\n',
                        "other": 'exec = ["sleep", "1000"]\ngpus = [0]\nkill_timeout = 0.5\n'})
    d = daemon_factory(stack, env={"OMNID_DEVELOPER_FAKE_GPU": str(fake)})
    pid = d.wait_state("worker", "active")["pid"]
    _held_by(fake, pid, 3072)
    summary = d.ok("stop", {"units": ["worker"]})["summary"]
    [rec] = [r for r in summary if r["unit"] == "worker"]
    assert rec["gpu_held"] == [f"pid {pid} holds 3072 MiB on GPU 0"], rec
    assert rec["gpu_release_ms"] is None
    assert d.unit("worker")["gpu_held"] == rec["gpu_held"]
    assert any(e.get("event", "").startswith("GPU memory still held") and e.get("unit") == "worker"
               for e in d.log_events()), d.log()[-2000:]
    # The failure path reports the same way (restart = "no" by default here).
    other = d.wait_state("other", "active")["pid"]
    _held_by(fake, other, 1024)
    os.kill(other, signal.SIGKILL)
    u = wait_for(lambda: (x := d.unit("other"))["gpu_held"] and x, 5, "the held GPU memory named after a failure")
    assert u["state"] == "failed" and u["gpu_held"] == [f"pid {other} holds 1024 MiB on GPU 0"], u


def test_fake_gpu_start_while_the_dead_workers_memory_is_released_is_not_lost(tmp_path, daemon_factory):
    """`omnid start` of a failed unit whose GPU memory the driver has not freed yet: the start
    waits for the release and then starts it (it used to answer "failed" at once, old reason,
    and start nothing)."""
    import os
    import signal

    fake = tmp_path / "gpu.json"
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000}], "processes": []})
    stack = make_stack({"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\nkill_timeout = 10\n'})
    d = daemon_factory(stack, env={"OMNID_DEVELOPER_FAKE_GPU": str(fake)})
    old = d.wait_state("worker", "active")["pid"]
    _held_by(fake, old)
    os.kill(old, signal.SIGKILL)
    d.wait_state("worker", "failed", timeout=5)
    assert d.unit("worker")["pid"] in (None, old)
    import json

    import zmq

    sock = d._ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{d.control}")
    try:
        sock.send(json.dumps({"id": 1, "cmd": "start", "args": {"units": ["worker"], "timeout": 20}}).encode())
        # The start is waiting on the release (the dead pid still holds its memory).
        assert not sock.poll(300), f"start answered while the GPU memory is held: {sock.recv()}"
        write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000}], "processes": []})
        assert sock.poll(30_000), f"no reply to start\n{d.log()[-2000:]}"
        reply = json.loads(sock.recv())
    finally:
        sock.close()
    assert reply["ok"] and reply["result"]["ok"], f"{reply}\n{d.log()[-2000:]}"
    u = d.unit("worker")
    assert u["state"] == "active" and u["pid"] not in (None, old), u


# --------------------------------------------------------------------------- GPU faults (omnid(8) GPU FAULTS)



def _gpu_daemon(tmp_path, daemon_factory, units: dict[str, str], **env: str):
    from omnid.gpu.fake import FakeGpuBackend

    path = tmp_path / "gpu.json"
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "total_mib": 8000}, {"index": 1, "total_mib": 8000}],
                               "processes": []})
    d = daemon_factory(make_stack(units), env={"OMNID_DEVELOPER_FAKE_GPU": str(path), "OMNID_GPU_INTERVAL": "0.1", **env})
    return d, FakeGpuBackend(path)


def test_fake_gpu_xid_79_turns_health_failed_naming_the_gpu(tmp_path, daemon_factory):
    d, fake = _gpu_daemon(tmp_path, daemon_factory, {"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\n',
                                                     "other": 'exec = ["sleep", "1000"]\ngpus = [1]\n'})
    d.wait_all_active()
    wait_for(lambda: d.http("/health")[0] == 200, 5, "200 before the fault")
    fake.inject_xid(0, 79)
    code, body = wait_for(lambda: (r := d.http("/health"))[1].get("gpus") and r, 5,
                          f"/health naming the GPU\n{d.log()[-2000:]}")
    assert code == 503 and body["status"] == "failed", body
    g = body["gpus"]["GPU 0"]
    assert g["status"] == "failed" and "Xid 79" in g["reason"] and "fallen off the bus" in g["reason"], g
    assert g["units"] == ["worker"] and "GPU 1" not in body["gpus"]
    st = d.ok("status")["daemon"]["gpu"]
    assert [c["xid"] for c in st["conditions"]] == [79] and st["conditions"][0]["blocks_start"]


def test_fake_gpu_xid_79_fails_the_unit_on_that_gpu_and_refuses_a_new_start(tmp_path, daemon_factory):
    d, fake = _gpu_daemon(tmp_path, daemon_factory, {"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\n',
                                                     "other": 'exec = ["sleep", "1000"]\ngpus = [1]\n'})
    d.wait_all_active()
    fake.inject_xid(0, 79)
    u = d.wait_state("worker", "failed", timeout=5)
    assert "Xid 79" in u["reason"] and "fallen off the bus" in u["reason"], u
    assert d.unit("other")["state"] == "active"  # another GPU's unit is not touched
    code, body = d.http("/health")
    assert code == 503 and body["status"] == "failed" and body["gpus"]["GPU 0"]["status"] == "failed"
    reply = d.call("start", {"units": ["worker"], "timeout": 10})
    units = reply["result"]["units"] if reply["ok"] else []
    reason = units[0]["reason"] if units else reply["error"]["message"]
    assert "refusing to start on GPU 0" in reason and "Xid 79" in reason, reply
    assert d.unit("worker")["pid"] is None


def test_fake_gpu_xid_48_fails_the_unit_with_the_xid_in_its_reason_and_it_restarts(tmp_path, daemon_factory):
    d, fake = _gpu_daemon(tmp_path, daemon_factory,
                          {"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\nrestart = "on-failure"\nrestart_sec = 0.1\n'})
    old = d.wait_state("worker", "active")["pid"]
    fake.inject_xid(0, 48)
    wait_for(lambda: "Xid 48" in (d.unit("worker")["reason"] or ""), 5, f"the Xid in the reason\n{d.log()[-2000:]}")
    assert "double-bit ECC" in d.unit("worker")["reason"]
    code, body = d.http("/health")
    assert code == 503 and "GPU 0" in body.get("gpus", {}), body
    # A contained fault does not block the GPU: the restart policy brings the unit back.
    wait_for(lambda: (u := d.unit("worker"))["state"] == "active" and u["pid"] != old, 10, "the restart")


def test_fake_gpu_hung_nvml_call_keeps_health_answering_and_status_says_unreadable(tmp_path, daemon_factory):
    import subprocess
    import sys
    import time

    from tests.harness import REPO, repo_pythonpath

    d, fake = _gpu_daemon(tmp_path, daemon_factory, {"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\n'},
                          OMNID_NVML_TIMEOUT="2")
    d.wait_all_active()
    wait_for(lambda: d.http("/health")[0] == 200, 5, "200 before the hang")
    fake.set_hang([0])  # GPU 0 alone: which GPU's read hangs first would depend on where the read cycle is
    try:
        # The GPU watch's read is now stuck in the "driver"; /health answers all along.
        deadline = time.monotonic() + 3.0
        slowest = 0.0
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            d.http("/health/live")
            d.http("/health")
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.05)
        assert slowest < 1.0, f"/health took {slowest:.2f} s while an NVML call hung"
        gpu = wait_for(lambda: (g := d.ok("status")["daemon"]["gpu"])["stuck_threads"] == 1 and g, 10,
                       f"status to say the GPU is unreadable\n{d.log()[-2000:]}")
        assert not gpu["readable"] and re.search(r"GPU 0: nvml\w+ has not returned", gpu["reason"]), gpu
        code, body = d.http("/health")
        assert code == 503 and body["status"] == "degraded", body
        assert "unreadable" in body["gpus"]["GPU 0"]["reason"] and body["gpus"]["GPU 0"]["units"] == ["worker"]
        out = subprocess.run([sys.executable, "-m", "omnid", "--control", d.control, "status"], capture_output=True,
                             text=True, timeout=30, cwd=str(REPO), env=dict(__import__("os").environ,
                                                                            PYTHONPATH=repo_pythonpath()))
        assert re.search(r"GPU: fake GPU reads stuck: unreadable: GPU 0: nvml\w+ has not returned", out.stdout), out.stdout
        assert "(1 reader thread stuck)" in out.stdout
    finally:
        fake.set_hang(False)
    wait_for(lambda: d.http("/health")[0] == 200, 10, "200 again once the call returned")
