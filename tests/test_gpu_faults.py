"""GPU faults without a GPU (this machine has none): Xid events, memory health and NVML
calls that never return, on the FAKE GPU backend (and on pynvml with its functions
replaced: fake NVML), at the level of omnid.gpu with a stub standing for the supervisor."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import pytest

from omnid import gpu
from omnid.gpu import (GpuUnreadable, NvmlBackend, affects, classify_xid, health_view, start_refusal, wait_released,
                       worst)
from omnid.gpu import watch as watch_mod
from omnid.gpu.fake import FakeGpuBackend
from omnid.core.lifecycle import UnitState as S
from tests.harness import wait_for

MIG_A = "MIG-aaaaaaaa-0000-0000-0000-000000000001"
MIG_B = "MIG-bbbbbbbb-0000-0000-0000-000000000002"
UUID0 = "GPU-00000000-0000-0000-0000-000000000000"


def fake(timeout: float = 0.3) -> FakeGpuBackend:
    b = FakeGpuBackend(timeout=timeout)
    b.set_gpu(0, 8000, uuid=UUID0)
    b.set_gpu(1, 8000, uuid="GPU-11111111-0000-0000-0000-000000000000")
    b.add_mig(1, MIG_A, 4000, gi=1, ci=0)
    b.add_mig(1, MIG_B, 4000, gi=2, ci=0)
    return b


@dataclass
class Spec:
    gpus: tuple = ()
    gpu_min_free_mib: int = 0


@dataclass
class Unit:
    name: str
    spec: Spec
    state: S = S.ACTIVE
    proc: object = None


@dataclass
class StubSup:
    """Stands for the supervisor: its units, the dicts the watch publishes, and a record
    of gpu_fault calls (the centre's gpu_fault fails the units of that GPU)."""

    units: dict = field(default_factory=dict)
    degraded: dict = field(default_factory=dict)
    gpu_mib: dict = field(default_factory=dict)
    faults: list = field(default_factory=list)

    def gpu_fault(self, gpu_item, xid: int, meaning: str) -> None:
        self.faults.append((gpu_item, xid, meaning))


def stub(**units_gpus: tuple) -> StubSup:
    return StubSup(units={n: Unit(n, Spec(gpus=g)) for n, g in units_gpus.items()})


async def run_watch(backend, sup, until, what: str, timeout: float = 5.0) -> None:
    task = asyncio.get_running_loop().create_task(watch_mod.watch(backend, sup, interval=0.05))
    try:
        deadline = time.monotonic() + timeout
        while not until():
            assert not task.done(), task.exception()
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {sup}"
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


# --------------------------------------------------------------------------- Xid events


def test_fake_gpu_xid_79_calls_gpu_fault_and_refuses_starts_on_that_gpu_only():
    b = fake()
    sup = stub(worker0=(0,), worker1=(MIG_A,))
    b.inject_xid(0, 79)
    asyncio.run(run_watch(b, sup, lambda: sup.faults, "gpu_fault"))
    b.close()
    assert sup.faults == [(0, 79, "GPU has fallen off the bus: it no longer answers on PCIe")]
    why = start_refusal(b, [0])
    assert why is not None and why.startswith("refusing to start on GPU 0: GPU 0: Xid 79: GPU has fallen off the bus")
    assert start_refusal(b, [UUID0]) is not None  # the same GPU named by its UUID
    assert start_refusal(b, [1]) is None and start_refusal(b, [MIG_A]) is None
    view = health_view(b, [("worker0", [0]), ("worker1", [MIG_A])])
    assert view == {"GPU 0": {"status": "failed", "units": ["worker0"],
                              "reason": view["GPU 0"]["reason"]}} and "Xid 79" in view["GPU 0"]["reason"]
    assert worst(view) == "failed"


def test_fake_gpu_xid_48_fails_the_units_without_blocking_new_starts():
    b = fake()
    sup = stub(worker0=(0,))
    b.inject_xid(UUID0, 48)  # named by the GPU's UUID: the event is on GPU 0
    asyncio.run(run_watch(b, sup, lambda: sup.faults, "gpu_fault"))
    b.close()
    assert sup.faults == [(0, 48, "double-bit ECC error: uncorrectable GPU memory error")]
    assert start_refusal(b, [0]) is None
    (c,) = b.conditions()
    assert (c.gpu, c.status, c.xid, c.source) == (0, "degraded", 48, "xid")
    assert worst(health_view(b, [("worker0", [0])])) == "degraded"


def test_fake_gpu_xid_of_an_application_is_only_logged():
    b = fake()
    sup = stub(worker0=(0,))
    b.inject_xid(0, 31)
    b.inject_xid(0, 63)  # row remapping pending: a notice, no failure
    asyncio.run(run_watch(b, sup, lambda: b.conditions(), "the Xid 63 notice"))
    b.close()
    assert sup.faults == [] and [c.xid for c in b.conditions()] == [63]
    assert worst(health_view(b, [("worker0", [0])])) == ""  # a notice leaves /health alone


def test_fake_gpu_xid_on_a_mig_device_reaches_that_device_and_its_whole_gpu_only():
    b = fake()
    sup = stub(on_a=(MIG_A,), on_b=(MIG_B,), whole=(1,), other=(0,))
    b.inject_xid(MIG_A, 94)
    asyncio.run(run_watch(b, sup, lambda: sup.faults, "gpu_fault"))
    b.close()
    assert sup.faults == [(MIG_A, 94, classify_xid(94).meaning)]
    reached = [n for n, u in sup.units.items() if any(affects(b, MIG_A, g) for g in u.spec.gpus)]
    assert reached == ["on_a", "whole"]
    assert health_view(b, [(n, list(u.spec.gpus)) for n, u in sup.units.items()])[MIG_A]["units"] == ["on_a", "whole"]
    # A whole GPU's fault reaches every MIG device on it.
    assert affects(b, 1, MIG_B) and not affects(b, 0, MIG_B)


@pytest.mark.fast
def test_fake_gpu_unknown_xid_degrades_naming_the_code():
    info = classify_xid(4242)
    assert info.status == "degraded" and not info.fails_units and "Xid 4242" in info.meaning


@pytest.mark.parametrize("xid,words,fails", [(48, "double-bit ECC", True), (63, "row remapping", False),
                                             (64, "row remapp", True), (74, "NVLink", True),
                                             (79, "fallen off the bus", True), (94, "contained ECC", True),
                                             (95, "uncontained ECC", True), (45, "killed", False)])
@pytest.mark.fast
def test_xid_meanings_of_the_critical_ones(xid, words, fails):
    info = classify_xid(xid)
    assert words in info.meaning and info.fails_units is fails


def test_fake_gpu_xid_events_while_no_watch_runs_reach_the_next_watch():
    b = fake()
    first = stub(worker0=(0,))
    asyncio.run(run_watch(b, first, lambda: b._events is not None, "the event thread"))
    b.inject_xid(0, 74)  # between two watches (a watch being restarted)
    wait_for(lambda: len(b._events._pending) == 1, 5, "the event kept while no watch runs")
    second = stub(worker0=(0,))
    asyncio.run(run_watch(b, second, lambda: second.faults, "the kept event"))
    b.close()
    assert first.faults == [] and second.faults == [(0, 74, classify_xid(74).meaning)]


def test_fake_gpu_watch_without_gpu_fault_logs_instead_of_crashing():
    b = fake()

    class Old(StubSup):
        gpu_fault = None  # a supervisor from before gpu_fault

    sup = Old(units={"w": Unit("w", Spec(gpus=(0,)))})
    b.inject_xid(0, 79)
    asyncio.run(run_watch(b, sup, lambda: b.conditions(), "the condition"))
    b.close()
    assert b.conditions()[0].xid == 79


# --------------------------------------------------------------------------- memory health


def test_fake_gpu_row_remapping_pending_is_a_notice_and_a_failure_degrades():
    b = fake()
    b.set_remapped_rows(0, correctable=1, uncorrectable=2, pending=True)
    b.set_remapped_rows(1, uncorrectable=512, failure=True)
    sup = stub(worker0=(0,), worker1=(1,))
    asyncio.run(run_watch(b, sup, lambda: len(b.conditions()) == 2, "two memory conditions"))
    b.close()
    by_gpu = {c.gpu: c for c in b.conditions()}
    assert by_gpu[0].status == "notice" and "row remapping pending" in by_gpu[0].reason
    assert by_gpu[1].status == "degraded" and "row remapping failed" in by_gpu[1].reason
    assert sup.degraded == {"worker1": by_gpu[1].describe()}


# --------------------------------------------------------------------------- NVML calls that never return


def test_fake_gpu_hung_call_is_cut_at_its_deadline_then_fails_at_once_with_one_stuck_thread():
    b = fake(timeout=0.3)
    assert b.gpus() and b.available
    threads = threading.active_count()
    b.set_hang([1])
    try:
        t0 = time.monotonic()
        with pytest.raises(GpuUnreadable, match="GPU 1: nvmlDeviceGetMemoryInfo has not returned"):
            b.gpus()
        assert time.monotonic() - t0 < 1.0
        for _ in range(20):  # every later read fails at once, on no new thread
            t1 = time.monotonic()
            with pytest.raises(GpuUnreadable):
                b.processes()
            assert time.monotonic() - t1 < 0.05
        assert b.stuck_threads == 1 and threading.active_count() <= threads + 1
        assert not b.available and "GPU 1: nvmlDeviceGetMemoryInfo" in b.reason
        (c,) = b.conditions()
        assert c.source == "unreadable" and c.gpu == 1 and c.blocks_start
        assert start_refusal(b, [1]).startswith("refusing to start on GPU 1: GPU 1: unreadable: nvmlDeviceGetMemory")
        assert start_refusal(b, [MIG_A]) is not None and start_refusal(b, [0]) is None
        assert gpu.holders_of(b, [0]) == []  # cannot tell: said, never raised
        assert asyncio.run(wait_released(b, [1234], 1.0)) == (None, [])
    finally:
        b.set_hang(False)
    wait_for(lambda: b.available, 5, "reads to work again once the call returned")
    assert [g.index for g in b.gpus()] == [0, 1] and b.stuck_threads == 0


def test_fake_gpu_hung_call_in_the_middle_of_wait_released_is_cannot_tell_not_released():
    b = fake(timeout=0.3)
    b.set_process(4242, 1000, mig=MIG_A)
    reads: list[list] = []
    real_processes = b.processes

    def counted(items=None):
        out = real_processes(items)
        reads.append(out)
        return out

    b.processes = counted  # type: ignore[method-assign]

    async def main():
        waiting = asyncio.ensure_future(wait_released(b, [4242], 5.0, items=[MIG_A]))
        deadline = time.monotonic() + 5
        while not reads:  # one read has seen pid 4242 holding memory: then the driver hangs
            assert time.monotonic() < deadline and not waiting.done(), "no GPU read within 5 s"
            await asyncio.sleep(0.01)
        b.set_hang(True)
        t0 = time.monotonic()
        ms, left = await waiting
        return ms, left, time.monotonic() - t0

    try:
        ms, left, took = asyncio.run(main())
    finally:
        b.set_hang(False)
    assert ms is None and took < 1.5
    assert [p.pid for p in left] == [4242], left  # what it saw last, never "released"


def test_fake_gpu_hung_call_never_stalls_the_watch_or_its_event_loop():
    # A loop that waited for the hung read itself would stall for the whole call timeout (2 s):
    # a bound at three quarters of it tells that from a loaded machine's scheduling delays
    # (0.82 s seen at load 26), and costs the test 2 s.
    timeout = 2.0
    b = fake(timeout=timeout)
    sup = stub(worker1=(1,), worker0=(0,))
    lags: list[float] = []

    async def main():
        async def heartbeat():
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.01)
                lags.append(time.monotonic() - t - 0.01)

        beat = asyncio.ensure_future(heartbeat())
        b.set_hang([1])
        try:
            await run_watch(b, sup, lambda: "worker1" in sup.degraded, "the unit on GPU 1 degraded")
        finally:
            beat.cancel()

    try:
        asyncio.run(main())
    finally:
        b.set_hang(False)
    # The loop kept its pace while the read hung (a thread waits, never the loop).
    assert max(lags) < 0.75 * timeout, f"the loop stalled {max(lags):.3f} s (call timeout {timeout} s)"
    assert sup.degraded["worker1"].startswith("GPU 1: unreadable: nvmlDeviceGetMemoryInfo has not returned")
    assert "worker0" not in sup.degraded  # its GPU is not the one whose call hung
    assert b.stuck_threads <= 1


