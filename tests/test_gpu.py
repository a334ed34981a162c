"""omnid.gpu: GPU truth for residue checks, start refusal and degraded detection.

Every test here except the last runs without a GPU: the `fake_gpu` tests use
FakeGpuBackend, the `fake_nvml` tests replace pynvml's functions to drive
NvmlBackend's error handling. The last test (`-m gpu`) uses the real NVML and is
skipped, with the reason, on a machine without one.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import structlog.testing

from omnid import gpu
from omnid.base import testswitch
from omnid.gpu import (
    GpuInfo,
    GpuProcess,
    NoGpuBackend,
    NvmlBackend,
    holders_of,
    memory_held_by,
    open_backend,
    wait_released,
)
from omnid.gpu.fake import FakeGpuBackend, write_fake_gpu_file
from tests.harness import wait_for


def two_gpus_with_workers() -> FakeGpuBackend:
    fake = FakeGpuBackend()
    fake.set_gpu(0, total_mib=81920)
    fake.set_gpu(1, total_mib=81920)
    fake.set_process(1001, 30000, gpu=0)
    fake.set_process(1002, 20000, gpu=1)
    fake.set_process(9999, 500, gpu=1)  # someone else's
    return fake


# ---------------------------------------------------------------------------- fake GPU


@pytest.mark.fast
def test_fake_gpu_says_it_is_fake() -> None:
    fake = two_gpus_with_workers()
    assert fake.kind == "fake"
    assert fake.available and fake.reason == "" and fake.pids_local
    assert "FAKE" in gpu.describe(fake)


@pytest.mark.fast
def test_fake_gpu_lists_gpus_with_free_memory_derived_from_processes() -> None:
    fake = two_gpus_with_workers()
    assert fake.gpus() == [
        GpuInfo(index=0, name="fake GPU 0", total_mib=81920, free_mib=51920, used_mib=30000),
        GpuInfo(index=1, name="fake GPU 1", total_mib=81920, free_mib=61420, used_mib=20500),
    ]


@pytest.mark.fast
def test_fake_gpu_explicit_free_memory_simulates_an_outside_process() -> None:
    fake = two_gpus_with_workers()
    fake.set_gpu(0, total_mib=81920, free_mib=12)
    (gpu0,) = [g for g in fake.gpus() if g.index == 0]
    assert gpu0.free_mib == 12 and gpu0.used_mib == 81908


@pytest.mark.fast
def test_fake_gpu_memory_held_by_only_the_given_pids() -> None:
    fake = two_gpus_with_workers()
    assert memory_held_by(fake, [1001, 1002, 4242]) == [
        GpuProcess(pid=1001, gpu=0, used_mib=30000),
        GpuProcess(pid=1002, gpu=1, used_mib=20000),
    ]
    assert memory_held_by(fake, []) == []


@pytest.mark.fast
def test_fake_gpu_process_on_two_gpus_is_listed_once_per_gpu() -> None:
    fake = two_gpus_with_workers()
    fake.set_process(1001, 100, gpu=1)
    assert sorted((p.pid, p.gpu) for p in memory_held_by(fake, [1001])) == [(1001, 0), (1001, 1)]
    fake.release(1001, gpu=0)
    assert [(p.pid, p.gpu) for p in memory_held_by(fake, [1001])] == [(1001, 1)]


@pytest.mark.fast
def test_fake_gpu_holders_of_lists_every_pid_on_those_gpus() -> None:
    fake = two_gpus_with_workers()
    assert sorted(p.pid for p in holders_of(fake, [1])) == [1002, 9999]
    assert [p.pid for p in holders_of(fake, [0])] == [1001]
    assert holders_of(fake, [7]) == []


def test_fake_gpu_wait_released_reports_ms_until_memory_is_freed() -> None:
    fake = two_gpus_with_workers()

    async def scenario() -> tuple[float | None, list[GpuProcess]]:
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, fake.release, 1001)
        loop.call_later(0.3, fake.release, 1002)
        return await wait_released(fake, [1001, 1002], timeout=5.0, interval=0.01)

    ms, leftovers = asyncio.run(scenario())
    assert leftovers == []
    assert ms is not None and 290 <= ms < 2000


def test_fake_gpu_wait_released_gives_up_at_the_deadline_with_leftovers() -> None:
    fake = two_gpus_with_workers()
    started = time.monotonic()
    ms, leftovers = asyncio.run(wait_released(fake, [1001, 1002], timeout=0.3, interval=0.02))
    elapsed = time.monotonic() - started
    assert ms is None
    assert leftovers == [GpuProcess(1001, 0, 30000), GpuProcess(1002, 1, 20000)]
    assert 0.3 <= elapsed < 1.5


@pytest.mark.fast
def test_fake_gpu_wait_released_with_nothing_held_is_immediate() -> None:
    fake = two_gpus_with_workers()
    # A poll interval of 10 s: the answer comes from the first read, not after any wait (a bound
    # of 50 ms on the time itself failed beside a parallel run: one read took 73 ms).
    ms, leftovers = asyncio.run(wait_released(fake, [4242], timeout=30.0, interval=10.0))
    assert leftovers == [] and ms is not None and ms < 5000
    assert asyncio.run(wait_released(fake, [], timeout=5.0)) == (0.0, [])


@pytest.mark.fast
def test_fake_gpu_unavailable_cannot_tell_instead_of_claiming_released() -> None:
    fake = two_gpus_with_workers()
    fake.set_unavailable("no GPU: fake NVML failure")
    assert not fake.available and fake.reason == "no GPU: fake NVML failure"
    assert fake.gpus() == [] and fake.processes() == []
    assert memory_held_by(fake, [1001]) == []
    assert asyncio.run(wait_released(fake, [1001], timeout=5.0)) == (None, [])
    fake.set_available()
    assert fake.available and len(memory_held_by(fake, [1001])) == 1


@pytest.mark.fast
def test_fake_gpu_host_pids_are_not_matched_to_unit_pids() -> None:
    fake = two_gpus_with_workers()
    fake.set_pids_local(False)
    assert memory_held_by(fake, [1001]) == []
    assert asyncio.run(wait_released(fake, [1001], timeout=5.0)) == (None, [])
    # who holds a GPU does not need pids to be comparable
    assert [p.pid for p in holders_of(fake, [0])] == [1001]


@pytest.mark.fast
def test_fake_gpu_file_from_env_is_what_open_backend_uses(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gpu.json"
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "name": "fake H100", "total_mib": 1000}],
                               "processes": [{"pid": 77, "gpu": 0, "used_mib": 250}]})
    monkeypatch.setenv("OMNID_DEVELOPER_FAKE_GPU", str(path))
    backend = open_backend()
    assert isinstance(backend, FakeGpuBackend) and backend.kind == "fake"
    assert backend.gpus() == [GpuInfo(0, "fake H100", 1000, 750, 250)]
    assert memory_held_by(backend, [77]) == [GpuProcess(77, 0, 250)]


def _open_refused(monkeypatch: pytest.MonkeyPatch) -> tuple[gpu.GpuBackend, list[dict]]:
    """open_backend() with no driver to fall back on; the backend and what it logged."""
    monkeypatch.setattr(gpu, "DRIVER_PATHS", ("/nonexistent/omnid-test-no-driver",))
    with structlog.testing.capture_logs() as logs:
        backend = open_backend()
    return backend, logs


@pytest.mark.fast
def test_fake_gpu_developer_option_is_refused_in_a_systemd_service(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gpu.json"
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "total_mib": 1000}], "processes": []})
    monkeypatch.setenv("OMNID_DEVELOPER_FAKE_GPU", str(path))
    monkeypatch.setenv("SYSTEMD_EXEC_PID", str(os.getpid()))  # what systemd sets for a service's main process
    backend, logs = _open_refused(monkeypatch)
    assert backend.kind == "none", backend
    [refused] = [e for e in logs if "refused" in e["event"]]
    assert refused["log_level"] == "error" and "systemd service" in refused["reason"], logs
    # The same variable inherited by another process of the service (a test daemon under
    # a CI runner that is a service) is not the service's main process.
    monkeypatch.setenv("SYSTEMD_EXEC_PID", str(os.getppid()))
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    assert open_backend().kind == "fake"


@pytest.mark.parametrize("dir_mode, file_mode, says", [
    (0o777, 0o644, "its directory"),   # another user could replace the file
    (0o700, 0o666, "writable by its group and others"),
])
@pytest.mark.fast
def test_fake_gpu_developer_option_refuses_a_file_others_could_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     dir_mode: int, file_mode: int,
                                                                     says: str) -> None:
    where = tmp_path / "shared"
    where.mkdir()
    path = where / "gpu.json"
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "total_mib": 1000}], "processes": []})
    path.chmod(file_mode)
    where.chmod(dir_mode)
    monkeypatch.setenv("OMNID_DEVELOPER_FAKE_GPU", str(path))
    monkeypatch.delenv("SYSTEMD_EXEC_PID", raising=False)
    backend, logs = _open_refused(monkeypatch)
    assert backend.kind == "none", backend
    [refused] = [e for e in logs if "refused" in e["event"]]
    assert says in refused["reason"] and str(path) in refused["reason"], refused


@pytest.mark.fast
def test_fake_gpu_old_variable_is_said_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gpu.json"
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "total_mib": 1000}], "processes": []})
    monkeypatch.delenv("OMNID_DEVELOPER_FAKE_GPU", raising=False)
    monkeypatch.setenv("OMNID_FAKE_GPU", str(path))
    backend, logs = _open_refused(monkeypatch)
    assert backend.kind == "none", backend
    assert any(e["log_level"] == "error" and "OMNID_DEVELOPER_FAKE_GPU" in e["event"] for e in logs), logs


def test_fake_gpu_module_is_never_imported_without_the_developer_option() -> None:
    """Production never loads the test double: checked in a fresh interpreter."""
    code = ("import os, sys; os.environ.pop('OMNID_DEVELOPER_FAKE_GPU', None); from omnid import gpu; "
            "b = gpu.open_backend(); print(b.kind, 'omnid.gpu.fake' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kind, imported = out.stdout.splitlines()[-1].split()
    assert kind != "fake" and imported == "False", out.stdout


@pytest.mark.fast
def test_fake_gpu_status_says_fake_and_the_demo_worker_reads_the_same_option() -> None:
    from omnid.cli.render import print_gpu

    st = gpu.status(FakeGpuBackend())
    assert st["backend"] == "fake" and "OMNID_DEVELOPER_FAKE_GPU" in st["warning"], st
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_gpu(st)
    assert f"GPU: {st['warning']}" in buf.getvalue().splitlines()
    # The demo worker takes the option's name from where it is defined once, not from
    # omnid.gpu (read without importing the worker: that loads torch).
    tree = ast.parse((Path(gpu.__file__).parent.parent / "demo" / "worker.py").read_text())
    [value] = [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
               and [getattr(t, "id", None) for t in n.targets] == ["FAKE_GPU_ENV"]]
    assert value == "testswitch.FAKE_GPU_ENV", value
    assert gpu.FAKE_GPU_ENV == testswitch.FAKE_GPU_ENV == "OMNID_DEVELOPER_FAKE_GPU"


@pytest.mark.fast
def test_fake_gpu_file_is_reread_on_every_call(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "total_mib": 1000}],
                               "processes": [{"pid": 77, "used_mib": 250}]})
    backend = FakeGpuBackend(path)
    assert backend.gpus()[0].free_mib == 750
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "total_mib": 1000, "free_mib": 3}],
                               "processes": []})
    assert backend.gpus()[0].free_mib == 3
    assert backend.processes() == []


@pytest.mark.fast
def test_fake_gpu_setters_on_a_file_are_seen_by_another_reader(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    writer, reader = FakeGpuBackend(path), FakeGpuBackend(path)
    writer.set_gpu(0, total_mib=2048)
    writer.set_process(5, 1024)
    assert reader.processes() == [GpuProcess(5, 0, 1024)]
    writer.release(5)
    assert reader.processes() == []
    assert [p.name for p in tmp_path.iterdir()] == ["gpu.json"]  # no temp files left


def test_fake_gpu_release_by_another_process_ends_the_wait(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    backend = FakeGpuBackend(path)
    backend.set_gpu(0)
    backend.set_process(4321, 4096)
    releaser = textwrap.dedent(f"""
        import time
        from omnid.gpu.fake import FakeGpuBackend
        time.sleep(0.3)
        FakeGpuBackend({str(path)!r}).release(4321)
    """)
    child = subprocess.Popen([sys.executable, "-c", releaser])
    try:
        ms, leftovers = asyncio.run(wait_released(backend, [4321], timeout=10.0))
    finally:
        assert child.wait(timeout=10) == 0
    assert leftovers == [] and ms is not None and ms >= 300


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read"),
    ("{not json", "cannot read"),
    ('{"gpus": [{"index": "zero", "total_mib": 1}]}', "gpus[0]: expected"),
    ('{"processes": [{"pid": 1}]}', "processes[0]: expected"),
    ('{"available": false, "reason": "no GPU: pretend"}', "no GPU: pretend"),
])
@pytest.mark.fast
def test_fake_gpu_bad_file_is_unavailable_with_a_reason(tmp_path: Path, content: str | None,
                                                        expected: str) -> None:
    path = tmp_path / "gpu.json"
    if content is not None:
        path.write_text(content)
    backend = FakeGpuBackend(path)
    assert not backend.available
    assert expected in backend.reason
    if "no GPU" not in expected:
        assert str(path) in backend.reason
    assert backend.gpus() == [] and backend.processes() == []
    assert asyncio.run(wait_released(backend, [1], timeout=5.0)) == (None, [])


# ---------------------------------------------------------------------------- no GPU / NVML errors


@pytest.mark.fast
def test_no_gpu_backend_answers_empty_and_never_raises() -> None:
    backend = NoGpuBackend("no GPU: NVML not found (libnvidia-ml.so.1 cannot be loaded)")
    assert not backend.available and backend.kind == "none"
    assert backend.gpus() == [] and backend.processes() == []
    assert memory_held_by(backend, [1]) == [] and holders_of(backend, [0]) == []
    assert asyncio.run(wait_released(backend, [1], timeout=5.0)) == (None, [])
    assert gpu.describe(backend) == "none: " + backend.reason


@pytest.mark.fast
def test_fake_nvml_open_backend_without_the_library_gives_no_gpu_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")
    monkeypatch.delenv("OMNID_DEVELOPER_FAKE_GPU", raising=False)

    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    monkeypatch.setattr(gpu, "DRIVER_PATHS", ("/",))  # as if a driver were loaded, its library missing
    backend = open_backend()
    assert isinstance(backend, NoGpuBackend)
    assert backend.reason == "no GPU: NVML not found (libnvidia-ml.so.1 cannot be loaded)"


def test_open_backend_where_no_driver_is_never_loads_nvml() -> None:
    """On a host with no NVIDIA driver the daemon says so and never imports pynvml (its
    ~2.7 MiB of the daemon's memory buy nothing there). Checked in a fresh interpreter."""
    present = [p for p in gpu.DRIVER_PATHS if Path(p).exists()]
    if present:
        pytest.skip(f"this host has an NVIDIA driver ({', '.join(present)})")
    code = ("import sys, os; os.environ.pop('OMNID_DEVELOPER_FAKE_GPU', None); from omnid import gpu; "
            "b = gpu.open_backend(); print(b.kind, 'pynvml' in sys.modules); print(b.reason)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, reason = out.stdout.splitlines()[-2:]  # after the log line
    assert first == "none False", out.stdout
    assert reason.startswith("no GPU: no NVIDIA driver on this host") and "/proc/driver/nvidia" in reason


@pytest.mark.parametrize("code_name, expected", [
    ("NVML_ERROR_DRIVER_NOT_LOADED", "no GPU: NVIDIA driver not loaded"),
    ("NVML_ERROR_NO_PERMISSION", "no GPU: NVML: insufficient permissions"),
    ("NVML_ERROR_UNKNOWN", "no GPU: NVML init failed: Unknown Error"),
])
@pytest.mark.fast
def test_fake_nvml_init_failure_is_a_reason_not_an_exception(
        monkeypatch: pytest.MonkeyPatch, code_name: str, expected: str) -> None:
    pynvml = pytest.importorskip("pynvml")

    def fail() -> None:
        raise pynvml.NVMLError(getattr(pynvml, code_name))
    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    backend = NvmlBackend()
    assert not backend.available and backend.reason == expected
    assert backend.gpus() == [] and backend.processes() == []


@pytest.mark.fast
def test_fake_nvml_missing_python_binding_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    backend = NvmlBackend()
    assert not backend.available
    assert backend.reason.startswith("no GPU: nvidia-ml-py is not installed")


class _Entry:
    def __init__(self, pid: int, used: int | None) -> None:
        self.pid, self.usedGpuMemory = pid, used


class _Memory:
    def __init__(self, total: int, free: int) -> None:
        self.total, self.free, self.used = total, free, total - free


def fake_nvml(monkeypatch: pytest.MonkeyPatch, lost_gpu: int | None = None):  # type: ignore[no-untyped-def]
    """Two fake NVML devices: pid 10 on both (compute and graphics on GPU 0), pid 11 with
    an amount the driver cannot tell, no graphics listing on GPU 1, no v3 MPS call."""
    pynvml = pytest.importorskip("pynvml")
    mib = 1024 * 1024
    err = pynvml.NVMLError

    def lost(handle: int) -> None:
        if handle == lost_gpu:
            raise err(pynvml.NVML_ERROR_GPU_IS_LOST)

    def compute(handle: int) -> list[_Entry]:
        lost(handle)
        return [_Entry(10, 512 * mib), _Entry(11, None)] if handle == 0 else [_Entry(10, 64 * mib)]

    def graphics(handle: int) -> list[_Entry]:
        lost(handle)
        if handle == 1:
            raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [_Entry(10, 512 * mib)]

    def mps_v3(handle: int) -> list[_Entry]:
        raise err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def memory(handle: int) -> _Memory:
        lost(handle)
        return _Memory(80 * 1024 * mib, 79 * 1024 * mib)

    for name, fn in {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: b"NVIDIA H100 80GB HBM3" if h == 0 else "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetMemoryInfo": memory,
        "nvmlDeviceGetComputeRunningProcesses_v3": compute,
        "nvmlDeviceGetGraphicsRunningProcesses_v3": graphics,
        "nvmlDeviceGetMPSComputeRunningProcesses_v3": mps_v3,
        "nvmlDeviceGetMPSComputeRunningProcesses_v2": lambda h: [],
    }.items():
        monkeypatch.setattr(pynvml, name, fn)
    monkeypatch.setattr(gpu, "in_initial_pid_namespace", lambda: True)
    return pynvml


@pytest.mark.fast
def test_fake_nvml_merges_process_lists_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch)
    backend = NvmlBackend()
    assert backend.available and backend.kind == "nvml"
    assert backend.processes() == [
        GpuProcess(pid=10, gpu=0, used_mib=512.0),
        GpuProcess(pid=10, gpu=1, used_mib=64.0),
        GpuProcess(pid=11, gpu=0, used_mib=0.0),  # amount unknown, still a holder
    ]
    assert [(g.index, g.name, g.total_mib, g.free_mib) for g in backend.gpus()] == [
        (0, "NVIDIA H100 80GB HBM3", 81920.0, 80896.0),
        (1, "NVIDIA H100 80GB HBM3", 81920.0, 80896.0),
    ]
    assert sorted(p.gpu for p in memory_held_by(backend, [11, 10])) == [0, 0, 1]


@pytest.mark.fast
def test_fake_nvml_lost_gpu_is_skipped_and_the_others_still_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch, lost_gpu=1)
    backend = NvmlBackend()
    assert [g.index for g in backend.gpus()] == [0]
    assert {p.gpu for p in backend.processes()} == {0}


