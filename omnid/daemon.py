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
from pathlib import Path

import structlog

from omnid import linux, logconfig, output, settings
from omnid.control import ControlError, ControlServer, prepare_socket_dir
from omnid.metrics import DaemonMetrics
from omnid.notify import NotifyServer
from omnid.systemd import ServiceNotifier
from omnid.ownership import UnsafePath, check_private_dir, raise_nofile_limit
from omnid.process import DAEMON_TAG, UNIT_TAG
from omnid.spawnclient import SpawnerClient, SpawnerGone
from omnid.spawnstart import SpawnerProcess
from omnid.states import UnitState as S
from omnid.statefile import StateFile, find_leftovers, kill_leftovers
from omnid import cgroup as cgroup_mod
from omnid.supervisor import StopRecord, Supervisor, UnitNotFound
from omnid.tasks import DaemonTask, report_crash
from omnid.units import InvalidValue, Stack, StackInvalid, check_stack, load_stack, parse_signal

log = structlog.get_logger("omnid.daemon")

DEFAULT_HEALTH = settings.DEFAULT_HEALTH
CHECK_TIMEOUT_S = 30.0  # the `check` request (omnid-control(7))
MAX_TIMEOUT_S = 86400.0  # a control request's "timeout": at most a day (omnid-control(7))


def bind_listener(listen: str) -> socket.socket:
    """A listening TCP socket on HOST:PORT (numeric host: no resolver thread)."""
    host, port = settings.parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


# Kept importable from here: the one resolver lives in omnid.settings.
default_control = settings.default_control
default_state_dir = settings.default_state_dir
default_units_dir = settings.default_units_dir
DaemonConfig = settings.DaemonConfig


