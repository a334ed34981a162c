"""GPU truth wired into the daemon, with the FAKE GPU backend (this machine has no
GPU; the NVML path is covered by the @pytest.mark.gpu test in test_gpu.py)."""

from __future__ import annotations

import subprocess

from omnid.gpu import write_fake_gpu_file
from tests.harness import make_stack, wait_for


def test_fake_gpu_min_free_mib_degrades_health_and_recovers(tmp_path, daemon_factory):
    fake = tmp_path / "gpu.json"
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000, "free_mib": 8000}], "processes": []})
    stack = make_stack({"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\ngpu_min_free_mib = 1000\n'})
    d = daemon_factory(stack, env={"OMNID_FAKE_GPU": str(fake), "OMNID_GPU_INTERVAL": "0.1"})
    d.wait_state("worker", "active")
    wait_for(lambda: d.http("/health")[0] == 200, 5, "200 with enough free GPU memory")
    # Another job takes the GPU's memory.
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000, "free_mib": 500}], "processes": []})
    code, body = wait_for(lambda: (r := d.http("/health"))[0] == 503 and r, 5, "503 when the GPU is full")
    assert body["status"] == "degraded"
    assert "GPU 0" in body["units"]["worker"]["reason"] and "gpu_min_free_mib" in body["units"]["worker"]["reason"]
    write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000, "free_mib": 7000}], "processes": []})
    wait_for(lambda: d.http("/health")[0] == 200, 5, "200 again once the memory is freed")


def test_fake_gpu_held_by_a_leftover_refuses_to_start_naming_the_pid(tmp_path, daemon_factory):
    import os

    leftover = subprocess.Popen(["sleep", "1000"], env=dict(os.environ, OMNID_UNIT="worker@0"))
    try:
        fake = tmp_path / "gpu.json"
        write_fake_gpu_file(fake, {"gpus": [{"index": 0, "total_mib": 8000}],
                                   "processes": [{"pid": leftover.pid, "gpu": 0, "used_mib": 2048}]})
        stack = make_stack({"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\n'})
        d = daemon_factory(stack, env={"OMNID_FAKE_GPU": str(fake)})
        u = d.wait_state("worker", "failed")
        assert f"pid {leftover.pid}" in u["reason"] and "GPU 0" in u["reason"] and "refusing" in u["reason"]
    finally:
        leftover.kill()
        leftover.wait()