@pytest.mark.fast
def test_fake_nvml_no_devices_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = fake_nvml(monkeypatch)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 0)
    backend = NvmlBackend()
    assert not backend.available and backend.reason == "no GPU: NVML found no devices"


# ---------------------------------------------------------------------------- MIG and UUIDs (fake GPU)

MIG_A = "MIG-aaaaaaaa-0000-0000-0000-000000000001"
MIG_B = "MIG-bbbbbbbb-0000-0000-0000-000000000002"
GPU1 = "GPU-11111111-2222-3333-4444-555555555555"


def mig_gpu() -> FakeGpuBackend:
    """GPU 0 whole; GPU 1 in MIG mode with two MIG devices, one process on each."""
    fake = FakeGpuBackend()
    fake.set_gpu(0, total_mib=81920)
    fake.set_gpu(1, total_mib=81920, uuid=GPU1)
    fake.add_mig(1, MIG_A, total_mib=40000, gi=1, ci=0)
    fake.add_mig(1, MIG_B, total_mib=40000, gi=2, ci=0)
    fake.set_process(2001, 10000, mig=MIG_A)
    fake.set_process(2002, 5000, mig=MIG_B)
    fake.set_process(2000, 1000, gpu=0)
    return fake


@pytest.mark.fast
def test_fake_gpu_uuids_and_mig_uuids_name_their_devices() -> None:
    fake = mig_gpu()
    gpus = fake.gpus()
    assert gpu.find_device(gpus, GPU1).index == 1
    a = gpu.find_device(gpus, MIG_A)
    assert (a.gpu, a.total_mib, a.used_mib, a.free_mib, a.gpu_instance) == (1, 40000, 10000, 30000, 1)
    assert gpu.find_device(gpus, "MIG-nope") is None and gpu.find_device(gpus, 0).index == 0
    assert gpus[1].used_mib == 15000  # a GPU's use is its MIG devices' together
    assert (fake.parent_of(MIG_B), fake.parent_of(GPU1), fake.parent_of(0), fake.parent_of("GPU-nope")) == (1, 1, 0, None)
    assert [(p.pid, p.gpu, p.mig, p.uuid) for p in fake.processes() if p.pid == 2001] == [(2001, 1, MIG_A, GPU1)]


