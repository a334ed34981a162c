"""Unit files: DESIGN.md Part 2, "Unit files" (the key table) and the parsing half of `omnid check`.

A stack directory holds one TOML file per unit (`NAME.toml`) and an optional
`omnid.toml` with daemon settings. `load_stack` reads them all once, expands
instances (`worker` with `instances = 2` -> `worker@0`, `worker@1`), resolves
dependencies and orders them, and returns frozen objects: nothing downstream
reads raw TOML. Every problem in every file is collected first and raised as
one `StackInvalid`, so `omnid check` reports all of them at once.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import os
import re
import resource
import signal
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from os import PathLike
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from omnid.ownership import check_unit_path

SETTINGS_FILE = "omnid.toml"
DEFAULT_TITLE = "omnid: %n"

# Set by omnid itself (DESIGN.md "The child's environment"); a unit that overrode
# them would hide from residue scans or talk to the wrong notify socket.
RESERVED_ENV = frozenset({"OMNID_UNIT", "OMNID_INSTANCE", "OMNID_INSTANCES", "OMNID_GENERATION", "SPT_NOENV",
                          "NOTIFY_SOCKET"})

# '@' separates a template from its instance number and '%' starts a specifier,
# so neither may appear in a unit name; '/' would escape the directory.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_REFERENCE = re.compile(r"(?P<template>[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<instance>[0-9]+))?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Only these: "%N" or "%s" in a unit's command (date +%s.%N) must reach it unchanged. The
# instance count is in the environment instead (OMNID_INSTANCES).
_SPECIFIER = re.compile(r"%[%in]")

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
    """Periodic HTTP probe while active: `failures` failed probes in a row fail the unit."""

    url: str
    interval: float = 5.0
    timeout: float = 2.0
    failures: int = 3


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
    names (a dependency on a template is expanded to all its instances).
    """

    name: str  # "worker@1", or "serve" for a single unit
    template: str  # "worker": the file name without .toml
    instance: int  # 0 for a single unit
    instances: int  # how many instances the template has
    file: Path
    exec: tuple[str, ...]
    description: str = ""
    role: str = ""
    title: str = "omnid: %n"  # "" = leave the process title alone
    after: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    cwd: str | None = None
    # Includes CUDA_VISIBLE_DEVICES derived from `gpus`; excluded from the hash
    # because a mapping is not hashable.
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    user: str | None = None
    group: str | None = None
    limits: tuple[Rlimit, ...] = ()
    gpus: tuple[int, ...] = ()
    ready: Ready = Ready()
    ready_timeout: float = 600.0
    liveness: Liveness | None = None
    watchdog_sec: float = 0.0
    stop_signal: signal.Signals = signal.SIGTERM
    stop_timeout: float = 10.0
    worker_group: str | None = None  # members fail, stop and restart together
    torch_distributed: TorchDistributed | None = None
    kill_timeout: float = 10.0
    restart: RestartPolicy = RestartPolicy.NO
    restart_sec: float = 1.0
    restart_max_sec: float = 60.0
    start_limit_burst: int = 5
    start_limit_interval: float = 60.0
    gpu_min_free_mib: int = 0
    memory_max: int | str | None = None  # cgroup memory.max (systemd MemoryMax=); "max" = no limit
    tasks_max: int | str | None = None  # cgroup pids.max (systemd TasksMax=)

    @property
    def dependencies(self) -> tuple[str, ...]:
        """Units that must be ready before this one starts (`requires` implies `after`)."""
        return tuple(sorted(set(self.after) | set(self.requires)))

    def environ(self, base: Mapping[str, str], notify_socket: str | None = None) -> dict[str, str]:
        """The full environment of this unit's process (DESIGN.md "The child's environment").

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
        if notify_socket is not None and self.ready.kind is ReadyKind.NOTIFY:
            env["NOTIFY_SOCKET"] = notify_socket
            if self.watchdog_sec > 0:
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
    cgroup_root: Path | None = None  # omnid.cgroup: a writable cgroup v2 directory for the units


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


# --------------------------------------------------------------------------- reading one file


_TOML_TYPE = {str: "string", int: "integer", float: "float", bool: "boolean", list: "array", dict: "table"}


def _quote(value: Any) -> str:
    """A value as it would be written in TOML, so messages can be pasted back into the file."""
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)


def _describe(value: Any) -> str:
    kind = _TOML_TYPE.get(type(value), "date/time")
    if isinstance(value, (dict, list)):
        return kind
    return f"{kind} {_quote(value)}"


class InvalidValue(ValueError):
    """A value that is not what its key expects ("expected ..., got ..."). Public: parse_signal
    raises it for callers outside unit files. Inside a key's reader it becomes one UnitFileError
    for that key (or `sub`key of its table)."""

    def __init__(self, message: str, sub: str = "") -> None:
        super().__init__(message)
        self.sub = sub


_Invalid = InvalidValue


class _Table:
    """Typed, error-collecting access to one TOML table (a file, or a nested table in one)."""

    def __init__(self, file: Path, raw: Mapping[str, Any], errors: list[UnitFileError], prefix: str = "") -> None:
        self.file = file
        self.raw = raw
        self.errors = errors
        self.prefix = prefix

    def error(self, key: str, message: str) -> None:
        self.errors.append(UnitFileError(self.file, self.prefix + key, message))

    def check_keys(self, allowed: Sequence[str]) -> None:
        for key in self.raw:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f'did you mean "{close[0]}"? ' if close else ""
                self.error(key, f"unknown key; {hint}expected one of: {', '.join(sorted(allowed))}")

    def get(self, key: str, default: Any, convert: Callable[[Any], Any]) -> Any:
        """The converted value of `key`, or `default` when it is absent or invalid (error recorded)."""
        if key not in self.raw:
            return default
        try:
            return convert(self.raw[key])
        except _Invalid as exc:
            self.error(f"{key}.{exc.sub}" if exc.sub else key, str(exc))
            return default


# Converters: each takes a raw TOML value and returns the typed one, or raises
# _Invalid with "expected ..., got ...".


MAX_UNITS = 4096  # units in one stack, instances expanded
MAX_INSTANCES = 1024  # per template (man omnid.unit(5)); more is a typo, not a stack
MAX_SECONDS = 86400.0  # any timeout or interval: at most one day
MAX_RLIMIT = (1 << 63) - 2  # largest finite rlim_t


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"expected a string, got {_describe(value)}")
    return value


def _nonempty_string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"expected a non-empty string, got {_describe(value)}")
    return value


def _string_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        got = _describe(value)
        if isinstance(value, list):
            got = "an array containing " + ", ".join(_describe(v) for v in value if not isinstance(v, str))
        raise _Invalid(f"expected an array of strings, got {got}")
    return tuple(value)


def _argv(value: Any) -> tuple[str, ...]:
    argv = _string_list(value)
    if not argv or not argv[0]:
        raise _Invalid('expected a non-empty array of strings whose first item is the program, e.g. ["vllm", "serve"]')
    return argv


def _integer(minimum: int, maximum: int = 1 << 31) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        # bool is an int in Python; `instances = true` is a typo, not 1.
        if not isinstance(value, int) or isinstance(value, bool):
            raise _Invalid(f"expected an integer >= {minimum} and <= {maximum}, got {_describe(value)}")
        if value < minimum or value > maximum:
            raise _Invalid(f"expected an integer >= {minimum} and <= {maximum}, got {value}")
        return value

    return convert


_SIZE = re.compile(r"([0-9]+)([KMGT]?)")


def _cgroup_amount(*, bytes_: bool) -> Callable[[Any], int | str]:
    """memory_max: bytes (integer, or "512M" / "8G" with K/M/G/T = 1024^n); tasks_max: an
    integer; both accept "infinity" (written as "max"). Checked against the cgroup root at start."""
    example = '"8G"' if bytes_ else "512"

    def convert(value: Any) -> int | str:
        if value == "infinity":
            return "max"
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        if bytes_ and isinstance(value, str):
            m = _SIZE.fullmatch(value)
            if m and int(m.group(1)) >= 1:
                return int(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " ")
        raise _Invalid(f'expected a positive integer, {example} or "infinity", got {_describe(value)}')

    return convert


def _seconds(*, zero_ok: bool) -> Callable[[Any], float]:
    bound = ">= 0" if zero_ok else "> 0"

    def convert(value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _Invalid(f"expected a number of seconds {bound}, got {_describe(value)}")
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok) or value > MAX_SECONDS:
            raise _Invalid(f"expected a number of seconds {bound} and <= {MAX_SECONDS} (1 day), got {value}")
        return float(value)

    return convert


def _choice(enum: type[StrEnum]) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        try:
            return enum(value)
        except ValueError:
            choices = ", ".join(_quote(m.value) for m in enum)
            raise _Invalid(f"expected one of {choices}, got {_describe(value)}") from None

    return convert


def parse_signal(value: Any) -> signal.Signals:
    if isinstance(value, str):
        name = value.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        sig = signal.Signals.__members__.get(name)
        if sig is not None:
            return sig
    raise _Invalid(f'expected a signal name such as "SIGTERM" or "SIGINT", got {_describe(value)}')


def _env(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _Invalid(f"expected a table of strings, got {_describe(value)}")
    for name, text in value.items():
        if not _ENV_NAME.fullmatch(name):
            raise _Invalid(f"expected a variable name of letters, digits and '_', got {_quote(name)}", name)
        if name in RESERVED_ENV:
            raise _Invalid(f"{name} is set by omnid; expected other variable names", name)
        if not isinstance(text, str):
            raise _Invalid(f"expected a string, got {_describe(text)}", name)
        if "\0" in text:
            raise _Invalid("expected a string without NUL bytes", name)
    return dict(value)


def _rlimit_value(name: str, value: Any) -> int:
    if value == "infinity":
        return resource.RLIM_INFINITY
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_RLIMIT:
        return value
    raise _Invalid(f'expected an integer from 0 to 2**63-2 or "infinity", got {_describe(value)}', name)


def _limits(value: Any) -> tuple[Rlimit, ...]:
    if not isinstance(value, dict):
        raise _Invalid(f'expected a table such as {{ nofile = 65536, memlock = "infinity" }}, got {_describe(value)}')
    limits = []
    for name, setting in value.items():
        if name not in RLIMITS:
            raise _Invalid(f"unknown limit; expected one of: {', '.join(sorted(RLIMITS))}", name)
        if isinstance(setting, list):
            # [soft, hard], for when the two must differ.
            if len(setting) != 2:
                raise _Invalid(f"expected [soft, hard], got an array of {len(setting)}", name)
            soft, hard = (_rlimit_value(name, v) for v in setting)
            if _rlimit_order(soft) > _rlimit_order(hard):
                raise _Invalid(f"expected soft <= hard, got {setting!r}", name)
        else:
            soft = hard = _rlimit_value(name, setting)
        limits.append(Rlimit(RLIMITS[name], soft, hard))
    return tuple(limits)


def _rlimit_order(value: int) -> float:
    # RLIM_INFINITY is -1 on some builds; it is the largest limit, whatever its encoding.
    return math.inf if value == resource.RLIM_INFINITY else value


def _gpus(value: Any) -> tuple[int, ...] | str:
    if value == "%i":
        return value  # one GPU per instance; resolved at expansion
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1024 for v in value):
        if len(set(value)) != len(value):
            raise _Invalid(f"expected each GPU once, got {value!r}")
        return tuple(value)
    raise _Invalid(f'expected an array of GPU indexes >= 0 (e.g. [0, 1]) or "%i", got {_describe(value)}')


def parse_host_port(text: str) -> tuple[str, int]:
    """"HOST:PORT" or "[V6]:PORT" -> (host, port); ValueError saying what was expected."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f'expected "HOST:PORT" with a port from 1 to 65535, got {_quote(text)}')
    return host, int(port_text)


