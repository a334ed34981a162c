"""Issue #12, operators' experience: `omnid start` as one operation, honest CLI, unit
logs, sd_notify towards systemd, Prometheus metrics, man pages, the settings resolver.

Real daemons and real children throughout; the only fake is the control server in
the `kill -s 15` test, which checks what the CLI sends (the daemon side of numeric
signals is tested with the control protocol)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnid.model import settings
from tests.harness import REPO, Daemon, free_port, make_stack, wait_for

PY = sys.executable


def omnid(*args: str, env: dict | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([PY, "-m", "omnid", *args], capture_output=True, text=True, timeout=timeout, env=e,
                          cwd=str(REPO))


class Cli:
    """`omnid start` daemons on a private control socket and state dir; always stopped."""

    def __init__(self, tmp_path: Path) -> None:
        self.control = str(tmp_path / "c.sock")
        self.state = tmp_path / "state"
        self.port = free_port()

    def __call__(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return omnid("--control", self.control, *args, **kw)

    def start(self, stack: Path, *extra: str, **kw) -> subprocess.CompletedProcess:
        return self("start", "-u", str(stack), "--state-dir", str(self.state), "--health-listen",
                    f"127.0.0.1:{self.port}", "--timeout", "60", *extra, **kw)

    def stop(self) -> None:
        if os.path.exists(self.control):
            r = self("stop")
            assert r.returncode == 0, r.stdout + r.stderr
        wait_for(lambda: not os.path.exists(self.control), 20, "the daemon to exit")


@pytest.fixture
def cli(tmp_path):
    c = Cli(tmp_path)
    yield c
    c.stop()


# ----------------------------------------------------------------------------- settings
@pytest.mark.fast
def test_settings_resolver_prefers_flag_then_env_then_omnid_toml_then_default(tmp_path):
    class Toml:
        control = tmp_path / "toml.sock"
        state_dir = tmp_path / "toml-state"
        health_listen = "127.0.0.2:9000"
        log_format = "console"

    env = {"OMNID_STATE_DIR": str(tmp_path / "env-state"), "OMNID_LOG_FORMAT": "json"}
    cfg = settings.resolve(units_dir=str(tmp_path), state_dir=str(tmp_path / "flag-state"), env=env,
                           stack_settings=Toml)
    assert cfg.state_dir == str(tmp_path / "flag-state") and cfg.source("state_dir") == "flag"
    assert cfg.log_format == "json" and cfg.source("log_format") == "env"
    assert cfg.control == str(tmp_path / "toml.sock") and cfg.source("control") == "omnid.toml"
    assert cfg.health_listen == "127.0.0.2:9000"
    cfg = settings.resolve(units_dir=str(tmp_path), env={}, stack_settings=None)
    assert cfg.health_listen == settings.DEFAULT_HEALTH and cfg.source("health_listen") == "default"
    assert cfg.control == os.path.abspath(settings.default_control())


def test_omnid_start_honours_omnid_toml_state_dir_and_log_format(tmp_path):
    state = tmp_path / "from-toml"
    control = str(tmp_path / "c.sock")
    stack = make_stack({"a": 'exec = ["sleep", "1000"]\n'},
                       settings=f'state_dir = "{state}"\nlog_format = "console"\n'
                                f'health_listen = "127.0.0.1:{free_port()}"\n')
    r = omnid("--control", control, "start", "-u", str(stack), "--timeout", "30")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        log = state / "daemon.log"
        assert log.exists(), f"daemon.log not in omnid.toml's state_dir; start said:\n{r.stdout}"
        assert oct(log.stat().st_mode & 0o777) == "0o600"
        # console format, not the JSON `omnid start` used to force
        assert not log.read_text().lstrip().startswith("{"), log.read_text()[:500]
    finally:
        assert omnid("--control", control, "stop").returncode == 0


# ----------------------------------------------------------------------------- omnid start
def test_start_of_a_fresh_daemon_runs_a_unit_that_fails_with_restart_no_once(tmp_path, cli):
    runs = tmp_path / "runs"
    prog = tmp_path / "fail.py"
    prog.write_text(f"open({str(runs)!r}, 'a').write('run\\n')\nraise SystemExit(3)\n")
    # ready = "notify": it fails while starting, before the stack could count it as up
    stack = make_stack({"bad": f'exec = ["{PY}", "{prog}"]\nrestart = "no"\nready = "notify"\n',
                        "good": 'exec = ["sleep", "1000"]\n'})
    for attempt in range(3):
        r = cli.start(stack)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "bad is failed" in r.stderr, r.stderr
        st = json.loads(cli("status", "--json").stdout)
        bad = next(u for u in st["units"] if u["name"] == "bad")
        assert runs.read_text().count("run") == attempt + 1, (attempt, runs.read_text(), r.stdout)
        assert bad["restarts"] == 0, bad
        cli.stop()


def test_start_with_another_stack_while_a_daemon_runs_is_exit_2_naming_both(tmp_path, cli):
    first = make_stack({"a": 'exec = ["sleep", "1000"]\n'})
    other = make_stack({"b": 'exec = ["sleep", "1000"]\n'})
    assert cli.start(first).returncode == 0
    r = cli.start(other)
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(first) in r.stderr and str(other) in r.stderr, r.stderr
    assert "ready" not in r.stdout
    # No -u means the demo stack (omnid(8)), not "whatever runs": refused the same (issue #28).
    r = cli("start", "--timeout", "30")
    assert r.returncode == 2 and str(first) in r.stderr, r.stdout + r.stderr
    r = cli("start", "a", "--timeout", "30")  # the running stack, by unit name
    assert r.returncode == 0 and "already active" in r.stdout, r.stdout + r.stderr


def test_start_progress_starts_from_a_snapshot_and_misses_no_unit(tmp_path, cli):
    stack = make_stack({"a": 'exec = ["sleep", "1000"]\n',
                        "b": 'exec = ["sleep", "1000"]\nrequires = ["a"]\n',
                        "c": 'exec = ["sleep", "1000"]\nrequires = ["b"]\n'})
    t0 = time.monotonic()
    proc = subprocess.Popen([PY, "-m", "omnid", "--control", cli.control, "start", "-u", str(stack),
                             "--state-dir", str(cli.state), "--health-listen", f"127.0.0.1:{cli.port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    first_progress = None
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if first_progress is None and line.startswith("  ["):
            first_progress = time.monotonic() - t0
    proc.wait(60)
    err = proc.stderr.read()  # type: ignore[union-attr]
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]
    out = "".join(lines)
    assert proc.returncode == 0, out + err
    print(f"time from `omnid start` to the first progress line: {first_progress:.3f} s")
    progress = [ln for ln in lines if ln.startswith("  [")]
    assert first_progress is not None and progress, out
    for name in ("a", "b", "c"):
        assert any(f"] {name}: " in ln for ln in progress), f"no progress for {name}:\n{out}"
        assert any(f"] {name}: active" in ln for ln in progress), f"{name} never shown active:\n{out}"


def test_daemon_start_failure_is_one_line_with_its_cause_and_the_log_path(tmp_path, cli):
    stack = make_stack({"a": 'exec = ["sleep", "1000"]\n'})
    cli.state.mkdir()
    # An earlier run's error must not be reported as this run's cause.
    (cli.state / "daemon.log").write_text(json.dumps({"event": "an earlier run's failure", "level": "error"}) + "\n")
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", cli.port))
        busy.listen(1)
        r = cli.start(stack)
    assert r.returncode == 1, r.stdout + r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1, r.stderr
    assert "health API cannot listen" in err[0] and "in use" in err[0], err[0]
    assert f"full log: {cli.state / 'daemon.log'}" in err[0]
    assert "earlier run" not in r.stderr and "{" not in r.stderr


def test_daemon_start_failure_for_an_unusable_state_dir_is_one_line(tmp_path, cli):
    stack = make_stack({"a": 'exec = ["sleep", "1000"]\n'})
    (tmp_path / "file").write_text("")
    cli.state = tmp_path / "file" / "state"  # below a regular file: ENOTDIR
    r = cli.start(stack)
    assert r.returncode == 1, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert str(cli.state) in r.stderr and "Not a directory" in r.stderr, r.stderr


def test_stop_with_no_daemon_exits_0_like_systemctl(tmp_path):
    r = omnid("--control", str(tmp_path / "none.sock"), "stop")
    assert r.returncode == 0 and "nothing to stop" in r.stderr, r.stderr
    assert omnid("--control", str(tmp_path / "none.sock"), "status").returncode == 3


def test_cli_kill_sends_a_numeric_signal_as_a_number(tmp_path):
    """A fake control server (not the daemon): what does `omnid kill -s 15` put on the wire?"""
    import threading

    import zmq

    path = str(tmp_path / "c.sock")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{path}")
    seen: list[dict] = []

    def serve() -> None:
        while router.poll(20000):
            ident, data = router.recv_multipart()
            req = json.loads(data)
            seen.append(req)
            router.send_multipart([ident, json.dumps({"id": req["id"], "ok": True, "result": {
                "signal": "SIGTERM", "signalled": ["a"]}}).encode()])
            return

    t = threading.Thread(target=serve)
    t.start()
    try:
        r = omnid("--control", path, "kill", "a", "-s", "15", timeout=30)
    finally:
        t.join(25)
        router.close(0)
        ctx.term()
    assert r.returncode == 0, r.stderr
    assert seen and seen[0]["args"]["signal"] == 15, seen


# ----------------------------------------------------------------------------- logs
def test_python_unit_print_reaches_logs_without_pythonunbuffered(tmp_path, daemon_factory):
    prog = tmp_path / "talk.py"
    prog.write_text("import time\nprint('hello from print', flush=False)\nwhile True: time.sleep(3600)\n")
    stack = make_stack({"talk": f'exec = ["{PY}", "{prog}"]\n'})
    d = Daemon(stack)
    d.env.pop("PYTHONUNBUFFERED", None)
    d.start()
    try:
        d.wait_state("talk", "active")
        lines = wait_for(lambda: d.ok("logs", {"unit": "talk", "n": 10})["talk"], 10,
                         "print() output in the unit's log")
        assert lines[0]["line"] == "hello from print" and lines[0]["stream"] and lines[0]["ts"] > 0
        r = omnid("--control", d.control, "logs", "talk", "--text")
        assert r.returncode == 0 and "[stdout] hello from print" in r.stdout, r.stdout + r.stderr
        assert r.stdout[:4].isdigit()  # a date first
        r = omnid("--control", d.control, "logs", "talk")  # not a TTY: text all the same (issue #28)
        assert "[stdout] hello from print" in r.stdout, r.stdout
        r = omnid("--control", d.control, "logs", "talk", "--json")
        item = json.loads(r.stdout.splitlines()[0])
        assert item["unit"] == "talk" and item["line"] == "hello from print" and "ts" in item
        r = omnid("--control", d.control, "logs", "talk", "--since", "1h", "--text")
        assert "hello from print" in r.stdout
        r = omnid("--control", d.control, "logs", "talk", "--since", str(time.time() + 60), "--text")
        assert "hello from print" not in r.stdout
    finally:
        d.close()


FLOOD = """
import os, sys
chunk = (b"y" * 65536) if sys.argv[1] == "chunks" else b"y\\n" * 32768
while True:
    os.write(1, chunk)
