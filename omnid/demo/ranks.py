"""A collective job rank (units/examples/torch-gloo): what a tensor-parallel worker does, on CPU.

Run as ``python -m omnid.demo.ranks`` in a unit with ``group`` and
``torch_distributed = true``: omnid gives each member torch's env:// rendezvous
variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``) and ``OMNID_GENERATION``. Every rank joins one gloo process
group, then runs ``all_reduce`` in a loop. It says ``READY=1`` after the first
collective succeeded (the group exists) and ``WATCHDOG=1`` after each one, so a
rank that is blocked inside a collective — because a peer died or hangs — stops
pinging: the same blind spot NCCL workers have, made visible.

With ``OMNID_RANKS_PROGRESS_DIR`` set, each rank rewrites
``<dir>/rank<R>`` after every collective with ``generation iteration
wall-clock-time pid`` so a test can tell from outside which ranks make
progress, in which generation, and since when they are stuck.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
import warnings

from omnid.demo import rankprogress
from omnid.demo.sdnotify import Notifier, watchdog_interval

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text) if text else default
    except ValueError:
        raise SystemExit(f"ranks: {name}={text!r} is not an integer") from None


def main() -> int:
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        if var not in os.environ:
            print(f"ranks: {var} is not set (run in a unit with torch_distributed = true)", file=sys.stderr)
            return 2
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    generation = _env_int("OMNID_GENERATION", 0)
    period_s = _env_int("OMNID_RANKS_PERIOD_MS", 50) / 1000
    timeout_s = _env_int("OMNID_RANKS_TIMEOUT_S", 600)
    progress = os.environ.get("OMNID_RANKS_PROGRESS_DIR", "")
    notifier = Notifier.from_env()
    interval = watchdog_interval()
    torch.set_num_threads(1)
    # A stop is an exit by the stop signal, so the supervisor can name it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    t0 = time.monotonic()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    print(f"rank {rank}/{world} generation {generation}: joined in {time.monotonic() - t0:.2f} s", flush=True)
    value = torch.ones(4)
    iteration = 0
    last_ping = 0.0
    while True:
        value.fill_(rank + 1)
        dist.all_reduce(value)  # blocks while any peer is missing
        expected = world * (world + 1) / 2
        if float(value[0]) != expected:
            print(f"rank {rank}: all_reduce gave {float(value[0])}, expected {expected}", file=sys.stderr)
            return 1
        iteration += 1
        if progress:
            rankprogress.write(progress, rank, generation, iteration)
        if iteration == 1:
            notifier.ready(f"rank {rank}/{world}, generation {generation}")
        now = time.monotonic()
        if interval and now - last_ping >= interval / 4:
            notifier.watchdog()
            last_ping = now
        time.sleep(period_s)


if __name__ == "__main__":
    sys.exit(main())
