"""One small adapter per supervisor: write config, launch, list children,
kill one child, stop, watch the supervisor's own event notifications.

Every adapter runs the same child program (bench/child.c) with the same
flags; only the supervisor differs. Peers run with their documented defaults,
except where a default would measure something else than the figure asks
(listed in README.md, "Peer configuration").
"""
from __future__ import annotations

import http.client
import json
import math
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .common import (BENCH_DIR, REPO_DIR, Janitor, Stamps, alive, cmdline_has,
                     free_port, log, now_ns, read_environ)

VENVS = BENCH_DIR / ".venvs"


class Unavailable(Exception):
    """The supervisor cannot be benchmarked here (not installed, not built)."""


@dataclass
class Program:
    name: str = "w"
    n: int = 1
    flags: list[str] = field(default_factory=list)  # child flags: -i, -g, -d MS
    stop_timeout: float = 10.0
    restart: bool = False
    # peers: turn on their options for signalling a child's own children
    # (residue figures only: Circus's costs a /proc scan per child on every stop)
    group_kill: bool = False


@dataclass
class Ctx:
    """What every adapter needs from the harness."""
    child: list[str]   # argv prefix of the child program
    janitor: Janitor
    max_sec: int       # child safety-net lifetime
    peers_python: str  # interpreter used to create the peers' venvs


# ------------------------------------------------------------------ events

