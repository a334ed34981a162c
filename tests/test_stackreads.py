"""omnid.api.stackreads: check's and reload's reads of a stack directory each run on a thread
of their own, bounded for the caller; a stuck read is counted until it returns, and past
max_out a new read is refused at once. The stuck read here is a thread blocked on an Event
(the daemon-level test, on a real hung FUSE mount, is in tests/test_hung_spawn.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from omnid.api.control import ControlError
from omnid.api.stackreads import StackReads


def test_a_read_answers_raises_or_times_out_and_stuck_reads_refuse_the_next_until_they_return():
    release = threading.Event()

    def stuck() -> str:
        release.wait(30)
        return "late"

    def broken() -> None:
        raise ValueError("unit file unreadable")

    async def main() -> None:
        reads = StackReads(max_out=2)
        assert await reads.run("check ok", lambda: 42, 5) == 42
        with pytest.raises(ValueError, match="unit file unreadable"):
            await reads.run("check broken", broken, 5)
        assert reads.out == {}
        for n in (1, 2):
            with pytest.raises(TimeoutError):
                await reads.run(f"check /mnt/hung/{n}", stuck, 0.05)
        assert [o.what for o in reads.out.values()] == ["check /mnt/hung/1", "check /mnt/hung/2"]
        with pytest.raises(ControlError) as refused:
            await reads.run("reload /mnt/hung", lambda: 0, 5)
        assert refused.value.code == "busy"
        assert "refused while 2 earlier reads have not returned; the oldest, check /mnt/hung/1" in str(refused.value)
        release.set()  # the mount answers: the reads return, nobody waits for them any more
        for _ in range(200):
            if not reads.out:
                break
            await asyncio.sleep(0.01)
        assert reads.out == {}
        assert await reads.run("check again", lambda: "ok", 5) == "ok"

    asyncio.run(main())