@pytest.mark.fast
def test_fake_gpu_mig_holders_of_a_mig_uuid_are_only_that_devices_processes() -> None:
    fake = mig_gpu()
    assert [p.pid for p in holders_of(fake, [MIG_A])] == [2001]
    assert [p.pid for p in holders_of(fake, [MIG_B])] == [2002]
    assert sorted(p.pid for p in holders_of(fake, [GPU1])) == [2001, 2002]  # the whole GPU, by its UUID
    assert sorted(p.pid for p in holders_of(fake, [1])) == [2001, 2002]
    assert sorted(p.pid for p in holders_of(fake, [0, MIG_B])) == [2000, 2002]


def test_fake_gpu_mig_wait_released_proves_the_release_on_that_mig_device() -> None:
    fake = mig_gpu()

    async def scenario() -> tuple[float | None, list[GpuProcess]]:
        asyncio.get_running_loop().call_later(0.2, fake.release, 2001)
        return await wait_released(fake, [2001, 2002], timeout=5.0, interval=0.01, items=[MIG_A])

    ms, left = asyncio.run(scenario())
    # 2002 still holds MIG_B: not this unit's device, so not its residue.
    assert left == [] and ms is not None and 190 <= ms < 2000
    ms, left = asyncio.run(wait_released(fake, [2002], timeout=0.2, interval=0.02, items=[MIG_B]))
    assert ms is None and [(p.pid, p.mig, p.where()) for p in left] == [(2002, MIG_B, f"GPU 1 ({MIG_B})")]
    assert memory_held_by(fake, [2001, 2002], [MIG_A]) == []


