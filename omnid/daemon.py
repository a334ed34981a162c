"""`omnid daemon`: wires spawner, supervisor, control socket, health HTTP and the
notify socket together on one asyncio loop (DESIGN.md Part 1, "Processes").

Order matters: the spawner is started by exec before the first ZeroMQ socket
exists (from then on the daemon has native threads and never forks). Signal
handlers only hand the signal to the loop.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import importlib
import math
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import zmq
import zmq.asyncio

from omnid import linux, logconfig
from omnid.control import ControlError, ControlServer, prepare_socket_dir
from omnid.notify import NotifyServer
from omnid.ownership import UnsafePath, check_private_dir, raise_nofile_limit
from omnid.process import DAEMON_TAG, UNIT_TAG
from omnid.spawnclient import SpawnerClient, SpawnerGone
from omnid.statefile import StateFile, find_leftovers, kill_leftovers
from omnid.supervisor import StopRecord, Supervisor, UnitNotFound
from omnid.tasks import DaemonTask
from omnid.units import Stack, StackInvalid, check_stack, load_stack, parse_signal

log = structlog.get_logger("omnid.daemon")

DEFAULT_HEALTH = "127.0.0.1:9321"
CHECK_TIMEOUT_S = 30.0  # the `check` request (omnid-control(7))
MAX_TIMEOUT_S = 86400.0  # a control request's "timeout": at most a day (omnid-control(7))


def bind_listener(listen: str) -> socket.socket:
    """A listening TCP socket on HOST:PORT (numeric host: no resolver thread)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(512)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def default_control() -> str:
    if os.getuid() == 0:
        return "/run/omnid/control.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "omnid", "control.sock")
    return f"/tmp/omnid-{os.getuid()}/control.sock"


def default_state_dir() -> str:
    if os.getuid() == 0:
        return "/var/lib/omnid"
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "omnid")


