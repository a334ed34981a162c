"""Collective jobs under omnid (issue 11): ranks that live and die together.

Real torch.distributed (gloo, CPU) jobs: omnid/demo/ranks.py runs all_reduce in a loop and
rewrites a progress file after every collective, so these tests see from outside which rank
makes progress, in which generation, and since when a survivor has been stuck.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.harness import REPO, alive, make_stack, wait_for

torch = pytest.importorskip("torch", reason="the collective-job tests need torch (the demo extra)")

PY = sys.executable


def read_progress(directory: Path) -> dict[int, tuple[int, int, float, int]]:
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


@pytest.fixture
def progress_dir():
    d = Path(tempfile.mkdtemp(prefix="omranks-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _torchrun_stack(progress: Path) -> Path:
    text = (REPO / "units/examples/torchrun/trainer.toml").read_text()
    text += f'\nenv = {{ OMNID_RANKS_PROGRESS_DIR = "{progress}", OMNID_RANKS_TIMEOUT_S = "60" }}\n'
    text = text.replace("stop_timeout = 15", "stop_timeout = 5").replace('restart = "on-failure"', 'restart = "no"')
    return make_stack({"trainer": text})


def _worker_pids(progress: Path, n: int, daemon) -> list[int]:
    got = wait_for(lambda: (p := read_progress(progress)) and len(p) == n and all(v[1] >= 2 for v in p.values()) and p,
                   90, f"{n} torchrun workers all-reducing (log:\n{daemon.log()[-3000:]})")
    return [v[3] for v in got.values()]


def test_torchrun_omnid_stop_leaves_no_worker(daemon_factory, progress_dir):
    d = daemon_factory(_torchrun_stack(progress_dir))
    d.wait_all_active(60)
    main = d.unit("trainer")["pid"]
    workers = _worker_pids(progress_dir, 2, d)
    # torchrun puts each worker in a session of its own: not in the unit's process group.
    assert all(os.getsid(w) != os.getsid(main) for w in workers), "torchrun no longer uses setsid for workers?"
    summary = d.ok("stop", {"units": ["trainer"]}, timeout=60)
    assert summary, summary
    d.wait_state("trainer", "inactive", 30)
    survivors = [w for w in workers if alive(w)]
    assert not survivors, f"torchrun workers {survivors} survived omnid stop; summary {summary}"


def test_torchrun_sigkill_leaves_no_worker(daemon_factory, progress_dir):
    d = daemon_factory(_torchrun_stack(progress_dir))
    d.wait_all_active(60)
    main = d.unit("trainer")["pid"]
    workers = _worker_pids(progress_dir, 2, d)
    os.kill(main, signal.SIGKILL)
    u = d.wait_state("trainer", "failed", 30)
    assert "SIGKILL" in u["reason"], u
    wait_for(lambda: not any(alive(w) for w in workers), 10,
             f"torchrun workers {workers} to be gone after SIGKILL of torchrun (log:\n{d.log()[-3000:]})")
