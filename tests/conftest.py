"""Test harness: every test runs under a leak check that asks the kernel, not omnid.

Each test gets a unique OMNID_TEST_ID in the environment; everything it starts
(daemon, spawner, units, their grandchildren) inherits it. After the test, any
process still carrying that id, any zombie child of pytest, or any fd pytest
did not have before fails the test.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from omnid.base import linux
from omnid.process import spawnstart
from tests.harness import Daemon

LEAK_GRACE_S = 10.0


def _marked(test_id: str) -> list[linux.ProcStat]:
    me = os.getpid()
    out = []
    for st in linux.scan():
        if st.pid == me or st.state in ("X",):
            continue
        if linux.read_environ_var(st.pid, "OMNID_TEST_ID") == test_id:
            out.append(st)
    return out


def _zombie_children() -> list[linux.ProcStat]:
    me = os.getpid()
    return [st for st in linux.scan() if st.ppid == me and st.state == "Z"]


def _fds() -> set[int]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        # pytest's own capture files and the fd of this listdir come and go.
        if "pytest" in target or target.startswith("/dev/pts") or target.startswith("/tmp/pytest"):
            continue
        out.add(fd)
    return out


def _processes_left(test_id: str, grace: float = LEAK_GRACE_S) -> list[str]:
    """Wait up to `grace` for every process carrying `test_id` to be gone; a problem line
    naming those still there (SIGKILLed by pidfd, so one leak does not poison the next test)."""
    deadline = time.monotonic() + grace
    left = _marked(test_id)
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = _marked(test_id)
    if not left:
        return []
    for p in left:
        try:
            fd = os.pidfd_open(p.pid)
        except ProcessLookupError:
            continue
        linux.pidfd_send_signal(fd, signal.SIGKILL)
        os.close(fd)
    return ["processes left behind: " + ", ".join(
        f"pid {p.pid} ({p.comm}, state {p.state}, ppid {p.ppid})" for p in left)]


@pytest.fixture(scope="module")
def module_test_id():
    """An OMNID_TEST_ID for what a module keeps across its tests (a daemon supervising an
    engine that takes a minute to start): give it to that daemon's environment explicitly.
    The per-test check cannot see these processes (they carry this id, not the test's); they
    are checked here instead, once the module's fixtures are torn down."""
    test_id = "module-" + uuid.uuid4().hex
    yield test_id
    problems = _processes_left(test_id)
    if problems:
        pytest.fail("leak check (module): " + "; ".join(problems), pytrace=False)


@pytest.fixture(autouse=True)
def no_leaks(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    test_id = uuid.uuid4().hex
    monkeypatch.setenv("OMNID_TEST_ID", test_id)
    monkeypatch.setenv("OMNID_CHECK_INVARIANTS", "1")
    fds_before = _fds()
    yield test_id
    problems = _processes_left(test_id)
    zombies = _zombie_children()
    if zombies:
        problems.append("zombies left (children of pytest not reaped): " + ", ".join(str(z.pid) for z in zombies))
        for z in zombies:
            try:
                os.waitpid(z.pid, os.WNOHANG)
            except ChildProcessError:
                pass
    leaked_fds = _fds() - fds_before
    if leaked_fds:
        desc = []
        for fd in sorted(leaked_fds):
            try:
                desc.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
            except OSError:
                continue
        if desc:
            problems.append("fds left open: " + ", ".join(desc))
    if problems:
        pytest.fail("leak check: " + "; ".join(problems), pytrace=False)


@pytest.fixture(autouse=True)
def fast_tier_starts_no_daemon(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """`-m fast` is the logic that needs no daemon: a fast test that starts one (the harness's
    daemon, or a supervisor's spawner in-process) fails at that call, naming itself."""
    if request.node.get_closest_marker("fast") is None:
        return

    def refusing(what: str):
        def refuse(*_a, **_kw):
            pytest.fail(f"{request.node.nodeid} is marked fast but starts {what}: drop its fast mark", pytrace=False)
        return refuse

    monkeypatch.setattr(Daemon, "start", refusing("an omnid daemon (tests.harness.Daemon)"))
    monkeypatch.setattr(spawnstart, "launch", refusing("a spawner (a supervisor in-process)"))


# The modules whose tests take longest (real vLLM restarts, the failure matrix's stacks, hosts
# made of network namespaces) go first: under xdist (`-n N --dist loadgroup`) a worker takes
# the next test when it is nearly idle, so a long one taken last would be the whole run's tail.
# Each module keeps its own order (module-scoped stacks rely on it).
def pytest_configure(config):
    """Once, in the process that runs or hands out the tests (not in each xdist worker): the
    checkout's bytecode. The tests start ~700 daemons and more CLIs and helper scripts, each a
    Python process importing omnid from here. Where PYTHONDONTWRITEBYTECODE is set (CI
    machines set it) none writes its .pyc, so each compiled omnid again: ~0.12 s of CPU a
    process (0.42 s to import the daemon's modules from source, 0.30 s from bytecode)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import compileall
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    for part in ("omnid", "tests"):
        compileall.compile_dir(repo / part, quiet=2, workers=1)
    if config.getoption("numprocesses", None):
        _rewrite_once_for_the_workers(config)


def _rewrite_once_for_the_workers(config) -> None:
    """The test modules with pytest's assertions rewritten, written once where every xdist
    worker reads them (__pycache__/*-pytest-*.pyc). Under PYTHONDONTWRITEBYTECODE pytest
    writes none, so each of the eight workers rewrote every module itself: 9.7 s of CPU to
    collect the suite against 4.2 s from the written files, ~45 CPU-s a run and ~20 s before
    the first test. pytest's own functions (pinned below 9.2 in pyproject.toml) do exactly
    what a worker does; any change in them costs speed only (the workers rewrite again)."""
    import fnmatch
    from pathlib import Path

    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
    except (ImportError, AttributeError, KeyError):
        return
    patterns = [*config.getini("python_files"), "conftest.py"]
    base = Path(config.invocation_params.dir)
    files: set[Path] = set()
    for arg in config.args:
        path = (base / arg.split("::", 1)[0]).resolve()
        for fn in (path.rglob("*.py") if path.is_dir() else [path]):
            if any(fnmatch.fnmatch(fn.name, p) for p in patterns) and "__pycache__" not in fn.parts:
                files.add(fn)
    for fn in sorted(files):
        pyc = rewrite.get_cache_dir(fn) / (fn.name[:-3] + rewrite.PYC_TAIL)
        try:
            if rewrite._read_pyc(fn, pyc) is None:
                pyc.parent.mkdir(exist_ok=True)
                source_stat, co = rewrite._rewrite_test(fn, config)
                rewrite._write_pyc(state, co, source_stat, pyc)
        except Exception:  # noqa: BLE001 - a speed-up only: the worker rewrites what is not here
            continue


FIRST = ("test_engine_vllm.py", "test_engine_vllm_socket.py", "failure_matrix/test_matrix.py",
         "test_cluster_e2e.py", "test_cluster.py")


@pytest.hookimpl(trylast=True)  # after xdist's own, which names each grouped test's group in its node id
def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, tail in enumerate(FIRST) if path.endswith(tail)), len(FIRST))

    items.sort(key=rank)  # stable: the order inside each module is kept
    if getattr(config.option, "loadgroup", False):
        # xdist 3.8 names the group by rewriting Item._nodeid, which pytest 9.2 no longer reads:
        # the groups were then spread over every worker (eight vLLM stacks at once, memory gone).
        lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:
            raise pytest.UsageError(f"--dist loadgroup did not group {len(lost)} tests (e.g. {lost[0]}): this "
                                    f"pytest-xdist does not work with this pytest; pyproject.toml pins the pair")


def pytest_terminal_summary(terminalreporter):
    """Figures a test reported (user property "figures": real vLLM's timings per row), shown at
    the end of the run, also when xdist workers ran the tests (their reports carry them)."""
    lines: dict[tuple[str, str], None] = {}  # in the order reported; a teardown's report repeats the call's
    for reports in terminalreporter.stats.values():
        for rep in reports:
            for k, v in getattr(rep, "user_properties", ()):
                if k == "figures":
                    lines[(rep.nodeid.split("::", 1)[0], v)] = None
    if lines:
        terminalreporter.section("figures the tests measured")
        for path, text in lines:
            terminalreporter.write_line(f"{path}: {text}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test shows what its daemons said: the tail of each one's log, so that a
    flake under load can be told from a bug without running it again."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when != "call" or not rep.failed:
        return
    for d in getattr(item, "omnid_daemons", ()):
        try:
            tail = "\n".join(d.log().splitlines()[-40:])
        except OSError as exc:
            tail = f"(log unreadable: {exc})"
        rep.sections.append((f"omnid daemon log, last 40 lines ({d.log_path})", tail))


@pytest.fixture
def daemon_factory(tmp_path_factory, request):
    """Start omnid daemons on stack directories; every one is stopped and reaped afterwards."""
    started: list[Daemon] = []
    request.node.omnid_daemons = started

    def start(units_dir, **kw) -> Daemon:
        d = Daemon(units_dir, **kw)
        started.append(d)
        d.start()
        return d

    yield start
    violations = []
    for d in started:
        d.close()
        violations.extend(d.invariant_violations())
    if violations:
        pytest.fail("the daemon's state disagreed with the kernel after a transition:\n" + "\n".join(violations[:10]),
                    pytrace=False)


@pytest.fixture(scope="session")
def real_nvml():
    """NVML on a real GPU, opened once for the session (or the test skips with the reason).

    libnvidia-ml keeps eventfds and pipes open from its first nvmlInit until the process
    exits; opened here, before any test's leak baseline, they are not counted as a leak."""
    from omnid.gpu import NvmlBackend

    backend = NvmlBackend()
    if not backend.available:
        pytest.skip(f"needs an NVIDIA GPU with NVML: {backend.reason}")
    yield backend
    backend.close()
