"""The spawner's batched protocol (omnid/process/spawnclient.py, omnid/process/spawner.py): a tier's spawns
travel as one request, the answers bring the pidfds together, and what every child gets before
exec is what it got one spawn at a time (checked in /proc of the real children)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket

import pytest

from omnid.base import linux
from omnid.process import spawnclient
from omnid.process.spawnclient import SpawnError, SpawnerClient, SpawnRequest
from tests.harness import wait_for


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


class Run:
    """A real spawner on a loop of our own; every child killed and reaped, every fd closed."""

    def __init__(self) -> None:
        self.exits: list = []
        self.client = SpawnerClient(on_exit=self.exits.append, on_gone=lambda: None)
        self.fds: list[int] = []

    async def __aenter__(self) -> "Run":
        self.client.launch()
        await self.client.attach()
        return self

    def pipe(self) -> tuple[int, int]:
        r, w = os.pipe2(os.O_CLOEXEC)
        self.fds += [r, w]
        return r, w

    async def kill_and_reap(self, spawned: list) -> None:
        """SIGKILL every child spawned (its pidfd closed), then wait for their exit reports."""
        live = [sp for sp in spawned if not isinstance(sp, BaseException)]
        for sp in live:
            linux.pidfd_send_signal(sp.pidfd, signal.SIGKILL)
            os.close(sp.pidfd)
        pids = {sp.pid for sp in live}
        for _ in range(500):
            if pids <= {e.pid for e in self.exits}:
                break
            await asyncio.sleep(0.01)
        assert pids <= {e.pid for e in self.exits}

    async def __aexit__(self, *exc) -> None:
        await self.client.shutdown()
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def sends(monkeypatch) -> list[int]:
    """How many fds each datagram to the spawner carried, in order."""
    out: list[int] = []
    real_send = socket.send_fds

    def counting_send(sock, buffers, fds, *args):
        out.append(len(fds))
        return real_send(sock, buffers, fds, *args)

    monkeypatch.setattr(spawnclient.socket, "send_fds", counting_send)
    return out


def test_a_tier_of_spawns_all_start_each_as_asked_and_a_bad_program_fails_alone():

    async def main() -> None:
        async with Run() as run:
            env = dict(os.environ, OMNID_UNIT="t")
            reqs = []
            for i in range(16):
                _r, w = run.pipe()
                reqs.append(run.client.spawn(SpawnRequest(unit=f"w@{i}", argv=("sleep", "1000"),
                                                          env={**env, "INDEX": str(i)}), w))
            _r, w = run.pipe()
            reqs.append(run.client.spawn(SpawnRequest(unit="bad", argv=("/nonexistent/omnid-test",), env=env), w))
            got = await asyncio.gather(*reqs, return_exceptions=True)
            *spawned, bad = got
            assert isinstance(bad, SpawnError) and "exec failed" in str(bad) and "No such file" in str(bad), bad
            try:
                for i, sp in enumerate(spawned):
                    assert not isinstance(sp, BaseException), sp
                    st = linux.read_stat(sp.pid)
                    # The kernel's view: a child of the spawner, in its own session, holding its own
                    # environment (the batch sends the common part once), named by its pidfd.
                    assert st is not None and st.ppid == run.client.pid and st.sid == sp.pid
                    # The spawn is answered once the child is in execve (vfork returns when it
                    # drops the spawner's memory); the new program's environment is laid out a
                    # moment later: read empty at load ~26 (fresh-clone run 24), so polled.
                    wait_for(lambda: linux.read_environ_var(sp.pid, "INDEX") is not None, 10,
                             f"pid {sp.pid}'s environment after its exec")
                    assert linux.read_environ_var(sp.pid, "INDEX") == str(i)
                    assert linux.read_environ_var(sp.pid, "OMNID_UNIT") == "t"
                    assert linux.pidfd_send_signal(sp.pidfd, 0)
                    status = proc_status(sp.pid)
                    # Nothing the daemon or the spawner ignored, caught or blocked reaches the unit
                    # (signals 32 and 33 are glibc's own: sigaction refuses them, to us and to all).
                    glibc = (1 << 31) | (1 << 32)
                    assert int(status["SigIgn"], 16) & ~glibc == 0 and int(status["SigBlk"], 16) == 0, status
            finally:
                await run.kill_and_reap(spawned)

    asyncio.run(main())


def test_a_spawn_whose_caller_gave_up_leaves_no_process():
    """Cancelled once queued: either it is taken back before it is sent, or (sent in the same
    turn of the loop) its child is one no unit owns and the spawner kills it. Either way,
    only the marker spawned after it may remain (the old version of this test slept 0.2 s
    and saw no child: the child had been spawned and killed, never "not sent")."""
    async def main() -> None:
        async with Run() as run:
            _r, w = run.pipe()
            task = asyncio.ensure_future(run.client.spawn(SpawnRequest(unit="x", argv=("sleep", "1000"),
                                                                       env=dict(os.environ)), w))
            await asyncio.sleep(0)  # queued; the send happens at the end of a turn of the loop
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # A marker spawn after it: the spawner serves requests in order, so once the marker
            # runs, the cancelled one has been answered too if it was sent.
            _r2, w2 = run.pipe()
            marker = await run.client.spawn(SpawnRequest(unit="marker", argv=("sleep", "1000"),
                                                         env=dict(os.environ)), w2)
            try:
                deadline = asyncio.get_running_loop().time() + 5
                while (kids := linux.children_of(run.client.pid)) != [marker.pid]:
                    assert asyncio.get_running_loop().time() < deadline, f"children left: {kids}"
                    await asyncio.sleep(0.01)
            finally:
                await run.kill_and_reap([marker])

    asyncio.run(main())


def test_spawns_beyond_one_datagrams_fd_limit_all_start():
    # 130 spawns with stdout and stderr each = 260 fds: more than one datagram can carry.
    async def main() -> None:
        async with Run() as run:
            reqs = []
            for i in range(130):
                _r, w = run.pipe()
                _r2, w2 = run.pipe()
                reqs.append(run.client.spawn(SpawnRequest(unit=f"w@{i}", argv=("sleep", "1000"),
                                                          env=dict(os.environ)), w, w2))
            spawned = await asyncio.gather(*reqs)
            try:
                assert len({sp.pid for sp in spawned}) == 130
                assert all(linux.read_stat(sp.pid).ppid == run.client.pid for sp in spawned)
            finally:
                for sp in spawned:
                    linux.pidfd_send_signal(sp.pidfd, signal.SIGKILL)
                    os.close(sp.pidfd)
            wait_for(lambda: not linux.children_of(run.client.pid), 10, "the children to be reaped")

    asyncio.run(main())


def test_the_spawner_is_named_and_single_threaded_once_it_answers():
    async def main() -> None:
        async with Run() as run:
            assert await run.client.wait_ready(10) == run.client.pid
            # Started with -I -S from its own file, it still finds setproctitle (the daemon's).
            assert open(f"/proc/{run.client.pid}/cmdline", "rb").read().startswith(b"omnid: spawner")
            assert linux.thread_count(run.client.pid) == 1

    asyncio.run(main())


def test_a_bare_program_name_is_found_in_the_units_path_and_argv0_stays_as_written(tmp_path, daemon_factory):
    """The daemon looks a bare name up in the unit's own PATH (the child then makes one
    execve instead of walking PATH after the fork); the process still sees argv[0] as the
    unit wrote it. A relative PATH entry is left to the child, relative to the unit's cwd."""
    import shutil

    from tests.harness import make_stack

    for d in ("bin", "rel/bin"):
        (tmp_path / d).mkdir(parents=True)
        shutil.copy2(shutil.which("sleep"), tmp_path / d / "napper")
    d = daemon_factory(make_stack({
        "own": f'exec = ["napper", "1000"]\nenv = {{ PATH = "{tmp_path}/bin:/usr/bin:/bin" }}\n',
        "rel": f'exec = ["napper", "1000"]\ncwd = "{tmp_path}/rel"\nenv = {{ PATH = "bin:/usr/bin:/bin" }}\n',
    }))
    d.wait_all_active()
    for unit, where in (("own", tmp_path / "bin"), ("rel", tmp_path / "rel" / "bin")):
        pid = d.unit(unit)["pid"]
        exe = os.readlink(f"/proc/{pid}/exe")
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        assert exe == str(where / "napper"), (unit, exe, d.units())
        assert argv[:2] == [b"napper", b"1000"], (unit, argv)


