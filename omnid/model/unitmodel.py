"""The unit model (omnid.unit(5)): frozen, typed units and stacks as
`omnid.units.load_stack` returns them, with the stack's start tiers and who requires whom.
Nothing here reads files."""

from __future__ import annotations

import re
import resource
import signal
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple




SETTINGS_FILE = "omnid.toml"
DEFAULT_TITLE = "omnid: %n"

# Set by omnid itself (omnid.unit(5), ENVIRONMENT OF A UNIT); a unit that overrode
# them would hide from residue scans or talk to the wrong notify socket.
RESERVED_ENV = frozenset({"OMNID_UNIT", "OMNID_INSTANCE", "OMNID_INSTANCES", "OMNID_GENERATION", "SPT_NOENV",
                          "NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_FDNAMES", "LISTEN_PID", "OMNID_CACHE_DIR"})

# '@' separates a template from its instance number and '%' starts a specifier,
# so neither may appear in a unit name; '/' would escape the directory. Also a worker group's name.
UNIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

# torch.distributed's env:// rendezvous (set by omnid for `torch_distributed` units).
TORCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

# rlimit names as written in `limits` (nofile, memlock, ...) -> resource constants.
RLIMITS: Mapping[str, int] = MappingProxyType(
    {n[len("RLIMIT_"):].lower(): getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")}
)



# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class UnitFileError:
    """One problem in one file: which file, which key, what was expected."""

    file: Path
    key: str  # dotted for nested keys ("liveness.interval"); "" for a whole-file problem
    message: str  # what is wrong and what was expected; never empty

    def __str__(self) -> str:
        if self.key:
            return f"{self.file}: {self.key}: {self.message}"
        return f"{self.file}: {self.message}"


class StackInvalid(Exception):
    """The stack directory cannot be run; `errors` lists every problem found, in file order."""

    def __init__(self, errors: Sequence[UnitFileError]) -> None:
        self.errors: tuple[UnitFileError, ...] = tuple(errors)
        super().__init__(self.errors)

    def __str__(self) -> str:
        count = len(self.errors)
        head = f"{count} error{'s' if count != 1 else ''} in unit files"
        return "\n".join([head + ":", *(f"  {e}" for e in self.errors)])


# --------------------------------------------------------------------------- parsed objects


class ReadyKind(StrEnum):
    STARTED = "started"
    NOTIFY = "notify"
    HTTP = "http"
    TCP = "tcp"


@dataclass(frozen=True)
class Ready:
    """When a unit counts as ready. `url` is set for HTTP, `host` and `port` for TCP."""

    kind: ReadyKind = ReadyKind.STARTED
    url: str = ""
    host: str = ""
    port: int = 0


@dataclass(frozen=True)
class Liveness:
    """Periodic probe while active: `failures` failed probes in a row fail the unit.

    The http form (`url` set) sends `method` with `body` and `headers` and passes when
    the status is in `expect` (empty: any 2xx); the exec form (`exec` set) runs that
    program as the unit's user and passes when it exits 0 within `timeout`."""

    url: str = ""
    interval: float = 5.0
    timeout: float = 2.0
    failures: int = 3
    method: str = "GET"
    body: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    expect: tuple[int, ...] = ()  # accepted statuses; () = any 2xx
    exec: tuple[str, ...] = ()

    def accepts(self, status: int) -> bool:
        return status in self.expect if self.expect else 200 <= status < 300


@dataclass(frozen=True)
class Canary:
    """The request the progress rule sends itself once the busy gauges have said idle for
    `stall_sec` (a one-token completion): accepted and neither answered nor seen producing a
    token within `stall_sec` while the metrics still answer, the unit is hung."""

    url: str
    method: str = "POST"
    body: str = ""
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Progress:
    """Forward-progress watchdog on a Prometheus endpoint: the unit fails when the `busy`
    gauges (summed over their labels) are > 0 and `counter` (summed) has not grown for
    `stall_sec` seconds; scraped every `interval` seconds. With a `canary`, an idle unit is
    asked for work now and then, for the gauges freeze with a hung engine."""

    metrics: str
    counter: str
    busy: tuple[str, ...]
    stall_sec: float = 60.0
    interval: float = 5.0
    canary: Canary | None = None


DEFAULT_BACKLOG = 1024  # a `sockets` entry's listen backlog when the unit file gives none


@dataclass(frozen=True)
class ListenSocket:
    """One `sockets` entry: a listening socket the daemon binds before the unit starts and
    holds across its restarts, passed to it as systemd does (LISTEN_FDS, from fd 3)."""

    listen: str  # "HOST:PORT" (numeric host, IPv6 in brackets) or an absolute Unix socket path
    name: str  # its LISTEN_FDNAMES entry
    backlog: int = DEFAULT_BACKLOG
    mode: int = 0o660  # a Unix socket's file mode
    reuseport: bool = False  # SO_REUSEPORT: several sockets (instances) on one address

    @property
    def unix(self) -> bool:
        return self.listen.startswith("/")


# fd_store_max at most: a unit's passed fds (held sockets and stored fds) travel to the spawner
# in one datagram with its stdout and stderr, and the kernel's SCM_MAX_FD is 253.
MAX_PASSED_FDS = 248


class UpdatePolicy(StrEnum):
    """How a restart or reload replaces the instances of a unit with `instances > 1`."""

    RESTART = "restart"  # all at once (dependents follow, as after any restart)
    ROLLING = "rolling"  # max_unavailable at a time, each next one once the new one is ready


class KillMode(StrEnum):
    """Who gets `stop_signal` (systemd's KillMode=)."""

    CONTROL_GROUP = "control-group"  # every process of the unit at once
    MIXED = "mixed"  # the main process; the rest SIGKILLed once it has exited, or at stop_timeout
    PROCESS = "process"  # the main process; the rest get stop_signal once it has exited


@dataclass(frozen=True)
class DrainHook:
    """`drain`: how a unit is told to stop taking work before its stop signal: a POST to
    `url`, or the signal `sig`."""

    url: str = ""
    sig: signal.Signals | None = None


class NumaMode(StrEnum):
    """`numa`'s words; a node number is the third form (an int)."""

    AUTO = "auto"  # the NUMA node(s) of the unit's `gpus`, when it has some
    OFF = "off"


# A GPU as `gpus` names it: an index (PCI bus order, as NVML and CUDA_DEVICE_ORDER=PCI_BUS_ID
# count), or a GPU or MIG device UUID as nvidia-smi -L prints it.
GpuRef = int | str


class RestartPolicy(StrEnum):
    NO = "no"
    ON_FAILURE = "on-failure"
    ALWAYS = "always"


class Rlimit(NamedTuple):
    """One `limits` entry, shaped as the spawner's (resource, soft, hard) triple."""

    resource: int
    soft: int
    hard: int


@dataclass(frozen=True)
class TorchDistributed:
    """`torch_distributed`: where rank 0 of a worker group listens for torch's env:// rendezvous."""

    master_addr: str = "127.0.0.1"
    master_port: int = 29500


@dataclass(frozen=True)
class Unit:
    """One runnable unit instance, with every %i / %n already expanded.

    Field names are the unit-file keys. `after` and `requires` hold full unit
    names (a dependency on a template is expanded to all its instances). A field's
    default is its key's default: the key table (omnid.model.keys) reads it from here.
    """

    name: str  # "worker@1", or "serve" for a single unit
    template: str  # "worker": the file name without .toml
    instance: int  # 0 for a single unit
    instances: int  # how many instances the template has
    file: Path
    exec: tuple[str, ...]
    description: str = ""
    role: str = ""
    title: str = DEFAULT_TITLE  # "" = leave the process title alone
    after: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    cwd: str | None = None
    # Includes CUDA_VISIBLE_DEVICES derived from `gpus`; excluded from the hash
    # because a mapping is not hashable.
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    user: str | None = None
    group: str | None = None
    limits: tuple[Rlimit, ...] = ()
    gpus: tuple[GpuRef, ...] = ()
    numa: NumaMode | int = NumaMode.AUTO  # CPU affinity and memory policy at spawn (omnid.process.numa)
    ready: Ready = Ready()
    ready_timeout: float = 600.0
    liveness: Liveness | None = None
    progress: Progress | None = None
    ready_interval: float = 5.0  # an http/tcp `ready` probe keeps running while active; 0 = off
    watchdog_sec: float = 0.0
    stop_signal: signal.Signals = signal.SIGTERM
    stop_timeout: float = 10.0
    # A unit failed alive (watchdog, liveness, progress, ready_timeout): seconds after its
    # stop_signal before SIGKILL, as systemd's TimeoutAbortSec=; None = stop_timeout. A hung
    # tree rarely finishes a graceful stop, and every second of it is an outage.
    abort_timeout: float | None = None
    worker_group: str | None = None  # members fail, stop and restart together
    torch_distributed: TorchDistributed | None = None
    group_hosts: tuple[str, ...] = ()  # a worker group across hosts (omnid.cluster): the leading host first
    kill_timeout: float = 10.0
    kill_mode: KillMode = KillMode.CONTROL_GROUP
    # After the main process exits by itself: how long its leftovers have, after stop_signal,
    # before SIGKILL (a resource tracker unlinks what it registered); 0 = SIGKILL at once.
    leftover_timeout: float = 3.0
    private_tmp: bool = True  # TMPDIR (TMP, TEMP) = a directory of this instance's own
    remove_ipc: bool = True  # its processes' POSIX and SysV IPC objects go with the unit
    # A persistent directory under the daemon's cache root (omnid.process.cachedir): False = none,
    # True = named for the template (its instances share it), a string = that name.
    cache_dir: bool | str = False
    # Seconds the hang capture (omnid.forensics) may take before a unit that is alive but
    # failed is killed; 0 = no capture.
    capture_timeout: float = 3.0
    drain: DrainHook | None = None  # planned stops drain first (omnid.unit(5) `drain`)
    drain_timeout: float = 30.0
    restart: RestartPolicy = RestartPolicy.NO
    restart_sec: float = 1.0
    restart_max_sec: float = 60.0
    start_limit_burst: int = 5
    start_limit_interval: float = 60.0
    gpu_min_free_mib: int = 0
    memory_max: int | str | None = None  # cgroup memory.max (systemd MemoryMax=); "max" = no limit
    tasks_max: int | str | None = None  # cgroup pids.max (systemd TasksMax=)
    sockets: tuple[ListenSocket, ...] = ()  # held by the daemon, passed from fd 3 (omnid.process.sockets)
    update: UpdatePolicy = UpdatePolicy.RESTART  # how a reload replaces its instances (omnid.core.reload)
    max_unavailable: int = 1  # instances a roll takes down at a time
    fd_store_max: int = 0  # fds the unit may keep in the daemon's fd store (omnid.process.fdstore); 0 = off

    @property
    def dependencies(self) -> tuple[str, ...]:
        """Units that must be ready before this one starts (`requires` implies `after`)."""
        return tuple(sorted(set(self.after) | set(self.requires)))

    def environ(self, base: Mapping[str, str], notify_socket: str | None = None) -> dict[str, str]:
        """The full environment of this unit's process (omnid.unit(5), ENVIRONMENT OF A UNIT).

        `base` is the daemon's own environment. Its systemd notify variables are
        dropped: they belong to the daemon, and a unit writing to them would
        speak for omnid to systemd.
        """
        env = {k: v for k, v in base.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        env.update(self.env)
        env["OMNID_UNIT"] = self.name
        env["OMNID_INSTANCE"] = str(self.instance)
        env["OMNID_INSTANCES"] = str(self.instances)
        env["SPT_NOENV"] = "1"  # setproctitle would otherwise wipe /proc/PID/environ (the OMNID_UNIT tag)
        if notify_socket is not None and (self.ready.kind is ReadyKind.NOTIFY or self.fd_store_max > 0):
            env["NOTIFY_SOCKET"] = notify_socket  # a unit with an fd store speaks sd_notify whatever `ready` says
            if self.watchdog_sec > 0 and self.ready.kind is ReadyKind.NOTIFY:
                # sd_watchdog_enabled() in the child reads this to learn the interval.
                env["WATCHDOG_USEC"] = str(int(self.watchdog_sec * 1_000_000))
        return env


class LogFormat(StrEnum):
    JSON = "json"
    CONSOLE = "console"


@dataclass(frozen=True)
class DaemonSettings:
    """`omnid.toml`: daemon flags in snake_case. None = not set there (the flag or default applies)."""

    file: Path | None = None
    control: Path | None = None
    state_dir: Path | None = None
    health_listen: str | None = None  # "HOST:PORT", numeric host
    log_format: LogFormat | None = None
    cgroup_root: Path | None = None  # omnid.process.cgroup: a writable cgroup v2 directory for the units
    cache_root: Path | None = None  # where units' `cache_dir` directories live (None: settings.default_cache_root)
    drain_sec: float | None = None  # /health 503 "draining" this long before the stack's first stop signal
    stop_deadline: float | None = None  # the stack stop's bound (None: derived from the units' budgets)
    # [cluster]: a stack across hosts, an omnid.cluster.settings.ClusterSettings (not imported
    # here: that module reads unit-file errors from this one)
    cluster: object | None = None
    exit_when_failed: bool = False  # stop the stack and exit 1 once a unit failed for good
    # The daemon's own nice value (its threads'; the units keep the one omnid was started with):
    # a supervisor whose units spin every core must still detect a death, answer /health and
    # renew its cluster lease in milliseconds (omnid.base.priority). None: 10 steps ahead of the
    # units (omnid.base.priority.DAEMON_NICE_AHEAD).
    daemon_nice: int | None = None


@dataclass(frozen=True, eq=False)
class Stack:
    """A validated stack: units by name (sorted), their start tiers and who requires whom."""

    directory: Path
    units: Mapping[str, Unit]
    settings: DaemonSettings
    _tiers: tuple[tuple[Unit, ...], ...] = field(repr=False)
    _tier_of: Mapping[str, int] = field(repr=False)
    _required_by: Mapping[str, tuple[str, ...]] = field(repr=False)
    # worker_group name -> member unit names in rank order (template, then instance number).
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    # file name -> the bytes this stack was read from: what a re-executed daemon parses
    # again, so that it runs what was loaded, not what the files say now.
    sources: Mapping[str, bytes] = field(default_factory=lambda: MappingProxyType({}), repr=False)

    def group_members(self, name: str) -> tuple[str, ...]:
        """The members of `name`'s worker group (itself included), or just (name,)."""
        group = self.units[name].worker_group
        return self.groups[group] if group else (name,)

    def __iter__(self) -> Iterator[Unit]:
        return iter(self.units.values())

    def __len__(self) -> int:
        return len(self.units)

    def __getitem__(self, name: str) -> Unit:
        return self.units[name]

    def __contains__(self, name: object) -> bool:
        return name in self.units

    def tiers(self) -> tuple[tuple[Unit, ...], ...]:
        """Start order: tier 0 needs nothing; each unit sits one tier after its latest dependency.

        Units of one tier may start together; stop order is this, reversed.
        """
        return self._tiers

    def tier_of(self, name: str) -> int:
        return self._tier_of[name]

    def resolve(self, name: str) -> tuple[Unit, ...]:
        """A unit name or a template name ("worker" = all its instances) -> units. KeyError if unknown."""
        if name in self.units:
            return (self.units[name],)
        found = tuple(u for u in self.units.values() if u.template == name)
        if not found:
            raise KeyError(name)
        return found

    def dependents(self, name: str) -> tuple[Unit, ...]:
        """Units to stop when `name` (unit or template) fails or stops: all that require it,
        directly or through others, in stop order (last tier first). `after` alone does not count."""
        seen: set[str] = set()
        todo = [u.name for u in self.resolve(name)]
        start = set(todo)
        while todo:
            for requirer in self._required_by.get(todo.pop(), ()):
                if requirer not in seen and requirer not in start:
                    seen.add(requirer)
                    todo.append(requirer)
        return tuple(sorted((self.units[n] for n in seen), key=lambda u: (-self._tier_of[u.name], u.name)))