class EventWatch:
    """Collects (receive time ns, event dict) from a supervisor in a thread."""

    def __init__(self):
        self.events: list[tuple[int, dict]] = []
        self.cond = threading.Condition()
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.connected = threading.Event()

    def start(self) -> "EventWatch":
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop_flag.set()
        self.thread.join(timeout=2)

    def _add(self, ts: int, ev: dict) -> None:
        with self.cond:
            self.events.append((ts, ev))
            self.cond.notify_all()

    def wait_for(self, pred, after_ns: int, timeout: float) -> tuple[int, dict] | None:
        end = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for ts, ev in self.events[seen:]:
                    if ts >= after_ns and pred(ev):
                        return ts, ev
                seen = len(self.events)
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(min(left, 0.1))

    def _run(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class ZmqSubWatch(EventWatch):
    def __init__(self, endpoint: str, topic: bytes = b""):
        super().__init__()
        self.endpoint, self.topic = endpoint, topic

    def _run(self) -> None:
        import zmq
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self.connected.set()
        try:
            while not self.stop_flag.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                ts = now_ns()
                ev = {"_topic": frames[0].decode(errors="replace") if len(frames) > 1 else ""}
                try:
                    body = json.loads(frames[-1])
                except ValueError:
                    body = {"_raw": frames[-1][:200].decode(errors="replace")}
                if isinstance(body, dict):
                    ev.update(body)
                else:
                    ev["_body"] = body
                self._add(ts, ev)
        finally:
            sub.close(0)


class UnixDgramWatch(EventWatch):
    """Receives the datagrams sent by bench/sd_listener.py."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)

    def _run(self) -> None:
        try:
            while not self.stop_flag.is_set():
                try:
                    data = self.sock.recv(65536)
                except socket.timeout:
                    continue
                recv = now_ns()
                try:
                    ev = json.loads(data)
                except ValueError:
                    continue
                if ev.get("hello"):
                    self.connected.set()
                    continue
                ev["_recv_ns"] = recv
                # the listener's own read time is the notification time
                self._add(int(ev.get("ts", recv)), ev)
        finally:
            self.sock.close()


# ------------------------------------------------------------------ base

class Adapter:
    name = "base"
    supports_health = False
    # Periods (seconds) of the supervisor's own timers: samples whose latency
    # depends on where in that period the trigger falls are taken at a
    # uniformly random phase (see scenarios.jitter).
    tick_s = 0.0       # the timer that notices a child's death
    stop_tick_s = 0.0  # the timer that acts on a stop request (SIGTERM)
    # A child that dies younger than this is restarted only after a pause the
    # supervisor imposes by design (runsv: 1 s); death samples let it get older.
    min_uptime_s = 0.0
    has_events = True  # the supervisor publishes its own death notifications

    def __init__(self, ctx: Ctx, workdir: Path):
        self.ctx = ctx
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stamps = Stamps(self.dir / "st")
        self.token = str(self.stamps.dir)
        self.proc: subprocess.Popen | None = None
        self.logf = None
        self.watch: EventWatch | None = None

    # -- installation ------------------------------------------------------
    @classmethod
    def prepare(cls, ctx: Ctx) -> dict:
        """Make sure the supervisor can run; return version info."""
        return {}

    # -- config ------------------------------------------------------------
    def child_argv(self, prog: Program) -> list[str]:
        return [*self.ctx.child, "-s", self.token, "-m", str(self.ctx.max_sec), *prog.flags]

    def write_config(self, programs: list[Program], events: bool = False) -> None:
        raise NotImplementedError

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        return env

    # -- lifecycle ---------------------------------------------------------
    def launch(self) -> int:
        """Start the supervisor; returns the launch time (monotonic ns)."""
        self.logf = open(self.dir / f"{self.name}.out", "wb")
        t0 = now_ns()
        self.proc = self.ctx.janitor.spawn(self.argv(), stdout=self.logf,
                                           stderr=subprocess.STDOUT, env=self.env(),
                                           cwd=str(self.dir))
        return t0

    def settle(self, timeout: float = 10.0) -> bool:
        """Wait until the supervisor itself considers the stack up (peers:
        their children are RUNNING as soon as spawned, nothing to wait for)."""
        return True

    def stop(self) -> int:
        """Graceful stop of everything (the supervisor exits); returns t0 ns."""
        t0 = now_ns()
        os.kill(self.proc.pid, signal.SIGTERM)
        return t0

    def own_pids(self) -> list[int]:
        """The supervisor's own processes whose exit ends its stop (the main one; runit: and
        every runsv, which outlive runsvdir until their service is down)."""
        return [self.proc.pid]

    def kill_supervisor(self) -> int:
        t0 = now_ns()
        os.kill(self.proc.pid, signal.SIGKILL)
        return t0

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if self.watch:
            self.watch.close()
            self.watch = None
        if self.logf:
            self.logf.close()
            self.logf = None

    # -- processes -----------------------------------------------------------
    def _descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def is_child(self, pid: int) -> bool:
        """The benchmark's child program (not one of the supervisor's own processes)."""
        return cmdline_has(pid, self.token)

    def children(self) -> list[int]:
        """Live child programs under the supervisor, from /proc."""
        return [p.pid for p in self._descendants()
                if alive(p.pid) and self.is_child(p.pid)]

    def supervisor_pids(self) -> list[int]:
        """The supervisor's own processes (main + helpers, not the children)."""
        out = [self.proc.pid]
        for p in self._descendants():
            if alive(p.pid) and not self.is_child(p.pid):
                out.append(p.pid)
        return out

    def kill_child(self, pid: int) -> int:
        t0 = now_ns()
        os.kill(pid, signal.SIGKILL)
        return t0

    # -- events ----------------------------------------------------------------
    def start_watch(self) -> EventWatch:
        raise NotImplementedError

    def death_pred(self, pid: int, unit: str | None):
        raise NotImplementedError

    def unit_of(self, pid: int) -> str | None:
        return None


# ------------------------------------------------------------------ peers

def _venv_tool(venv: str, pkg: str, tool: str, ctx: Ctx) -> tuple[Path, str]:
    """Create bench/.venvs/<venv> with <pkg> from PyPI if missing; return
    (path of tool, installed version). Never touches the project's venv."""
    vdir = VENVS / venv
    exe = vdir / "bin" / tool
    py = vdir / "bin" / "python"
    if not exe.exists():
        log(f"installing {pkg} into {vdir}")
        VENVS.mkdir(parents=True, exist_ok=True)
        subprocess.run([ctx.peers_python, "-m", "venv", "--clear", str(vdir)], check=True, timeout=300)
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", pkg],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0 or not exe.exists():
            raise Unavailable(f"pip install {pkg} failed: {r.stderr[-2000:]}")
    r = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({pkg!r}))"],
                       capture_output=True, text=True, timeout=60)
    return exe, r.stdout.strip()