def _group_name(value: Any) -> str:
    if isinstance(value, str) and _NAME.fullmatch(value):
        return value
    raise _Invalid(f"expected a group name (a letter or digit, then letters, digits, '_', '.' or '-'), "
                   f"got {_describe(value)}")


def _http_url(value: Any) -> str:
    if isinstance(value, str):
        parts = urlsplit(value)
        if parts.scheme in ("http", "https") and parts.hostname:
            return value
    example = "http://127.0.0.1:8000/health"
    raise _Invalid(f'expected an http:// or https:// URL such as "{example}", got {_describe(value)}')


# --------------------------------------------------------------------------- unit files


UNIT_KEYS = (
    "exec", "description", "role", "title", "instances", "after", "requires", "cwd", "env",
    "user", "group", "limits", "gpus", "ready", "ready_timeout", "liveness", "watchdog_sec",
    "stop_signal", "stop_timeout", "kill_timeout", "restart", "restart_sec", "restart_max_sec",
    "start_limit_burst", "start_limit_interval", "gpu_min_free_mib", "worker_group", "torch_distributed",
    "memory_max", "tasks_max",
)  # fmt: skip
TORCH_DISTRIBUTED_KEYS = ("master_addr", "master_port")
# The restart policy of a worker group is one policy: every member must declare the same.
GROUP_POLICY_KEYS = ("restart", "restart_sec", "restart_max_sec", "start_limit_burst", "start_limit_interval")
LIVENESS_KEYS = ("http", "interval", "timeout", "failures")
SETTINGS_KEYS = ("control", "state_dir", "health_listen", "log_format", "cgroup_root")


