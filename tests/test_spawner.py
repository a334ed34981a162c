"""The spawner's batched protocol (omnid/spawnclient.py, omnid/spawner.py): a tier's spawns
travel as one request, the answers bring the pidfds together, and what every child gets before
exec is what it got one spawn at a time (checked in /proc of the real children)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import pytest

from omnid import linux, spawnclient
from omnid.spawnclient import SpawnError, SpawnerClient, SpawnRequest
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

    async def __aexit__(self, *exc) -> None:
        await self.client.shutdown()
        for fd in self.fds:
            os.close(fd)


def test_a_tier_of_spawns_is_one_request_and_its_pidfds_come_back_together(monkeypatch):
    sends: list[int] = []
    real_send = socket.send_fds

    def counting_send(sock, buffers, fds, *args):
        sends.append(len(fds))
        return real_send(sock, buffers, fds, *args)

    monkeypatch.setattr(spawnclient.socket, "send_fds", counting_send)

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
            # One datagram for all 17 spawns, with the 17 output pipes.
            assert sends == [17], sends
            *spawned, bad = got
            assert isinstance(bad, SpawnError) and "exec failed" in str(bad) and "No such file" in str(bad), bad
            try:
                for i, sp in enumerate(spawned):
                    assert not isinstance(sp, BaseException), sp
                    st = linux.read_stat(sp.pid)
                    # The kernel's view: a child of the spawner, in its own session, holding its own
                    # environment (the batch sends the common part once), named by its pidfd.
                    assert st is not None and st.ppid == run.client.pid and st.sid == sp.pid
                    assert linux.read_environ_var(sp.pid, "INDEX") == str(i)
                    assert linux.read_environ_var(sp.pid, "OMNID_UNIT") == "t"
                    assert linux.pidfd_send_signal(sp.pidfd, 0)
                    status = proc_status(sp.pid)
                    # Nothing the daemon or the spawner ignored, caught or blocked reaches the unit
                    # (signals 32 and 33 are glibc's own: sigaction refuses them, to us and to all).
                    glibc = (1 << 31) | (1 << 32)
                    assert int(status["SigIgn"], 16) & ~glibc == 0 and int(status["SigBlk"], 16) == 0, status
            finally:
                for sp in spawned:
                    if not isinstance(sp, BaseException):
                        linux.pidfd_send_signal(sp.pidfd, signal.SIGKILL)
                        os.close(sp.pidfd)
            pids = {sp.pid for sp in spawned}
            for _ in range(500):
                if pids <= {e.pid for e in run.exits}:
                    break
                await asyncio.sleep(0.01)
            assert pids <= {e.pid for e in run.exits}

    asyncio.run(main())


def test_a_spawn_whose_caller_gave_up_before_it_was_sent_is_never_sent():
    async def main() -> None:
        async with Run() as run:
            _r, w = run.pipe()
            task = asyncio.ensure_future(run.client.spawn(SpawnRequest(unit="x", argv=("sleep", "1000"),
                                                                       env=dict(os.environ)), w))
            await asyncio.sleep(0)  # queued, not yet sent (that happens at the end of this turn)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.2)
            assert linux.children_of(run.client.pid) == []

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
