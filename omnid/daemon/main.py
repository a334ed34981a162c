"""`omnid daemon`: wires spawner, supervisor, control socket, health HTTP and the
notify socket together on one asyncio loop (ARCHITECTURE.md, "Processes").

Order matters: the spawner is started by exec before the first ZeroMQ socket
exists (from then on the daemon has native threads and never forks). Signal
handlers only hand the signal to the loop.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import importlib
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from omnid.process import cgroup as cgroup_mod
from omnid.daemon import clusterwiring
from omnid.base import linux
from omnid.base import logconfig
from omnid.model import settings
from omnid.daemon import startup
from omnid.api.control import ControlError, ControlServer, prepare_socket_dir
from omnid.core import takeover as takeover_mod
from omnid.core.faults import ENV as FAULTS_ENV
from omnid.core.faults import Faults
from omnid.core.cleanup import UnitCleanup
from omnid.core.lifecycle import Phase
from omnid.core.supervisor import Supervisor
from omnid.api.metrics import DaemonMetrics
from omnid.api.notify import NotifyServer
from omnid.base.ownership import UnsafePath, check_private_dir, raise_nofile_limit
from omnid.process.spawnclient import SpawnerClient, SpawnerGone
from omnid.process.spawnstart import SpawnerProcess
from omnid.daemon.statefile import StateFile, find_leftovers, kill_leftovers
from omnid.api.systemd import ServiceNotifier
from omnid.base.tasks import DaemonTask, report_crash
from omnid.model.units import Stack, StackInvalid, load_stack

if TYPE_CHECKING:  # imported once the first tier's spawns are out (Daemon._load_handlers)
    from omnid.forensics.store import CaptureStore
    from omnid.api.handlers import ControlHandlers

log = structlog.get_logger("omnid.daemon.main")

DEFAULT_HEALTH = settings.DEFAULT_HEALTH
# The health API's import waits for the first tier's spawns to be answered, this long at most.
HEALTH_IMPORT_WAIT_S = 1.0
# After a forced stop's SIGKILL to every unit: how long the kernel's proof of each unit's end
# is waited for before the daemon goes on to stop the spawner (whose exit kills what is left).
FORCED_WAIT_S = 5.0
SWITCH_INTERVAL_S = 0.001  # the GIL's switch interval in the daemon (Python's default: 5 ms)


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


# Kept importable from here: the one resolver lives in omnid.model.settings.
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
        self.force_stop: asyncio.Event | None = None  # a second SIGTERM/SIGINT: SIGKILL every unit now
        self.exit_code = 0
        self._state_write: asyncio.TimerHandle | None = None
        self.gpu = None
        self.cgroups = None  # omnid.cgroup.CgroupRoot, or None: process groups (cgroup hook)
        self._gpu_task: DaemonTask | None = None
        self._control_reader: DaemonTask | None = None
        self._health_task: asyncio.Task | None = None
        self.reexecs = 0  # how many times this daemon replaced its own program (omnid reexec)
        self.program_since = time.time()  # when this program of the daemon began (a re-exec begins another)
        self.handover_ms: float | None = None  # exec -> every unit taken over, at the last re-exec
        self.handlers: ControlHandlers | None = None  # once the first tier is out
        self.zmq = None  # the zmq.asyncio.Context, made once the first tier is out
        self.health_fd = -1  # a dup of the health listening socket, kept for a re-exec
        self.lock_fd = -1  # the state directory's lock, held for the daemon's life
        self.log_file: str | None = None
        self.reexec: asyncio.Task | None = None  # a re-exec being prepared
        self.handover_error: str | None = None  # why the last re-exec's handover could not be used
        self.cleanup: UnitCleanup | None = None  # private tmp directories and IPC residue
        self.captures: CaptureStore | None = None  # hang forensics (omnid dump), with the handlers
        self.cluster = None  # omnid.cluster.session.ClusterSession with [cluster]
        self._failed_watch: asyncio.Task | None = None

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

    def identity(self) -> dict:
        """What `status --json` says of the daemon program itself."""
        from omnid.version import version

        out = {"version": version(), "reexecs": self.reexecs, "program_since": self.program_since,
               **({"handover_ms": self.handover_ms} if self.handover_ms is not None else {})}
        if self.cluster is not None:
            out["cluster"] = self.cluster.status()
        return out

    # -- life ---------------------------------------------------------------------
    async def run(self, takeover: dict | None = None) -> int:
        """Run until the stack is stopped. With `takeover` (a re-exec), continue from what the
        previous program of this daemon handed over instead of starting the stack."""
        loop = asyncio.get_running_loop()
        self.shutdown_requested = asyncio.Event()
        self.force_stop = asyncio.Event()
        self.shutdown_result = loop.create_future()
        self.settled = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # SIGHUP = `omnid reload` (systemd's ExecReload=): never the default, which would kill
        # the daemon and, with it, every unit.
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        if takeover is None:
            await self.spawner.attach()
        else:
            sp = takeover["spawner"]
            self.spawner.adopt(int(sp["pid"]), int(sp["pidfd"]), int(sp["sock"]), int(sp["start_time"]),
                               sp["exec_path"] if isinstance(sp.get("exec_path"), str) else None)
        self.notify = NotifyServer(self.token, self._on_notify, attribute=self._notify_sender,
                                   fd=None if takeover is None else int(takeover["notify"]["fd"]),
                                   on_fds=self._on_fds)
        if takeover is not None:
            self.notify.counters.update({k: int(v) for k, v in takeover["notify"]["counters"].items()})
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
        self.sup.fdstore.start()  # stored fds that hang up are dropped (omnid.process.fdstore)
        faults, refused = Faults.from_environ()
        if refused:
            log.error("test fault injection refused", reason=refused)
        if faults is not None:  # developer-only (omnid/core/faults.py): never in production
            log.error("TEST FAULT INJECTION IS ON: an action will raise", point=faults.point, unit=faults.unit,
                      env=FAULTS_ENV)
            self.sup.executor.faults = faults
        # Private tmp and IPC residue (a thread: the fanotify listener, after the spawner's exec).
        self.cleanup = UnitCleanup(self.token, self.cfg.state_dir)
        self.sup.executor.cleanup = self.cleanup
        self.cleanup.start()
        if takeover is not None:
            self.cleanup.take_over(takeover.get("cleanup"))
        if takeover is not None:
            self._load_handlers()  # units in the middle of a stop may capture at once
            takeover_mod.take_over(self.sup, takeover["supervisor"])
            self.metrics.take_over(takeover["metrics"])
        if self.stack.settings.cluster is not None and not await clusterwiring.open_cluster(self, takeover):
            self.exit_code = 2  # named on stderr and in the log; nothing is started
            self.shutdown_requested.set()
        health_sock = self._health_socket(takeover)
        if health_sock is not None and not self.shutdown_requested.is_set():
            if takeover is None:
                self.sup.kick()
                # Three turns of the loop (converge, the spawns, the spawner client's send): the
                # first tier's requests are out before anything below is imported.
                for _ in range(3):
                    await asyncio.sleep(0)
            else:
                takeover_mod.resume(self.sup)
            report_crash(loop.create_task(self.cleanup.sweep_previous()), "private tmp sweep")
        self._load_handlers()
        if self.gpu is None:
            from omnid import gpu as gpu_mod

            self.gpu = self.sup.gpu = gpu_mod.open_backend()
        if not self.gpu.available:
            log.info("GPU checks off", reason=self.gpu.reason)
        self._open_control()
        if self.gpu.available:
            self._gpu_task = DaemonTask("GPU watch", lambda: loop.create_task(self._gpu_watch())).start()
        self._write_state()
        if takeover is not None:
            self.handover_ms = round((time.monotonic() - float(takeover["exec_at"])) * 1000, 1)
        log.info("daemon ready" if takeover is None else "daemon re-executed: every unit taken over",
                 units_dir=self.cfg.units_dir, control=self.cfg.control, health=self.cfg.health_listen,
                 units=len(self.sup.units), spawner_pid=self.spawner.pid, reexecs=self.reexecs,
                 handover_ms=self.handover_ms)
        startup_task = None
        if health_sock is not None and self.shutdown_requested.is_set():
            health_sock.close()
        elif health_sock is not None:
            self.service.status(f"starting: {startup.progress(self.sup)}")
            self.service.start_watchdog()
            self._health_task = report_crash(loop.create_task(self._start_health(health_sock)), "health API start")
            if takeover is not None and takeover["settled"]:
                self.settled.set()
                self.service.status(f"ready: {startup.progress(self.sup)} (re-executed)")
            else:
                startup_task = loop.create_task(startup.watch(self.sup, self.service, self.settled,
                                                              self.shutdown_requested))
                startup_task.add_done_callback(self._report_task)
            if self.stack.settings.exit_when_failed:
                self._failed_watch = report_crash(loop.create_task(clusterwiring.watch_failed_for_good(self)),
                                                  "exit_when_failed")
        await self.shutdown_requested.wait()
        return await self._stop(startup_task)

    def _open_control(self) -> None:
        assert self.handlers is not None
        import zmq.asyncio  # after the first tier is out (its import starts libzmq's threads)

        self.zmq = zmq.asyncio.Context()
        self.control = ControlServer(self.zmq, self.cfg.control, self.handlers.table())
        self.control.bind()
        # Daemon-wide tasks are supervised: a crash is logged and the task restarted.
        self._control_reader = DaemonTask("control reader", self._start_control_reader).start()

    def _load_handlers(self) -> None:
        """The control commands and the capture store (hang forensics): imported once the
        first tier's spawns are out (~25 ms of imports the first child need not wait for)."""
        if self.handlers is not None:
            return
        from omnid.forensics.store import CaptureStore
        from omnid.api.handlers import ControlHandlers

        self.captures = CaptureStore(self.cfg.state_dir)
        assert self.sup is not None
        self.sup.executor.captures = self.captures

        async def check_new_program():  # noqa: ANN202 - for `reexec`: handover's refusal as the reply's error
            from omnid.daemon import handover

            try:
                return await handover.check_new_program()
            except handover.HandoverError as exc:
                raise ControlError("reexec_refused", str(exc)) from None

        self.handlers = ControlHandlers(self, check_new_program)

    def _health_socket(self, takeover: dict | None) -> socket.socket | None:
        """Bound now with a plain socket, so a busy port fails the daemon before any unit starts
        (aiohttp, a ~100 ms import, takes it over once the first spawns are out). A dup of it is
        kept for a re-exec: the listening socket outlives the program, so no connection is
        refused while the next one loads."""
        assert self.shutdown_requested is not None
        try:
            if takeover is None:
                sock = bind_listener(self.cfg.health_listen)
            else:
                fd = int(takeover["health"]["fd"])
                os.set_inheritable(fd, False)
                sock = socket.socket(fileno=fd)
                sock.setblocking(False)
        except OSError as exc:
            log.error("health API cannot listen", listen=self.cfg.health_listen, error=str(exc))
            self.exit_code = 1
            self.shutdown_requested.set()
            return None
        self.health_fd = os.dup(sock.fileno())
        return sock

    async def _stop(self, startup_task: asyncio.Task | None) -> int:
        assert self.sup is not None and self.control is not None and self.notify is not None
        assert self.shutdown_result is not None
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
        assert self.force_stop is not None
        drain_sec = self.stack.settings.drain_sec or 0.0
        if drain_sec > 0 and not self.force_stop.is_set():  # the preStop pattern: /health says draining first
            self.sup.shutting_down = True
            self.sup.draining_until = time.monotonic() + drain_sec
            log.info("draining before the stop", drain_sec=drain_sec)
            try:  # a second signal ends the drain window at once
                await asyncio.wait_for(self.force_stop.wait(), drain_sec)
            except asyncio.TimeoutError:
                pass
        t0 = time.monotonic()
        recs = await self._stop_units_bounded()
        if self.cleanup is not None:  # removals of failed units' leftovers still under way
            await self.cleanup.settle()
        await clusterwiring.close_cluster(self)
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
        if self._failed_watch is not None:
            self._failed_watch.cancel()
        if self._gpu_task is not None:
            self._gpu_task.close()
        await self._close_front()
        self.notify.close()
        self.sup.sockets.close_all()  # every unit is stopped: their sockets (and socket files) go
        self.sup.fdstore.close_all()
        await self.spawner.shutdown()
        if self.cleanup is not None:
            self.cleanup.close()
        self.state.remove()
        self.service.status(f"stopped (exit {self.exit_code})")
        self.service.close()
        return self.exit_code

    def stop_deadline(self) -> tuple[float, str]:
        """The stack stop's bound and where it came from: OMNID_STOP_DEADLINE, stop_deadline in
        omnid.toml, else the units' budgets (Supervisor.stop_budget)."""
        assert self.sup is not None
        raw = os.environ.get("OMNID_STOP_DEADLINE")
        if raw:
            try:
                value = float(raw)
                if value > 0 and value == value and value != float("inf"):
                    return value, "env"
            except ValueError:
                pass
            log.error("OMNID_STOP_DEADLINE ignored: expected a positive number of seconds", value=raw)
        if self.sup.stack.settings.stop_deadline:
            return float(self.sup.stack.settings.stop_deadline), "omnid.toml"
        return self.sup.stop_budget(), "derived"

    async def _stop_units_bounded(self) -> list:
        """The stack stop, in order, within its deadline; past it, or on a second SIGTERM/SIGINT,
        SIGKILL to every unit at once (as systemd's TimeoutStopSec and docker stop's second
        signal), then a bounded wait for the kernel to confirm (FORCED_WAIT_S)."""
        assert self.sup is not None and self.force_stop is not None
        deadline, origin = self.stop_deadline()
        log.info("stack stop deadline", deadline_s=round(deadline, 1), deadline_from=origin)
        stop = asyncio.get_running_loop().create_task(self.sup.requests.shutdown())
        forced = asyncio.get_running_loop().create_task(self.force_stop.wait())
        try:
            await asyncio.wait({stop, forced}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
            if stop.done():
                return stop.result()
            why = "a second signal" if self.force_stop.is_set() else f"the stop deadline ({deadline:g} s) passed"
            left = {n: f"{rt.state.value}/{rt.phase.value}" for n, rt in self.sup.units.items()
                    if not self.sup.schedule.settled_down(rt)}
            killed = self.sup.kill_all()
            log.error("stack stop forced: SIGKILL to every unit", why=why, killed=killed, not_stopped=left)
            self.exit_code = 1
            try:
                return await asyncio.wait_for(asyncio.shield(stop), FORCED_WAIT_S)
            except asyncio.TimeoutError:
                left = {n: f"{rt.state.value}/{rt.phase.value}" for n, rt in self.sup.units.items()
                        if not self.sup.schedule.settled_down(rt)}
                log.error("units not down after SIGKILL; the spawner's exit kills what is left",
                          seconds=FORCED_WAIT_S, not_stopped=left)
                stop.cancel()
                return []
        finally:
            forced.cancel()

    async def _close_front(self) -> None:
        """The control socket, the event stream and the health API (its listening socket
        stays open through the dup kept for a re-exec)."""
        if self._control_reader is not None:
            self._control_reader.close()
        if self._health_task is not None:
            try:
                await asyncio.wait_for(self._health_task, 10)
            except Exception as exc:  # noqa: BLE001 - report, then go on closing
                log.error("health API start failed", error=str(exc))
        if self.health is not None:
            await self.health.close()
        if self.control is not None:
            await self.control.close()
        self.zmq.term()

    # -- re-exec (omnid.daemon.handover) ---------------------------------------------------
    def start_reexec(self, check) -> None:  # noqa: ANN001 - omnid.handover.ProgramCheck
        from omnid.daemon import handover

        self.reexec = report_crash(asyncio.get_running_loop().create_task(handover.hand_over(self, check)),
                                   "re-exec")

    async def close_for_exec(self) -> None:
        """The fronts that cannot be handed over as they are: the ZeroMQ sockets (bound again
        by the next program) and aiohttp (the listening socket itself stays, through its dup)."""
        if self._gpu_task is not None:
            self._gpu_task.close()
            self._gpu_task = None
        if self._health_task is not None:
            try:
                await asyncio.wait_for(self._health_task, 10)
            except Exception as exc:  # noqa: BLE001 - report, then go on
                log.error("health API start failed", error=str(exc))
            self._health_task = None
        if self.health is not None:
            left = await self.health.quiesce(1.0)
            if left:
                log.info("health connections still open at the re-exec (idle keep-alive)", count=left)
            self.health = None  # not cleaned up: the program is replaced, its connections close
        await self._close_front()
        self.control = None

    async def reopen_after_failed_exec(self) -> None:
        loop = asyncio.get_running_loop()
        self._open_control()
        sock = socket.socket(fileno=os.dup(self.health_fd))
        sock.setblocking(False)
        self._health_task = report_crash(loop.create_task(self._start_health(sock)), "health API start")
        if self.gpu is not None and self.gpu.available:
            self._gpu_task = DaemonTask("GPU watch", lambda: loop.create_task(self._gpu_watch())).start()

    def _start_control_reader(self) -> asyncio.Task:
        assert self.control is not None
        self.control.start()
        assert self.control._reader is not None
        return self.control._reader

    async def _start_health(self, sock: socket.socket) -> None:
        """Import aiohttp (~100 ms of CPU) in a thread once the first tier's spawns are answered
        (at most HEALTH_IMPORT_WAIT_S), while the loop keeps watching pidfds and READY
        messages; then serve on the bound socket. Not during the spawns: an import in a
        thread holds the GIL in slices of the switch interval (5 ms), and the loop would wait
        out a slice between two spawn answers (start 256: ~100 ms)."""
        assert self.sup is not None
        units = self.sup.units.values()
        await self.sup.wait_until(lambda: not any(rt.phase is Phase.SPAWNING for rt in units), HEALTH_IMPORT_WAIT_S)
        health_mod = await asyncio.to_thread(importlib.import_module, "omnid.api.health")
        self.health = health_mod.HealthServer(self.sup, self.cfg.health_listen, degraded=lambda: self.sup.degraded_units(),
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

    def _on_hup(self) -> None:
        log.info("SIGHUP: reloading the stack directory", units_dir=self.cfg.units_dir)
        report_crash(asyncio.get_running_loop().create_task(self._reload_on_hup()), "reload on SIGHUP")

    async def _reload_on_hup(self) -> None:
        if self.handlers is None:  # the first tier is being spawned: nothing read yet can differ
            log.warning("SIGHUP while the daemon starts: nothing to reload yet; send it again once it is up")
            return
        try:
            result = await self.handlers.handle_reload({})
        except ControlError as exc:
            log.error("reload refused", code=exc.code, reason=exc.message)
            return
        log.info("reload done", added=result["added"], removed=result["removed"], restarted=result["restarted"],
                 updated=result["updated"], settings=result["settings"], ok=result.get("ok", True))

    def _on_signal(self, sig: int) -> None:
        assert self.shutdown_requested is not None
        if self.shutdown_requested.is_set():
            assert self.force_stop is not None
            if not self.force_stop.is_set():
                log.warning("second signal while stopping: SIGKILL to every unit now", signal=linux.signal_name(sig))
                self.force_stop.set()
            return
        log.info("signal received: stopping the stack in order", signal=linux.signal_name(sig))
        self.shutdown_requested.set()

    def _notify_sender(self, pid: int) -> str | None:
        return self.sup.monitors.sender_unit(pid) if self.sup is not None else None

    def _on_fds(self, unit: str, fields: dict[str, str], fds: list[int]) -> None:
        if self.sup is None:
            for fd in fds:
                os.close(fd)
            return
        self.sup.fdstore.offer(unit, fields, fds)

    def _on_notify(self, pid: int, fields: dict[str, str]) -> None:
        if self.sup is not None:
            self.sup.monitors.on_notify(pid, fields)


def run(units_dir: str | None, control: str | None, state_dir: str | None, health_listen: str | None,
        log_format: str | None, log_file: str | None = None,
        cgroup_root: str | None = None, takeover: int | None = None,
        spawner: SpawnerProcess | None = None) -> int:
    """The `omnid daemon` command. Returns the process exit code. `takeover`: the fd of the
    handover a previous program of this daemon left (omnid reexec). `spawner`: one already
    started (omnid.process.spawnstart), taken over; else one is started here."""
    # A thread running Python (a reload's parse, a capture's listing, the health API's
    # import) keeps the GIL for the switch interval at a time, and the loop that sees deaths
    # waits for it: 1 ms instead of Python's 5. Measured beside a thread spinning in Python: a
    # death seen in 1.25 ms instead of 5.3 (a reload's parse of 256 files, mostly I/O, showed
    # no difference: bench/gil_numbers.py).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    udir = os.path.abspath(units_dir or default_units_dir())
    if takeover is not None:
        from omnid.daemon import handover

        try:
            rec = handover.read_memfd(takeover)
            code = _run_taken_over(rec)
            if code is not None:
                return code
            why = "the handed-over units could not be taken over (see the log)"
        except (ValueError, KeyError, TypeError, StackInvalid) as exc:
            why = f"{type(exc).__name__}: {exc}"
        cfg = settings.resolve(units_dir=udir, control=control, state_dir=state_dir, health_listen=health_listen,
                               log_format=log_format, cgroup_root=cgroup_root)
        logconfig.configure(cfg.log_format, log_file=log_file)
        survivors = handover.stop_what_is_provably_ours(cfg.state_dir, udir, why)
        if survivors:
            log.error("units of the previous program survived SIGKILL", processes=survivors)
        handover.forget_inherited_fds()
        handover.reap_old_children()
        handover_error = why
    else:
        handover_error = None
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
    _set_title(cfg)
    lock_fd = _lock_state_dir(cfg)
    if lock_fd < 0:
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
    daemon.lock_fd, daemon.log_file, daemon.handover_error = lock_fd, log_file, handover_error
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


def _run_taken_over(rec: dict) -> int | None:
    """Go on from a handover: the same units, processes, fds and settings. None when it turned
    out unusable before anything was taken over (the caller falls back)."""
    from omnid.daemon import handover

    cfg = handover.settings_of(rec)
    stack = load_stack(rec["stack"]["directory"], handover.decode_sources(rec["stack"]["sources"]))
    handover.validate(rec, stack)
    log_file = rec["settings"]["log_file"]
    logconfig.configure(cfg.log_format, log_file=log_file)
    _set_title(cfg)
    daemon = Daemon(cfg, stack, ServiceNotifier(dict(rec["systemd"])))
    daemon.token = str(rec["token"])
    daemon.reexecs = int(rec["reexecs"]) + 1
    daemon.lock_fd, daemon.log_file = int(rec["lock_fd"]), log_file
    os.set_inheritable(daemon.lock_fd, False)
    if rec["cgroup"] is not None:
        daemon.cgroups = cgroup_mod.CgroupRoot.take_over(rec["cgroup"])
    raise_nofile_limit()
    log.info("taking over from the previous program", from_version=rec["from_version"],
             to_version=rec["to_version"], reexecs=daemon.reexecs)
    try:
        return asyncio.run(daemon.run(takeover=rec))
    finally:
        os.close(daemon.lock_fd)


def _set_title(cfg: DaemonConfig) -> None:
    try:
        from setproctitle import setproctitle

        setproctitle(f"omnid: daemon {cfg.units_dir}")
    except ImportError:
        pass


def _lock_state_dir(cfg: DaemonConfig) -> int:
    """The state directory, made private, and its lock held for the daemon's life; -1 (said
    why) when another daemon holds it or the directory is not safe."""
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
        return -1
    except OSError as exc:
        print(f"omnid: cannot use state dir {cfg.state_dir}: {exc}", file=sys.stderr)
        return -1
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"omnid: another daemon holds {cfg.state_dir}/daemon.lock", file=sys.stderr)
        os.close(lock_fd)
        return -1
    return lock_fd
