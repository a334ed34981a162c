"""The exec form of `liveness` (omnid.unit(5)): a program run as the unit -- its user and
group, cwd, rlimits and environment, never through a shell -- that passes when it exits 0
within `timeout` (Kubernetes' exec probe).

The daemon never forks: the probe is spawned by the spawner like a unit's process (its own
session and process group, PDEATHSIG), outside the unit's cgroup. Its end is seen on its
pidfd; the status comes from the pidfd once the spawner has reaped it (or from the
spawner's exit report, core/exits.py). Past its timeout, or when the monitor is cancelled,
its whole process group is SIGKILLed through the pidfd's proof (ProcessHandle.signal_group);
so is what it left behind in its group when it exits. Its stdout and stderr share one pipe
read on the loop, of which only the last OUTPUT_KEEP bytes are kept: the last lines go
into a failure's reason. One probe per call: the caller runs them one after another."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal

import structlog

from omnid.base import linux
from omnid.core import spawning
from omnid.core.centre import Centre
from omnid.core.runtime import UnitRuntime
from omnid.core.probes import ProbeFailed
from omnid.process.handle import ProcessHandle
from omnid.process.spawnclient import SpawnError, SpawnRequest

log = structlog.get_logger("omnid.supervisor")

OUTPUT_KEEP = 4096  # bytes of a probe's output kept (the tail)
REASON_LINES = 3  # of which this many last lines go into a failure's reason
REASON_CHARS = 300
REAP_WAIT_S = 2.0  # after its exit or SIGKILL: how long to wait for the status
PROBE_ENV = "OMNID_PROBE"  # set to "liveness" in a probe's environment


def _tail(buf: bytes) -> str:
    lines = [ln.strip() for ln in buf.decode("utf-8", "replace").splitlines() if ln.strip()]
    text = " | ".join(lines[-REASON_LINES:])
    return text if len(text) <= REASON_CHARS else "..." + text[-REASON_CHARS:]


def request(rt: UnitRuntime, argv: tuple[str, ...], token: str) -> SpawnRequest:
    spec = rt.spec
    env = spawning.environ(spec, None, token, {PROBE_ENV: "liveness"})
    return SpawnRequest(unit=rt.name, argv=argv, env=env, cwd=spec.cwd, user=spec.user, group=spec.group,
                        rlimits=tuple(spec.limits), path=spawning.program_path(argv[0], env, spec))


async def run(sup: Centre, rt: UnitRuntime, argv: tuple[str, ...], timeout: float) -> None:
    """Run the probe once; returns when it passed, raises ProbeFailed saying why not. The
    probe and its process group are gone (killed, reaped by the spawner) when this returns
    or is cancelled, and no fd of it stays open here."""
    what = f"exec {shlex.join(argv)}"
    loop = asyncio.get_running_loop()
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    try:
        sp = await sup.spawner.spawn(request(rt, argv, sup.token), out_w)
    except SpawnError as exc:
        os.close(out_r)
        raise ProbeFailed(f"{what}: {exc}") from None
    except BaseException:
        os.close(out_r)
        raise
    finally:
        os.close(out_w)
    h = ProcessHandle(unit=rt.name, pid=sp.pid, pidfd=sp.pidfd, pgid=sp.pid, start_time=sp.start_time)

    def kill_group() -> None:
        # Once the probe is reaped its group's members are looked for among the spawner's
        # descendants, the units' subtrees pruned: never a scan of the host's /proc on the loop.
        h.signal_group(signal.SIGKILL, sup.token,
                       lambda: linux.descendants(sup.spawner.pid, frozenset(sup.by_pid)))

    reported = sup.exits.expect_helper(sp.pid)
    tail = bytearray()
    exited = loop.create_future()

    def on_output() -> bool:
        """One read; False when nothing more is there now."""
        try:
            chunk = os.read(out_r, 65536)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            loop.remove_reader(out_r)  # EOF: every writer (its group too) has closed it
            return False
        tail.extend(chunk)
        del tail[:-OUTPUT_KEEP]
        return True

    def on_exit() -> None:
        loop.remove_reader(h.pidfd)
        if not exited.done():
            exited.set_result(None)

    os.set_blocking(out_r, False)
    loop.add_reader(out_r, on_output)
    loop.add_reader(h.pidfd, on_exit)
    timed_out = False
    try:
        try:
            await asyncio.wait_for(asyncio.shield(exited), timeout)
        except TimeoutError:
            timed_out = True
        # Its group goes with it: at the timeout, and whatever it left running when it exited.
        kill_group()
        if timed_out:
            try:
                await asyncio.wait_for(asyncio.shield(exited), REAP_WAIT_S)
            except TimeoutError:
                raise ProbeFailed(f"{what} timed out after {timeout:g} s and did not die at SIGKILL "
                                  f"(pid {h.pid}, state {_state(h.pid)})") from None
        status = linux.pidfd_exit_status(h.pidfd)
        if status is None:
            try:
                status = await asyncio.wait_for(asyncio.shield(reported), REAP_WAIT_S)
            except TimeoutError:
                status = None
        for _ in range(16):  # what it wrote last, still in the pipe (64 KiB at most)
            if not on_output():
                break
    finally:
        if not exited.done():  # cancelled (the unit left `active`) or failed above
            kill_group()
        loop.remove_reader(out_r)
        os.close(out_r)
        h.close()  # removes the pidfd's reader too
    said = _tail(bytes(tail))
    said = f": {said}" if said else ""
    if timed_out:
        raise ProbeFailed(f"{what} timed out after {timeout:g} s (killed){said}")
    if status is None:
        raise ProbeFailed(f"{what}: exit status unknown (pid {h.pid}){said}")
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return
    raise ProbeFailed(f"{what} {linux.describe_wait_status(status)[2]}{said}")


def _state(pid: int) -> str:
    st = linux.read_stat(pid)
    return st.state if st is not None else "gone"