@pytest.mark.fast
def test_fake_gpu_mig_min_free_mib_reads_the_mig_devices_own_memory() -> None:
    from omnid.gpu import watch
    from omnid.core.lifecycle import UnitState

    fake = mig_gpu()

    class Spec:
        gpus = (MIG_A,)
        gpu_min_free_mib = 35000

    class U:
        name, spec, state, proc = "worker", Spec(), UnitState.ACTIVE, None

    degraded, _ = watch.assess([U()], fake.gpus(), {}, "fake")
    assert degraded == {"worker": f"{MIG_A} has 30000 MiB free, under gpu_min_free_mib = 35000"}
    Spec.gpus = ("MIG-gone",)
    degraded, _ = watch.assess([U()], fake.gpus(), {}, "fake")
    assert degraded == {"worker": "MIG-gone not visible to fake"}


@pytest.mark.fast
def test_fake_gpu_mig_file_naming_an_unknown_mig_device_is_unavailable_with_a_reason(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "total_mib": 100}],
                               "processes": [{"pid": 1, "mig": MIG_A, "used_mib": 1}]})
    fake = FakeGpuBackend(path)
    assert not fake.available and "processes[0]" in fake.reason and "MIG UUID" in fake.reason


# ---------------------------------------------------------------------------- real GPU