@dataclass(frozen=True)
class _Template:
    """One unit file, typed but not yet expanded: strings may still hold %i / %n."""

    name: str
    file: Path
    instances: int
    values: Mapping[str, Any]  # Unit field -> typed value, for keys that are per-template
    after: tuple[str, ...]
    requires: tuple[str, ...]
    gpus: tuple[int, ...] | str | None


def _read_toml(file: Path, errors: list[UnitFileError]) -> dict[str, Any] | None:
    try:
        with file.open("rb") as f:
            data = f.read(MAX_UNIT_FILE_BYTES + 1)
        if len(data) > MAX_UNIT_FILE_BYTES:
            errors.append(UnitFileError(file, "", f"larger than {MAX_UNIT_FILE_BYTES} bytes; expected a unit file"))
            return None
        return tomllib.loads(data.decode())
    except tomllib.TOMLDecodeError as exc:
        errors.append(UnitFileError(file, "", f"invalid TOML ({exc}); expected a TOML document"))
    except RecursionError:
        errors.append(UnitFileError(file, "", "TOML nested too deeply for the parser; expected a flat unit file"))
    except (ValueError, OverflowError, MemoryError) as exc:
        errors.append(UnitFileError(file, "", f"invalid TOML ({type(exc).__name__}: {str(exc)[:200]}); "
                                    "expected a TOML document"))
    except UnicodeDecodeError as exc:
        errors.append(UnitFileError(file, "", f"not UTF-8 ({exc.reason}); expected a UTF-8 TOML document"))
    except OSError as exc:
        errors.append(UnitFileError(file, "", f"cannot read ({exc.strerror}); expected a readable file"))
    return None


