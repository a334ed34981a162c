"""The stack stop's deadline and what a second SIGTERM does, on the demo stack (units/demo):
the deadline the daemon derives (log line "stack stop deadline"), an ordered stop's time
with one SIGTERM, and with a second SIGTERM once the stop is under way: the time from the second
signal until every unit process is gone (their pidfds, opened before) and until the daemon
exits. Run from the repository root: python -m bench.stop_numbers [runs]."""

from __future__ import annotations

import os
import select
import signal
import sys
import time

from tests.failure_matrix.harness import DemoStack
from tests.harness import Daemon, wait_for


def unit_pids(d: Daemon) -> list[int]:
    from omnid.base.linux import children_of

    out, todo = [], [u["pid"] for u in d.units().values() if u["pid"]]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children_of(p))
    return out


def one(second: bool) -> dict:
    s = DemoStack()
    d = Daemon(s.dir, env=s.env).start()
    fds = []
    try:
        d.wait_all_active(120)
        fds = [os.pidfd_open(p) for p in unit_pids(d)]
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        t2 = t0
        if second:  # once the stop is under way (its deadline line is out)
            wait_for(lambda: any(e.get("event") == "stack stop deadline" for e in d.log_events()), 10, "the stop")
            t2 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
        left = set(fds)
        while left:
            ready, _, _ = select.select(list(left), [], [], 120)
            left -= set(ready)
        gone = time.monotonic() - t2
        code = d.wait_exit(120)
        out = time.monotonic() - t2
        ev = wait_for(lambda: next((e for e in d.log_events() if e.get("event") == "stack stop deadline"), None), 5,
                      "the deadline line")
        return {"deadline_s": ev["deadline_s"], "from": ev["deadline_from"], "processes": len(fds),
                "all_gone_ms": round(gone * 1000, 1), "daemon_exit_ms": round(out * 1000, 1), "exit": code}
    finally:
        for fd in fds:
            os.close(fd)
        d.close()
        s.cleanup()


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for second in (False, True):
        for _ in range(runs):
            print(("second SIGTERM " if second else "one SIGTERM    "), one(second), flush=True)


if __name__ == "__main__":
    main()