def test_fake_gpu_hung_event_wait_is_counted_once_and_named():
    b = fake(timeout=0.2)
    sup = stub(worker0=(0,))

    async def main():
        b.set_hang_events(True)
        await run_watch(b, sup, lambda: b.stuck_threads == 1, "the event wait to count as stuck")

    try:
        asyncio.run(main())
        assert any("Xid events unreadable" in c.reason for c in b.conditions())
        assert b.available  # reads still work: only the event wait is stuck
    finally:
        b.set_hang_events(False)
        b.close()


# --------------------------------------------------------------------------- fake NVML (pynvml replaced)


class _Mem:
    def __init__(self, total: int, free: int) -> None:
        self.total, self.free, self.used = total, free, total - free


class _Entry:
    def __init__(self, pid: int, used: int) -> None:
        self.pid, self.usedGpuMemory = pid, used


def fake_pynvml(monkeypatch, hang: threading.Event | None = None):
    """Two GPUs; GPU 1 in MIG mode with two MIG devices (handles 10 and 11) holding a
    process each; an event set that returns one Xid 48 on MIG device gi=2 of GPU 1."""
    pynvml = pytest.importorskip("pynvml")
    mib = 1 << 20
    sent = []

    def memory(h):
        if hang is not None and h == 0:
            hang.wait()
        return _Mem(80 * 1024 * mib, 70 * 1024 * mib)

    def procs(h):
        return {0: [_Entry(100, 512 * mib)], 10: [_Entry(110, 256 * mib)], 11: [_Entry(111, 128 * mib)]}.get(h, [])

    class Data:
        device = 1
        eventType = pynvml.nvmlEventTypeXidCriticalError
        eventData = 48
        gpuInstanceId = 2
        computeInstanceId = 0

    def wait(es, timeout_ms):
        if not sent:
            sent.append(1)
            return Data()
        time.sleep(timeout_ms / 1000)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    for name, fn in {
        "nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i, "nvmlDeviceGetName": lambda h: "NVIDIA A100",
        "nvmlDeviceGetUUID": lambda h: {0: "GPU-zero", 1: "GPU-one", 10: MIG_A, 11: MIG_B}[h],
        "nvmlDeviceGetMigMode": lambda h: [1 if h == 1 else 0, 0],
        "nvmlDeviceGetMaxMigDeviceCount": lambda h: 7,
        "nvmlDeviceGetMigDeviceHandleByIndex": lambda h, j: (10 + j if j < 2 else (_ for _ in ()).throw(
            pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND))),
        "nvmlDeviceGetGpuInstanceId": lambda h: {10: 1, 11: 2}[h],
        "nvmlDeviceGetComputeInstanceId": lambda h: 0,
        "nvmlDeviceGetMemoryInfo": memory,
        "nvmlDeviceGetComputeRunningProcesses_v3": procs,
        "nvmlDeviceGetGraphicsRunningProcesses_v3": lambda h: [],
        "nvmlDeviceGetMPSComputeRunningProcesses_v3": lambda h: [],
        "nvmlDeviceGetRemappedRows": lambda h: (0, 3, 1, 0) if h == 0 else (0, 0, 0, 0),
        "nvmlEventSetCreate": lambda: "set", "nvmlEventSetFree": lambda es: None,
        "nvmlDeviceGetSupportedEventTypes": lambda h: pynvml.nvmlEventTypeXidCriticalError,
        "nvmlDeviceRegisterEvents": lambda h, types, es: None,
        "nvmlEventSetWait_v2": wait,
        "nvmlDeviceGetHandleByUUID": lambda u: (_ for _ in ()).throw(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)),
    }.items():
        monkeypatch.setattr(pynvml, name, fn)
    monkeypatch.setattr(gpu.nvml, "in_initial_pid_namespace", lambda: True)
    return pynvml