MAX_UNIT_FILE_BYTES = 1 << 20


def _ready(value: Any) -> Ready:
    if value == "started":
        return Ready(ReadyKind.STARTED)
    if value == "notify":
        return Ready(ReadyKind.NOTIFY)
    if isinstance(value, dict) and len(value) == 1:
        (kind, target), = value.items()
        if kind == "http":
            return Ready(ReadyKind.HTTP, url=_string(target))  # URL checked after %i expansion
        if kind == "tcp":
            return Ready(ReadyKind.TCP, url=_string(target))  # split into host/port after expansion
    raise _Invalid(f'expected "started", "notify", {{ http = URL }} or {{ tcp = "HOST:PORT" }}, got {_describe(value)}')


def _parse_unit_file(file: Path, name: str, raw: Mapping[str, Any], errors: list[UnitFileError]) -> _Template:
    t = _Table(file, raw, errors)
    t.check_keys(UNIT_KEYS)
    if "exec" not in raw:
        t.error("exec", 'missing; expected the program and its arguments, e.g. exec = ["vllm", "serve"]')
    v: dict[str, Any] = {
        "exec": t.get("exec", ("true",), _argv),
        "description": t.get("description", "", _string),
        "role": t.get("role", "", _string),
        "title": t.get("title", DEFAULT_TITLE, _string),
        "cwd": t.get("cwd", None, _nonempty_string),
        "env": t.get("env", {}, _env),
        "user": t.get("user", None, _nonempty_string),
        "group": t.get("group", None, _nonempty_string),
        "limits": t.get("limits", (), _limits),
        "ready": t.get("ready", Ready(), _ready),
        "ready_timeout": t.get("ready_timeout", 600.0, _seconds(zero_ok=False)),
        "watchdog_sec": t.get("watchdog_sec", 0.0, _seconds(zero_ok=True)),
        "stop_signal": t.get("stop_signal", signal.SIGTERM, parse_signal),
        "stop_timeout": t.get("stop_timeout", 10.0, _seconds(zero_ok=False)),
        "kill_timeout": t.get("kill_timeout", 10.0, _seconds(zero_ok=False)),
        "restart": t.get("restart", RestartPolicy.NO, _choice(RestartPolicy)),
        "restart_sec": t.get("restart_sec", 1.0, _seconds(zero_ok=False)),
        "restart_max_sec": t.get("restart_max_sec", 60.0, _seconds(zero_ok=False)),
        "start_limit_burst": t.get("start_limit_burst", 5, _integer(1)),
        "start_limit_interval": t.get("start_limit_interval", 60.0, _seconds(zero_ok=False)),
        "gpu_min_free_mib": t.get("gpu_min_free_mib", 0, _integer(0)),
        "worker_group": t.get("worker_group", None, _group_name),
        "torch_distributed": None,
        "memory_max": t.get("memory_max", None, _cgroup_amount(bytes_=True)),
        "tasks_max": t.get("tasks_max", None, _cgroup_amount(bytes_=False)),
        "liveness": None,
    }
    td = raw.get("torch_distributed", False)
    if td is True or isinstance(td, dict):
        tt = _Table(file, td if isinstance(td, dict) else {}, errors, prefix="torch_distributed.")
        tt.check_keys(TORCH_DISTRIBUTED_KEYS)
        v["torch_distributed"] = TorchDistributed(
            master_addr=tt.get("master_addr", "127.0.0.1", _nonempty_string),
            master_port=tt.get("master_port", 29500, _integer(1)),
        )
        if v["torch_distributed"].master_port > 65535:
            tt.error("master_port", f"expected a port from 1 to 65535, got {v['torch_distributed'].master_port}")
        if v["worker_group"] is None:
            t.error("torch_distributed", "needs worker_group: ranks that do not fail and restart together hang "
                    "in their next collective when one of them dies; expected e.g. worker_group = \"tp0\"")
    elif td is not False:
        t.error("torch_distributed", f"expected true, false or a table {{ master_addr = \"127.0.0.1\", "
                f"master_port = 29500 }}, got {_describe(td)}")
    if "liveness" in raw:
        if isinstance(raw["liveness"], dict):
            lt = _Table(file, raw["liveness"], errors, prefix="liveness.")
            lt.check_keys(LIVENESS_KEYS)
            if "http" not in lt.raw:
                lt.error("http", 'missing; expected { http = "http://HOST:PORT/PATH" }')
            v["liveness"] = Liveness(
                url=lt.get("http", "", _string),  # URL checked after %i expansion
                interval=lt.get("interval", 5.0, _seconds(zero_ok=False)),
                timeout=lt.get("timeout", 2.0, _seconds(zero_ok=False)),
                failures=lt.get("failures", 3, _integer(1)),
            )
        else:
            t.error("liveness", f"expected a table {{ http = URL, interval = 5, timeout = 2, failures = 3 }}, "
                    f"got {_describe(raw['liveness'])}")  # fmt: skip
    if v["watchdog_sec"] > 0 and v["ready"].kind is not ReadyKind.NOTIFY:
        t.error("watchdog_sec", f'needs ready = "notify" (the watchdog is fed by WATCHDOG=1 notifications), '
                f'got ready = "{v["ready"].kind}"')  # fmt: skip
    if v["restart_max_sec"] < v["restart_sec"]:
        t.error("restart_max_sec", f"expected seconds >= restart_sec ({v['restart_sec']:g}), "
                f"got {v['restart_max_sec']:g}")  # fmt: skip
    return _Template(
        name=name,
        file=file,
        instances=t.get("instances", 1, _integer(1, MAX_INSTANCES)),
        values=v,
        after=t.get("after", (), _string_list),
        requires=t.get("requires", (), _string_list),
        gpus=t.get("gpus", None, _gpus),
    )


