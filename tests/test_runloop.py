"""The daemon's event loop ends within a bound (omnid.base.runloop): a task that will not end
when cancelled, or a thread that never returns, is named with where it waits, and the
process exits with its exit code; an end where everything ends is asyncio.run's. Each case
runs in a process of its own (the bounded end leaves by os._exit)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

from omnid.base.tasks import pending_tasks, suspended_at
from tests.harness import REPO, repo_pythonpath

PRELUDE = textwrap.dedent("""\
    import asyncio, atexit, os, sys, threading
    from omnid.base import logconfig, runloop
    logconfig.configure("json")
    atexit.register(lambda: print("atexit ran", flush=True))
    """)


def run_script(body: str, timeout: float = 60) -> tuple[int, str, list[dict]]:
    """(exit code, stdout, the JSON log lines of stderr) of PRELUDE + body."""
    p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                       timeout=timeout, cwd=str(REPO), env={"PYTHONPATH": repo_pythonpath(), "PATH": "/usr/bin:/bin"})
    events = []
    for line in p.stderr.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return p.returncode, p.stdout + p.stderr, events


def test_an_end_where_everything_ends_returns_the_code_through_the_interpreters_exit():
    code, out, events = run_script("""
        async def polite():
            await asyncio.Event().wait()
        async def main():
            asyncio.get_running_loop().create_task(polite())
            await asyncio.to_thread(sum, range(10))
            return 3
        sys.exit(runloop.run(main(), grace=5))
        """)
    assert code == 3, out
    assert "atexit ran" in out, out  # a normal exit, not os._exit
    assert not [e for e in events if e.get("level") == "error"], out


def test_a_task_that_will_not_end_is_named_where_it_waits_and_the_process_exits_with_its_code():
    code, out, events = run_script("""
        async def hold_on():
            while True:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    pass  # a close that swallows its cancellation
        async def main():
            asyncio.get_running_loop().create_task(hold_on(), name="holder")
            await asyncio.sleep(0)
            return 7
        sys.exit(runloop.run(main(), grace=0.5))
        """)
    assert code == 7, out
    assert "atexit ran" not in out, out
    end = [e for e in events if e.get("event") == "exiting without what did not end in time"]
    assert end and end[0]["exit_code"] == 7, out
    [left] = end[0]["left"]
    assert left.startswith("task holder, cancelled, still waits in hold_on (") and "wait (" in left, left


def test_a_thread_that_never_returns_is_named_with_its_call_and_the_process_exits():
    code, out, events = run_script("""
        r, w = os.pipe()
        def blocked_read():
            return os.read(r, 1)  # nobody writes: as a read under a hung mount, it never returns
        async def main():
            try:
                await asyncio.wait_for(asyncio.to_thread(blocked_read), 0.2)
            except TimeoutError:
                pass
            return 0
        sys.exit(runloop.run(main(), grace=0.5))
        """)
    assert code == 0, out
    end = [e for e in events if e.get("event") == "exiting without what did not end in time"]
    assert end, out
    [left] = end[0]["left"]
    assert left.startswith("thread asyncio_0, still runs ") and "> blocked_read (<string>:" in left, left


def test_a_daemon_that_raises_still_ends_within_the_bound_and_logs_the_exception():
    code, out, events = run_script("""
        def blocked():
            threading.Event().wait()
        async def main():
            asyncio.get_running_loop().run_in_executor(None, blocked)
            await asyncio.sleep(0.05)
            raise RuntimeError("the daemon's bug")
        sys.exit(runloop.run(main(), grace=0.5))
        """)
    assert code == 1, out
    end = [e for e in events if e.get("event") == "exiting without what did not end in time"]
    assert end and "RuntimeError: the daemon's bug" in end[0].get("exception", ""), out


def test_suspended_at_follows_awaits_through_coroutines_and_async_generators():
    async def innermost(ev: asyncio.Event) -> None:
        await ev.wait()

    async def events(ev: asyncio.Event):
        yield 1
        await innermost(ev)
        yield 2

    async def consumer(ev: asyncio.Event) -> None:
        async for _ in events(ev):
            pass

    async def main() -> tuple[list[str], dict[str, str]]:
        ev = asyncio.Event()
        t = asyncio.get_running_loop().create_task(consumer(ev), name="consumer")
        for _ in range(3):
            await asyncio.sleep(0)
        chain, tasks = suspended_at(t), pending_tasks()
        ev.set()
        await t
        return chain, tasks

    chain, tasks = asyncio.run(main())
    names = [c.split(" (")[0] for c in chain]
    assert names == ["consumer", "events", "innermost", "wait"], chain
    assert chain[0].startswith("consumer (tests/test_runloop.py:"), chain
    assert set(tasks) == {"consumer"} and tasks["consumer"] == " > ".join(chain), tasks
