"""What the running daemon holds (its parts, on one asyncio loop) and the GPU watch it runs:
the state that omnid.daemon.main brings up, omnid.daemon.fronts opens and closes, and
omnid.daemon.shutdown stops. A module of its own so that those modules name the daemon's type
without importing the module that imports them."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

from omnid.api.control import ControlServer
from omnid.api.metrics import DaemonMetrics
from omnid.api.notify import NotifyServer
from omnid.api.systemd import ServiceNotifier
from omnid.base.tasks import DaemonTask
from omnid.core.cleanup import UnitCleanup
from omnid.core.supervisor import Supervisor
from omnid.daemon.statefile import StateFile
from omnid.model.settings import DaemonConfig
from omnid.model.units import Stack
from omnid.process.spawnclient import SpawnerClient

if TYPE_CHECKING:  # imported once the first tier's spawns are out (Daemon._load_handlers)
    from omnid.api.handlers import ControlHandlers
    from omnid.forensics.store import CaptureStore


class DaemonParts:
    """What the daemon holds, for its modules (fronts, shutdown) to read and set; `Daemon`
    brings it up. The spawner client is made by `Daemon`, which receives its reports."""

    spawner: SpawnerClient

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
        self.gpu_task: DaemonTask | None = None
        self.control_reader: DaemonTask | None = None  # omnid.daemon.fronts
        self.health_task: asyncio.Task | None = None  # omnid.daemon.fronts
        self.reexecs = 0  # how many times this daemon replaced its own program (omnid reexec)
        self.nice: int | None = None  # the daemon's nice value, once set (omnid.base.priority)
        self.program_since = time.time()  # when this program of the daemon began (a re-exec begins another)
        self.handover_ms: float | None = None  # exec -> every unit taken over, at the last re-exec
        self.handlers: ControlHandlers | None = None  # once the first tier is out
        self.hup_reload: asyncio.Task | None = None  # the reload SIGHUP runs: one at a time
        self.hup_folded = 0  # SIGHUPs during that reload: they ask for one more, not one each
        self.hup_early = 0  # SIGHUPs before there was anything to reload (the first is logged)
        self.zmq = None  # the zmq.asyncio.Context, made once the first tier is out
        self.health_fd = -1  # a dup of the health listening socket, kept for a re-exec
        self.lock_fd = -1  # the state directory's lock, held for the daemon's life
        self.log_file: str | None = None
        self.reexec: asyncio.Task | None = None  # a re-exec being prepared
        self.handover_error: str | None = None  # why the last re-exec's handover could not be used
        self.cleanup: UnitCleanup | None = None  # private tmp directories and IPC residue
        self.captures: CaptureStore | None = None  # hang forensics (omnid dump), with the handlers
        self.cluster = None  # omnid.cluster.session.ClusterSession with [cluster]
        self.failed_watch: asyncio.Task | None = None

    def start_gpu_watch(self) -> None:
        if self.gpu is not None and self.gpu.available:
            self.gpu_task = DaemonTask("GPU watch", lambda: asyncio.get_running_loop().create_task(
                self.gpu_watch())).start()

    def stop_gpu_watch(self) -> None:
        if self.gpu_task is not None:
            self.gpu_task.close()
            self.gpu_task = None

    async def gpu_watch(self) -> None:
        from omnid.gpu import watch

        assert self.sup is not None
        await watch.watch(self.gpu, self.sup)