def default_units_dir() -> str:
    """The built-in reference stack: units/demo of the checkout, or the copy shipped in the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "units" / "demo", here / "demo" / "units"):
        if candidate.is_dir():
            return str(candidate)
    return str(here.parent / "units" / "demo")


@dataclass(frozen=True)
class DaemonConfig:
    units_dir: str
    control: str
    state_dir: str
    health_listen: str
    log_format: str


def resolve_config(units_dir: str | None, control: str | None, state_dir: str | None,
                   health_listen: str | None, log_format: str | None, stack: Stack | None) -> DaemonConfig:
    """Flags > environment > omnid.toml > defaults."""
    st = stack.settings if stack is not None else None
    return DaemonConfig(
        units_dir=os.path.abspath(units_dir or default_units_dir()),
        control=os.path.abspath(control or os.environ.get("OMNID_CONTROL")
                                or (str(st.control) if st and st.control else None) or default_control()),
        state_dir=os.path.abspath(state_dir or os.environ.get("OMNID_STATE_DIR")
                                  or (str(st.state_dir) if st and st.state_dir else None) or default_state_dir()),
        health_listen=health_listen or os.environ.get("OMNID_HEALTH_LISTEN")
        or (st.health_listen if st and st.health_listen else None) or DEFAULT_HEALTH,
        log_format=log_format or os.environ.get("OMNID_LOG_FORMAT")
        or (str(st.log_format) if st and st.log_format else None) or "console",
    )


class Daemon:
    def __init__(self, cfg: DaemonConfig, stack: Stack) -> None:
        self.cfg = cfg
        self.stack = stack
        self.token = secrets.token_hex(8)
        self.state = StateFile(Path(cfg.state_dir))
        self.spawner = SpawnerClient(on_exit=self._on_exit, on_gone=self._on_spawner_gone)
        self.sup: Supervisor | None = None
        self.control: ControlServer | None = None
        self.health = None  # omnid.health.HealthServer, imported once the first spawns are out
        self.notify: NotifyServer | None = None
        self.shutdown_requested: asyncio.Event | None = None
        self.shutdown_result: asyncio.Future | None = None
        self.exit_code = 0
        self._state_write: asyncio.TimerHandle | None = None
        self.gpu = None
        self._gpu_task: DaemonTask | None = None
        self._control_reader: DaemonTask | None = None
        self._health_task: asyncio.Task | None = None
        self._senders: dict[int, tuple[str | None, float]] = {}  # notify sender pid -> (unit, valid until)

    # -- callbacks --------------------------------------------------------------
    def _on_exit(self, rep) -> None:
        if self.sup is not None:
            self.sup.on_exit_report(rep)

    def _on_spawner_gone(self) -> None:
        log.error("the spawner died; every unit died with it (PDEATHSIG); stopping the daemon")
        if self.sup is not None:
            self.sup.on_spawner_gone()
        self.exit_code = 1
        if self.shutdown_requested is not None:
            self.shutdown_requested.set()

    def _schedule_state_write(self) -> None:
        # Coalesce: 256 spawns in a burst write the file a few times, not 256.
        if self._state_write is None:
            self._state_write = asyncio.get_running_loop().call_later(0.1, self._write_state)

    def _write_state(self) -> None:
        self._state_write = None
        assert self.sup is not None
        procs = {u.name: {"pid": u.proc.pid, "start_time": u.proc.start_time, "pgid": u.proc.pgid}
                 for u in self.sup.units.values() if u.proc is not None}
        try:
            self.state.write({
                "token": self.token,
                "daemon": {"pid": os.getpid(), "start_time": linux.start_time_of(os.getpid())},
                "spawner": {"pid": self.spawner.pid, "start_time": self.spawner.start_time},
                "units_dir": self.cfg.units_dir,
                "processes": procs,
                "written": time.time(),
            })
        except OSError as exc:
            log.error("cannot write the state file", path=str(self.state.path), error=str(exc))

    # -- control handlers (dispatch by name: handle_<cmd>) ---------------------------
    def _units_arg(self, args: dict) -> list[str] | None:
        units = args.get("units")
        if units is None:
            return None
        if not isinstance(units, list) or not all(isinstance(x, str) and x for x in units):
            raise ControlError("bad_request", "\"units\" must be a list of unit names")
        return units or None

    def _timeout_arg(self, args: dict) -> float | None:
        t = args.get("timeout")
        if t is None:
            return None
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or t <= 0 or t > MAX_TIMEOUT_S:
            raise ControlError("bad_request", f"\"timeout\" must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}, "
                                              f"got {str(t)[:60]!r}")
        return float(t)

    def _known(self, names: list[str] | None) -> None:
        assert self.sup is not None
        if names:
            try:
                self.sup.expand(names)
            except UnitNotFound as exc:
                raise ControlError("unknown_unit", f"no unit named {exc.args[0]!r} in {self.cfg.units_dir}; "
                                                   f"units: {', '.join(self.sup.order)}") from None

    async def handle_status(self, args: dict) -> dict:
        assert self.sup is not None
        names = self._units_arg(args)
        self._known(names)
        wanted = set(self.sup.expand(names)) if names else None
        units = [s for s in self.sup.snapshot() if wanted is None or s["name"] in wanted]
        out: dict = {"units": units, "daemon": {"pid": os.getpid(), "spawner_pid": self.spawner.pid,
                                               "units_dir": self.cfg.units_dir, "since": self.sup.started_at,
                                               "shutting_down": self.sup.shutting_down,
                                               "notify": dict(self.notify.counters) if self.notify else {}}}
        if args.get("verify"):
            problems = self.sup.verify()
            if problems:
                # The kernel may be a few ms ahead of the loop (a death not yet processed): look again.
                await asyncio.sleep(0.1)
                problems = self.sup.verify()
            out["verify"] = {"ok": not problems, "problems": problems,
                             "invariant_violations": list(self.sup.invariant_violations)}
        return out

    async def handle_start(self, args: dict) -> dict:
        assert self.sup is not None
        if self.sup.shutting_down:
            raise ControlError("shutting_down", "the daemon is stopping; start it again afterwards")
        names = self._units_arg(args)
        self._known(names)
        units = await self.sup.start_units(names, self._timeout_arg(args))
        ok = all(u["state"] == "active" for u in units)
        return {"ok": ok, "units": units}

    async def handle_stop(self, args: dict) -> dict:
        assert self.sup is not None
        names = self._units_arg(args)
        if names is None:
            raise ControlError("bad_request", "stop needs \"units\"; to stop the whole stack use \"shutdown\"")
        self._known(names)
        recs = await self.sup.stop_units(names, self._timeout_arg(args))
        return {"summary": [r.to_json() for r in recs], "units": self.sup.snapshot()}

    async def handle_restart(self, args: dict) -> dict:
        assert self.sup is not None
        names = self._units_arg(args)
        if names is None:
            raise ControlError("bad_request", "restart needs \"units\"")
        self._known(names)
        units = await self.sup.restart_units(names, self._timeout_arg(args))
        return {"ok": all(u["state"] == "active" for u in units), "units": units}

    async def handle_kill(self, args: dict) -> dict:
        assert self.sup is not None
        unit = args.get("unit")
        if not isinstance(unit, str) or not unit:
            raise ControlError("bad_request", "kill needs \"unit\": a unit name")
        self._known([unit])
        raw = args.get("signal", "SIGTERM")
        if isinstance(raw, int) and not isinstance(raw, bool):
            # omnid-control(7): a name or a number. Any signal the kernel knows, 0 excluded.
            if not 1 <= raw <= signal.SIGRTMAX:
                raise ControlError("bad_request", f"bad \"signal\": {raw} is not a signal number "
                                                  f"(1 to {int(signal.SIGRTMAX)})")
            sig = raw
        else:
            try:
                sig = int(parse_signal(raw))
            except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's error
                raise ControlError("bad_request", f"bad \"signal\": {exc}") from None
        hit = self.sup.kill_unit(unit, sig)
        if not hit:
            raise ControlError("not_running", f"unit {unit!r} has no running process to signal")
        return {"signalled": hit, "signal": linux.signal_name(sig)}

    async def handle_logs(self, args: dict) -> dict:
        assert self.sup is not None
        unit = args.get("unit")
        if not isinstance(unit, str) or not unit:
            raise ControlError("bad_request", "logs needs \"unit\": a unit name")
        self._known([unit])
        n = args.get("n", 50)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ControlError("bad_request", f"\"n\" must be a non-negative integer, got {n!r}")
        return {name: self.sup.units[name].output.tail(n) for name in self.sup.expand([unit])}  # type: ignore[union-attr]

    async def handle_shutdown(self, args: dict) -> dict:
        assert self.shutdown_requested is not None and self.shutdown_result is not None
        self.shutdown_requested.set()
        recs: list[StopRecord] = await asyncio.shield(self.shutdown_result)
        return {"summary": [r.to_json() for r in recs]}

    async def handle_check(self, args: dict) -> dict:
        directory = args.get("units_dir") or self.cfg.units_dir
        if not isinstance(directory, str):
            raise ControlError("bad_request", "\"units_dir\" must be a path")
        # Off the loop (a big stack takes seconds to read) and bounded: /health and deaths
        # keep their milliseconds while it runs.
        try:
            errors = await asyncio.wait_for(asyncio.to_thread(check_stack, directory), CHECK_TIMEOUT_S)
        except TimeoutError:
            raise ControlError("timeout", f"checking {directory} took more than {CHECK_TIMEOUT_S:g} s") from None
        return {"ok": not errors, "units_dir": directory, "errors": [str(e) for e in errors]}

    # -- life ---------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.shutdown_requested = asyncio.Event()
        self.shutdown_result = loop.create_future()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        await self.spawner.attach()
        self.notify = NotifyServer(self.token, self._on_notify, attribute=self._notify_sender)
        self.notify.start()
        from omnid import gpu as gpu_mod

        self.gpu = gpu_mod.open_backend()
        if not self.gpu.available:
            log.info("GPU checks off", reason=self.gpu.reason)
        ctx = zmq.asyncio.Context()
        self.sup = Supervisor(self.stack, self.spawner, token=self.token, notify_socket=self.notify.address,
                              publish=lambda ev: self.control.publish(ev) if self.control else None,
                              on_pids_changed=self._schedule_state_write,
                              check_invariants=os.environ.get("OMNID_CHECK_INVARIANTS") == "1",
                              gpu=self.gpu)
        handlers = {name[len("handle_"):]: getattr(self, name) for name in dir(self) if name.startswith("handle_")}
        self.control = ControlServer(ctx, self.cfg.control, handlers)
        self.control.bind()
        # Daemon-wide tasks are supervised: a crash is logged and the task restarted.
        self._control_reader = DaemonTask("control reader", self._start_control_reader).start()
        if self.gpu.available:
            self._gpu_task = DaemonTask("GPU watch", lambda: loop.create_task(self._gpu_watch())).start()
        try:
            # Bound now with a plain socket, so a busy port fails the daemon before any unit
            # starts; aiohttp (a ~100 ms import) takes it over once the first spawns are out.
            health_sock = bind_listener(self.cfg.health_listen)
        except OSError as exc:
            log.error("health API cannot listen", listen=self.cfg.health_listen, error=str(exc))
            self.exit_code = 1
            self.shutdown_requested.set()
            health_sock = None
        self._write_state()
        log.info("daemon ready", units_dir=self.cfg.units_dir, control=self.cfg.control,
                 health=self.cfg.health_listen, units=len(self.sup.units), spawner_pid=self.spawner.pid)
        if health_sock is not None:
            self.sup._kick()
            self._health_task = loop.create_task(self._start_health(health_sock))
        await self.shutdown_requested.wait()
        log.info("stopping the stack")
        t0 = time.monotonic()
        recs = await self.sup.shutdown()
        self.shutdown_result.set_result(recs)
        left = [p for p in linux.children_of(self.spawner.pid)
                if (st := linux.read_stat(p)) is not None and st.state not in ("Z", "X")]
        if left:
            log.error("processes left under the spawner after stop", pids=left)
        log.info("stack stopped", seconds=round(time.monotonic() - t0, 3), units=len(recs),
                 residue=sum(len(r.residue) for r in recs), unkillable=sum(len(r.unkillable) for r in recs))
        if any(r.unkillable for r in recs):
            self.exit_code = 1
        # Let the `shutdown` reply go out before the sockets close.
        deadline = time.monotonic() + 2.0
        while self.control._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._gpu_task is not None:
            self._gpu_task.close()
        if self._control_reader is not None:
            self._control_reader.close()
        if self._health_task is not None:
            try:
                await asyncio.wait_for(self._health_task, 10)
            except Exception as exc:  # noqa: BLE001 - report, then go on closing
                log.error("health API start failed", error=str(exc))
        if self.health is not None:
            await self.health.close()
        await self.control.close()
        ctx.term()
        self.notify.close()
        await self.spawner.shutdown()
        self.state.remove()
        return self.exit_code

    def _start_control_reader(self) -> asyncio.Task:
        assert self.control is not None
        self.control.start()
        assert self.control._reader is not None
        return self.control._reader

    async def _start_health(self, sock: socket.socket) -> None:
        """Import aiohttp (~100 ms) in a thread while the loop spawns the first tier and
        keeps watching pidfds and READY messages; then serve on the bound socket."""
        assert self.sup is not None
        health_mod = await asyncio.to_thread(importlib.import_module, "omnid.health")
        self.health = health_mod.HealthServer(self.sup, self.cfg.health_listen, degraded=lambda: self.sup.degraded,
                                              gpu_usage=lambda: self.sup.gpu_mib,
                                              notify_counters=lambda: self.notify.counters if self.notify else {})
        await self.health.start(sock)
        # Everything allocated so far (modules, sockets, units) lives as long as the
        # daemon: keep it out of the cyclic GC, whose full passes over it cost tens of
        # ms in the middle of a 256-unit stop.
        gc.freeze()

    async def _gpu_watch(self) -> None:
        from omnid.gpu import watch

        assert self.sup is not None
        await watch.watch(self.gpu, self.sup)

    def _on_signal(self, sig: int) -> None:
        assert self.shutdown_requested is not None
        if self.shutdown_requested.is_set():
            log.warning("already stopping", signal=linux.signal_name(sig))
            return
        log.info("signal received: stopping the stack in order", signal=linux.signal_name(sig))
        self.shutdown_requested.set()

    def _notify_sender(self, pid: int) -> str | None:
        """The unit whose own process sent a notify datagram (by process group or session,
        as the supervisor attributes it), or None: anyone else's message is dropped."""
        if self.sup is None:
            return None
        now = time.monotonic()
        hit = self._senders.get(pid)
        if hit is not None and hit[1] > now:
            return hit[0]  # a flood costs one /proc read per sender per second, not per datagram
        unit = self._attribute_sender(pid)
        if len(self._senders) > 4096:
            self._senders.clear()
        self._senders[pid] = (unit, now + 1.0)
        return unit

    def _attribute_sender(self, pid: int) -> str | None:
        assert self.sup is not None
        st = linux.read_stat(pid)
        if st is None:
            return None
        pending = False
        for u in self.sup.units.values():
            if u.proc is not None:
                if u.proc.pgid in (st.pgid, st.sid):
                    return u.name
            elif u.op_kind == "start":
                pending = True
        if pending:
            # READY=1 can come before the spawner's reply: the environment proves it ours.
            tag = linux.read_environ_var(pid, UNIT_TAG)
            if tag in self.sup.units and linux.read_environ_var(pid, DAEMON_TAG) == self.token:
                return tag
        return None

    def _on_notify(self, pid: int, fields: dict[str, str]) -> None:
        if self.sup is not None:
            self.sup.on_notify(pid, fields)