"""


def test_a_child_flooding_stdout_neither_stalls_health_nor_grows_the_daemon(tmp_path, daemon_factory):
    prog = tmp_path / "flood.py"
    prog.write_text(FLOOD)
    stack = make_stack({"lines": f'exec = ["{PY}", "{prog}", "lines"]\n',
                        "chunks": f'exec = ["{PY}", "{prog}", "chunks"]\n'})
    d = daemon_factory(stack)
    d.wait_all_active()
    import psutil

    me = psutil.Process(d.pid)
    rss0 = me.memory_info().rss
    lat = []
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        t = time.monotonic()
        code, _ = d.http("/health")  # a stalled loop would time out here (5 s)
        lat.append(time.monotonic() - t)
        assert code == 200
    lat.sort()
    worst, median = lat[-1], lat[len(lat) // 2]
    rss1 = me.memory_info().rss
    _, text = d.http("/metrics")
    dropped = [ln for ln in text.splitlines() if ln.startswith('omnid_unit_log_lines_dropped_total{unit="lines"}')]
    truncated = [ln for ln in text.splitlines()
                 if ln.startswith('omnid_unit_log_lines_truncated_total{unit="chunks"}')]
    print(f"{len(lat)} /health: median {median * 1000:.1f} ms, worst {worst * 1000:.1f} ms, daemon RSS {rss0 >> 20} -> {rss1 >> 20} MiB, {dropped}, {truncated}")
    # Latency figures belong to bench/log_flood.py; here: answered, and not crawling.
    # (A shared 2-core VM under load can stretch single requests; the median stays low
    # unless the loop is starved, as it was before reads were bounded: ~70 ms median.)
    assert median < 0.5, (median, worst)
    assert rss1 - rss0 < 64 << 20, (rss0, rss1)
    assert dropped and float(dropped[0].split()[-1]) > 0, dropped
    assert truncated and float(truncated[0].split()[-1]) > 0, truncated
    st = {u["name"]: u for u in d.ok("status")["units"]}
    assert st["lines"]["log"]["not_echoed"] > 0 and st["chunks"]["log"]["truncated"] > 0, st
    r = subprocess.run([PY, "-m", "omnid", "--control", d.control, "status", "lines"], capture_output=True,
                       text=True, timeout=30, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert "not echoed (rate limit)" in r.stdout, r.stdout + r.stderr
    tail = d.ok("logs", {"unit": "chunks", "n": 3})["chunks"]
    assert all(len(i["line"]) <= 16 * 1024 for i in tail)


def test_daemon_log_rotates_by_size_and_stays_private(tmp_path):
    from omnid.base import logconfig

    path = tmp_path / "daemon.log"
    code = (f"import os, sys\n"
            f"fd = os.open({str(path)!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)\n"
            f"os.dup2(fd, 2); os.dup2(fd, 1)\n"
            f"from omnid.base import logconfig\n"
            f"logconfig.configure('json', log_file={str(path)!r}, max_bytes=20000)\n"
            f"import structlog\n"
            f"log = structlog.get_logger('t')\n"
            f"for i in range(2000): log.info('line', i=i)\n")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    old = path.with_name("daemon.log.1")
    assert old.exists()
    assert path.stat().st_size < 40000 and old.stat().st_size < 40000
    assert path.stat().st_mode & 0o777 == 0o600 and old.stat().st_mode & 0o077 == 0
    assert '"i": 1999' in path.read_text()
    assert logconfig.LOG_MAX_BYTES > 0


# ----------------------------------------------------------------------------- status / events
def test_status_shows_uptime_memory_cpu_tasks_and_detail_view_with_log_lines(tmp_path, daemon_factory):
    prog = tmp_path / "talk.py"
    prog.write_text("import time\nprint('detail line', flush=True)\nwhile True: time.sleep(3600)\n")
    d = daemon_factory(make_stack({"talk": f'exec = ["{PY}", "{prog}"]\ndescription = "talker"\n'}))
    d.wait_state("talk", "active")
    wait_for(lambda: d.ok("logs", {"unit": "talk", "n": 1})["talk"], 10, "the unit's first line")
    r = omnid("--control", d.control, "status")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("TIER"))  # below the verdict (issue #28)
    header, row = lines[at:at + 2]
    for col in ("UPTIME", "MEM", "CPU", "TASKS", "GPU", "LAST EXIT", "REASON"):
        assert col in header
    mem = row[header.index("MEM"):].split()[0]
    assert "M" in mem or "K" in mem, row  # RSS of a live python
    assert "\x1b[" not in r.stdout  # no colours into a pipe
    r = omnid("--control", d.control, "status", "talk")
    assert r.returncode == 0, r.stderr
    assert "talk - talker" in r.stdout and "Main PID:" in r.stdout and "Memory:" in r.stdout
    assert "detail line" in r.stdout


def test_events_prints_the_current_state_first_then_changes(tmp_path, daemon_factory):
    d = daemon_factory(make_stack({"a": 'exec = ["sleep", "1000"]\nrestart = "always"\nrestart_sec = 0.1\n'}))
    d.wait_state("a", "active")
    proc = subprocess.Popen([PY, "-m", "omnid", "--control", d.control, "events", "--json"], stdout=subprocess.PIPE,
                            text=True, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        first = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert first["unit"] == "a" and first["to"] == "active" and first.get("current") is True, first
        pid = d.unit("a")["pid"]
        os.kill(pid, 9)
        nxt = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert nxt["unit"] == "a" and not nxt.get("current"), nxt
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()  # type: ignore[union-attr]


def test_every_option_has_help_and_version_prints():
    from omnid.cli.main import build_parser

    p = build_parser()
    missing = []
    for action in p._actions:
        if action.help is None and action.option_strings:
            missing.append(str(action.option_strings))
    for name, sp in p._subparsers._group_actions[0].choices.items():  # type: ignore[union-attr]
        for action in sp._actions:
            if action.help is None:
                missing.append(f"{name} {action.option_strings or action.dest}")
    assert not missing, missing
    r = omnid("--version")
    assert r.returncode == 0 and r.stdout.startswith("omnid ")


# ----------------------------------------------------------------------------- omnid check
def test_check_warns_for_missing_executable_unknown_user_group_and_missing_cwd(tmp_path):
    stack = make_stack({
        "a": 'exec = ["/nonexistent/bin/engine"]\nuser = "no-such-user-omnid"\n',
        "b": 'exec = ["no-such-program-omnid"]\ngroup = "no-such-group-omnid"\ncwd = "/nonexistent/dir"\n',
        "c": 'exec = ["sleep", "1"]\n',
    })
    r = omnid("check", "-u", str(stack))
    assert r.returncode == 0, r.stderr
    for needle in ("/nonexistent/bin/engine", "no-such-user-omnid", "no-such-program-omnid",
                   "no-such-group-omnid", "/nonexistent/dir"):
        assert needle in r.stderr, r.stderr
    assert r.stderr.count("warning:") == 5 and "c.toml" not in r.stderr
    r = omnid("check", "--this-host", "-u", str(stack))
    assert r.returncode == 2 and r.stderr.count("error:") == 5, r.stderr


# ----------------------------------------------------------------------------- systemd
class NotifyListener:
    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []

    def drain(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except (socket.timeout, BlockingIOError):
                return self.messages

    def has(self, prefix: str) -> bool:
        return any(line.startswith(prefix) for m in self.drain() for line in m.split("\n"))

    def lines(self) -> list[str]:
        return [line for m in self.drain() for line in m.split("\n")]


def slow_notifier(tmp_path: Path, delay_s: float) -> Path:
    """A `ready = "notify"` unit's program that says READY=1 after `delay_s`, then idles."""
    slow = tmp_path / "slow.py"
    slow.write_text(f"import os, socket, time\ntime.sleep({delay_s})\n"
                    "a = os.environ['NOTIFY_SOCKET']\na = '\\0' + a[1:] if a.startswith('@') else a\n"
                    "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\ns.sendto(b'READY=1', a)\n"
                    "while True: time.sleep(3600)\n")
    return slow


