"""The spawner's two paths from fork to exec (omnid/process/spawner.py): the compiled one
(omnid/process/_spawnc.c, a vfork child in C) and the Python one (a forked child running Python).
Each child is checked in /proc, as the kernel sees it; the failures must read the same on
both paths, word for word, since operators and the restart policy read them."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import resource
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from omnid.base import linux
from omnid.process import numa
from omnid.process.spawnclient import SpawnError, SpawnRequest
from tests.harness import make_stack, wait_for
from tests.test_spawner import Run

try:
    from omnid.process import _spawnc
except ImportError:
    _spawnc = None

PATHS = ("compiled", "python")


def _use(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "python":
        monkeypatch.setenv("OMNID_SPAWNER_PYTHON", "1")
    else:
        monkeypatch.delenv("OMNID_SPAWNER_PYTHON", raising=False)
        if _spawnc is None:
            pytest.skip("omnid.process._spawnc is not built here (no C compiler at install): only the Python path runs")


def status_of(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def limits_of(pid: int) -> dict[str, tuple[str, str]]:
    out = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        parts = line[26:].split()
        out[line[:26].strip()] = (parts[0], parts[1])
    return out


class Spawner(Run):
    """test_spawner's real spawner on our loop, once it said hello (its path), and many
    requests' outcomes at once."""

    async def __aenter__(self) -> Spawner:
        await super().__aenter__()
        await self.client.wait_ready(10)
        return self

    async def outcomes(self, reqs: list[SpawnRequest]) -> list:
        """Each request's Spawned or SpawnError."""
        futs = []
        for req in reqs:
            _r, w = self.pipe()
            futs.append(self.client.spawn(req, w))
        return await asyncio.gather(*futs, return_exceptions=True)


def _kill(spawned) -> None:
    for sp in spawned:
        if not isinstance(sp, BaseException):
            linux.pidfd_send_signal(sp.pidfd, signal.SIGKILL)
            os.close(sp.pidfd)


@pytest.mark.parametrize("path", PATHS)
def test_a_child_is_set_up_the_same_on_either_path_as_the_kernel_sees_it(path, monkeypatch, tmp_path):
    _use(path, monkeypatch)
    root = os.geteuid() == 0
    nobody = pwd.getpwnam("nobody") if root else None
    placement = numa.Placement(nodes=(0,), cpus=(0,), memory=numa.MPOL_PREFERRED, mem_nodes=(0,), source="test")

    async def main() -> None:
        async with Spawner() as run:
            assert run.client.exec_path == path
            out_r, out_w = run.pipe()
            err_r, err_w = run.pipe()
            req = SpawnRequest(unit="u", argv=("sh", "-c", "echo out; echo err >&2; exec sleep 1000"),
                               env={"PATH": "/usr/bin:/bin", "MARK": "x"}, cwd=str(tmp_path),
                               rlimits=((resource.RLIMIT_NOFILE, 512, 1024), (resource.RLIMIT_CORE, 0, 0)),
                               placement=placement, user="nobody" if root else None,
                               path=shutil.which("sh", path="/usr/bin:/bin"))
            sp = await run.client.spawn(req, out_w, err_w)
            try:
                assert os.read(out_r, 100) == b"out\n" and os.read(err_r, 100) == b"err\n"
                wait_for(lambda: Path(f"/proc/{sp.pid}/exe").resolve().name == "sleep", 10, "the unit exec'd sleep")
                st = linux.read_stat(sp.pid)
                assert st.ppid == run.client.pid and st.sid == sp.pid and st.pgid == sp.pid, st
                status = status_of(sp.pid)
                glibc = (1 << 31) | (1 << 32)  # glibc's own signals: nobody can set them
                assert int(status["SigIgn"], 16) & ~glibc == 0 and int(status["SigBlk"], 16) == 0, status
                assert int(status["SigCgt"], 16) == 0, status
                # The exe link turns to sleep before execve closes the close-on-exec fds (seen:
                # a 4th fd 1 run in 3, on both paths and before this change): wait for the exec's end.
                wait_for(lambda: sorted(os.listdir(f"/proc/{sp.pid}/fd")) == ["0", "1", "2"], 10,
                         lambda: f"sleep's fds only 0, 1, 2: {os.listdir(f'/proc/{sp.pid}/fd')}")
                assert os.readlink(f"/proc/{sp.pid}/fd/0") == "/dev/null"
                assert os.readlink(f"/proc/{sp.pid}/cwd") == str(tmp_path)
                limits = limits_of(sp.pid)
                assert limits["Max open files"] == ("512", "1024") and limits["Max core file size"] == ("0", "0")
                assert status["Cpus_allowed_list"] == "0", status
                assert numa.memory_policy_of(Path(f"/proc/{sp.pid}/numa_maps").read_text()) == "prefer:0"
                # The exe link turns to sleep early in execve, before the kernel sets the new
                # program's environment up (read as empty until then): wait for it too.
                wait_for(lambda: linux.read_environ_var(sp.pid, "MARK") == "x", 10,
                         lambda: f"MARK=x in sleep's environment: {Path(f'/proc/{sp.pid}/environ').read_bytes()!r}")
                if root:
                    assert status["Uid"].split()[0] == str(nobody.pw_uid), status
                    assert status["Gid"].split()[0] == str(nobody.pw_gid), status
                    assert set(status["Groups"].split()) == {str(g) for g in os.getgrouplist("nobody", nobody.pw_gid)}
                # Parent-death signal: the spawner gone, the unit goes with it.
                signal.pidfd_send_signal(run.client.pidfd, signal.SIGKILL)
                wait_for(lambda: linux.read_stat(sp.pid) is None
                         or linux.read_stat(sp.pid).state == "Z", 10, "the unit died with its spawner")
            finally:
                _kill([sp])

    asyncio.run(main())


