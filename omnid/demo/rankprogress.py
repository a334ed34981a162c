"""The progress file each rank of omnid/demo/ranks.py rewrites after every collective.

``<dir>/rank<R>`` holds ``generation iteration wall-clock-time pid``; written through a
``.tmp`` file and a rename, so a reader never sees half a line. Kept apart from ranks.py
(which imports torch) so tests and bench/ can read it without torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def write(directory: str, rank: int, generation: int, iteration: int) -> None:
    path = os.path.join(directory, f"rank{rank}")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{generation} {iteration} {time.time():.6f} {os.getpid()}\n")
    os.replace(tmp, path)


def read(directory: Path) -> dict[int, tuple[int, int, float, int]]:
    """rank -> (generation, iteration, wall time of the last collective, pid)."""
    out = {}
    for f in directory.glob("rank*"):
        if f.name.endswith(".tmp"):
            continue
        try:
            gen, it, ts, pid = f.read_text().split()
        except (OSError, ValueError):
            continue
        out[int(f.name[4:])] = (int(gen), int(it), float(ts), int(pid))
    return out