class Supervisord(Adapter):
    name = "supervisord"
    # runforever(): poll(timeout=1); signals and reaping are handled after it
    tick_s = 1.0
    stop_tick_s = 1.0

    @classmethod
    def prepare(cls, ctx: Ctx) -> dict:
        exe, ver = _venv_tool("supervisor", "supervisor", "supervisord", ctx)
        cls.exe = exe
        cls.python = str(exe.parent / "python")
        return {"version": ver, "exe": str(exe)}

    def write_config(self, programs: list[Program], events: bool = False) -> None:
        d = self.dir
        (d / "logs").mkdir(exist_ok=True)
        lines = [
            "[unix_http_server]", f"file={d}/sv.sock", "",
            "[supervisord]", "nodaemon=true", f"logfile={d}/supervisord.log",
            f"pidfile={d}/supervisord.pid", f"childlogdir={d}/logs", "minfds=8192", "",
            "[rpcinterface:supervisor]",
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface", "",
            "[supervisorctl]", f"serverurl=unix://{d}/sv.sock", "",
        ]
        for p in programs:
            lines += [
                f"[program:{p.name}]",
                "command=" + " ".join(self.child_argv(p)),
                f"numprocs={p.n}",
                "process_name=%(program_name)s_%(process_num)d",
                "autostart=true",
                f"autorestart={'true' if p.restart else 'false'}",
                "startsecs=0",          # RUNNING as soon as spawned, like omnid ready=started
                "stopsignal=TERM",
                f"stopwaitsecs={max(1, math.ceil(p.stop_timeout))}",
                f"stopasgroup={'true' if p.group_kill else 'false'}",
                f"killasgroup={'true' if p.group_kill else 'false'}",
                "",
            ]
        if events:
            self.ev_path = d / "ev.sock"
            lines += [
                "[eventlistener:benchev]",
                f"command={self.python} {BENCH_DIR / 'sd_listener.py'} {self.ev_path}",
                "events=PROCESS_STATE",
                "buffer_size=1024",
                "",
            ]
        (d / "supervisord.conf").write_text("\n".join(lines))

    def argv(self) -> list[str]:
        return [str(self.exe), "-n", "-c", str(self.dir / "supervisord.conf")]

    def start_watch(self) -> EventWatch:
        self.watch = UnixDgramWatch(self.ev_path).start()
        return self.watch

    def death_pred(self, pid: int, unit: str | None):
        def pred(ev: dict) -> bool:
            return (ev.get("event") == "PROCESS_STATE_EXITED"
                    and ev.get("payload", {}).get("pid") == str(pid))
        return pred


class Circus(Adapter):
    name = "circus"
    tick_s = 5.0  # [circus] check_delay default: reaping / respawn happen on this timer
    stop_tick_s = 0.0  # SIGTERM is handled by the event loop at once

    @classmethod
    def prepare(cls, ctx: Ctx) -> dict:
        exe, ver = _venv_tool("circus", "circus", "circusd", ctx)
        cls.exe = exe
        return {"version": ver, "exe": str(exe)}

    def write_config(self, programs: list[Program], events: bool = False) -> None:
        d = self.dir
        lines = [
            "[circus]",
            f"endpoint = ipc://{d}/ctl",
            f"pubsub_endpoint = ipc://{d}/pub",
            "statsd = false",
            "",
        ]
        for p in programs:
            argv = self.child_argv(p)
            lines += [
                f"[watcher:{p.name}]",
                f"cmd = {argv[0]}",
                "args = " + " ".join(argv[1:]),
                f"numprocesses = {p.n}",
                f"graceful_timeout = {p.stop_timeout}",
                "stop_signal = TERM",
                f"stop_children = {'true' if p.group_kill else 'false'}",
                f"respawn = {'true' if p.restart else 'false'}",
                "warmup_delay = 0",
                "",
            ]
        (d / "circus.ini").write_text("\n".join(lines))

    def argv(self) -> list[str]:
        return [str(self.exe), str(self.dir / "circus.ini")]

    def start_watch(self) -> EventWatch:
        self.watch = ZmqSubWatch(f"ipc://{self.dir}/pub", b"watcher.").start()
        return self.watch

    def death_pred(self, pid: int, unit: str | None):
        def pred(ev: dict) -> bool:
            return ev.get("_topic", "").endswith(".reap") and ev.get("process_pid") == pid
        return pred