def _failing(tmp_path: Path) -> list[tuple[str, SpawnRequest]]:
    plain = tmp_path / "plain"
    plain.write_text("not a program\n")  # no exec bit: EACCES
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x00\x01\x02 not ELF, no #!\n")
    garbage.chmod(stat.S_IRWXU)  # exec bit, no format: ENOEXEC
    env = {"PATH": f"{tmp_path / 'a'}:{tmp_path / 'b'}"}
    cases = [
        ("missing program", SpawnRequest(unit="m", argv=("/nonexistent/omnid-prog",), env=env)),
        ("no exec bit", SpawnRequest(unit="p", argv=(str(plain),), env=env)),
        ("no format", SpawnRequest(unit="g", argv=(str(garbage),), env=env)),
        ("not in PATH", SpawnRequest(unit="n", argv=("omnid-no-such-prog",), env=env)),
        ("missing cwd", SpawnRequest(unit="c", argv=("/bin/true",), env=env, cwd="/nonexistent/dir")),
        ("rlimit above the kernel's", SpawnRequest(unit="r", argv=("/bin/true",), env=env,
                                                    rlimits=((resource.RLIMIT_NOFILE, 1 << 30, 1 << 30),))),
        ("unknown user", SpawnRequest(unit="us", argv=("/bin/true",), env=env, user="omnid-no-such-user")),
        ("unknown group", SpawnRequest(unit="gr", argv=("/bin/true",), env=env, group="omnid-no-such-group")),
    ]
    return cases


def test_every_failure_reads_the_same_on_either_path(monkeypatch, tmp_path):
    if _spawnc is None:
        pytest.skip("omnid.process._spawnc is not built here (no C compiler at install): nothing to compare")
    seen: dict[str, list[tuple[str, int | None]]] = {}
    for path in PATHS:
        _use(path, monkeypatch)

        async def main(path: str = path) -> list:
            async with Spawner() as run:
                assert run.client.exec_path == path
                got = await run.outcomes([req for _name, req in _failing(tmp_path)])
                _kill(got)
                return got

        got = asyncio.run(main())
        seen[path] = []
        for (name, _req), outcome in zip(_failing(tmp_path), got):
            assert isinstance(outcome, SpawnError), f"{path}: {name}: spawned {outcome}"
            seen[path].append((str(outcome), outcome.errno))
    for (name, _req), compiled, python in zip(_failing(tmp_path), seen["compiled"], seen["python"]):
        assert compiled == python, f"{name}: compiled {compiled} != python {python}"
    texts = dict(zip((name for name, _r in _failing(tmp_path)), seen["compiled"]))
    # The restart policy tells a program that cannot run from a passing fault by exec's errno.
    missing = "exec failed: [Errno 2] No such file or directory: '/nonexistent/omnid-prog'"
    assert texts["missing program"] == (missing, 2), texts
    assert texts["no exec bit"][1] == 13 and texts["no format"][1] == 8, texts
    not_found = f"exec failed: [Errno 2] No such file or directory: '{tmp_path / 'b' / 'omnid-no-such-prog'}'"
    assert texts["not in PATH"] == (not_found, 2), texts
    assert texts["missing cwd"][0].startswith("chdir '/nonexistent/dir' failed: [Errno 2]"), texts
    assert texts["rlimit above the kernel's"][0] == (f"setrlimit({resource.RLIMIT_NOFILE}) failed: "
                                                     "not allowed to raise maximum limit"), texts
    assert "omnid-no-such-user" in texts["unknown user"][0] and texts["unknown user"][1] is None, texts


@pytest.mark.parametrize("path", PATHS)
def test_a_bare_program_name_is_found_through_the_units_path(path, monkeypatch, tmp_path):
    _use(path, monkeypatch)
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "prog").write_text("not executable\n")  # EACCES here: execvpe goes on to b
    (second / "prog").symlink_to(shutil.which("sleep"))

    async def main() -> None:
        async with Spawner() as run:
            [sp] = await run.outcomes([SpawnRequest(unit="x", argv=("prog", "1000"),
                                                    env={"PATH": f"{first}:{second}"})])
            try:
                assert not isinstance(sp, BaseException), sp
                assert Path(f"/proc/{sp.pid}/exe").resolve() == Path(shutil.which("sleep")).resolve()
            finally:
                _kill([sp])

    asyncio.run(main())