def run(units_dir: str | None, control: str | None, state_dir: str | None, health_listen: str | None,
        log_format: str | None) -> int:
    """The `omnid daemon` command. Returns the process exit code."""
    udir = os.path.abspath(units_dir or default_units_dir())
    try:
        stack = load_stack(udir)
    except StackInvalid as exc:
        print(f"omnid: invalid stack in {udir}:", file=sys.stderr)
        for err in exc.errors:
            print(f"  {err}", file=sys.stderr)
        return 2
    cfg = resolve_config(udir, control, state_dir, health_listen, log_format, stack)
    logconfig.configure(cfg.log_format)
    linux.mark_fds_non_inheritable()
    try:
        from setproctitle import setproctitle

        setproctitle(f"omnid: daemon {cfg.units_dir}")
    except ImportError:
        pass
    state_dir_path = Path(cfg.state_dir)
    try:
        if not os.path.lexists(state_dir_path):
            state_dir_path.mkdir(parents=True, mode=0o700)
            os.chmod(state_dir_path, 0o700)
        # A state directory another user can write would let them list pids for us to kill.
        check_private_dir(state_dir_path, "state directory")
        lock_fd = os.open(state_dir_path / "daemon.lock",
                          os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except UnsafePath as exc:
        print(f"omnid: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"omnid: cannot use state dir {cfg.state_dir}: {exc}", file=sys.stderr)
        return 1
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"omnid: another daemon holds {cfg.state_dir}/daemon.lock", file=sys.stderr)
        return 1
    try:
        prepare_socket_dir(cfg.control)
    except ControlError as exc:
        print(f"omnid: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"omnid: cannot create control socket directory for {cfg.control}: {exc}", file=sys.stderr)
        return 1
    daemon = Daemon(cfg, stack)
    previous = daemon.state.read()
    if previous:
        leftovers = find_leftovers(previous)
        if leftovers:
            log.warning("killing leftovers of a previous daemon", count=len(leftovers),
                        processes=[lo.describe() for lo in leftovers])
            alive = kill_leftovers(leftovers)
            if alive:
                log.error("leftovers of a previous daemon survived SIGKILL", processes=alive)
    # Start the spawner by exec while this process has no threads yet.
    daemon.spawner.launch()
    # After the spawner's exec, so units keep the usual soft limit: health connections,
    # pidfds and pipes must not run libzmq out of fds (it aborts on EMFILE).
    raise_nofile_limit()
    try:
        return asyncio.run(daemon.run())
    except SpawnerGone as exc:
        log.error("spawner failed to start", error=str(exc))
        return 1
    finally:
        os.close(lock_fd)
