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
import urllib.request
import uuid

import pytest

from omnid.process import cgroupfs
from omnid.process.cgroupdiscovery import CgroupError, validate
from omnid.process.cgrouproot import CgroupRoot
from tests.harness import Daemon, cgroup2_for_tests, make_stack, remove_cgroup_tree, wait_for

MOUNTS = cgroupfs.cgroup2_mounts()
MOUNT, _MISSING = cgroup2_for_tests()
needs_cgroup2 = pytest.mark.skipif(MOUNT is None, reason=_MISSING)


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
    assert cgroupfs.escape("worker@1") == "worker@1"
    assert cgroupfs.escape("a/b") == "a\\x2fb"
    assert cgroupfs.escape("cgroup.procs") == "_cgroup.procs"
    assert cgroupfs.escape("daemon") == "_daemon"
    assert "/" not in cgroupfs.escape("../x")


@needs_cgroup2
def test_validate_rejects_a_directory_outside_cgroup2_naming_it(tmp_path):
    with pytest.raises(CgroupError, match=str(tmp_path)):
        validate(str(tmp_path))
    with pytest.raises(CgroupError, match="absolute"):
        validate("relative/dir")


@needs_cgroup2
def test_pid_in_cgroup_says_member_for_the_cgroup_and_below_and_not_for_a_sibling(cg_root):
    """The membership proof the kill targets ask before a signal: the kernel's /proc/PID/cgroup."""
    unit, sibling = os.path.join(cg_root, "u"), os.path.join(cg_root, "u2")  # "u" is a prefix of "u2"
    for d in (unit, os.path.join(unit, "sub"), sibling):
        os.mkdir(d)
    inner = _spawn_into(os.path.join(unit, "sub"), ["sleep", "300"])
    beside = _spawn_into(sibling, ["sleep", "300"])
    try:
        name = cgroupfs.proc_name(unit)
        assert name.endswith("/u") and not name.startswith(MOUNT + "/"), name
        seen = {"in a sub-cgroup": cgroupfs.pid_in_cgroup(inner.pid, name),
                "in the sibling u2": cgroupfs.pid_in_cgroup(beside.pid, name),
                "this test": cgroupfs.pid_in_cgroup(os.getpid(), name)}
        assert seen == {"in a sub-cgroup": True, "in the sibling u2": False, "this test": False}, seen
    finally:
        for p in (inner, beside):
            p.kill()
            p.wait(5)


@needs_cgroup2
def test_unit_cgroup_kill_reaches_an_escaped_grandchild_and_emptiness_is_an_event(cg_root, tmp_path):
    root = CgroupRoot(cg_root, "test")
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
    root = CgroupRoot(cg_root, "test")
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
    root = CgroupRoot(cg_root, "test")
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
    root = CgroupRoot(cg_root, "test")
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
    root = CgroupRoot(cg_root, "test")
    try:
        errs = root.check_keys("big", {"memory_max": 1 << 30, "tasks_max": 10})
        for key, ctl in (("memory_max", "memory"), ("tasks_max", "pids")):
            if ctl in root.controllers:
                assert not any(key in e for e in errs)
            else:
                assert any(key in e and ctl in e and "big" in e for e in errs), errs
    finally:
        root.close()


# ---------------------------------------------------------------- through the daemon

def _toml_unit(pidfile, then="sleep") -> str:
    import json
    code = (f"import os,sys,time\n"
            f"if os.fork()==0:\n"
            f"  os.setsid()\n"
            f"  if os.fork()==0:\n"
            f"    os.execve('/usr/bin/env',['env','-i','/bin/sh','-c','echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; exec sleep 300'],{{}})\n"
            f"  os._exit(0)\n"
            f"while not os.path.exists('{pidfile}'): time.sleep(0.01)\n"
            # "exit": once the test holds the grandchild by its pidfd (Grandchild), else the
            # unit's failure could kill it before the test has read its pid.
            + ("time.sleep(300)\n" if then == "sleep" else
               f"while not os.path.exists('{pidfile}.held'): time.sleep(0.01)\nsys.exit(1)\n"))
    return f"exec = {json.dumps(['python3', '-c', code])}\nstop_timeout = 5\n"