def test_the_compiled_path_is_built_wherever_a_c_compiler_is():
    # A host with a compiler that still runs the Python path lost 2 ms a spawn without a word.
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this host: the Python path is the expected one")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no Python headers for this interpreter: the Python path is the expected one")
    assert _spawnc is not None, "a C compiler is here but omnid.process._spawnc was not built: see the pip install's output"


CHILD_WITHOUT_PIDFD = r"""
import errno, json, os, signal, socket, sys, time
from omnid.base import linux
from omnid.process import spawner
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sp = spawner.Spawner(theirs, os.getppid())
sp.launcher.reset_signals = ()
def no_fds(pid):
    raise OSError(errno.EMFILE, "Too many open files")
linux.pidfd_open = no_fds
r, w = os.pipe2(os.O_CLOEXEC)
sp.spawn({"id": 1, "unit": "x", "argv": ["/bin/sleep", "1000"], "env": {}, "path": "/bin/sleep"}, [w])
deadline = time.monotonic() + 10
while sp.children.launching() and time.monotonic() < deadline:  # the Python path: its exec report
    for child in sp.children.launching():
        sp.launcher.exec_report(child.pipe)
sp.flush()
pid, status = os.wait()
print(json.dumps({"answer": json.loads(ours.recv(65536)), "pid": pid,
                  "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}))
"""


@pytest.mark.parametrize("path", PATHS)
def test_a_child_the_spawner_cannot_hold_by_pidfd_is_killed_and_reported(path, monkeypatch):
    # Out of fds at pidfd_open: the child must not run on unheld, and the daemon must hear why.
    _use(path, monkeypatch)
    out = subprocess.run([sys.executable, "-c", CHILD_WITHOUT_PIDFD], capture_output=True, text=True, check=False,
                         timeout=60, env=dict(os.environ), cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    events = got["answer"]["events"]
    assert [e["op"] for e in events] == ["spawn_failed"] and "pidfd_open failed" in events[0]["error"], got
    assert got["signal"] == signal.SIGKILL and got["pid"] == events[0]["pid"], got


@pytest.mark.parametrize("path", PATHS)
def test_status_says_which_path_the_spawner_takes_and_a_re_exec_keeps_it(path, monkeypatch, daemon_factory):
    _use(path, monkeypatch)
    env = {"OMNID_SPAWNER_PYTHON": "1"} if path == "python" else {}
    d = daemon_factory(make_stack({"a": 'exec = ["sleep", "1000"]\n'}), env=env)
    pid = d.wait_state("a", "active")["pid"]
    assert d.ok("status")["daemon"]["spawner_exec_path"] == path
    d.reexec()
    st = d.ok("status")
    assert st["daemon"]["spawner_exec_path"] == path and d.unit("a")["pid"] == pid, st["daemon"]


def _link(pid: int, fd: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return "?"


@pytest.mark.parametrize("walk", [False, True], ids=["close_range", "walk /proc/self/fd"])
def test_a_compiled_child_keeps_no_fd_but_stdio_with_close_range_or_without(walk):
    # A kernel before 5.9 has no close_range: the child walks /proc/self/fd instead (a raised
    # RLIMIT_NOFILE would make closing every number a million system calls a spawn).
    if _spawnc is None:
        pytest.skip("omnid.process._spawnc is not built here (no C compiler at install)")
    r, w = os.pipe()
    high = os.dup2(w, 1000, inheritable=True)
    os.set_inheritable(r, True)
    _spawnc._walk_fds(walk)
    try:
        sleep = shutil.which("sleep")
        pid, stage, err, _index = _spawnc.spawn(
            [os.fsencode(sleep)], [b"sleep", b"1000"], [b"PATH=/bin"], w, w, w, os.getpid(), (), (), None,
            None, 0, b"", 0, True, None, -1, None, -1)
        try:
            assert stage == 0, (stage, err)
            wait_for(lambda: Path(f"/proc/{pid}/exe").resolve() == Path(sleep).resolve(), 10, "sleep exec'd")
            # Just after the exec the dynamic loader holds fd 3 for a moment (it opens the
            # libraries); an fd the spawn leaked stays for good, so wait for stdio alone.
            seen: list[list[str]] = []

            def only_stdio() -> bool:
                fds = sorted(os.listdir(f"/proc/{pid}/fd"), key=int)
                seen.append([f"{fd} -> {_link(pid, fd)}" for fd in fds])
                return fds == ["0", "1", "2"]

            wait_for(only_stdio, 10, lambda: f"the exec'd child to hold stdio alone (last seen: {seen[-1]})")
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    finally:
        _spawnc._walk_fds(False)
        for fd in (r, w, high):
            os.close(fd)
