"""A unit's cache directory (omnid.unit(5) `cache_dir`, omnid.toml `cache_root`): it outlives
the unit's crashes, restarts, a reload and a re-exec, unlike its private TMPDIR; it is made
owned by the unit's user, mode 0700; a hostile path in its place is refused, never followed
nor re-owned. Real daemons, real units; owners and modes read from the kernel (stat)."""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import stat
import sys
from pathlib import Path

import pytest

from tests.harness import free_port, make_stack, repo_pythonpath, temp_dir, unit_environ, wait_for
from omnid.model.units import check_stack

ROOT = os.geteuid() == 0
SYS_PY = "/usr/bin/python3"  # another user runs it (the venv's interpreter may be root's alone)
PY = sys.executable

# At start: lists what its cache directory holds into found.<pid>, then leaves made.<pid> there.
CACHER = r"""
import os, sys, time
d = os.environ["OMNID_CACHE_DIR"]
names = sorted(n for n in os.listdir(d) if n.startswith("made."))
with open(os.path.join(d, f"found.{os.getpid()}"), "w") as f:
    f.write("\n".join(names))
with open(os.path.join(d, f"made.{os.getpid()}"), "w") as f:
    f.write("x")
print("cache", d, "found", names, flush=True)
time.sleep(1000)
"""


def script(text: str, name: str) -> str:
    """A program every user can read (pytest's tmp_path is root's alone)."""
    d = temp_dir("omt-prog-")
    os.chmod(d, 0o755)
    p = d / name
    p.write_text(text)
    os.chmod(p, 0o644)
    return str(p)


def cache_root() -> Path:
    """A root of the test's own below /tmp (sticky, root's): omnid walks it as it would /var/cache."""
    d = temp_dir("omt-cache-")
    os.chmod(d, 0o755)  # as /var/cache/omnid: every unit's user passes through it
    return d


def env_of(pid: int) -> dict[str, str]:
    return unit_environ(pid)


def kill(pid: int) -> None:
    fd = os.pidfd_open(pid)
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


def unit(prog: str, extra: str = "", py: str = SYS_PY) -> str:
    return f"exec = {json.dumps([py, prog])}\nstop_timeout = 5\nrestart_sec = 0.1\n{extra}\n"


def settings(root: Path) -> str:
    return f"cache_root = {json.dumps(str(root))}\n"


def seen(d, what: str) -> str:
    return f"{what} (units: {json.dumps(d.units())}\nlog:\n{d.log()[-3000:]})"


@pytest.mark.fast
def test_cache_dir_keys_are_checked():
    """Never a path: a unit file that could name a directory would have a root daemon chown it."""
    for bad in ("/etc", "../etc", "a/b", "", ".hidden", 3):
        (error,) = check_stack(make_stack({"t": f'exec = ["true"]\ncache_dir = {json.dumps(bad)}\n'}))
        assert error.key == "cache_dir" and "directory name under the cache root" in error.message, error
    assert check_stack(make_stack({"t": 'exec = ["true"]\ncache_dir = "vllm-0.32"\n'})) == ()
    (error,) = check_stack(make_stack({"t": 'exec = ["true"]\nenv = { OMNID_CACHE_DIR = "/x" }\n'}))
    assert error.key == "env.OMNID_CACHE_DIR" and "set by omnid" in error.message, error


@pytest.mark.fast
def test_the_default_cache_root_is_systemds_place(monkeypatch):
    from omnid.model import settings as settings_mod

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert settings_mod.default_cache_root() == "/var/cache/omnid"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_CACHE_HOME", "/home/u/.xdg-cache")
    assert settings_mod.default_cache_root() == "/home/u/.xdg-cache/omnid"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/u")
    assert settings_mod.default_cache_root() == "/home/u/.cache/omnid"