class Grandchild:
    """The escaped grandchild, held by a pidfd from the moment its pid is read."""

    def __init__(self, pidfile) -> None:
        wait_for(lambda: os.path.exists(pidfile), 20, f"the grandchild's pid in {pidfile}")
        self.pid = int(open(pidfile).read())
        self.fd = os.pidfd_open(self.pid)
        open(f"{pidfile}.held", "w").close()  # the unit may go on (and fail) now

    def alive(self) -> bool:
        import select
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        return not p.poll(0)

    def close(self) -> None:
        if self.alive():
            signal.pidfd_send_signal(self.fd, signal.SIGKILL)
            wait_for(lambda: not self.alive(), 5, f"grandchild {self.pid} to die")
        os.close(self.fd)


@pytest.fixture
def daemon_factory(request):
    made = []

    def make(units: dict[str, str], cgroup: bool = True, env: dict | None = None, **kw) -> Daemon:
        root = request.getfixturevalue("cg_root") if cgroup else None
        env = dict(env or {}, **({} if cgroup else {"OMNID_TEST_CGROUP": "0"}))  # the fallback, whatever the run
        d = Daemon(make_stack(units), cgroup_root=root, env=env, **kw)
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.close()


def _why(d: Daemon) -> str:
    return f"units: {d.units()}\nlog tail:\n{d.log()[-3000:]}"


@needs_cgroup2
def test_escaped_grandchild_dies_with_omnid_stop_under_cgroups(daemon_factory, tmp_path, cg_root):
    pf = tmp_path / "gc.pid"
    d = daemon_factory({"esc": _toml_unit(pf)})
    d.wait_state("esc", "active")
    gc = Grandchild(pf)
    try:
        assert gc.pid in cgroupfs.procs(os.path.join(cg_root, "esc")), _why(d)
        d.ok("stop", {"units": ["esc"]})
        wait_for(lambda: not gc.alive(), 5, f"escaped grandchild {gc.pid} to die with stop\n{_why(d)}")
        wait_for(lambda: not os.path.exists(os.path.join(cg_root, "esc")), 5, "the unit's cgroup to be removed")
        assert d.ok("status", {"verify": True})["verify"]["ok"], _why(d)
    finally:
        gc.close()


@needs_cgroup2
def test_escaped_grandchild_dies_with_the_units_failure_under_cgroups(daemon_factory, tmp_path, cg_root):
    pf = tmp_path / "gc.pid"
    d = daemon_factory({"esc": _toml_unit(pf, then="exit")})
    gc = Grandchild(pf)
    try:
        d.wait_state("esc", "failed")
        wait_for(lambda: not gc.alive(), 5, f"escaped grandchild {gc.pid} to die with the failure\n{_why(d)}")
        wait_for(lambda: not os.path.exists(os.path.join(cg_root, "esc")), 5, "the unit's cgroup to be removed")
    finally:
        gc.close()


@needs_cgroup2
def test_without_cgroups_the_escaped_grandchild_survives_stop(daemon_factory, tmp_path):
    """The hole this issue closes, shown on the fallback backend (process groups)."""
    pf = tmp_path / "gc.pid"
    d = daemon_factory({"esc": _toml_unit(pf)}, cgroup=False)
    d.wait_state("esc", "active")
    gc = Grandchild(pf)
    try:
        assert d.ok("status")["daemon"]["backend"] == "process-group"
        d.ok("stop", {"units": ["esc"]})
        d.wait_state("esc", "inactive")
        assert gc.alive(), "expected the escaped grandchild to survive without cgroups"
    finally:
        gc.close()  # by the pidfd of the pid we recorded


@needs_cgroup2
def test_256_units_one_cgroup_each_and_no_directory_left(daemon_factory, cg_root):
    units = {f"u{i:03d}": 'exec = ["sleep", "300"]\n' for i in range(256)}
    d = daemon_factory(units)
    d.wait_all_active(timeout=120)
    dirs = sorted(n for n in os.listdir(cg_root) if os.path.isdir(os.path.join(cg_root, n)))
    assert dirs == sorted(units), f"{len(dirs)} cgroups"
    for n in dirs:
        assert len(cgroupfs.procs(os.path.join(cg_root, n))) == 1, n
    d.ok("stop", {"units": list(units)}, timeout=120)
    left = [n for n in os.listdir(cg_root) if os.path.isdir(os.path.join(cg_root, n))]
    assert left == [], f"cgroup directories left: {left[:10]}"