@pytest.mark.fast
def test_the_daemon_hands_the_spawner_the_program_it_found_and_only_when_it_is_sure(tmp_path):
    import shutil

    from omnid.core.spawning import program_path
    from omnid.model.units import load_stack
    from tests.harness import make_stack

    (tmp_path / "bin").mkdir()
    shutil.copy2(shutil.which("sleep"), tmp_path / "bin" / "napper")
    stack = load_stack(make_stack({"a": 'exec = ["napper"]\n', "u": 'exec = ["napper"]\nuser = "nobody"\n'}))
    a, u = stack.units["a"], stack.units["u"]
    path = {"PATH": f"{tmp_path}/bin:/usr/bin"}
    assert program_path("napper", path, a) == str(tmp_path / "bin" / "napper")
    assert program_path("napper", {"PATH": "/usr/bin:/bin"}, a) is None  # not there: the child says why
    assert program_path("./napper", path, a) is None  # a slash: exactly as written
    assert program_path("napper", {"PATH": "bin"}, a) is None  # relative: the unit's cwd decides
    assert program_path("napper", path, u) is None  # another user's X_OK is not root's


def test_a_big_tier_goes_out_in_parts_as_it_is_built(sends):
    # 70 spawns asked in one turn of the loop: the first leaves at once (the spawner has
    # nothing to do: it starts that child while the rest are built), then parts of 32 while
    # the rest are still being built, then the turn's last 5.

    async def main() -> None:
        async with Run() as run:
            env = dict(os.environ)
            reqs = []
            for i in range(70):
                _r, w = run.pipe()
                reqs.append(asyncio.ensure_future(run.client.spawn(SpawnRequest(unit=f"w@{i}", argv=("sleep", "1000"),
                                                                                 env=env), w)))
            await asyncio.sleep(0)  # every request built and queued in this one turn
            assert sends[:3] == [1, *[spawnclient.PIPELINE_SPAWNS] * 2], sends
            spawned = await asyncio.gather(*reqs)
            try:
                assert sends == [1, 32, 32, 5] and len({sp.pid for sp in spawned}) == 70, sends
            finally:
                await run.kill_and_reap(spawned)

    asyncio.run(main())


def test_a_pidfd_numbered_above_1024_is_read_by_poll_not_select():
    """A daemon holding a pidfd and two pipes per unit passes fd 1024 at ~340 units; select()
    refuses such fds (ValueError), which failed every unit's stop past that number."""
    import subprocess

    from omnid.base import linux

    child = subprocess.Popen(["sleep", "30"])
    low = os.pidfd_open(child.pid)
    high = fcntl.fcntl(low, fcntl.F_DUPFD_CLOEXEC, 1500)
    os.close(low)
    try:
        assert high >= 1500
        assert not linux.pidfd_exited(high)
        child.kill()
        child.wait()
        assert linux.pidfd_exited(high)
    finally:
        os.close(high)
