"""omnid.core.cleanup: a unit's death never waits on its leftovers' removal for good.

The removal's /proc scan reads every process's /proc/PID/maps, which can wait as long as that
process's memory lock is held: by a read of /proc/PID/mem at a page of a file on a mount whose
server stops answering reads, say. Making that here needs a FUSE server that answers until a
read, and the tests have only one that never answers (tests/hung.py), so the removal below is
a stand-in that blocks on an Event, and what is tested is the bound around it -- the
unit's GONE is fed after the IPC part's bound (IPC_BOUND_S), the stuck removal keeps its own thread (counted until
it returns), and past MAX_STUCK the next removals are not tried at all."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from omnid.core import cleanup
from omnid.process import ipc


def _dead_unit(c: cleanup.UnitCleanup, name: str) -> SimpleNamespace:
    """A unit whose instance left one /dev/shm entry: its removal needs the scan."""
    c.book.begin(name, 0)
    c.book.units[name].shm[f"{name}-seg"] = 1
    c._due.add(name)
    return SimpleNamespace(name=name, spec=SimpleNamespace(remove_ipc=True))


def test_a_removal_that_never_returns_costs_a_death_its_bound_once_and_then_nothing(monkeypatch):
    release = threading.Event()
    calls: list[str] = []

    def stuck(u: ipc.UnitIpc, budget_s: float):  # the stand-in for a maps read that waits
        calls.append(u.unit)
        release.wait(30)
        return [], [], {}

    monkeypatch.setattr(ipc, "remove_residue", stuck)
    monkeypatch.setattr(cleanup, "IPC_BOUND_S", 0.3)

    async def main() -> None:
        c = cleanup.UnitCleanup("token", None)
        took = []
        for name in ("a", "b", "c"):
            t0 = time.monotonic()
            await c.gone(_dead_unit(c, name), None)
            took.append(time.monotonic() - t0)
        # a and b each waited the bound and were given up; c was not tried (two out)
        assert calls == ["a", "b"], calls
        assert all(0.25 <= t < 2.0 for t in took[:2]), took
        assert took[2] < 0.1, took
        assert [o.what for o in c.threads.out.values()] == ["a's IPC residue", "b's IPC residue"]
        assert "a's IPC residue, out for" in (c.threads.oldest() or "")
        release.set()  # the kernel answers: the threads return and are no longer counted
        for _ in range(300):
            if not c.threads.out:
                break
            await asyncio.sleep(0.01)
        assert c.threads.out == {}
        t0 = time.monotonic()
        await c.gone(_dead_unit(c, "d"), None)
        assert calls[-1] == "d" and time.monotonic() - t0 < 2.0

    asyncio.run(main())