@needs_cgroup2
def test_daemon_sigkill_then_a_fresh_daemon_cleans_leftover_cgroups(cg_root, tmp_path):
    pf = tmp_path / "gc.pid"
    stack = make_stack({"esc": _toml_unit(pf)})
    d1 = Daemon(stack, cgroup_root=cg_root).start()
    d2 = None
    gc = None
    try:
        d1.wait_state("esc", "active")
        gc = Grandchild(pf)
        # The daemon and its spawner both SIGKILLed (an OOM kill of the pair): the spawner's
        # cleanup cannot run, the escaped grandchild is left in the unit's cgroup.
        spawner = os.pidfd_open(d1.ok("status")["daemon"]["spawner_pid"])  # the daemon's child, held
        try:
            os.kill(d1.pid, signal.SIGSTOP)  # a pid we spawned: it must not notice before both die
            signal.pidfd_send_signal(spawner, signal.SIGKILL)
            os.kill(d1.pid, signal.SIGKILL)
        finally:
            os.close(spawner)
        d1.wait_exit(10)
        assert gc.alive() and os.path.isdir(os.path.join(cg_root, "esc"))
        d2 = Daemon(make_stack({"other": 'exec = ["sleep", "300"]\n'}), cgroup_root=cg_root).start()
        wait_for(lambda: not gc.alive(), 10, f"the fresh daemon to kill the leftover cgroup\n{d2.log()[-2000:]}")
        assert not os.path.exists(os.path.join(cg_root, "esc"))
    finally:
        if gc is not None:
            gc.close()
        d1.close()
        if d2 is not None:
            d2.close()


def test_fallback_without_a_cgroup_root_says_so_once_and_works(daemon_factory, tmp_path):
    d = daemon_factory({"a": 'exec = ["sleep", "300"]\n'}, cgroup=False, env={"INVOCATION_ID": ""})
    d.wait_state("a", "active")
    assert d.ok("status")["daemon"]["backend"] == "process-group"
    code, body = d.http("/health")
    assert body["backend"] == "process-group" and body["cgroup"] is None
    falls = [e for e in d.log_events() if "falls back to process groups" in e.get("event", "")]
    assert len(falls) == 1, d.log()[-2000:]
    d.ok("stop", {"units": ["a"]})
    d.wait_state("a", "inactive")


@needs_cgroup2
def test_a_bad_cgroup_root_is_refused_naming_the_flag_and_reason(tmp_path):
    d = Daemon(make_stack({"a": 'exec = ["sleep", "300"]\n'}), cgroup_root=str(tmp_path))
    try:
        with pytest.raises(AssertionError, match="not on a cgroup2 file system"):
            d.start()
        assert d.proc.returncode == 2
        assert "--cgroup-root" in d.log()
    finally:
        d.close()


@needs_cgroup2
def test_health_and_units_name_the_cgroup_backend(daemon_factory, cg_root):
    d = daemon_factory({"a": 'exec = ["sleep", "300"]\n'})
    d.wait_state("a", "active")
    assert d.ok("status")["daemon"]["cgroup"] == cg_root
    _c, body = d.http("/health")
    assert body["backend"] == "cgroup" and body["cgroup"] == cg_root
    _c, body = d.http("/units")
    assert body["cgroup"] == cg_root and body["units"][0]["cgroup"] == os.path.join(cg_root, "a")


# ---------------------------------------------------------------- unit keys

def test_memory_max_and_tasks_max_parse_with_systemd_units():
    from omnid.model.units import load_stack
    stack = load_stack(make_stack({"a": 'exec = ["true"]\nmemory_max = "8G"\ntasks_max = 64\n',
                                   "b": 'exec = ["true"]\nmemory_max = "infinity"\n'}))
    assert stack.units["a"].memory_max == 8 << 30 and stack.units["a"].tasks_max == 64
    assert stack.units["b"].memory_max == "max"


def test_a_bad_memory_max_names_file_and_key():
    from omnid.model.units import StackInvalid, load_stack
    with pytest.raises(StackInvalid) as ei:
        load_stack(make_stack({"a": 'exec = ["true"]\nmemory_max = "8X"\n'}))
    assert any("memory_max" in str(e) and "a.toml" in str(e) for e in ei.value.errors)


def _refused(stack, cgroup_root) -> str:
    d = Daemon(stack, cgroup_root=cgroup_root, env={"INVOCATION_ID": "", "OMNID_TEST_CGROUP": "0"})
    try:
        with pytest.raises(AssertionError):
            d.start()
        assert d.proc.returncode == 2
        return d.log()
    finally:
        d.close()