def _parse_settings(file: Path, raw: Mapping[str, Any], directory: Path, errors: list[UnitFileError]) -> DaemonSettings:
    t = _Table(file, raw, errors)
    t.check_keys(SETTINGS_KEYS)

    def path(value: Any) -> Path:
        # Relative to the stack directory, not to wherever the daemon happens to start.
        return directory / _nonempty_string(value)

    def listen(value: Any) -> str:
        try:
            host, _port = parse_host_port(_string(value))
            ipaddress.ip_address(host)
        except ValueError as exc:
            # A host name makes aiohttp start a resolver thread (DESIGN.md Part 1): numeric only.
            raise _Invalid(f'expected "ADDRESS:PORT" with a numeric address such as "127.0.0.1:9321" ({exc})') from None
        return value

    return DaemonSettings(
        file=file,
        control=t.get("control", None, path),
        state_dir=t.get("state_dir", None, path),
        health_listen=t.get("health_listen", None, listen),
        log_format=t.get("log_format", None, _choice(LogFormat)),
        cgroup_root=t.get("cgroup_root", None, path),
    )


# --------------------------------------------------------------------------- expansion


def _expand(text: str, name: str, instance: int) -> str:
    # Only %i, %n and %% are specifiers; any other % stays as written (printf formats, dates).
    return _SPECIFIER.sub(lambda m: {"%%": "%", "%i": str(instance), "%n": name}[m.group()], text)


