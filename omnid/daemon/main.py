"""The running daemon: the parts it holds (spawner client, supervisor, notify socket, control
socket, health API, GPU backend, cleanup, cluster membership) on one asyncio loop, how they
are brought up, and how they talk to each other (ARCHITECTURE.md, "Processes").

There are two ways up, sharing their steps: `start_fresh` (`omnid daemon`) and
`continue_after_reexec` (the same daemon after `omnid reexec`, going on from the record its
previous program handed over: omnid.daemon.handover, omnid.daemon.record). What happens before the
loop (settings, the state directory's lock, the spawner's exec) is omnid.daemon.command's; the stop
is omnid.daemon.shutdown's; the control socket and the health API are omnid.daemon.fronts'.

Why this order (both ways up):
1. Signal handlers first: SIGTERM/SIGINT stop the stack, SIGHUP reloads; they only hand the
   signal to the loop.
2. The spawner: started by exec before the first ZeroMQ socket exists (from then on the daemon
   has native threads and never forks); after a re-exec the running one is adopted.
3. The notify socket, before the supervisor: its address goes into every unit's environment.
4. The GPU backend only if a unit needs the GPU check to start (a leftover holding its GPU);
   otherwise it loads after the first tier is out, like the rest of the heavy imports.
5. The supervisor, then the cleanup (a fanotify thread: after the spawner's exec).
6. After a re-exec, the handed-over state is taken over before the cluster membership opens
   (the groups' generations are checked against the restart books taken over).
7. The cluster membership (a stack across hosts), before any unit starts: ranks come from it.
8. The health socket is bound before any unit starts: a busy port fails the daemon with
   nothing started (and after a re-exec it is the same socket, never closed).
9. The first tier is spawned (or, after a re-exec, what the records imply is re-armed), and
   only then the heavy imports: control handlers, the GPU backend, ZeroMQ, aiohttp (in a
   thread, once the spawns are answered). The first child does not wait ~150 ms of imports.
10. The control socket, the GPU watch, the state file; then the daemon serves until stopped.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import time

import structlog

from omnid.daemon import clusterwiring
from omnid.daemon.parts import DaemonParts
from omnid.daemon import fronts
from omnid.base import closer, linux, testswitch
from omnid.daemon import shutdown
from omnid.daemon import startup
from omnid.api.control import ControlError
from omnid.core import takeover as takeover_mod
from omnid.core.faults import ENV as FAULTS_ENV
from omnid.core.faults import Faults
from omnid.core.cleanup import UnitCleanup
from omnid.core.supervisor import Supervisor
from omnid.api.notify import NotifyServer, Sender
from omnid.model.settings import DaemonConfig
from omnid.process.spawnclient import SpawnerClient
from omnid.api.systemd import ServiceNotifier
from omnid.base.tasks import report_crash
from omnid.model.units import Stack

log = structlog.get_logger("omnid.daemon.main")

# At most this many turns of the loop wait for the first tier's spawn requests to be sent
# (a spawn waiting on a thread, a cache_dir being made, takes more turns: it goes on alone).
FIRST_TIER_TURNS = 64


class Daemon(DaemonParts):
    def __init__(self, cfg: DaemonConfig, stack: Stack, service: ServiceNotifier | None = None) -> None:
        super().__init__(cfg, stack, service)
        self.spawner = SpawnerClient(on_exit=self._on_exit, on_gone=self._on_spawner_gone)

    # -- the two ways up (the order: the module's docstring) -------------------------
    async def start_fresh(self) -> int:
        """`omnid daemon`: start the stack, serve until it is stopped; the exit code."""
        self._handle_signals()
        await self.spawner.attach()
        self._open_notify(inherited=None)
        self._open_gpu_if_a_unit_needs_it_to_start()
        self._make_supervisor()
        self._start_cleanup()
        await self._open_cluster(record=None)
        health_sock = fronts.health_socket(self, inherited_fd=None)
        if self._starting(health_sock):
            await self._start_first_tier()
        self._bring_up_the_rest()
        log.info("daemon ready", units_dir=self.cfg.units_dir, control=self.cfg.control,
                 health=self.cfg.health_listen, units=len(self.sup.units), spawner_pid=self.spawner.pid, nice=self.nice,
                 reexecs=self.reexecs, handover_ms=self.handover_ms)
        return await self._serve(health_sock, settled=False)

    async def continue_after_reexec(self, record: dict) -> int:
        """After `omnid reexec`: go on from the record the previous program of this daemon
        handed over (checked whole by omnid.daemon.record before this runs), with its
        spawner, units, sockets and counters; serve until stopped; the exit code."""
        self._handle_signals()
        closer.close_all(record.get("foreign_fds") or [])  # what the previous program had still to close
        sp = record["spawner"]
        self.spawner.adopt(sp["pid"], sp["pidfd"], sp["sock"], sp["start_time"], sp.get("exec_path"))
        self._open_notify(inherited=record["notify"])
        self._open_gpu_if_a_unit_needs_it_to_start()
        self._make_supervisor()
        self._start_cleanup()
        self.cleanup.take_over(record.get("cleanup"))
        self._load_handlers()  # units in the middle of a stop may capture at once
        takeover_mod.take_over(self.sup, record["supervisor"])
        self.metrics.take_over(record["metrics"])
        await self._open_cluster(record)
        health_sock = fronts.health_socket(self, inherited_fd=record["health"]["fd"])
        if self._starting(health_sock):
            takeover_mod.resume(self.sup)
            report_crash(asyncio.get_running_loop().create_task(self.cleanup.sweep_previous()), "private tmp sweep")
        self._bring_up_the_rest()
        self.handover_ms = round((time.monotonic() - float(record["exec_at"])) * 1000, 1)
        log.info("daemon re-executed: every unit taken over", units_dir=self.cfg.units_dir, control=self.cfg.control,
                 health=self.cfg.health_listen, units=len(self.sup.units), spawner_pid=self.spawner.pid, nice=self.nice,
                 reexecs=self.reexecs, handover_ms=self.handover_ms)
        return await self._serve(health_sock, settled=record["settled"])

    # -- the steps ------------------------------------------------------------------
    def _handle_signals(self) -> None:
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

    def _open_notify(self, inherited: dict | None) -> None:
        self.notify = NotifyServer(self.token, self._on_notify, attribute=self._notify_sender,
                                   fd=None if inherited is None else inherited["fd"], on_fds=self._on_fds)
        if inherited is not None:
            self.notify.counters.update(inherited["counters"])
        self.notify.start()

    def _open_gpu_if_a_unit_needs_it_to_start(self) -> None:
        # The first tier is spawned before the GPU backend, ZeroMQ and the HTTP server are
        # loaded, unless a unit needs the GPU check (a leftover holding its GPU) to start.
        if any(u.gpus for u in self.stack):
            from omnid import gpu as gpu_mod

            self.gpu = gpu_mod.open_backend()

    def _make_supervisor(self) -> None:
        assert self.notify is not None
        self.sup = Supervisor(self.stack, self.spawner, token=self.token, notify_socket=self.notify.address,
                              publish=self._publish,
                              on_pids_changed=self._schedule_state_write,
                              check_invariants=os.environ.get("OMNID_CHECK_INVARIANTS") == "1",
                              gpu=self.gpu, cgroups=self.cgroups)
        self.sup.sockets.keep_record(self.cfg.state_dir)  # what proves a unit's socket file omnid's
        self.sup.fdstore.start()  # stored fds that hang up are dropped (omnid.process.fdstore)
        for name, why in testswitch.refused_at_start():  # outside omnid's test suite: ignored, said once
            log.error("test switch ignored", env=name, reason=why)
        if (note := linux.proc_children_note()) is not None:
            log.warning("no children lists in /proc: falling back to full scans", reason=note)
        faults, refused = Faults.from_environ()
        if refused:
            log.error("test fault injection refused", reason=refused)
        if faults is not None:  # developer-only (omnid/core/faults.py): never in production
            log.error("TEST FAULT INJECTION IS ON: an action will raise", point=faults.point, unit=faults.unit,
                      env=FAULTS_ENV)
            self.sup.executor.faults = faults

    def _start_cleanup(self) -> None:
        """Private tmp and IPC residue (a thread: the fanotify listener, after the spawner's exec)."""
        assert self.sup is not None
        sup = self.sup  # `cache_root` of the stack loaded now: a reload may change it
        self.cleanup = UnitCleanup(self.token, self.cfg.state_dir, cache_root=lambda: sup.stack.settings.cache_root)
        self.sup.executor.cleanup = self.cleanup
        self.spawner.before_send = self.cleanup.flush_record  # one record write per batch of spawns
        self.cleanup.start()

    async def _open_cluster(self, record: dict | None) -> None:
        """[cluster]: this host's membership; refused, the daemon stops at once with exit 2."""
        assert self.shutdown_requested is not None
        if self.stack.settings.cluster is not None and not await clusterwiring.open_cluster(self, record):
            self.exit_code = 2  # named on stderr and in the log; nothing is started
            self.shutdown_requested.set()

    def _starting(self, health_sock: socket.socket | None) -> bool:
        """Nothing refused the start so far (the cluster, the health socket)."""
        assert self.shutdown_requested is not None
        return health_sock is not None and not self.shutdown_requested.is_set()

    async def _start_first_tier(self) -> None:
        assert self.sup is not None and self.cleanup is not None
        self.sup.kick()
        # Turns of the loop until the first tier's requests are out (the converge, each spawn's
        # preparation, a private TMPDIR's record among them, its request, the spawner client's
        # send): nothing below is imported before. Three fixed turns were too few for a unit
        # with a private TMPDIR: its spawn went out after the imports (~35 ms later here).
        quiet = 0
        for _ in range(FIRST_TIER_TURNS):
            await asyncio.sleep(0)
            quiet = 0 if self.sup.executor.unsent else quiet + 1
            if quiet >= 3 and not self.spawner.queued:  # the last one asked, then sent
                break
        report_crash(asyncio.get_running_loop().create_task(self.cleanup.sweep_previous()), "private tmp sweep")

    def _bring_up_the_rest(self) -> None:
        """What waits until the first tier is out: the control handlers, the GPU backend, the
        control socket, the GPU watch; then the state file names what runs."""
        assert self.sup is not None
        self._load_handlers()
        if self.gpu is None:
            from omnid import gpu as gpu_mod

            self.gpu = self.sup.gpu = gpu_mod.open_backend()
        if not self.gpu.available:
            log.info("GPU checks off", reason=self.gpu.reason)
        fronts.open_control(self)
        self.start_gpu_watch()
        self._write_state()
        # On from here (off since the command's first line, omnid.cli.main): what was
        # allocated so far lives as long as the daemon, out of every collection.
        gc.freeze()
        gc.enable()

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
        self.handlers = ControlHandlers(self, fronts.check_new_program)

    async def _serve(self, health_sock: socket.socket | None, settled: bool) -> int:
        """Serve until a stop is asked, then stop (omnid.daemon.shutdown). `settled`: the stack's first
        start had settled before a re-exec (READY=1 was sent then)."""
        assert self.sup is not None and self.shutdown_requested is not None and self.settled is not None
        startup_task = None
        if health_sock is not None and self.shutdown_requested.is_set():
            health_sock.close()
        elif health_sock is not None:
            self.service.status(f"starting: {startup.progress(self.sup)}")
            self.service.start_watchdog()
            fronts.start_health(self, health_sock)
            if settled:
                self.settled.set()
                self.service.status(f"ready: {startup.progress(self.sup)} (re-executed)")
            else:
                startup_task = asyncio.get_running_loop().create_task(
                    startup.watch(self.sup, self.service, self.settled, self.shutdown_requested))
                startup_task.add_done_callback(self._report_task)
            if self.stack.settings.exit_when_failed:
                self.failed_watch = report_crash(
                    asyncio.get_running_loop().create_task(clusterwiring.watch_failed_for_good(self)),
                    "exit_when_failed")
        await self.shutdown_requested.wait()
        return await shutdown.stop_daemon(self, startup_task)

    # -- re-exec (omnid.daemon.handover) ---------------------------------------------------
    def start_reexec(self, check) -> None:  # noqa: ANN001 - omnid.handover.ProgramCheck
        from omnid.daemon import handover

        self.reexec = report_crash(asyncio.get_running_loop().create_task(handover.hand_over(self, check)),
                                   "re-exec")

    # Called by omnid.handover.hand_over, which may be a newer program's (imported at the
    # `reexec` request, after an upgrade in place): these names stay as they are.
    async def close_for_exec(self) -> None:
        await fronts.close_for_exec(self)

    async def reopen_after_failed_exec(self) -> None:
        await fronts.reopen_after_failed_exec(self)

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

        out = {"version": version(), "reexecs": self.reexecs, "program_since": self.program_since, "nice": self.nice,
               **({"handover_ms": self.handover_ms} if self.handover_ms is not None else {})}
        if self.cluster is not None:
            out["cluster"] = self.cluster.status()
        return out

    @staticmethod
    def _report_task(task: asyncio.Task) -> None:
        """No task whose exception nobody sees: log it the moment it ends badly."""
        if not task.cancelled() and task.exception() is not None:
            log.error("daemon task failed", task=task.get_coro().__qualname__, error=repr(task.exception()))

    def _on_hup(self) -> None:
        """SIGHUP asks the daemon to run what the stack directory says now. One reload at a
        time: the SIGHUPs that arrive during one are folded into one more after it, which
        reads the newest files. A storm of them costs back-to-back reloads at most, never a
        backlog of one reload per signal, which starved the loop (no control reply, no
        death seen) and, once asyncio's signal wakeup socket filled, lost signals, a SIGTERM
        among them."""
        if self.hup_reload is not None:
            self.hup_folded += 1
            return
        self.hup_reload = report_crash(asyncio.get_running_loop().create_task(self._reloads_on_hup()),
                                       "reload on SIGHUP")

    async def _reloads_on_hup(self) -> None:
        try:
            signals = 1
            while True:
                self.hup_folded = 0
                if self.handlers is None:  # the first tier is being spawned: nothing read yet can differ
                    self.hup_early += signals
                    if self.hup_early == signals:  # the first only: a storm must not flood the log
                        log.warning("SIGHUP while the daemon starts: nothing to reload yet; send it again once "
                                    "it is up (further SIGHUPs until then are not logged)")
                    return
                log.info("SIGHUP: reloading the stack directory", units_dir=self.cfg.units_dir, signals=signals)
                await self._reload_on_hup()
                signals = self.hup_folded
                if not signals:
                    return
        finally:
            self.hup_reload = None

    async def _reload_on_hup(self) -> None:
        assert self.handlers is not None and self.sup is not None
        reloader = self.sup.reloader
        while True:
            if not reloader.idle.is_set():
                # A reload asked over the control socket is being applied, and it may have read
                # the files before this SIGHUP's change: this one runs once it is done.
                log.info("SIGHUP: waiting for the reload under way to end first",
                         for_s=round(time.monotonic() - (reloader.running_since or time.monotonic()), 1))
                await reloader.idle.wait()
            try:
                result = await self.handlers.handle_reload({})
            except ControlError as exc:
                if exc.code == "busy":  # another began while this one read the files
                    continue
                log.error("reload refused", code=exc.code, reason=exc.message)
                return
            break
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

    def _notify_sender(self, sender: Sender) -> str | None:
        return self.sup.monitors.sender_unit(sender.pid, sender.pidfd) if self.sup is not None else None

    def _on_fds(self, unit: str, fields: dict[str, str], fds: list[int]) -> None:
        if self.sup is None:  # nothing to keep them in yet
            closer.close_all(fds)
            return
        self.sup.fdstore.offer(unit, fields, fds)

    def _on_notify(self, pid: int, fields: dict[str, str]) -> None:
        if self.sup is not None:
            self.sup.monitors.on_notify(pid, fields)