def test_memory_max_without_a_cgroup_root_is_refused_naming_unit_and_key():
    log = _refused(make_stack({"big": 'exec = ["sleep", "300"]\nmemory_max = "1G"\n'}), None)
    assert "unit big: memory_max: needs a cgroup v2 root" in log, log


@needs_cgroup2
def test_memory_max_and_tasks_max_follow_the_controllers_of_the_root(cg_root):
    stack = make_stack({"big": 'exec = ["sleep", "300"]\nmemory_max = "1G"\ntasks_max = 32\n'})
    controllers = set(open(os.path.join(cg_root, "cgroup.controllers")).read().split())
    if {"memory", "pids"} <= controllers:
        d = Daemon(stack, cgroup_root=cg_root).start()
        try:
            d.wait_state("big", "active")
            assert open(os.path.join(cg_root, "big", "memory.max")).read().strip() == str(1 << 30)
            assert open(os.path.join(cg_root, "big", "pids.max")).read().strip() == "32"
        finally:
            d.close()
    else:
        log = _refused(stack, cg_root)
        for key, ctl in (("memory_max", "memory"), ("tasks_max", "pids")):
            if ctl not in controllers:
                assert f"unit big: {key}: needs the {ctl} controller in cgroup root {cg_root}" in log, log


@needs_cgroup2
def test_cgroup_figures_in_status_units_and_metrics(daemon_factory, cg_root):
    d = daemon_factory({"a": 'exec = ["python3", "-c", "sum(range(10**6)); import time; time.sleep(300)"]\n'})
    d.wait_state("a", "active")
    files = cgroupfs.figures(os.path.join(cg_root, "a"))
    assert "cpu_usage_usec" in files  # cpu.stat is a core cgroup v2 file
    st = d.unit("a")
    assert set(st["cgroup_figures"]) == set(files), (st, files)
    _c, body = d.http("/units")
    assert set(body["units"][0]["cgroup_figures"]) == set(files)
    with urllib.request.urlopen(f"http://127.0.0.1:{d.health_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'omnid_unit_cgroup_cpu_usage_usec_total{unit="a"}' in text
    assert ("omnid_unit_cgroup_memory_bytes" in text) == ("memory_current" in files)


@needs_cgroup2
def test_under_systemd_delegation_the_daemon_moves_into_a_daemon_leaf_and_units_are_siblings(cg_root, tmp_path):
    """systemd with Delegate=yes, reproduced: the daemon starts inside a cgroup marked
    trusted.delegate=1 with INVOCATION_ID set, and no --cgroup-root."""
    os.setxattr(cg_root, "trusted.delegate", b"1")
    wrap = tmp_path / "python-in-cgroup"
    wrap.write_text(f'#!/bin/sh\necho $$ > {cg_root}/cgroup.procs\nexec {sys.executable} "$@"\n')
    wrap.chmod(0o755)
    d = Daemon(make_stack({"a": 'exec = ["sleep", "300"]\n'}), python=str(wrap),
               env={"INVOCATION_ID": uuid.uuid4().hex, "OMNID_TEST_CGROUP": "0"})
    try:
        d.start()
        d.wait_state("a", "active")
        st = d.ok("status")["daemon"]
        assert st["backend"] == "cgroup" and st["cgroup"] == cg_root, d.log()[-2000:]
        leaf = cgroupfs.procs(os.path.join(cg_root, "daemon"))
        assert d.pid in leaf and st["spawner_pid"] in leaf, leaf
        assert cgroupfs.procs(cg_root) == []  # no process in the inner cgroup
        assert cgroupfs.procs(os.path.join(cg_root, "a")) == [d.unit("a")["pid"]]
    finally:
        d.close()
    wait_for(lambda: not os.path.exists(os.path.join(cg_root, "a")), 5, "the unit's cgroup removed")


@needs_cgroup2
def test_a_root_holding_cgroups_omnid_did_not_make_is_refused_not_wiped(cg_root):
    foreign = os.path.join(cg_root, "someone-else")
    os.mkdir(foreign)
    p = _spawn_into(foreign, ["sleep", "300"])
    try:
        d = Daemon(make_stack({"a": 'exec = ["sleep", "300"]\n'}), cgroup_root=cg_root)
        try:
            with pytest.raises(AssertionError, match="holds cgroups omnid did not make"):
                d.start()
            assert d.proc.returncode == 2
        finally:
            d.close()
        assert p.poll() is None, "a process in a cgroup omnid did not make was killed"
    finally:
        p.kill()
        p.wait(5)