def _instance_names(template: _Template) -> list[tuple[str, int]]:
    if template.instances == 1:
        return [(template.name, 0)]
    return [(f"{template.name}@{i}", i) for i in range(template.instances)]


def _expand_unit(
    template: _Template,
    name: str,
    instance: int,
    directory: Path,
    dependencies: Mapping[str, list[str]],
    errors: list[UnitFileError],
) -> Unit:
    v = template.values
    x: Callable[[str], str] = lambda s: _expand(s, name, instance)  # noqa: E731
    t = _Table(template.file, {}, errors)  # only for t.error(): values here are already typed

    env = {k: x(val) for k, val in v["env"].items()}
    gpus: tuple[int, ...] = ()
    if template.gpus == "%i":
        gpus = (instance,)
    elif isinstance(template.gpus, tuple):
        gpus = template.gpus
    if template.gpus is not None:
        # An explicit env value wins: the operator may want a different mapping (MIG UUIDs, say).
        env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(map(str, gpus)))

    ready: Ready = v["ready"]
    if ready.kind is ReadyKind.HTTP:
        try:
            ready = Ready(ReadyKind.HTTP, url=_http_url(x(ready.url)))
        except _Invalid as exc:
            t.error("ready.http", str(exc))
    elif ready.kind is ReadyKind.TCP:
        try:
            host, port = parse_host_port(x(ready.url))
            ready = Ready(ReadyKind.TCP, host=host, port=port)
        except ValueError as exc:
            t.error("ready.tcp", str(exc))
    liveness: Liveness | None = v["liveness"]
    if liveness is not None and liveness.url:
        try:
            liveness = Liveness(_http_url(x(liveness.url)), liveness.interval, liveness.timeout, liveness.failures)
        except _Invalid as exc:
            t.error("liveness.http", str(exc))
    cwd = v["cwd"]
    if cwd is not None:
        # Relative to the stack directory: the daemon's own cwd is "/" under systemd.
        cwd = str(directory / x(cwd))

    return Unit(
        name=name,
        template=template.name,
        instance=instance,
        instances=template.instances,
        file=template.file,
        exec=tuple(x(a) for a in v["exec"]),
        description=v["description"],
        role=v["role"],
        title=x(v["title"]),
        after=tuple(dependencies["after"]),
        requires=tuple(dependencies["requires"]),
        cwd=cwd,
        env=MappingProxyType(env),
        user=v["user"],
        group=v["group"],
        limits=v["limits"],
        gpus=gpus,
        ready=ready,
        ready_timeout=v["ready_timeout"],
        liveness=liveness,
        watchdog_sec=v["watchdog_sec"],
        stop_signal=v["stop_signal"],
        stop_timeout=v["stop_timeout"],
        kill_timeout=v["kill_timeout"],
        restart=v["restart"],
        restart_sec=v["restart_sec"],
        restart_max_sec=v["restart_max_sec"],
        start_limit_burst=v["start_limit_burst"],
        start_limit_interval=v["start_limit_interval"],
        gpu_min_free_mib=v["gpu_min_free_mib"],
        worker_group=v["worker_group"],
        torch_distributed=v["torch_distributed"],
        memory_max=v["memory_max"],
        tasks_max=v["tasks_max"],
    )


def _resolve_reference(
    reference: str, templates: Mapping[str, _Template], broken: set[str]
) -> tuple[list[str], str | None]:
    """A dependency as written -> unit names, or an error message saying what was expected."""
    match = _REFERENCE.fullmatch(reference)
    if match is None:
        return [], f"expected a unit name (NAME or NAME@N), got {_quote(reference)}"
    target = templates.get(match["template"])
    if target is None:
        if match["template"] in broken:
            return [], None  # that file's own errors are already reported
        known = ", ".join(sorted(templates)) or "none"
        return [], f"unknown unit {_quote(reference)}; expected one of the units in this directory: {known}"
    if match["instance"] is None:
        return [n for n, _ in _instance_names(target)], None
    if target.instances == 1:
        return [], f'unknown unit "{reference}"; {target.name} has no instances, expected "{target.name}"'
    if int(match["instance"]) >= target.instances or match["instance"] != str(int(match["instance"])):
        return [], (
            f'unknown unit "{reference}"; expected {target.name}@0 to {target.name}@{target.instances - 1} '
            f'or "{target.name}" for all of them'
        )
    return [reference], None


