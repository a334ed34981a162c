"""Every stack we ship validates with `omnid check` (exit 0): the demo and the
vLLM, vLLM-Omni and SGLang example layouts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omnid.model.units import ReadyKind, load_stack
from tests.harness import REPO

STACKS = [REPO / "units" / "demo",
          *sorted(p for p in (REPO / "units" / "examples").iterdir() if p.is_dir() and p.name != "multinode"),
          # one host's stack per directory: a group across hosts (omnid(8), CLUSTER)
          *sorted(p for p in (REPO / "units" / "examples" / "multinode").iterdir() if p.is_dir())]


@pytest.mark.parametrize("stack", STACKS, ids=lambda p: p.name)
def test_shipped_stack_passes_omnid_check(stack):
    r = subprocess.run([sys.executable, "-m", "omnid", "check", "-u", str(stack)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


# Inference layouts (serve -> engines -> workers); torchrun is a collective job of another shape.
INFERENCE = [p for p in STACKS[1:] if p.name in ("vllm", "vllm-omni", "sglang") and p.parent.name == "examples"]


@pytest.mark.parametrize("stack", INFERENCE, ids=lambda p: p.name)
def test_examples_use_spawn_memlock_and_real_readiness(stack):
    units = list(load_stack(stack))
    assert any(u.ready.kind is ReadyKind.HTTP for u in units)  # served over HTTP, probed there
    for u in units:
        if u.gpus:
            assert u.env.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn" or "sglang" in stack.name
            assert u.limits, f"{u.name}: GPU units set limits (memlock)"