class Runit(Adapter):
    """runit from the Debian package: runsvdir starts one runsv per service
    directory, runsv forks and execs the service's ./run and restarts it.

    ./run is a symlink to the child program itself (its arguments in ./args,
    see child.c), not the usual `#!/bin/sh exec ...` script: runit's best case,
    no shell exec on the spawn path. runit has no event stream (no death
    notification figure) and no stop timeout of its own: `sv -w T
    force-shutdown` is its documented "TERM, wait T, KILL". runsv restarts
    every ./run that exits (`restart = no` would need `sv once` per service);
    in these figures only the death figure's children exit on their own, and
    that one restarts on every supervisor."""

    name = "runit"
    tick_s = 0.0       # runsv waits on SIGCHLD (self-pipe), no timer
    stop_tick_s = 0.0
    min_uptime_s = 1.0  # runsv(8): "If ./run exits immediately, runsv waits a second"
    has_events = False

    @classmethod
    def prepare(cls, ctx: Ctx) -> dict:
        import shutil
        missing = [t for t in ("runsvdir", "runsv", "sv") if shutil.which(t) is None]
        if missing:
            raise Unavailable(f"{', '.join(missing)} not found (Debian: apt-get install runit)")
        r = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "runit"], capture_output=True,
                           text=True, timeout=30)
        return {"version": r.stdout.strip() or "?", "exe": shutil.which("runsvdir")}

    def write_config(self, programs: list[Program], events: bool = False) -> None:
        svc = self.dir / "service"
        svc.mkdir(exist_ok=True)
        self._services: list[Path] = []
        self._stop_timeout = max((p.stop_timeout for p in programs), default=10.0)
        exe = Path(self.ctx.child[0]).resolve()
        self._child_exe = str(exe)
        direct = len(self.ctx.child) == 1  # the C child; the Python one needs its interpreter
        for p in programs:
            for i in range(p.n):
                d = svc / f"{p.name}-{i}"
                d.mkdir()
                argv = self.child_argv(p)
                if direct:
                    (d / "args").write_text("".join(a + "\n" for a in argv[1:]))
                    (d / "run").symlink_to(exe)
                else:
                    (d / "run").write_text("#!/bin/sh\nexec " + " ".join(argv) + "\n")
                    (d / "run").chmod(0o755)
                self._services.append(d)
        # runsvdir does not trust a directory modified within the current second
        # and scans it again a second later; a real service directory is older
        # than its runsvdir, so date it back (runit's best case, as in production).
        past = time.time() - 5
        os.utime(svc, (past, past))

    def argv(self) -> list[str]:
        return ["runsvdir", str(self.dir / "service")]

    def is_child(self, pid: int) -> bool:
        if len(self.ctx.child) > 1:
            return cmdline_has(pid, self.token)
        try:
            return os.readlink(f"/proc/{pid}/exe") == self._child_exe
        except OSError:
            return False

    def stop(self) -> int:
        """SIGHUP to runsvdir: it sends TERM to every runsv, which TERMs (and CONTs)
        its service and does not restart it (`x`); runsvdir exits and restarts no
        runsv. `sv -w T force-shutdown` in the background adds the KILL after T."""
        t0 = now_ns()
        os.kill(self.proc.pid, signal.SIGHUP)
        self._sv = self.ctx.janitor.spawn(
            ["sv", "-w", str(max(1, math.ceil(self._stop_timeout))), "force-shutdown",
             *map(str, self._services)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return t0

    def wait_exit(self, timeout: float) -> int | None:
        rc = super().wait_exit(timeout)
        sv = getattr(self, "_sv", None)
        if sv is not None:
            try:
                sv.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                pass
        if rc is None:
            return None
        # runsvdir exits at once on HUP; the stop is over when every runsv is gone.
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not [p for p in self._descendants() if alive(p.pid) and not self.is_child(p.pid)
                    and p.pid != getattr(sv, "pid", None)]:
                break
            time.sleep(0.02)
        return rc

    def own_pids(self) -> list[int]:
        return [self.proc.pid, *(p.pid for p in self._descendants() if alive(p.pid) and not self.is_child(p.pid))]

    def _descendants(self) -> list[psutil.Process]:
        # runsv processes outlive runsvdir (re-parented to the harness, a subreaper)
        # until their service is down: look under the harness too.
        out = super()._descendants()
        if out or self.proc is None or self.proc.poll() is None:
            return out
        mine = set()
        try:
            for p in psutil.Process().children(recursive=True):
                try:
                    if self.dir.as_posix() in " ".join(p.cmdline()) or (
                            p.cwd().startswith(str(self.dir))):
                        mine.add(p)
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        return list(mine)

    def start_watch(self) -> EventWatch:
        self.watch = _NoEvents().start()
        return self.watch

    def death_pred(self, pid: int, unit: str | None):
        return lambda ev: False


class _NoEvents(EventWatch):
    """For a supervisor without notifications: connected at once, never an event."""

    def _run(self) -> None:
        self.connected.set()
        self.stop_flag.wait()


# ------------------------------------------------------------------ omnid

class Omnid(Adapter):
    name = "omnid"
    supports_health = True
    # event-driven by design (pidfds, signals in the loop): tick 0, jitter() still
    # applies a minimum random phase as a guard against a hidden timer
    exe: Path = REPO_DIR / ".venv" / "bin" / "omnid"
    restart_sec: str = "0"
    pin_backoff: bool = True
    # The peers run at the nice value they were started with: so does omnid here, so that the
    # ratios compare the code, not the scheduler's weights (omnid's default is 10 steps ahead).
    settings: str = "daemon_nice = 0\n"

    @classmethod
    def prepare(cls, ctx: Ctx) -> dict:
        exe = Path(os.environ.get("OMNID_BENCH_EXE", cls.exe))
        if not exe.exists():
            raise Unavailable(f"{exe} not found")
        r = subprocess.run([str(exe), "daemon", "--help"], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise Unavailable(f"`omnid daemon --help` failed (rc={r.returncode}): "
                              f"{(r.stderr or r.stdout).strip()[-500:]}")
        cls.exe = exe
        # As pip installs it: with bytecode. An editable install has none, and with
        # PYTHONDONTWRITEBYTECODE set every daemon start would compile omnid from source
        # (~80 ms on 2 cores) while the peers, pip-installed, load theirs compiled.
        py = exe.parent / "python"
        if py.exists():
            r = subprocess.run([str(py), "-c", "import omnid, os; print(os.path.dirname(omnid.__file__))"],
                               capture_output=True, text=True, timeout=60, cwd="/")
            if r.returncode == 0 and r.stdout.strip():
                subprocess.run([str(py), "-m", "compileall", "-q", r.stdout.strip()], capture_output=True,
                               timeout=300, cwd="/")
        # The peers restart a dead child at once, every time. omnid: the smallest
        # restart_sec the validator accepts, and its exponential backoff pinned
        # (restart_max_sec = restart_sec) so the 30th restart is not 2^29 x slower.
        import tempfile
        with tempfile.TemporaryDirectory(prefix="omnid-bench-check-") as td:
            found = False
            for pin in (True, False):
                for rs in ("0", "0.001", "0.01", "0.1", "1"):
                    extra = f"restart_max_sec = {rs}\n" if pin else ""
                    (Path(td) / "w.toml").write_text(
                        f'exec = ["/bin/true"]\ntitle = ""\nrestart = "always"\nrestart_sec = {rs}\n{extra}'
                        'start_limit_burst = 1000000\nstart_limit_interval = 1\n')
                    c = subprocess.run([str(exe), "check", "-u", td], capture_output=True,
                                       text=True, timeout=60)
                    if c.returncode == 0:
                        cls.restart_sec, cls.pin_backoff, found = rs, pin, True
                        break
                if found:
                    break
            if not found:
                raise Unavailable(f"`omnid check` rejects the bench unit: {(c.stderr or c.stdout)[-500:]}")
        v = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
        ver = (v.stdout or v.stderr).strip() if v.returncode == 0 else ""
        if not ver:
            try:
                import importlib.metadata as m
                ver = m.version("omnid")
            except Exception:
                ver = "?"
        return {"version": ver, "exe": str(exe), "restart_sec": cls.restart_sec,
                "restart_max_sec": cls.restart_sec if cls.pin_backoff else "default"}

    def __init__(self, ctx: Ctx, workdir: Path):
        super().__init__(ctx, workdir)
        self.control = self.dir / "ctl.sock"
        self.port = free_port()
        self._http: http.client.HTTPConnection | None = None

    @staticmethod
    def _toml_str(s: str) -> str:
        return json.dumps(s)  # a JSON string is a valid TOML basic string

    def write_config(self, programs: list[Program], events: bool = False) -> None:
        stack = self.dir / "stack"
        stack.mkdir(exist_ok=True)
        (self.dir / "state").mkdir(exist_ok=True)
        for p in programs:
            argv = ", ".join(self._toml_str(a) for a in self.child_argv(p))
            body = [
                f"exec = [{argv}]",
                'title = ""',  # exec the argv as is (no title runner for a Python child)
                f"instances = {p.n}",
                f"stop_timeout = {p.stop_timeout}",
                f'restart = "{"always" if p.restart else "no"}"',
                f"restart_sec = {self.restart_sec}",
                *([f"restart_max_sec = {self.restart_sec}"] if self.pin_backoff else []),
                "start_limit_burst = 1000000",
                "start_limit_interval = 1",
            ]
            (stack / f"{p.name}.toml").write_text("\n".join(body) + "\n")
        if self.settings:
            (stack / "omnid.toml").write_text(self.settings)

    def env(self) -> dict[str, str]:
        env = super().env()
        env["OMNID_CONTROL"] = str(self.control)
        return env

    def argv(self) -> list[str]:
        return [str(self.exe), "--control", str(self.control), "daemon",
                "-u", str(self.dir / "stack"), "--state-dir", str(self.dir / "state"),
                "--health-listen", f"127.0.0.1:{self.port}", "--log-format", "json"]

    def cli(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.exe), "--control", str(self.control), *args],
                              capture_output=True, text=True, timeout=timeout, env=self.env())

    # -- health --------------------------------------------------------------
    def health(self, timeout: float = 2.0) -> int | None:
        """GET /health over a kept-alive connection; status code or None."""
        for _ in range(2):
            try:
                if self._http is None:
                    self._http = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
                self._http.request("GET", "/health")
                r = self._http.getresponse()
                r.read()
                return r.status
            except (OSError, http.client.HTTPException):
                if self._http is not None:
                    self._http.close()
                self._http = None
        return None

    def wait_health(self, code: int, timeout: float, interval: float = 0.002) -> int | None:
        """Poll /health until it answers `code`; monotonic ns of that answer."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.health() == code:
                return now_ns()
            time.sleep(interval)
        return None

    def settle(self, timeout: float = 10.0) -> bool:
        return self.wait_health(200, timeout, interval=0.02) is not None

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
        super().close()

    # -- events --------------------------------------------------------------
    def start_watch(self) -> EventWatch:
        self.watch = ZmqSubWatch(f"ipc://{self.control}.events").start()
        return self.watch

    def unit_of(self, pid: int) -> str | None:
        return read_environ(pid).get("OMNID_UNIT")

    def death_pred(self, pid: int, unit: str | None):
        def pred(ev: dict) -> bool:
            if ev.get("from") not in ("active", "starting"):
                return False
            if ev.get("pid") == pid:
                return True
            return ev.get("pid") is None and unit is not None and ev.get("unit") == unit
        return pred


class OmnidBaseline(Omnid):
    """Another omnid build (OMNID_BENCH_BASELINE=/path/to/its/bin/omnid), measured in the
    same run, interleaved with the current one: before/after figures under the same load."""

    name = "omnid-base"
    settings = ""  # its omnid.toml may not know daemon_nice (builds before it ran at nice 0 anyway)

    @classmethod
    def prepare(cls, ctx: Ctx) -> dict:
        exe = os.environ.get("OMNID_BENCH_BASELINE")
        if not exe:
            raise Unavailable("OMNID_BENCH_BASELINE is not set (the path of another omnid build)")
        saved = os.environ.get("OMNID_BENCH_EXE")
        os.environ["OMNID_BENCH_EXE"] = exe
        try:
            return super().prepare.__func__(cls, ctx)
        finally:
            if saved is None:
                del os.environ["OMNID_BENCH_EXE"]
            else:
                os.environ["OMNID_BENCH_EXE"] = saved


ADAPTERS: dict[str, type[Adapter]] = {
    "omnid": Omnid,
    "supervisord": Supervisord,
    "circus": Circus,
    "runit": Runit,
    "omnid-base": OmnidBaseline,
}
