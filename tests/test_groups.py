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

from omnid.demo import rankprogress
from tests.harness import REPO, alive, free_port, make_stack, skip_module_without, wait_for

skip_module_without("torch", "the collective-job tests need torch (the demo extra)")

PY = sys.executable


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
    got = wait_for(lambda: (p := rankprogress.read(progress)) and len(p) == n and all(v[1] >= 2 for v in p.values()) and p,
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


# ------------------------------------------------------------------ worker groups


def _ranks_stack(progress: Path, n: int, *, group: bool, watchdog: float = 0, restart: str = "on-failure") -> Path:
    port = free_port()
    lines = [
        'exec = ["python3", "-m", "omnid.demo.ranks"]',
        f"instances = {n}",
        'ready = "notify"',
        "ready_timeout = 60",
        "stop_timeout = 2",
        f'restart = "{restart}"',
        "restart_sec = 0.2",
        "start_limit_burst = 20",
    ]
    env = {"OMNID_RANKS_PROGRESS_DIR": str(progress), "OMNID_RANKS_TIMEOUT_S": "120"}
    if group:
        lines += ['worker_group = "job"', f"torch_distributed = {{ master_port = {port} }}"]
    else:  # the same job without the key: each rank is its own unit (what omnid did before)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="%i", WORLD_SIZE=str(n))
    if watchdog:
        lines.append(f"watchdog_sec = {watchdog}")
    lines.append("env = { " + ", ".join(f'{k} = "{v}"' for k, v in env.items()) + " }")
    return make_stack({"ranks": "\n".join(lines) + "\n"})


def _all_reducing(progress: Path, n: int, generation: int, after: float = 0.0):
    """Every rank made >= 2 collectives in `generation`, the last one after `after` (wall time)."""
    p = rankprogress.read(progress)
    if len(p) == n and all(v[0] == generation and v[1] >= 2 and v[2] > after for v in p.values()):
        return p
    return None


def _group_fault(daemon_factory, progress: Path, n: int, fault: signal.Signals, watchdog: float = 0) -> dict:
    d = daemon_factory(_ranks_stack(progress, n, group=True, watchdog=watchdog))
    d.wait_all_active(90)
    wait_for(lambda: _all_reducing(progress, n, 1), 30, f"{n} ranks all-reducing in generation 1")
    before = d.units()
    pids = {name: u["pid"] for name, u in before.items()}
    assert all(u["generation"] == 1 and u["worker_group"] == "job" for u in before.values()), before
    victim = "ranks@1"
    t_fault = time.monotonic()
    wall_fault = time.time()
    os.kill(pids[victim], fault)
    gone_at: dict[str, float] = {}

    def survivors_gone():
        for name, pid in pids.items():
            if name not in gone_at and not alive(pid):
                gone_at[name] = time.monotonic()
        return len(gone_at) == n

    wait_for(survivors_gone, 30 + watchdog, f"every rank of generation 1 to be stopped (log:\n{d.log()[-3000:]})",
             interval=0.002)
    wait_for(lambda: _all_reducing(progress, n, 2, wall_fault), 90,
             f"the group back in generation 2 (log:\n{d.log()[-4000:]})")
    t_back = time.monotonic()
    after = d.wait_all_active(30)
    assert all(u["generation"] == 2 and u["pid"] != pids[name] for name, u in after.items()), after
    code, body = d.http("/health")
    assert code == 200, body
    blocked = {name: round((t - t_fault) * 1000, 1) for name, t in gone_at.items() if name != victim}
    figures = {"ranks": n, "fault": fault.name, "fault_to_healthy_s": round(t_back - t_fault, 3),
               "survivors_blocked_ms": blocked}
    print("worker group:", figures)
    return figures


@pytest.mark.parametrize("n", [2, 4])
def test_group_sigkill_one_rank_restarts_whole_group(daemon_factory, progress_dir, n):
    figures = _group_fault(daemon_factory, progress_dir, n, signal.SIGKILL)
    assert figures["fault_to_healthy_s"] < 90


def test_group_sigstop_one_rank_caught_by_watchdog_restarts_whole_group(daemon_factory, progress_dir):
    figures = _group_fault(daemon_factory, progress_dir, 2, signal.SIGSTOP, watchdog=2)
    # The stopped rank is caught by its watchdog (2 s); its peer is blocked in all_reduce
    # until then, and stopped together with it, not left hanging.
    assert all(ms >= 1500 for ms in figures["survivors_blocked_ms"].values()), figures


def test_without_group_survivor_stays_blocked_in_collective(daemon_factory, progress_dir):
    """What omnid did before worker groups: the peer of a hung rank stays `active`, blocked."""
    d = daemon_factory(_ranks_stack(progress_dir, 2, group=False))
    d.wait_all_active(90)
    wait_for(lambda: _all_reducing(progress_dir, 2, 1), 30, "2 ranks all-reducing")
    pids = {name: u["pid"] for name, u in d.units().items()}
    os.kill(pids["ranks@1"], signal.SIGSTOP)
    try:
        stuck_at = wait_for(lambda: (p := rankprogress.read(progress_dir)) and p[0][1], 5, "rank 0's progress")
        # Over 2 s, rank 0 makes no progress and omnid still calls it active: a hung group that
        # /health reports healthy. (An observation window, not a wait for a condition.)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert rankprogress.read(progress_dir)[0][1] <= stuck_at + 1
            assert d.unit("ranks@0")["state"] == "active" and alive(pids["ranks@0"])
            time.sleep(0.1)
        assert d.http("/health")[0] == 200
    finally:
        os.kill(pids["ranks@1"], signal.SIGCONT)


def test_group_operator_restart_of_one_member_restarts_the_group(daemon_factory, progress_dir):
    d = daemon_factory(_ranks_stack(progress_dir, 2, group=True))
    d.wait_all_active(90)
    wait_for(lambda: _all_reducing(progress_dir, 2, 1), 30, "2 ranks all-reducing")
    pids = {name: u["pid"] for name, u in d.units().items()}
    d.ok("restart", {"units": ["ranks@0"]}, timeout=90)
    after = d.wait_all_active(60)
    assert all(u["pid"] != pids[n] and u["generation"] == 2 for n, u in after.items()), after
    assert not any(alive(p) for p in pids.values())
    wait_for(lambda: _all_reducing(progress_dir, 2, 2), 60, "the group all-reducing in generation 2")


def test_group_restart_no_stays_down_with_reason(daemon_factory, progress_dir):
    d = daemon_factory(_ranks_stack(progress_dir, 2, group=True, restart="no"))
    d.wait_all_active(90)
    pids = {name: u["pid"] for name, u in d.units().items()}
    os.kill(pids["ranks@0"], signal.SIGKILL)
    d.wait_state("ranks@0", "failed", 15)
    peer = d.wait_state("ranks@1", "inactive", 15)
    assert "worker group job is down: ranks@0 failed: killed by SIGKILL" in peer["reason"], peer
    assert not alive(pids["ranks@1"])
    deadline = time.monotonic() + 1.5  # stable: nothing restarts by itself
    while time.monotonic() < deadline:
        us = d.units()
        assert us["ranks@0"]["state"] == "failed" and us["ranks@1"]["state"] == "inactive", us
        time.sleep(0.1)
    d.ok("start", {"units": ["ranks"]}, timeout=90)
    assert all(u["state"] == "active" and u["generation"] == 2 for u in d.units().values())


# ------------------------------------------------------------------ unit files


def _write(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.fast
def test_worker_group_members_in_rank_order_and_instance_count(tmp_path):
    from omnid.model.units import load_stack

    stack = load_stack(_write(tmp_path, {"rank.toml": (
        'exec = ["date", "+%s.%N"]\ninstances = 12\nworker_group = "tp"\n'
        'torch_distributed = { master_port = 29611 }\n')}))
    members = stack.groups["tp"]
    assert members == tuple(f"rank@{i}" for i in range(12))  # rank@10 after rank@9, not after rank@1
    assert stack["rank@3"].exec == ("date", "+%s.%N")  # %N is date's, not a specifier
    assert stack["rank@3"].torch_distributed.master_port == 29611
    assert stack["rank@3"].environ({})["OMNID_INSTANCES"] == "12"


@pytest.mark.parametrize("files, key, words", [
    ({"a.toml": 'exec = ["a"]\ntorch_distributed = true\n'}, "torch_distributed", "needs worker_group"),
    ({"a.toml": 'exec = ["a"]\nworker_group = "g"\n',
      "b.toml": 'exec = ["b"]\nworker_group = "g"\nafter = ["a"]\n'}, "worker_group", "start together"),
    ({"a.toml": 'exec = ["a"]\nworker_group = "g"\nrestart = "on-failure"\n',
      "b.toml": 'exec = ["b"]\nworker_group = "g"\n'}, "restart", "restarts as one"),
    ({"a.toml": 'exec = ["a"]\nworker_group = "g/h"\n'}, "worker_group", "expected a group name"),
    ({"a.toml": 'exec = ["a"]\nworker_group = "g"\ntorch_distributed = { master_port = 70000 }\n'},
     "torch_distributed.master_port", "65535"),
    ({"a.toml": 'exec = ["a"]\nworker_group = "g"\ntorch_distributed = "yes"\n'}, "torch_distributed", "expected true"),
])
@pytest.mark.fast
def test_worker_group_mistakes_are_named(tmp_path, files, key, words):
    from omnid.model.units import check_stack

    errors = check_stack(_write(tmp_path, files))
    assert any(e.key == key and words in e.message for e in errors), [str(e) for e in errors]