@pytest.mark.fast
def test_fake_nvml_mig_processes_are_read_per_mig_device(monkeypatch):
    fake_pynvml(monkeypatch)
    b = NvmlBackend(timeout=0.5)
    assert b.available
    procs = b.processes()
    assert [(p.pid, p.gpu, p.mig) for p in procs] == [(100, 0, ""), (110, 1, MIG_A), (111, 1, MIG_B)]
    assert [p.pid for p in gpu.holders_of(b, [MIG_B])] == [111]
    assert [p.pid for p in gpu.holders_of(b, ["GPU-one"])] == [110, 111]
    assert [p.pid for p in gpu.memory_held_by(b, [110, 111], [MIG_A])] == [110]
    g1 = b.gpus()[1]
    assert g1.uuid == "GPU-one" and [(m.uuid, m.gpu_instance) for m in g1.migs] == [(MIG_A, 1), (MIG_B, 2)]
    assert b.parent_of(MIG_B) == 1 and b.memory_health() == {0: ("notice", b.memory_health()[0][1])}
    b.close()


def test_fake_nvml_xid_event_is_mapped_to_its_mig_device(monkeypatch):
    fake_pynvml(monkeypatch)
    b = NvmlBackend(timeout=0.5)
    sup = stub(on_b=(MIG_B,))
    asyncio.run(run_watch(b, sup, lambda: sup.faults, "gpu_fault"))
    b.close()
    assert sup.faults == [(MIG_B, 48, classify_xid(48).meaning)]


def test_fake_nvml_hung_call_makes_the_backend_unreadable_naming_it(monkeypatch):
    hang = threading.Event()
    fake_pynvml(monkeypatch, hang)
    b = NvmlBackend(timeout=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(GpuUnreadable, match="GPU 0: nvmlDeviceGetMemoryInfo"):
            b.gpus()
        assert time.monotonic() - t0 < 1.0 and b.stuck_threads == 1 and not b.available
        with pytest.raises(GpuUnreadable):
            b.processes()
    finally:
        hang.set()
    wait_for(lambda: b.available, 5, "NVML reads to work again")
    assert len(b.gpus()) == 2
    b.close()
