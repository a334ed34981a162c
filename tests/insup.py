"""Run a real Supervisor in-process (real spawner, real children, checked against
/proc) so a test can inject a fault into one of its tasks and watch what follows."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable

from omnid.process.spawnclient import SpawnerClient
from omnid.core.supervisor import Supervisor
from omnid.model.units import load_stack
from tests.harness import make_stack

SLEEPER = '''
exec = ["sleep", "1000"]
stop_timeout = 2
kill_timeout = 2
restart = "no"
'''


async def until(pred: Callable[[], object], timeout: float, what: str, sup: Supervisor | None = None) -> object:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            seen = {n: (u.state.value, u.reason) for n, u in sup.units.items()} if sup else {}
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; units: {seen}")
        await asyncio.sleep(0.005)


def run(units: dict[str, str], body: Callable[[Supervisor], Awaitable[None]], **sup_kw) -> None:
    d = make_stack(units)

    async def main() -> None:
        holder: list[Supervisor] = []
        spawner = SpawnerClient(on_exit=lambda r: holder and holder[0].on_exit_report(r), on_gone=lambda: None)
        spawner.launch()
        await spawner.attach()
        sup = Supervisor(load_stack(str(d)), spawner, token="insup-token", echo_output=False,
                         check_invariants=True, **sup_kw)
        holder.append(sup)
        sup.kick()
        try:
            await body(sup)
        finally:
            try:
                await sup.requests.shutdown(30)
            finally:
                await spawner.shutdown()
                for u in sup.units.values():
                    u.output.detach()
        assert not sup.invariant_violations, sup.invariant_violations

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(d, ignore_errors=True)
