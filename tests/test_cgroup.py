"""cgroup v2 per unit (issue #10), tested against the kernel: real processes in real
cgroups below a per-test root on the host's cgroup2 mount, /proc and cgroup.procs checked.
Skipped with the reason where no writable cgroup v2 exists."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from omnid import cgroup as cgm
from tests.harness import Daemon, alive, make_stack, remove_cgroup_tree, wait_for

MOUNTS = cgm.cgroup2_mounts()


def _usable_mount() -> str | None:
    for m in MOUNTS:
        if os.access(m, os.W_OK) and os.access(os.path.join(m, "cgroup.procs"), os.W_OK):
            return m
    return None


MOUNT = _usable_mount()
needs_cgroup2 = pytest.mark.skipif(MOUNT is None or os.geteuid() != 0,
                                   reason=f"no writable cgroup v2 mount as root (cgroup2 mounts: {MOUNTS or 'none'})")


@pytest.fixture
def cg_root():
    path = os.path.join(MOUNT, f"omnid-test-{uuid.uuid4().hex[:12]}")
    os.mkdir(path)
    yield path
    remove_cgroup_tree(path)


def _spawn_into(path: str, argv: list[str]) -> subprocess.Popen:
    """A child that joins the cgroup before exec (as the spawner's child does)."""
    def join() -> None:  # test helper only: the daemon itself never uses preexec_fn
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write("0")
    return subprocess.Popen(argv, preexec_fn=join, stdin=subprocess.DEVNULL)


ESCAPE = r'''
import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
os.execve("/usr/bin/env", ["env", "-i", "/bin/sh", "-c", "echo $$ > %s; exec sleep 300"], {})
'''


# ---------------------------------------------------------------- kernel level


def test_escape_names_every_unit_name_as_one_directory():
    assert cgm.escape("worker@1") == "worker@1"
    assert cgm.escape("a/b") == "a\\x2fb"
    assert cgm.escape("cgroup.procs") == "_cgroup.procs"
    assert cgm.escape("daemon") == "_daemon"
    assert "/" not in cgm.escape("../x")


@needs_cgroup2
def test_validate_rejects_a_directory_outside_cgroup2_naming_it(tmp_path):
    with pytest.raises(cgm.CgroupError, match=str(tmp_path)):
        cgm.validate(str(tmp_path))
    with pytest.raises(cgm.CgroupError, match="absolute"):
        cgm.validate("relative/dir")


@needs_cgroup2
def test_unit_cgroup_kill_reaches_an_escaped_grandchild_and_emptiness_is_an_event(cg_root, tmp_path):
    root = cgm.CgroupRoot(cg_root, "test")
    try:
        cg = root.create("esc@1")
        pidfile = tmp_path / "gc.pid"
        p = _spawn_into(cg.path, [sys.executable, "-c", ESCAPE % pidfile])
        p.wait(10)
        deadline = time.monotonic() + 10
        while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.01)
        gc = int(pidfile.read_text())
        fd = os.pidfd_open(gc)
        try:
            assert cg.pids() == [gc], "the escaped grandchild (setsid, double fork, env -i) is in the unit's cgroup"
            assert cg.populated()
            cg.kill()
            t0 = time.monotonic()
            assert asyncio.run(cg.wait_empty(time.monotonic() + 5)), f"still populated: {cg.pids()}"
            assert time.monotonic() - t0 < 2
            assert cg.pids() == []
            root.release("esc@1")
            assert not os.path.exists(cg.path), "cgroup directory removed after populated 0"
        finally:
            os.close(fd)
    finally:
        root.close()


@needs_cgroup2
def test_wait_empty_wakes_on_the_inotify_event_not_at_the_deadline(cg_root):
    root = cgm.CgroupRoot(cg_root, "test")
    try:
        cg = root.create("w")
        p = _spawn_into(cg.path, ["sleep", "300"])

        async def go() -> float:
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, p.kill)
            t0 = time.monotonic()
            ok = await cg.wait_empty(time.monotonic() + 30)
            assert ok
            return time.monotonic() - t0

        took = asyncio.run(go())
        p.wait(5)
        assert took < 5, f"woke after {took:.2f} s: not an event"
        assert not cg.populated()
    finally:
        root.close()


@needs_cgroup2
def test_stale_cgroups_of_a_previous_daemon_are_killed_and_removed(cg_root):
    stale = os.path.join(cg_root, "old-unit")
    os.mkdir(stale)
    os.mkdir(os.path.join(stale, "sub"))
    p = _spawn_into(os.path.join(stale, "sub"), ["sleep", "300"])
    root = cgm.CgroupRoot(cg_root, "test")
    try:
        assert root.stale() == [stale]
        assert root.clean_stale() == []
        p.wait(5)
        assert p.returncode == -signal.SIGKILL
        assert os.listdir(cg_root) and not os.path.exists(stale)
    finally:
        root.close()


@needs_cgroup2
def test_figures_only_from_files_that_exist(cg_root):
    root = cgm.CgroupRoot(cg_root, "test")
    try:
        cg = root.create("f")
        figs = cg.figures()
        for key, fname in (("memory_current", "memory.current"), ("pids_current", "pids.current"),
                           ("memory_peak", "memory.peak")):
            assert (key in figs) == os.path.exists(os.path.join(cg.path, fname)), (key, figs)
        assert ("cpu_usage_usec" in figs) == os.path.exists(os.path.join(cg.path, "cpu.stat"))
        root.release("f")
    finally:
        root.close()


@needs_cgroup2
def test_memory_max_is_rejected_naming_the_key_when_the_controller_is_absent(cg_root):
    root = cgm.CgroupRoot(cg_root, "test")
    try:
        errs = root.check_keys("big", {"memory_max": 1 << 30, "tasks_max": 10})
        for key, ctl in (("memory_max", "memory"), ("tasks_max", "pids")):
            if ctl in root.controllers:
                assert not any(key in e for e in errs)
            else:
                assert any(key in e and ctl in e and "big" in e for e in errs), errs
    finally:
        root.close()