def _dependencies(
    template: _Template,
    name: str,
    instance: int,
    templates: Mapping[str, _Template],
    broken: set[str],
    errors: list[UnitFileError],
) -> dict[str, list[str]]:
    """`after` and `requires` of one instance, as full unit names ({"after": [...], "requires": [...]})."""
    declared: dict[str, list[str]] = {}
    for key in ("after", "requires"):
        names: list[str] = []
        for reference in getattr(template, key):
            expanded = _expand(reference, name, instance)
            # "worker" inside worker.toml means all instances, this one included. Messages
            # quote the reference as written, so N instances report the same mistake once.
            if expanded in (name, template.name):
                errors.append(UnitFileError(template.file, key, f'"{reference}" is this unit itself; '
                                            "expected the names of other units"))  # fmt: skip
                continue
            resolved, problem = _resolve_reference(expanded, templates, broken)
            if problem:
                errors.append(UnitFileError(template.file, key, problem))
            names.extend(n for n in resolved if n not in names)
        declared[key] = names
    return declared


# --------------------------------------------------------------------------- ordering


def _tiers(
    units: Mapping[str, Unit], edges: Mapping[str, Mapping[str, str]], errors: list[UnitFileError]
) -> tuple[tuple[tuple[Unit, ...], ...], dict[str, int]]:
    """Layer units by dependencies (Kahn); report each dependency cycle once."""
    tier_of: dict[str, int] = {}
    remaining = set(units)
    tiers: list[tuple[Unit, ...]] = []
    # Kahn with in-degrees: linear in units + edges (a 10,000-unit chain is not a hang).
    waiting = {n: len(edges[n]) for n in units}
    dependents: dict[str, list[str]] = {n: [] for n in units}
    for n in units:
        for d in edges[n]:
            if d in dependents:
                dependents[d].append(n)
    layer = sorted(n for n, k in waiting.items() if k == 0)
    while layer:
        for n in layer:
            tier_of[n] = len(tiers)
        remaining.difference_update(layer)
        tiers.append(tuple(units[n] for n in layer))
        ready = []
        for n in layer:
            for m in dependents[n]:
                waiting[m] -= 1
                if waiting[m] == 0:
                    ready.append(m)
        layer = sorted(ready)

    # Every unit left waits for another unit left, so walking "waits for" edges
    # from any of them must loop. Walks that reach an already-reported cycle are
    # units stuck behind it, not cycles of their own.
    explained: set[str] = set()
    reported: set[tuple[str, ...]] = set()
    for start in sorted(remaining):
        path: list[str] = []
        on_path: set[str] = set()
        node = start
        while node not in explained and node not in on_path:
            path.append(node)
            on_path.add(node)
            node = min(d for d in edges[node] if d in remaining)
        explained.update(path)
        if node not in path:
            continue
        cycle = path[path.index(node):]
        first = cycle.index(min(cycle))
        cycle = cycle[first:] + cycle[:first]
        templates = tuple(units[n].template for n in cycle)
        if templates in reported:  # the same loop through other instances of the same templates
            continue
        reported.add(templates)
        head = units[cycle[0]]
        errors.append(UnitFileError(
            head.file, edges[cycle[0]][cycle[1 % len(cycle)]],
            f"dependency cycle {' -> '.join([*cycle, cycle[0]])}; expected units that can be started in an order "
            f"(files: {', '.join(sorted({units[n].file.name for n in cycle}))})",
        ))  # fmt: skip
    return tuple(tiers), tier_of


def _worker_groups(units: Mapping[str, Unit], errors: list[UnitFileError]) -> dict[str, tuple[str, ...]]:
    """worker_group -> members in rank order; members must share one restart policy and must
    not wait for each other (they start together: a rank that waits for a peer's readiness,
    which needs the rank itself, would never start)."""
    members: dict[str, list[Unit]] = {}
    for unit in units.values():
        if unit.worker_group:
            members.setdefault(unit.worker_group, []).append(unit)
    groups: dict[str, tuple[str, ...]] = {}
    for group, found in sorted(members.items()):
        found.sort(key=lambda u: (u.template, u.instance))
        names = {u.name for u in found}
        first = found[0]
        for unit in found:
            for dep in unit.dependencies:
                if dep in names:
                    errors.append(UnitFileError(unit.file, "worker_group", (
                        f"{unit.name} waits for {dep} (after/requires), but both are in worker_group "
                        f'"{group}", whose members start together; expected no dependency between members')))
            for key in GROUP_POLICY_KEYS:
                if getattr(unit, key) != getattr(first, key):
                    errors.append(UnitFileError(unit.file, key, (
                        f'worker_group "{group}" restarts as one: expected the same {key} as {first.name} '
                        f"({first.file.name}: {getattr(first, key)}), got {getattr(unit, key)}")))
            if (unit.torch_distributed is None) != (first.torch_distributed is None) or (
                    unit.torch_distributed and unit.torch_distributed != first.torch_distributed):
                errors.append(UnitFileError(unit.file, "torch_distributed", (
                    f'worker_group "{group}" is one torch.distributed job or none: expected the same '
                    f"torch_distributed as {first.name} ({first.file.name})")))
        groups[group] = tuple(u.name for u in found)
    return groups