@pytest.mark.gpu
def test_real_nvml_sees_a_child_holding_gpu_memory_and_its_release(real_nvml: NvmlBackend) -> None:
    backend = real_nvml
    gpus = backend.gpus()
    assert gpus and all(g.total_mib > 0 and 0 <= g.free_mib <= g.total_mib for g in gpus)
    if not backend.pids_local:
        pytest.skip("NVML reports host pids in this PID namespace; per-pid check impossible")
    with subprocess.Popen([sys.executable, "-m", "omnid.demo.gpu_hog", "256"], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stderr is not None
            line = child.stdout.readline()
            assert line.startswith("holding 256 "), f"CUDA child failed: {line!r} {child.stderr.read()}"
            held = wait_for(lambda: memory_held_by(backend, [child.pid]), 10, f"NVML to list pid {child.pid}",
                            interval=0.05)
            # 0.0 = the driver does not tell the amount (some VMs, MIG); the pid still counts
            assert held[0].pid == child.pid and (held[0].used_mib == 0.0 or held[0].used_mib >= 256)
            assert child.pid in {p.pid for p in holders_of(backend, [held[0].gpu])}
        finally:
            child.kill()
            child.wait(timeout=10)
    ms, leftovers = asyncio.run(wait_released(backend, [child.pid], timeout=10.0))
    assert leftovers == [] and ms is not None
