"""Issue 26 (one half): proofs that hold, reads that cannot be swapped, scans kept off the
event loop, and the smaller defects a close reading found. Each test observes behaviour
(the kernel, a socket, a clock) and fails on the code before the fix."""

from __future__ import annotations

import asyncio
import subprocess

import zmq
import zmq.asyncio

from omnid import linux
from omnid.control import ControlServer


# ------------------------------------------------------------------ the pidfd proof
def test_pidfd_if_refuses_a_proof_when_the_process_exited_during_the_read():
    """A pidfd does not pin the pid number: a process that exits and is reaped while its
    proof is read leaves the number free for a stranger, whom the /proc read may describe."""
    p = subprocess.Popen(["sleep", "100"])
    seen = []

    def proof() -> bool:
        # What /proc said came in, and meanwhile the process died and was reaped: the
        # number may name anyone now. The proof "holds" -- about whom, nobody knows.
        p.kill()
        p.wait()
        seen.append(p.returncode)
        return True

    fd = linux.pidfd_if(p.pid, proof)
    if fd is not None:
        linux.os.close(fd)
    assert seen == [-9], seen
    assert fd is None, "pidfd_if returned a pidfd for a process that exited before its proof was complete"


def test_pidfd_if_keeps_a_pidfd_whose_process_still_runs_after_the_proof():
    p = subprocess.Popen(["sleep", "100"])
    try:
        fd = linux.pidfd_if(p.pid, lambda: linux.start_time_of(p.pid) is not None)
        assert fd is not None
        linux.os.close(fd)
    finally:
        p.kill()
        p.wait()


# ------------------------------------------------------------------ control socket
def test_event_socket_receive_error_is_logged_and_the_counter_goes_on(tmp_path):
    """`zmq` is imported for type checking only in omnid.control: an `except zmq.ZMQError`
    there is a NameError that kills the subscription counter silently."""
    path = str(tmp_path / "c.sock")

    async def main():
        ctx = zmq.asyncio.Context()
        server = ControlServer(ctx, path, {})
        server.bind()
        real_recv = server.pub.recv
        errors = []

        async def fail_once(*a, **kw):
            if not errors:
                errors.append(1)
                raise zmq.ZMQError(zmq.EAGAIN, "injected receive error")
            return await real_recv(*a, **kw)

        server.pub.recv = fail_once
        server.start()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"ipc://{path}.events")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            deadline = asyncio.get_running_loop().time() + 10
            while server.subscriptions < 1:
                assert not server._subs.done(), f"subscription counter died: {server._subs.exception()!r}"
                assert asyncio.get_running_loop().time() < deadline, "no subscription counted in 10 s"
                await asyncio.sleep(0.01)
            assert errors == [1]
        finally:
            sub.close()
            await server.close()
            ctx.term()

    asyncio.run(main())
