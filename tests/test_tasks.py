"""Issue #8: no asyncio task that can die unseen. Each kind of task (liveness, stop,
control reader, GPU watch) gets an injected exception; the daemon recovers and no
unit stays in `stopping`. Processes are checked in /proc, not through omnid."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import pytest
import zmq
import zmq.asyncio

from omnid.api import health
from omnid.base import linux
from omnid.core import probes
from omnid.api.control import ControlServer
from omnid.core.lifecycle import Signal, UnitState as S
from omnid.core.monitors import Monitors
from omnid.process.handle import ProcessHandle
from omnid.base.tasks import DaemonTask
from omnid.process.termination import ProcessGroupTarget, terminate
from tests import insup
from tests.harness import alive, free_port


def _live(pid: int) -> bool:
    return alive(pid)


# ------------------------------------------------------------------ liveness
def test_liveness_monitor_survives_a_probe_that_raises_an_unexpected_error(monkeypatch):
    calls = []

    async def broken_probe(url, timeout, **_request):
        calls.append(url)
        raise RuntimeError("injected probe bug")

    monkeypatch.setattr(probes, "http_check", broken_probe)  # the http form of liveness
    unit = insup.SLEEPER + 'liveness = { http = "http://127.0.0.1:9/", interval = 0.05, timeout = 0.2, failures = 2 }\n'

    async def body(sup):
        u = sup.units["a"]
        await insup.until(lambda: u.state is S.ACTIVE, 10, "a active", sup)
        pid = u.proc.pid
        await insup.until(lambda: u.state is S.FAILED, 10, "a failed by liveness", sup)
        assert "liveness:" in u.reason and "RuntimeError: injected probe bug" in u.reason, u.reason
        assert len(calls) >= 2
        await insup.until(lambda: not _live(pid), 5, "the main process gone from /proc")

    insup.run({"a": unit}, body)


def test_liveness_probe_with_a_status_line_over_64k_fails_the_unit():
    """http_probe used to raise ValueError here, which ended the liveness task silently."""

    async def body_with_server(sup, port):
        u = sup.units["a"]
        await insup.until(lambda: u.state is S.FAILED, 15, "a failed by liveness", sup)
        assert "status line over 64 KiB" in u.reason, u.reason

    port = free_port()
    unit = insup.SLEEPER + (f'liveness = {{ http = "http://127.0.0.1:{port}/", interval = 0.05, timeout = 1, '
                            'failures = 2 }\n')

    async def body(sup):
        async def answer(reader, writer):
            await reader.read(100)
            writer.write(b"HTTP/1.1 200 " + b"x" * 70000 + b"\r\n\r\n")
            try:
                await writer.drain()
            except OSError:
                pass
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", port)
        try:
            await body_with_server(sup, port)
        finally:
            server.close()
            await server.wait_closed()

    insup.run({"a": unit}, body)


def test_a_crash_inside_the_liveness_task_fails_the_unit(monkeypatch):
    async def crashing_liveness(self, u):
        raise KeyError("injected monitor bug")

    monkeypatch.setattr(Monitors, "_liveness", crashing_liveness)
    unit = insup.SLEEPER + 'liveness = { http = "http://127.0.0.1:9/", interval = 5, timeout = 1, failures = 3 }\n'

    async def body(sup):
        u = sup.units["a"]
        await insup.until(lambda: u.state is S.FAILED, 10, "a failed", sup)
        assert "internal error in liveness" in u.reason and "injected monitor bug" in u.reason, u.reason

    insup.run({"a": unit}, body)


# ---------------------------------------------------------------------- stop
def test_a_crash_in_the_signal_handler_of_a_stop_leaves_no_unit_in_stopping():
    """An action handler that raises is fed back as INTERNAL_ERROR: the table SIGKILLs what is
    left through the kill policy and the unit ends down, never stuck in `stopping`."""

    async def body(sup):
        u = sup.units["a"]
        await insup.until(lambda: u.state is S.ACTIVE, 10, "a active", sup)
        pid = u.proc.pid
        handlers = sup.executor._handlers
        real = handlers[Signal]
        crashed = []

        def crash_once(rt, action, ctx):
            if not crashed:
                crashed.append(action)
                raise RuntimeError("injected stop bug")
            return real(rt, action, ctx)

        handlers[Signal] = crash_once
        await asyncio.wait_for(sup.requests.stop_units(["a"], 20), 25)
        assert crashed and crashed[0].sig == "stop_signal", crashed
        # failed, then inactive (the operator asked for a stop): the reason keeps the bug
        assert u.state in (S.FAILED, S.INACTIVE) and not u.busy, (u.state, u.phase, u.reason)
        assert "internal error in Signal: RuntimeError: injected stop bug" in u.reason, u.reason
        assert not _live(pid), f"pid {pid} still alive after the crashed stop"
        assert not sup.verify(), sup.verify()

    insup.run({"a": insup.SLEEPER}, body)


# -------------------------------------------------------------- /health window
def test_health_says_failed_between_the_pidfd_firing_and_the_exit_status():
    """The spawner is held (SIGSTOP): the exit report cannot come, the pidfd has fired. /health
    says failed at once, the unit is not published `failed` before the spawner reaped it."""

    async def body(sup):
        u = sup.units["a"]
        await insup.until(lambda: u.state is S.ACTIVE, 10, "a active", sup)
        assert health.overall(sup, {}) == "ok"
        h = u.proc
        os.kill(sup.spawner.pid, signal.SIGSTOP)  # our own child, the spawner
        try:
            os.kill(h.pid, signal.SIGKILL)  # our own child's pid, held by the pidfd we check below
            await insup.until(lambda: h.exited.is_set(), 5, "the pidfd to fire", sup)
            assert u.state is S.ACTIVE  # no exit status yet: not recorded as failed yet
            assert health.overall(sup, {}) == "failed", "503 must say failed, not starting"
            assert health.unit_reason(u, {}) == "main process exited; failing"
        finally:
            os.kill(sup.spawner.pid, signal.SIGCONT)
        await insup.until(lambda: u.state is S.FAILED, 5, "a failed", sup)
        assert "killed by SIGKILL" in u.reason, u.reason

    insup.run({"a": insup.SLEEPER}, body)


def test_failed_is_published_only_after_the_kernel_proves_the_group_empty():
    """The race seen in the full suite: `failed` published while zombies of the unit's group
    were not reaped yet (the invariant check saw the group non-empty). The spawner is held
    while the unit's main process and its child die together: the child stays a zombie in
    the group, so `failed` must wait until the spawner reaps it (about 2.5 s later here)."""
    family = ('exec = ["python3", "-c", "import os, time, signal\\nif os.fork() == 0:\\n'
              '    time.sleep(1000)\\nelse:\\n    time.sleep(1000)"]\n'
              'stop_timeout = 2\nkill_timeout = 2\nrestart = "no"\n')

    async def body(sup):
        u = sup.units["a"]
        await insup.until(lambda: u.state is S.ACTIVE and len(linux.children_of(u.proc.pid)) == 1, 10,
                          "a active with its child", sup)
        h = u.proc
        child = linux.children_of(h.pid)[0]
        os.kill(sup.spawner.pid, signal.SIGSTOP)
        try:
            os.killpg(h.pgid, signal.SIGKILL)  # the unit's own group: main and child die together
            await insup.until(lambda: h.exited.is_set(), 5, "the pidfd to fire", sup)
            await asyncio.sleep(2.5)  # past the 2 s wait for the exit status: the group holds zombies
            st = linux.read_stat(child)
            assert st is not None and st.state == "Z", st
            assert u.state is not S.FAILED, f"published failed with zombies in the group: {u.reason}"
        finally:
            os.kill(sup.spawner.pid, signal.SIGCONT)
        await insup.until(lambda: u.state is S.FAILED, 10, "a failed once reaped", sup)
        assert not sup.invariant_violations, sup.invariant_violations

    insup.run({"a": family}, body)


# ------------------------------------------------------------ control reader
def test_control_reader_that_crashes_is_logged_and_restarted(tmp_path):
    path = str(tmp_path / "c.sock")

    async def main():
        ctx = zmq.asyncio.Context()

        async def status(args):
            return {"pong": True}

        server = ControlServer(ctx, path, {"status": status})
        server.bind()
        real_recv = server.router.recv_multipart
        crashes = []

        async def crash_once(*a, **kw):
            if not crashes:
                crashes.append(1)
                raise RuntimeError("injected reader bug")
            return await real_recv(*a, **kw)

        server.router.recv_multipart = crash_once

        def start_reader():
            server.start()
            return server._reader

        reader = DaemonTask("control reader", start_reader).start()
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(f"ipc://{path}")
        try:
            await client.send(json.dumps({"id": 1, "cmd": "status"}).encode())
            reply = json.loads(await asyncio.wait_for(client.recv(), 10))
            assert reply == {"id": 1, "ok": True, "result": {"pong": True}}
            assert crashes and reader.crashes == 1
        finally:
            client.close(0)
            reader.close()
            await server.close()
            ctx.term()

    asyncio.run(main())


# --------------------------------------------------------------- GPU watch
def test_gpu_watch_that_crashes_is_restarted_fake_gpu_no_hardware(monkeypatch, tmp_path):
    """No GPU on this machine: the GPU backend is the fake one. The real watch loop gets
    an exception injected into its policy once; it is logged, restarted, and then
    publishes the degraded units."""
    from omnid.daemon import parts as daemon_mod
    from omnid.gpu import watch
    from omnid.gpu.fake import FakeGpuBackend, write_fake_gpu_file

    path = tmp_path / "gpu.json"
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "name": "fake", "total_mib": 1000, "used_mib": 990}],
                               "processes": []})
    backend = FakeGpuBackend(str(path))
    real = watch.assess
    calls = []

    def crash_once(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected GPU watch bug")
        return real(*a, **kw)

    monkeypatch.setattr(watch, "assess", crash_once)

    class Spec:
        gpu_min_free_mib = 100
        gpus = (0,)

    class U:
        name, spec, state, proc = "engine", Spec(), S.ACTIVE, None

    class Sup:
        units = {"engine": U()}
        degraded: dict = {}
        gpu_mib: dict = {}

    sup = Sup()

    async def main():
        t = DaemonTask("GPU watch", lambda: asyncio.get_running_loop().create_task(
            watch.watch(backend, sup, interval=0.01))).start()
        try:
            await insup.until(lambda: "engine" in sup.degraded, 5, "the restarted watch to see the full GPU")
            assert t.crashes == 1 and not t.task.done()
        finally:
            t.close()

    asyncio.run(main())
    assert "under gpu_min_free_mib = 100" in sup.degraded["engine"]
    assert daemon_mod.DaemonTask is DaemonTask  # the daemon supervises its GPU watch with this


# ---------------------------------------------------------------- pid reuse
def _force_pid(pid: int) -> subprocess.Popen | None:
    """Start `sleep` in its own session with exactly this pid (ns_last_pid), or None."""
    for _ in range(20):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def stranger_scenario() -> None:
    """The leader died and was reaped; a stranger now leads a group with the same number.
    signal_group and the kill policy must leave it alone (no killpg on a bare number).
    Runs as pid 1 of a pid namespace of its own (see the test below)."""

    async def main():
        child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        pidfd = os.pidfd_open(child.pid)
        h = ProcessHandle(unit="gone", pid=child.pid, pidfd=pidfd, pgid=child.pid,
                          start_time=linux.start_time_of(child.pid) or 0)
        child.kill()
        status = os.waitpid(child.pid, 0)[1]
        h.exit_status = status
        h.exited.set()
        h.reaped.set()
        stranger = _force_pid(child.pid)
        assert stranger is not None, "could not reuse the pid through ns_last_pid in our own pid namespace"
        try:
            assert os.getpgid(stranger.pid) == h.pgid
            assert not h.leader_alive()
            h.signal_group(signal.SIGKILL)
            target = ProcessGroupTarget("gone", h, os.getpid(), "no-token")
            assert target.members() == []
            rec = await terminate(target, signal.SIGTERM, 0.5, 0.5)
            assert rec.residue == [] and rec.unkillable == []
            assert stranger.poll() is None and _live(stranger.pid), "the stranger was killed"
        finally:
            stranger.kill()
            stranger.wait()
            os.close(pidfd)

    asyncio.run(main())
    print("stranger scenario: ok")


def test_a_stranger_that_reused_a_dead_units_pgid_is_never_signalled():
    """stranger_scenario in a pid namespace of its own (unshare(1); with a user namespace when
    not root): there this test owns the pid numbers, so ns_last_pid is writable whatever the
    host allows and no other process can take the reused number first."""
    import shutil
    import sys

    from tests.harness import REPO, repo_pythonpath

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) from util-linux to make a pid namespace")
    ns = ["--pid", "--fork", "--mount-proc"] if os.geteuid() == 0 else \
        ["--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    r = subprocess.run([unshare, *ns, sys.executable, "-c",
                        "from tests.test_tasks import stranger_scenario; stranger_scenario()"],
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=repo_pythonpath()), capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0 and r.stderr.startswith("unshare:"):
        pytest.skip(f"cannot make a pid namespace here: {r.stderr.strip()}")
    assert r.returncode == 0 and "stranger scenario: ok" in r.stdout, r.stdout + r.stderr


def test_leftover_cleanup_uses_the_one_kill_policy_and_skips_a_recycled_pid():
    """terminate_leftovers (for statefile.kill_leftovers): SIGKILL through pidfds, bounded
    wait; an item whose start time no longer matches is not touched."""
    from omnid.daemon.statefile import Leftover
    from omnid.process.termination import terminate_leftovers

    victim = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    bystander = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    try:
        class Stale:
            pid = bystander.pid
            start_time = (linux.start_time_of(bystander.pid) or 0) + 1  # "recycled": not the one we saw

            def describe(self):
                return "stale"

        left = terminate_leftovers([Leftover(victim.pid, "worker@1", "test", linux.start_time_of(victim.pid) or 0), Stale()],
                                   kill_timeout=2)
        assert left == []
        assert victim.wait(5) == -signal.SIGKILL
        assert bystander.poll() is None and _live(bystander.pid)
    finally:
        for p in (victim, bystander):
            p.kill()
            p.wait()


@pytest.mark.fast
def test_spawner_messages_are_decoded_into_typed_values_and_bad_ones_are_named():
    from omnid.process.spawnclient import (ExitReport, Hello, ProtocolError, SpawnedMsg, SpawnFailedMsg, SpawnRequest,
                                   decode, spawn_wire)

    assert decode({"op": "hello", "pid": 5}) == Hello(5)
    assert decode({"op": "spawned", "id": 1, "pid": 9, "start_time": 77}) == SpawnedMsg(1, 9, 77)
    assert decode({"op": "spawn_failed", "id": 1, "error": "exec failed", "errno": 2}) == SpawnFailedMsg(1, "exec failed", 2)
    assert decode({"op": "exit", "pid": 9, "status": 0, "adopted": False}) == ExitReport(9, 0, False)
    for bad, why in [({"op": "exit", "pid": "9", "status": 0, "adopted": False}, "exit: field 'pid' must be int"),
                     ({"op": "spawned", "id": True, "pid": 9, "start_time": 1}, "spawned: field 'id' must be int"),
                     ({"op": "nope"}, "unknown op 'nope'"), ([], "message is a list")]:
        with pytest.raises(ProtocolError) as err:
            decode(bad)
        assert str(err.value).startswith(why), str(err.value)
    wire = spawn_wire(3, SpawnRequest(unit="a", argv=("sleep", "1"), env={"A": "1"}, rlimits=((7, 1, 2),)))
    assert wire["op"] == "spawn" and wire["id"] == 3 and wire["argv"] == ["sleep", "1"] and wire["rlimits"] == [[7, 1, 2]]