@pytest.mark.skipif(not ROOT, reason="a unit of another user (nobody) needs a root daemon")
def test_cache_dir_outlives_a_sigkill_while_the_private_tmp_goes(daemon_factory):
    root = cache_root()
    nobody = pwd.getpwnam("nobody")
    prog = script(CACHER, "cacher.py")
    d = daemon_factory(make_stack({"t": unit(prog, 'user = "nobody"\ncache_dir = true\nrestart = "always"\n'
                                               'env = { TRITON_CACHE_DIR = "/opt/triton-of-my-own" }\n')},
                                  settings(root)))
    pid = d.wait_state("t", "active")["pid"]
    cache = str(root / "t")
    # Its own file first: it has exec'd (its environment before that is the spawner's).
    wait_for(lambda: os.path.exists(f"{cache}/made.{pid}"), 15, lambda: seen(d, "the unit's first file"))
    env = env_of(pid)
    assert env["OMNID_CACHE_DIR"] == cache, env
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{cache}/torchinductor" and env["VLLM_CACHE_ROOT"] == f"{cache}/vllm"
    assert env["TRITON_CACHE_DIR"] == "/opt/triton-of-my-own", "the unit's own env must win"
    st = os.lstat(cache)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)
    assert (st.st_uid, st.st_gid) == (nobody.pw_uid, nobody.pw_gid), (st.st_uid, st.st_gid)
    assert os.lstat(root).st_uid == 0
    tmpdir = env["TMPDIR"]
    assert os.path.isdir(tmpdir) and not tmpdir.startswith(cache)

    kill(pid)
    pid2 = wait_for(lambda: (u := d.unit("t"))["state"] == "active" and u["pid"] != pid and u["pid"], 20,
                    lambda: seen(d, "the restart after the SIGKILL"))
    wait_for(lambda: os.path.exists(f"{cache}/found.{pid2}") and os.path.exists(f"{cache}/made.{pid2}"), 15,
             lambda: seen(d, "the restarted unit's files"))
    assert Path(f"{cache}/found.{pid2}").read_text().split() == [f"made.{pid}"], "the restart did not find the file"
    assert env_of(pid2)["OMNID_CACHE_DIR"] == cache
    wait_for(lambda: not os.path.lexists(tmpdir), 10, "the dead instance's private TMPDIR to go")
    d.ok("stop", {"units": ["t"]})
    assert sorted(os.listdir(cache)) == sorted([f"made.{pid}", f"found.{pid}", f"made.{pid2}", f"found.{pid2}"])
    assert os.lstat(cache).st_ino == st.st_ino, "the cache directory was made again"


@pytest.mark.skipif(not ROOT, reason="a unit of another user (nobody) needs a root daemon")
def test_instances_share_the_template_directory_and_a_name_chooses_another(daemon_factory):
    root = cache_root() / "made" / "by-omnid"  # missing components of the root are made, 0755
    prog = script(CACHER, "cacher.py")
    d = daemon_factory(make_stack({"w": unit(prog, 'user = "nobody"\ncache_dir = true\ninstances = 2\n'),
                                   "v": unit(prog, 'user = "nobody"\ncache_dir = "engines"\n')}, settings(root)))
    pids = {n: d.wait_state(n, "active")["pid"] for n in ("w@0", "w@1", "v")}
    made = lambda: sorted(p.name for p in root.glob("*/made.*"))  # noqa: E731
    wait_for(lambda: len(made()) == 3, 15, lambda: seen(d, f"each unit's file (seen {made()})"))
    envs = {n: env_of(pid) for n, pid in pids.items()}
    assert envs["w@0"]["OMNID_CACHE_DIR"] == envs["w@1"]["OMNID_CACHE_DIR"] == str(root / "w"), envs
    assert envs["v"]["OMNID_CACHE_DIR"] == str(root / "engines")
    assert sorted(os.listdir(root)) == ["engines", "w"]
    for p in (root, root.parent):
        st = os.lstat(p)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755), (p, st)


@pytest.mark.skipif(not ROOT, reason="hostile paths against a root daemon")
@pytest.mark.parametrize("plant", ["symlink", "other_users_dir", "file", "root_writable_by_others"])
def test_a_hostile_path_in_place_of_the_cache_dir_is_refused_and_left_alone(daemon_factory, plant):
    root = cache_root()
    target = temp_dir("omt-target-")  # what a link points to: must be neither chowned nor written
    nobody = pwd.getpwnam("nobody")
    place = root / "t"
    expected = {
        "symlink": "is a symbolic link",
        "other_users_dir": "is owned by nobody (uid 65534), not by the unit's user root (uid 0)",
        "file": "is not a directory",
        "root_writable_by_others": "mode 0777 is writable by its group and others",
    }[plant]
    if plant == "symlink":
        place.symlink_to(target)
    elif plant == "other_users_dir":
        place.mkdir(mode=0o700)
        os.chown(place, nobody.pw_uid, nobody.pw_gid)
    elif plant == "file":
        place.write_text("not a directory")
    else:
        os.chmod(root, 0o777)
    before = os.lstat(place) if os.path.lexists(place) else None
    prog = script(CACHER, "cacher.py")
    d = daemon_factory(make_stack({"t": unit(prog, 'cache_dir = true\nrestart = "no"\n', py=PY)}, settings(root)))
    u = d.wait_state("t", "failed")
    assert "cache_dir" in u["reason"] and expected in u["reason"], u["reason"]
    if before is not None:
        after = os.lstat(place)
        assert (after.st_ino, after.st_uid, after.st_mode) == (before.st_ino, before.st_uid, before.st_mode)
    st = os.stat(target)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700 and os.listdir(target) == []