def test_daemon_notifies_systemd_status_ready_watchdog_extend_and_stopping_in_order(tmp_path):
    listener = NotifyListener(str(tmp_path / "notify"))
    slow = slow_notifier(tmp_path, 2.5)
    stack = make_stack({"fast": 'exec = ["sleep", "1000"]\n',
                        "slow": f'exec = ["{PY}", "{slow}"]\nready = "notify"\n'})
    d = Daemon(stack, env={"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "400000"})
    d.start()
    try:
        wait_for(lambda: listener.has("READY=1"), 20, f"READY=1 (got {listener.messages}, log {d.log()[-2000:]})")
        units = d.units()
        assert all(u["state"] == "active" for u in units.values()), units
        wait_for(lambda: sum(ln == "WATCHDOG=1" for ln in listener.lines()) >= 3, 5, "WATCHDOG=1 pings")
    finally:
        d.close()
    lines = listener.lines()
    listener.sock.close()
    print(lines)
    first = lambda prefix: next(i for i, ln in enumerate(lines) if ln.startswith(prefix))  # noqa: E731
    assert first("STATUS=starting") < first("EXTEND_TIMEOUT_USEC=") < first("READY=1") < first("STOPPING=1")
    assert any(ln.startswith("STATUS=ready: 2/2 units active") for ln in lines), lines
    # once: the slow unit's own READY=1 went to the daemon's socket, never to systemd's
    assert lines.count("READY=1") == 1


def test_a_service_manager_that_does_not_read_stops_neither_the_loop_nor_loses_ready(tmp_path):
    """sd_notify's socket holds ten datagrams. A manager that stops reading it (busy, stuck)
    once had the daemon's loop wait in sendto() at its next ping: no death seen, /health and
    the control socket silent until the manager read again. Here the queue is full (filled
    here, until the kernel refuses one more) before the stack settles: the daemon still
    answers, /health still shows a death, and READY=1, held meanwhile, arrives once the
    manager reads."""
    listener = NotifyListener(str(tmp_path / "notify"))
    slow = slow_notifier(tmp_path, 1.5)
    stack = make_stack({"slow": f'exec = ["{PY}", "{slow}"]\nready = "notify"\n',
                        "victim": 'exec = ["sleep", "1000"]\nrestart = "no"\n'})
    stuffing = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    while True:  # full before the daemon starts: everything it says must wait
        try:
            stuffing.sendto(b"STUFFING", socket.MSG_DONTWAIT, listener.path)
        except BlockingIOError:
            break
    d = Daemon(stack, env={"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "1000000"})  # a ping each 0.5 s
    try:
        d.start()
        d.wait_state("slow", "active")  # the stack settled: READY=1 is due while nothing can go
        victim = d.wait_state("victim", "active")["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: d.http("/health")[0] == 503, 10, "/health to show the death while systemd does not read")
        wait_for(lambda: listener.has("READY=1"), 10, lambda: f"READY=1 once systemd reads (got {listener.messages})")
        wait_for(lambda: sum(ln == "WATCHDOG=1" for ln in listener.lines()) >= 3, 5, "the pings again")
    finally:
        stuffing.close()
        d.close()
        listener.sock.close()
    assert "the service manager does not read its notify socket" in d.closed_log, d.closed_log[-2000:]


def test_systemd_analyze_verify_accepts_the_unit_file(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd; .ci/run installs it)")
    exe = shutil.which("omnid", path=os.path.dirname(PY) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        pytest.skip("no `omnid` executable installed in the test environment (pip install .)")
    text = (REPO / "packaging" / "omnid.service").read_text()
    assert "Type=notify" in text
    unit = tmp_path / "omnid.service"
    unit.write_text(text.replace("/usr/local/bin/omnid", exe))
    # Documentation=man:... is checked with man(1): lay the pages out as `pip install .` does.
    man = tmp_path / "man"
    for page in (REPO / "man").glob("omnid*.[0-9]"):
        (man / f"man{page.suffix[1:]}").mkdir(parents=True, exist_ok=True)
        shutil.copy(page, man / f"man{page.suffix[1:]}" / page.name)
    r = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, MANPATH=f"{man}:"))
    # Only lines about our file count: a container's systemd may complain about its own units.
    ours = [ln for ln in (r.stdout + r.stderr).splitlines() if "omnid.service" in ln]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr


# ----------------------------------------------------------------------------- metrics
def test_promtool_check_metrics_is_clean_after_deaths_restarts_and_failures(tmp_path, daemon_factory):
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    d = daemon_factory(make_stack({
        "flappy": 'exec = ["sleep", "1000"]\nrestart = "always"\nrestart_sec = 0.1\n',
        "broken": 'exec = ["false"]\nrestart = "no"\n',
    }))
    d.wait_state("flappy", "active")
    for _ in range(2):
        pid = d.unit("flappy")["pid"]
        os.kill(pid, 9)
        wait_for(lambda: (u := d.unit("flappy"))["state"] == "active" and u["pid"] != pid, 10, "flappy back")
    d.wait_state("broken", "failed")
    _, text = d.http("/metrics")
    assert 'omnid_death_detection_seconds_count{unit="flappy"} 2' in text, text
    assert 'omnid_unit_restarts_total{unit="flappy"} 2' in text
    assert "omnid_death_detection_ms" not in text
    r = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


# ----------------------------------------------------------------------------- man pages
MANS = sorted((REPO / "man").glob("omnid*.[0-9]"))


@pytest.mark.parametrize("page", MANS, ids=lambda p: p.name)
def test_man_page_is_mandoc_lint_clean(page):
    tool = shutil.which("mandoc")
    if tool is None:
        pytest.skip("mandoc is not installed (Debian package mandoc; .ci/run installs it)")
    r = subprocess.run([tool, "-Tlint", "-W", "warning", str(page)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_pip_install_puts_the_man_pages_under_share_man(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info next to pyproject.toml.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("omnid", "man"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                        str(src)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named pip" in r.stderr:
        pytest.skip("no pip in this interpreter")
    assert r.returncode == 0, r.stdout + r.stderr
    import zipfile

    wheel = next(tmp_path.glob("omnid-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for sect, page in (("man8", "omnid.8"), ("man5", "omnid.unit.5"), ("man7", "omnid-control.7")):
        assert any(n.endswith(f".data/data/share/man/{sect}/{page}") for n in names), names


@pytest.mark.fast
def test_units_readme_points_nowhere_outside_the_repo():
    text = (REPO / "units" / "README.md").read_text()
    assert "../shared" not in text and "/work/" not in text


def test_harness_removes_its_temp_dirs_at_exit(tmp_path):
    code = ("from tests.harness import make_stack, Daemon\n"
            "s = make_stack({'a': 'exec = [\"x\"]'})\nd = Daemon(s)\nprint(s, d.workdir)\n")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, cwd=str(REPO),
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    made = r.stdout.split()
    assert len(made) == 2 and all(p.startswith("/tmp/om") for p in made)
    assert not any(os.path.exists(p) for p in made), made



def test_logs_tell_stdout_from_stderr(tmp_path, daemon_factory):
    prog = tmp_path / "both.py"
    prog.write_text("import sys, time\nprint('to stdout', flush=True)\n"
                    "print('to stderr', file=sys.stderr, flush=True)\nwhile True: time.sleep(3600)\n")
    d = daemon_factory(make_stack({"both": f'exec = ["{PY}", "{prog}"]\n'}))
    d.wait_state("both", "active")
    lines = wait_for(lambda: (got := d.ok("logs", {"unit": "both", "n": 10})["both"]) and len(got) >= 2 and got,
                     10, f"both lines in the unit's log (log:\n{d.log()[-2000:]})")
    streams = {item["line"]: item["stream"] for item in lines}
    assert streams == {"to stdout": "stdout", "to stderr": "stderr"}, lines
