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


# --------------------------------------------------------------------------- vLLM's weight holder

PRELOAD = REPO / "units" / "examples" / "vllm-preload"
PARALLEL = ("--data-parallel-size", "--data-parallel-size-local", "--tensor-parallel-size")


def _flag(argv: tuple[str, ...], name: str) -> str:
    assert argv.count(name) == 1, f"{name} given {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


@pytest.mark.fast
def test_vllm_preload_layout_holder_and_engines():
    """The holder runs `vllm preload`; the engines map its weights (`--load-format ipc_cache`)
    and `require` it, so that its death restarts them and theirs leaves it alone; both meet at
    one socket directory outside any unit's private TMPDIR, on the same GPUs, model and
    parallel sizes (a mismatch makes the engines load from disk)."""
    import json

    units = {u.name: u for u in load_stack(PRELOAD)}
    assert set(units) == {"weights", "serve"}
    holder, serve = units["weights"], units["serve"]
    assert holder.exec[1] == "preload" and serve.exec[1] == "serve"
    assert tuple(serve.requires) == ("weights",) and not tuple(holder.requires)
    assert _flag(serve.exec, "--load-format") == "ipc_cache"
    assert "--load-format" not in holder.exec, "the holder loads from disk (vLLM refuses ipc_cache there)"
    sock_dir = _flag(holder.exec, "--weight-cache-socket-dir")
    assert json.loads(_flag(serve.exec, "--model-loader-extra-config"))["socket_dir"] == sock_dir
    assert sock_dir.startswith("/") and not sock_dir.startswith("/tmp/"), sock_dir
    assert _flag(holder.exec, "--model") == serve.exec[2]
    for flag in PARALLEL:
        assert _flag(holder.exec, flag) == _flag(serve.exec, flag), flag
    assert holder.gpus == serve.gpus
    port = _flag(holder.exec, "--weight-cache-health-port")
    assert holder.ready.url.endswith(f":{port}/health") and _flag(holder.exec, "--weight-cache-health-host") in \
        holder.ready.url


# Builds vLLM's own `vllm preload` and `vllm serve` parsers (as vllm/entrypoints/cli/main.py
# does) and parses each unit's arguments with them: an unknown or misspelt flag exits 2.
_PARSE = r"""
import json, sys
from vllm.entrypoints.cli import preload, serve
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm")
sub = parser.add_subparsers(dest="subparser")
for mod in (preload, serve):
    for cmd in mod.cmd_init():
        cmd.subparser_init(sub)
out = {}
for argv in json.loads(sys.argv[1]):
    a = parser.parse_args(argv)
    out[argv[0]] = {k: getattr(a, k, None) for k in ("load_format", "model_loader_extra_config",
                                                      "weight_cache_socket_dir", "weight_cache_health_port")}
print(json.dumps(out, default=str))
"""


@pytest.mark.timeout(600)  # vLLM's parsers: its imports, minutes on two cores loaded by a parallel run
def test_vllm_preload_layout_flags_are_vllms_own():
    """Every argument of both units parses with the installed vLLM's own CLI (tests/engines/
    vllm_env.py's cached CPU build; skipped where it is not made: this does not install it)."""
    import json
    import os

    from tests.engines import vllm_env

    if not vllm_env._complete(vllm_env.venv_dir()):
        pytest.skip(f"vLLM's CPU build is not cached in {vllm_env.venv_dir()} (python -m tests.engines.vllm_env)")
    units = {u.name: u for u in load_stack(PRELOAD)}
    argvs = [list(units["weights"].exec[1:]), list(units["serve"].exec[1:])]
    r = subprocess.run([str(vllm_env.engine_python()), "-c", _PARSE, json.dumps(argvs)], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, VLLM_NO_USAGE_STATS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["serve"]["load_format"] == "ipc_cache"
    assert got["preload"]["weight_cache_socket_dir"] == _flag(units["weights"].exec, "--weight-cache-socket-dir")
    assert "socket_dir" in str(got["serve"]["model_loader_extra_config"])