@pytest.mark.skipif(not ROOT, reason="a unit of another user (nobody) needs a root daemon")
def test_reload_and_reexec_keep_the_cache_dir_and_a_changed_one_restarts_the_unit(daemon_factory):
    root = cache_root()
    prog = script(CACHER, "cacher.py")
    stack = make_stack({"t": unit(prog, 'user = "nobody"\ncache_dir = true\n', py=SYS_PY)}, settings(root))
    d = daemon_factory(stack, env={"PYTHONPATH": repo_pythonpath()})
    pid = d.wait_state("t", "active")["pid"]
    cache = root / "t"
    wait_for(lambda: (cache / f"made.{pid}").exists(), 15, lambda: seen(d, "the unit's file"))
    ino = os.lstat(cache).st_ino

    d.reexec()
    assert d.unit("t")["pid"] == pid and env_of(pid)["OMNID_CACHE_DIR"] == str(cache)
    assert (cache / f"made.{pid}").exists() and os.lstat(cache).st_ino == ino

    # A reload that changes nothing of the unit leaves it running, its directory as it was.
    (stack / "t.toml").write_text(unit(prog, 'user = "nobody"\ncache_dir = true\ndescription = "x"\n'))
    d.ok("reload")
    assert d.unit("t")["pid"] == pid and (cache / f"made.{pid}").exists()

    # cache_dir changed: the unit restarts with the new directory; the old one is kept.
    (stack / "t.toml").write_text(unit(prog, 'user = "nobody"\ncache_dir = "other"\n'))
    d.ok("reload")
    pid2 = wait_for(lambda: (u := d.unit("t"))["state"] == "active" and u["pid"] != pid and u["pid"], 20,
                    lambda: seen(d, "the restart for the changed cache_dir"))
    # Its own file in the new directory: it has exec'd, with the new directory in its environment.
    wait_for(lambda: (root / "other" / f"made.{pid2}").exists(), 15, lambda: seen(d, "the restarted unit's file"))
    assert env_of(pid2)["OMNID_CACHE_DIR"] == str(root / "other")
    assert (cache / f"made.{pid}").exists() and os.lstat(cache).st_ino == ino


@pytest.mark.skipif(not ROOT, reason="the cache root of a root daemon")
@pytest.mark.timeout(600)  # torch.compile twice: minutes on two cores loaded by a parallel run
def test_a_compiled_worker_restarted_finds_its_inductor_cache_while_private_tmp_goes(daemon_factory):
    """The real thing: the demo worker with --compile (torch.compile before READY=1), private_tmp
    on. Its second start loads the graph the first compiled (inductor says hit), from the unit's
    cache directory, though its first TMPDIR is gone."""
    pytest.importorskip("torch")
    root = cache_root()
    worker = ('exec = ["python3", "-m", "omnid.demo.worker", "--compile"]\nready = "notify"\nready_timeout = 600\n'
              'stop_timeout = 10\nrestart = "no"\ncache_dir = true\n'
              f'env = {{ OMNID_DEMO_DEVICE = "cpu", OMNID_DEMO_MODEL_MIB = "8", '
              f'OMNID_DEMO_WORKER_PORT = "{free_port()}", TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS = "0" }}\n')
    d = daemon_factory(make_stack({"w": worker}, settings(root)))
    said = lambda: re.findall(r"compiled its step in [0-9.]+ s \(inductor's FX graph cache: (\d+) hit, (\d+) miss",
                              d.log())  # noqa: E731
    pid = d.wait_state("w", "active", timeout=600)["pid"]
    tmp1 = env_of(pid)["TMPDIR"]
    assert env_of(pid)["TORCHINDUCTOR_CACHE_DIR"] == str(root / "w" / "torchinductor")
    d.ok("stop", {"units": ["w"]}, timeout=60)
    assert not os.path.lexists(tmp1)
    assert os.listdir(root / "w" / "torchinductor" / "fxgraph"), "nothing compiled into the cache directory"
    d.ok("start", {"units": ["w"]}, timeout=600)
    d.wait_state("w", "active", timeout=600)
    wait_for(lambda: len(said()) == 2, 10, lambda: seen(d, "both compile lines"))
    assert said() == [("0", "1"), ("1", "0")], said()
