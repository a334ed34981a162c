"""The GPU paths on a real NVIDIA GPU (marked `gpu`; each test skips, with the reason,
where NVML or CUDA is missing, so CI without a GPU runs none of them).

What runs here on hardware what the rest of the suite can only drive through the fake
backend: the reference stack with its workers' model tensors in GPU memory, SIGKILL of a
worker and of the daemon with the driver's memory release checked through NVML, another job
taking every free byte of the GPU (FM-17), and a leftover holder refused by pid.

Figures (release times) are printed and appended to $OMNID_MATRIX_REPORT when set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from omnid.gpu import NvmlBackend, memory_held_by
from tests.failure_matrix.harness import DemoStack, Load
from tests.harness import REPO, alive, make_stack, wait_for

pytestmark = pytest.mark.gpu

MODEL_MIB = 8192  # per worker: big enough that the driver's release takes measurable time



@pytest.fixture
def nvml(real_nvml: NvmlBackend) -> NvmlBackend:
    """The session's NVML (conftest's real_nvml: libnvidia-ml keeps fds from its first init
    until the process exits, so opening it per test would show as a leak of the first test
    run), with what these tests need beside it."""
    if not real_nvml.pids_local:
        pytest.skip("NVML reports host pids in this PID namespace; per-pid checks impossible")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the demo worker needs torch, which is not installed")
    return real_nvml


class Holder:
    """Another job on GPU 0 (omnid.demo.gpu_hog; killed by the pid we spawned)."""

    def __init__(self, mib: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "omnid.demo.gpu_hog", mib],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ, **(env or {})), cwd=str(REPO))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("holding"):
            err = self.proc.stderr.read() if self.proc.stderr else ""
            self.close()
            raise AssertionError(f"GPU holder failed: {line!r} {err}")
        self.held_mib, self.free_mib = int(line.split()[1]), int(line.split()[3])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def report(row: str, **figures) -> None:
    print(json.dumps({"row": row, **figures}))
    path = os.environ.get("OMNID_MATRIX_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"row": row, **figures}) + "\n")


def gpu_stack(restart: str = "no", worker: dict[str, str] | None = None) -> DemoStack:
    """The reference stack with both workers on GPU 0 (this machine may have one GPU),
    each holding a MODEL_MIB tensor there; CUDA required (no CPU fallback)."""
    s = DemoStack(restart, {"worker": {"gpus": "[0]", **(worker or {})}})
    s.env.update({"OMNID_DEMO_DEVICE": "cuda", "OMNID_DEMO_MODEL_MIB": str(MODEL_MIB)})
    return s


def held_mib(nvml: NvmlBackend, pids) -> float:
    return sum(p.used_mib for p in memory_held_by(nvml, pids))


def worker_pids(d) -> list[int]:
    return [u["pid"] for n, u in d.units().items() if n.startswith("worker@") and u["pid"]]


def why(d) -> str:
    units = {n: (u["state"], u["pid"], u["reason"]) for n, u in d.units().items()}
    return f"units: {units}\ndaemon log tail:\n{d.log()[-3000:]}"


def test_gpu_real_worker_sigkill_frees_its_memory_before_the_group_restarts(nvml, daemon_factory):
    s = gpu_stack(restart="on-failure")
    try:
        d = s.daemon(daemon_factory)
        d.wait_all_active(180)
        old = worker_pids(d)
        # Each worker's model tensor is in GPU memory, as NVML (not torch) sees it.
        for pid in old:
            assert held_mib(nvml, [pid]) >= MODEL_MIB, (pid, memory_held_by(nvml, [pid]), why(d))
        fault = time.monotonic()
        os.kill(old[0], signal.SIGKILL)
        d.wait_state("worker@0", "failed", timeout=5)
        failed_ms = (time.monotonic() - fault) * 1000
        wait_for(lambda: held_mib(nvml, old) == 0, 30, f"the old workers' GPU memory freed\n{why(d)}",
                 interval=0.005)
        freed_ms = (time.monotonic() - fault) * 1000
        # The group comes back in a new generation, on a GPU the corpses no longer fill.
        wait_for(lambda: (set(worker_pids(d)) & set(old)) == set() and len(worker_pids(d)) == 2
                 and d.http("/health")[0] == 200, 180, f"the stack healthy again\n{why(d)}")
        back_ms = (time.monotonic() - fault) * 1000
        w0, w1 = d.unit("worker@0"), d.unit("worker@1")
        assert w0["gpu_held"] == [] and w0["gpu_release_ms"] is not None, w0
        assert w1["gpu_held"] == [] and w1["gpu_release_ms"] is not None, w1
        new = worker_pids(d)
        for pid in new:
            assert held_mib(nvml, [pid]) >= MODEL_MIB
        summary = d.ok("stop", {"units": list(d.units())}, timeout=120)["summary"]
        for rec in summary:
            if rec["unit"].startswith("worker@"):
                assert rec["gpu_held"] == [] and rec["gpu_release_ms"] is not None, rec
        assert held_mib(nvml, old + new) == 0
        report("GPU worker SIGKILL", model_mib=MODEL_MIB, failed_ms=round(failed_ms, 1),
               nvml_freed_ms=round(freed_ms, 1), omnid_release_ms=round(w0["gpu_release_ms"], 1),
               peer_release_ms=round(w1["gpu_release_ms"], 1), healthy_again_ms=round(back_ms),
               stop_release_ms=[r["gpu_release_ms"] for r in summary if r["unit"].startswith("worker@")])
    finally:
        s.cleanup()


@pytest.mark.parametrize("load", [False, True])
def test_gpu_real_fm17_another_job_takes_every_free_byte(nvml, daemon_factory, load):
    s = gpu_stack(worker={"gpu_min_free_mib": "1024"})
    s.env["OMNID_GPU_INTERVAL"] = "0.2"
    try:
        d = s.daemon(daemon_factory)
        d.wait_all_active(180)
        wait_for(lambda: d.http("/health")[0] == 200, 10, f"200 before the fault\n{why(d)}")
        ld = Load(s.serve_port).start() if load else None
        holder = None
        try:
            if ld:
                ld.wait_successes(4)
            asked = time.monotonic()
            holder = Holder("all")
            fault = time.monotonic()  # the memory is taken (the hog printed what it holds)
            took_ms = (fault - asked) * 1000
            code, body = wait_for(lambda: (r := d.http("/health"))[0] == 503 and r, 0.2 + 1.0,
                                  f"503 within one GPU read interval\n{why(d)}")
            degraded_ms = (time.monotonic() - fault) * 1000
            assert body["status"] == "degraded", body
            assert "gpu_min_free_mib" in body["units"]["worker@0"]["reason"], body
            failures = []
            if ld:
                # Requests on the full GPU fail fast with a 5xx naming the out-of-memory; none hangs.
                t_full = time.monotonic()
                wait_for(lambda: any(o.started > t_full and o.status and o.status >= 500
                                     for o in list(ld.outcomes)), 10, "a 5xx for a request on a full GPU")
                late = [o for o in list(ld.outcomes) if o.started > t_full]
                assert all(o.ended - o.started < 2.0 for o in late), [(o.status, o.body) for o in late]
                failures = [o for o in late if o.status and o.status >= 500]
                assert any("out of memory" in o.body for o in failures), [o.body for o in failures[:3]]
            held = holder.held_mib
            holder.close()
            holder = None
            freed = time.monotonic()
            wait_for(lambda: d.http("/health")[0] == 200, 10, f"200 once the memory is free\n{why(d)}")
            recovered_ms = (time.monotonic() - freed) * 1000
            if ld:
                ld.wait_successes(sum(o.ok for o in list(ld.outcomes)) + 2, 30)
        finally:
            if holder is not None:
                holder.close()
            if ld:
                ld.stop()
        report(f"FM-17 real GPU ({'load' if load else 'idle'})", taken_mib=held, take_ms=round(took_ms),
               degraded_ms=round(degraded_ms, 1), recovered_ms=round(recovered_ms, 1),
               fast_5xx=len(failures))
    finally:
        s.cleanup()


def test_gpu_real_fm16_daemon_sigkill_frees_every_workers_memory(nvml, daemon_factory):
    s = gpu_stack()
    try:
        d = s.daemon(daemon_factory)
        d.wait_all_active(180)
        pids = [u["pid"] for u in d.units().values() if u["pid"]]
        workers = worker_pids(d)
        assert held_mib(nvml, workers) >= 2 * MODEL_MIB
        fault = time.monotonic()
        os.kill(d.pid, signal.SIGKILL)
        d.wait_exit(10)
        wait_for(lambda: not any(alive(p) for p in pids), 1.0, "every unit process gone within 1 s")
        gone_ms = (time.monotonic() - fault) * 1000
        wait_for(lambda: held_mib(nvml, workers) == 0, 30, "the workers' GPU memory freed", interval=0.005)
        freed_ms = (time.monotonic() - fault) * 1000
        report("FM-16 real GPU", all_gone_ms=round(gone_ms, 1), gpu_freed_ms=round(freed_ms, 1))
    finally:
        s.cleanup()


def test_gpu_real_leftover_holder_is_refused_by_pid(nvml, daemon_factory):
    holder = Holder("512", env={"OMNID_UNIT": "worker"})
    try:
        stack = make_stack({"worker": 'exec = ["sleep", "1000"]\ngpus = [0]\n'})
        d = daemon_factory(stack)
        u = d.wait_state("worker", "failed", timeout=30)
        assert f"pid {holder.proc.pid}" in u["reason"] and "GPU 0" in u["reason"], u
        assert "refusing" in u["reason"], u
    finally:
        holder.close()