class Daemon:
    def __init__(self, cfg: DaemonConfig, stack: Stack, service: ServiceNotifier | None = None) -> None:
        self.cfg = cfg
        self.service = service or ServiceNotifier({})
        # Set once the stack's first start has settled (every unit active, or failed and
        # not restarting, or waiting on one that is): READY=1 to systemd, `wait` replies.
        self.settled: asyncio.Event | None = None
        self.metrics = DaemonMetrics()
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
        self.cgroups = None  # omnid.cgroup.CgroupRoot, or None: process groups (cgroup hook)
        self._gpu_task: DaemonTask | None = None
        self._control_reader: DaemonTask | None = None
        self._health_task: asyncio.Task | None = None
        self._senders: dict[int, tuple[str | None, float]] = {}  # notify sender pid -> (unit, valid until)

    # -- callbacks --------------------------------------------------------------
    def _publish(self, ev: dict) -> None:
        if self.sup is not None:
            self.metrics.on_event(ev, self.sup)
        if self.control is not None:
            self.control.publish(ev)

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
        wanted = set(self.sup.expand(names, whole_groups=False)) if names else None
        units = [s for s in self.sup.snapshot() if wanted is None or s["name"] in wanted]
        output.add_counters(units, self.sup.units)  # operators (#12): what a flooding unit cost
        out: dict = {"units": units, "daemon": {"pid": os.getpid(), "spawner_pid": self.spawner.pid,
                                               "units_dir": self.cfg.units_dir, "since": self.sup.started_at,
                                               "shutting_down": self.sup.shutting_down,
                                               **cgroup_mod.backend(self.cgroups),  # cgroup hook
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
            except InvalidValue as exc:
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
        return {name: self.sup.units[name].output.tail(n) for name in self.sup.expand([unit], whole_groups=False)}  # type: ignore[union-attr]

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

    async def handle_wait(self, args: dict) -> dict:
        """Wait (up to "timeout") for the daemon's first start of the stack to settle, without
        starting anything: `omnid start` launching a fresh daemon uses it, so a unit that
        failed with restart = "no" runs once."""
        assert self.sup is not None and self.settled is not None
        timeout = self._timeout_arg(args)
        assert self.shutdown_requested is not None
        waits = [asyncio.ensure_future(self.settled.wait()), asyncio.ensure_future(self.shutdown_requested.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if self.shutdown_requested.is_set() and not self.settled.is_set():
            raise ControlError("shutting_down", "the daemon is stopping (see its log for why)")
        units = self.sup.snapshot()
        return {"ok": self.settled.is_set() and all(u["state"] == "active" for u in units),
                "settled": self.settled.is_set(), "units": units}

    # -- systemd ------------------------------------------------------------------
    def _stack_settled(self) -> bool:
        assert self.sup is not None
        sup = self.sup
        for u in sup.units.values():
            if u.op is not None:
                return False
            if u.state is S.ACTIVE or (u.state is S.FAILED and not u.restart_pending):
                continue
            if u.state is S.INACTIVE and sup._stuck(u):
                continue
            return False
        return True

    def _progress(self) -> str:
        assert self.sup is not None
        units = self.sup.units.values()
        active = sum(1 for u in units if u.state is S.ACTIVE)
        failed = sorted(u.name for u in units if u.state is S.FAILED)
        starting = sorted(u.name for u in units if u.state is S.STARTING)
        text = f"{active}/{len(self.sup.units)} units active"
        if starting:
            text += f", starting: {', '.join(starting[:5])}" + (" ..." if len(starting) > 5 else "")
        if failed:
            text += f", failed: {', '.join(failed[:5])}" + (" ..." if len(failed) > 5 else "")
        return text

    async def _watch_startup(self) -> None:
        """STATUS= lines while the stack comes up, EXTEND_TIMEOUT_USEC while units are
        still starting (a slow model load), then READY=1 once it has settled."""
        assert self.sup is not None and self.settled is not None and self.shutdown_requested is not None
        last = ""
        while not self.shutdown_requested.is_set():
            if await self.sup.wait_until(self._stack_settled, 1.0):
                break
            text = self._progress()
            if text != last:
                self.service.status(f"starting: {text}")
                last = text
            if any(u.state is S.STARTING for u in self.sup.units.values()):
                self.service.send("EXTEND_TIMEOUT_USEC=3000000")
        if self.shutdown_requested.is_set():
            return
        self.settled.set()
        text = self._progress()
        self.service.send("READY=1", f"STATUS=ready: {text}")
        log.info("stack settled", status=text)

    # -- life ---------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.shutdown_requested = asyncio.Event()
        self.shutdown_result = loop.create_future()
        self.settled = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        await self.spawner.attach()
        self.notify = NotifyServer(self.token, self._on_notify, attribute=self._notify_sender)
        self.notify.start()
        # The first tier is spawned before the GPU backend, ZeroMQ and the HTTP server are
        # loaded, unless a unit needs the GPU check (a leftover holding its GPU) to start.
        if any(u.gpus for u in self.stack):
            from omnid import gpu as gpu_mod

            self.gpu = gpu_mod.open_backend()
        self.sup = Supervisor(self.stack, self.spawner, token=self.token, notify_socket=self.notify.address,
                              publish=self._publish,
                              on_pids_changed=self._schedule_state_write,
                              check_invariants=os.environ.get("OMNID_CHECK_INVARIANTS") == "1",
                              gpu=self.gpu, cgroups=self.cgroups)
        try:
            # Bound now with a plain socket, so a busy port fails the daemon before any unit
            # starts; aiohttp (a ~100 ms import) takes it over once the first spawns are out.
            health_sock = bind_listener(self.cfg.health_listen)
        except OSError as exc:
            log.error("health API cannot listen", listen=self.cfg.health_listen, error=str(exc))
            self.exit_code = 1
            self.shutdown_requested.set()
            health_sock = None
        if health_sock is not None:
            self.sup._kick()
            # Three turns of the loop (converge, the start ops, the spawner client's send): the
            # first tier's requests are out before anything below is imported.
            for _ in range(3):
                await asyncio.sleep(0)
        if self.gpu is None:
            from omnid import gpu as gpu_mod

            self.gpu = self.sup.gpu = gpu_mod.open_backend()
        if not self.gpu.available:
            log.info("GPU checks off", reason=self.gpu.reason)
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        handlers = {name[len("handle_"):]: getattr(self, name) for name in dir(self) if name.startswith("handle_")}
        self.control = ControlServer(ctx, self.cfg.control, handlers)
        self.control.bind()
        # Daemon-wide tasks are supervised: a crash is logged and the task restarted.
        self._control_reader = DaemonTask("control reader", self._start_control_reader).start()
        if self.gpu.available:
            self._gpu_task = DaemonTask("GPU watch", lambda: loop.create_task(self._gpu_watch())).start()
        self._write_state()
        log.info("daemon ready", units_dir=self.cfg.units_dir, control=self.cfg.control,
                 health=self.cfg.health_listen, units=len(self.sup.units), spawner_pid=self.spawner.pid)
        startup_task = None
        if health_sock is not None:
            self.service.status(f"starting: {self._progress()}")
            self.service.start_watchdog()
            self._health_task = report_crash(loop.create_task(self._start_health(health_sock)), "health API start")
            startup_task = loop.create_task(self._watch_startup())
            startup_task.add_done_callback(self._report_task)
        await self.shutdown_requested.wait()
        self.service.send("STOPPING=1", "STATUS=stopping the stack")
        log.info("stopping the stack")
        if startup_task is not None:
            startup_task.cancel()
            try:
                await startup_task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - already logged by _report_task
                pass
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
        self.service.status(f"stopped (exit {self.exit_code})")
        self.service.close()
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
        self.health.daemon_metrics = self.metrics
        await self.health.start(sock)
        # Everything allocated so far (modules, sockets, units) lives as long as the
        # daemon: keep it out of the cyclic GC, whose full passes over it cost tens of
        # ms in the middle of a 256-unit stop.
        gc.freeze()

    async def _gpu_watch(self) -> None:
        from omnid.gpu import watch

        assert self.sup is not None
        await watch.watch(self.gpu, self.sup)

    @staticmethod
    def _report_task(task: asyncio.Task) -> None:
        """No task whose exception nobody sees: log it the moment it ends badly."""
        if not task.cancelled() and task.exception() is not None:
            log.error("daemon task failed", task=task.get_coro().__qualname__, error=repr(task.exception()))

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
        log_format: str | None, log_file: str | None = None,
        cgroup_root: str | None = None, spawner: SpawnerProcess | None = None) -> int:
    """The `omnid daemon` command. Returns the process exit code. `spawner`: one already
    started (omnid.spawnstart), taken over; else one is started here."""
    udir = os.path.abspath(units_dir or default_units_dir())
    try:
        stack = load_stack(udir)
    except StackInvalid as exc:
        print(f"omnid: invalid stack in {udir}:", file=sys.stderr)
        for err in exc.errors:
            print(f"  {err}", file=sys.stderr)
        return 2
    cfg = settings.resolve(units_dir=udir, control=control, state_dir=state_dir, health_listen=health_listen,
                           log_format=log_format, cgroup_root=cgroup_root, stack_settings=stack.settings)
    logconfig.configure(cfg.log_format, log_file=log_file)
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
    # Taken out of the environment before the spawner is exec'd: units never see systemd's socket.
    daemon = Daemon(cfg, stack, ServiceNotifier())
    # The cgroup root (resolved like every setting, else systemd delegation): check memory_max /
    # tasks_max against it, and kill a previous daemon's unit cgroups.
    try:
        daemon.cgroups = cgroup_mod.start(cfg.cgroup_root, cfg.source("cgroup_root"), stack,
                                          companions=(spawner.pid,) if spawner else ())
    except cgroup_mod.CgroupError as exc:
        print(f"omnid: {exc}", file=sys.stderr)
        return 2
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
    daemon.spawner.launch(spawner)
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