# --------------------------------------------------------------------------- entry points


def load_stack(directory: str | PathLike[str]) -> Stack:
    """Read and validate a stack directory. Raises StackInvalid listing every error in every file."""
    stack, errors = _load(Path(directory))
    if errors:
        raise StackInvalid(errors)
    assert stack is not None
    return stack


def check_stack(directory: str | PathLike[str]) -> tuple[UnitFileError, ...]:
    """Every error in a stack directory (empty when valid), for `omnid check`."""
    return _load(Path(directory))[1]


def _load(directory: Path) -> tuple[Stack | None, tuple[UnitFileError, ...]]:
    errors: list[UnitFileError] = []
    if not directory.is_dir():
        return None, (UnitFileError(directory, "", "not a directory; expected a directory of unit files (NAME.toml)"),)
    # Dotfiles are editor leftovers (.serve.toml.swp, .#serve.toml), not units.
    files = sorted(p for p in directory.glob("*.toml") if not p.name.startswith(".") and p.is_file())
    if os.geteuid() == 0:
        # A root daemon runs what these files say: only root may be able to change them.
        problem = check_unit_path(directory, directory=True)
        if problem:
            errors.append(UnitFileError(directory, "", problem))
        for file in files:
            problem = check_unit_path(file, directory=False)
            if problem:
                errors.append(UnitFileError(file, "", problem))
        if errors:
            return None, tuple(errors)

    settings = DaemonSettings()
    templates: dict[str, _Template] = {}
    broken: set[str] = set()  # units whose file could not be read at all
    for file in files:
        raw = _read_toml(file, errors)
        if file.name == SETTINGS_FILE:
            if raw is not None:
                settings = _parse_settings(file, raw, directory, errors)
            continue
        name = file.name[: -len(".toml")]
        if not _NAME.fullmatch(name):
            errors.append(UnitFileError(file, "", f'unit name "{name}" (the file name) is not valid; expected a '
                                        "letter or digit, then letters, digits, '_', '.' or '-' (no '@')"))  # fmt: skip
            continue
        if raw is None:
            broken.add(name)
            continue
        templates[name] = _parse_unit_file(file, name, raw, errors)
    if not templates and not broken:
        errors.append(UnitFileError(directory, "", "no unit files; expected at least one NAME.toml"))

    total = sum(t.instances for t in templates.values())
    if total > MAX_UNITS:
        errors.append(UnitFileError(directory, "", f"{total} units after expanding instances; expected at most "
                                    f"{MAX_UNITS} in one stack"))
        return None, tuple(errors)
    units: dict[str, Unit] = {}
    # unit -> {dependency: the key that declares it}, for cycle messages.
    edges: dict[str, dict[str, str]] = {}
    for template in templates.values():
        for name, instance in _instance_names(template):
            declared = _dependencies(template, name, instance, templates, broken, errors)
            units[name] = _expand_unit(template, name, instance, directory, declared, errors)
            # `requires` last, so an edge declared by both keys is named by `requires`.
            edges[name] = {dep: key for key in ("after", "requires") for dep in declared[key]}

    tiers, tier_of = _tiers(units, edges, errors)
    groups = _worker_groups(units, errors)
    required_by: dict[str, list[str]] = {n: [] for n in units}
    for unit in units.values():
        for dep in unit.requires:
            required_by[dep].append(unit.name)

    # The same mistake in a template repeats once per instance: report it once.
    # Sorted by file (stable) so each file's errors read together.
    unique = tuple(sorted(dict.fromkeys(errors), key=lambda e: str(e.file)))
    if unique:
        return None, unique
    return (
        Stack(
            directory=directory,
            units=MappingProxyType(dict(sorted(units.items()))),
            settings=settings,
            _tiers=tiers,
            _tier_of=MappingProxyType(tier_of),
            _required_by=MappingProxyType({n: tuple(r) for n, r in required_by.items()}),
            groups=MappingProxyType(groups),
        ),
        (),
    )

