"""Reading one unit-file value: each converter takes a raw TOML value and returns the typed
one, or raises InvalidValue saying "expected ..., got ...". Also `Table`, the error-collecting
reader of one TOML table, and the documented maxima. The unit model's shared vocabulary:
omnid.model.keys names a converter per key, omnid.model.unitfile reads the nested tables with them."""

from __future__ import annotations

import difflib
import json
import math
import re
import resource
import signal
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from omnid.model.cluster import HOST_NAME
from omnid.model.unitmodel import (RESERVED_ENV, RLIMITS, UNIT_NAME, DrainHook, NumaMode, Ready, ReadyKind, Rlimit,
                             UnitFileError)


# --------------------------------------------------------------------------- reading one file


_TOML_TYPE = {str: "string", int: "integer", float: "float", bool: "boolean", list: "array", dict: "table"}


def quote(value: Any) -> str:
    """A value as it would be written in TOML, so messages can be pasted back into the file."""
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)


def describe(value: Any) -> str:
    kind = _TOML_TYPE.get(type(value), "date/time")
    if isinstance(value, (dict, list)):
        return kind
    return f"{kind} {quote(value)}"


class InvalidValue(ValueError):
    """A value that is not what its key expects ("expected ..., got ..."). Public: parse_signal
    raises it for callers outside unit files. Inside a key's reader it becomes one UnitFileError
    for that key (or `sub`key of its table)."""

    def __init__(self, message: str, sub: str = "") -> None:
        super().__init__(message)
        self.sub = sub


class Table:
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
        except InvalidValue as exc:
            self.error(f"{key}.{exc.sub}" if exc.sub else key, str(exc))
            return default


# Converters: each takes a raw TOML value and returns the typed one, or raises
# InvalidValue with "expected ..., got ...".


MAX_UNITS = 4096  # units in one stack, instances expanded
MAX_INSTANCES = 1024  # per template (man omnid.unit(5)); more is a typo, not a stack
MAX_SECONDS = 86400.0  # any timeout or interval: at most one day
MAX_RLIMIT = (1 << 63) - 2  # largest finite rlim_t


def string(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidValue(f"expected a string, got {describe(value)}")
    return value


def nonempty_string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidValue(f"expected a non-empty string, got {describe(value)}")
    return value


def string_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        got = describe(value)
        if isinstance(value, list):
            got = "an array containing " + ", ".join(describe(v) for v in value if not isinstance(v, str))
        raise InvalidValue(f"expected an array of strings, got {got}")
    return tuple(value)


def argv(value: Any) -> tuple[str, ...]:
    argv = string_list(value)
    if not argv or not argv[0]:
        raise InvalidValue('expected a non-empty array of strings whose first item is the program, '
                           'e.g. ["vllm", "serve"]')
    return argv


def integer(minimum: int, maximum: int = 1 << 31) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        # bool is an int in Python; `instances = true` is a typo, not 1.
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidValue(f"expected an integer >= {minimum} and <= {maximum}, got {describe(value)}")
        if value < minimum or value > maximum:
            raise InvalidValue(f"expected an integer >= {minimum} and <= {maximum}, got {value}")
        return value

    return convert


_SIZE = re.compile(r"([0-9]+)([KMGT]?)")


def cgroup_amount(*, bytes_: bool) -> Callable[[Any], int | str]:
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
        raise InvalidValue(f'expected a positive integer, {example} or "infinity", got {describe(value)}')

    return convert


def seconds(*, zero_ok: bool) -> Callable[[Any], float]:
    bound = ">= 0" if zero_ok else "> 0"

    def convert(value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise InvalidValue(f"expected a number of seconds {bound}, got {describe(value)}")
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok) or value > MAX_SECONDS:
            raise InvalidValue(f"expected a number of seconds {bound} and <= {MAX_SECONDS} (1 day), got {value}")
        return float(value)

    return convert


def seconds_at_most(maximum: float) -> Callable[[Any], float]:
    """Seconds >= 0 and <= `maximum` (a bound tighter than a day)."""
    def convert(value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise InvalidValue(f"expected a number of seconds >= 0, got {describe(value)}")
        if not math.isfinite(value) or not 0 <= value <= maximum:
            raise InvalidValue(f"expected a number of seconds from 0 to {maximum:g}, got {value}")
        return float(value)

    return convert


def choice(enum: type[StrEnum]) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        try:
            return enum(value)
        except ValueError:
            choices = ", ".join(quote(m.value) for m in enum)
            raise InvalidValue(f"expected one of {choices}, got {describe(value)}") from None

    return convert


def parse_signal(value: Any) -> signal.Signals:
    if isinstance(value, str):
        name = value.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        sig = signal.Signals.__members__.get(name)
        if sig is not None:
            return sig
    raise InvalidValue(f'expected a signal name such as "SIGTERM" or "SIGINT", got {describe(value)}')


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise InvalidValue(f"expected a table of strings, got {describe(value)}")
    for name, text in value.items():
        if not _ENV_NAME.fullmatch(name):
            raise InvalidValue(f"expected a variable name of letters, digits and '_', got {quote(name)}", name)
        if name in RESERVED_ENV:
            raise InvalidValue(f"{name} is set by omnid; expected other variable names", name)
        if not isinstance(text, str):
            raise InvalidValue(f"expected a string, got {describe(text)}", name)
        if "\0" in text:
            raise InvalidValue("expected a string without NUL bytes", name)
    return dict(value)


def _rlimit_value(name: str, value: Any) -> int:
    if value == "infinity":
        return resource.RLIM_INFINITY
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_RLIMIT:
        return value
    raise InvalidValue(f'expected an integer from 0 to 2**63-2 or "infinity", got {describe(value)}', name)


def limits(value: Any) -> tuple[Rlimit, ...]:
    if not isinstance(value, dict):
        raise InvalidValue(f'expected a table such as {{ nofile = 65536, memlock = "infinity" }}, '
                           f"got {describe(value)}")
    limits = []
    for name, setting in value.items():
        if name not in RLIMITS:
            raise InvalidValue(f"unknown limit; expected one of: {', '.join(sorted(RLIMITS))}", name)
        if isinstance(setting, list):
            # [soft, hard], for when the two must differ.
            if len(setting) != 2:
                raise InvalidValue(f"expected [soft, hard], got an array of {len(setting)}", name)
            soft, hard = (_rlimit_value(name, v) for v in setting)
            if _rlimit_order(soft) > _rlimit_order(hard):
                raise InvalidValue(f"expected soft <= hard, got {setting!r}", name)
        else:
            soft = hard = _rlimit_value(name, setting)
        limits.append(Rlimit(RLIMITS[name], soft, hard))
    return tuple(limits)


def _rlimit_order(value: int) -> float:
    # RLIM_INFINITY is -1 on some builds; it is the largest limit, whatever its encoding.
    return math.inf if value == resource.RLIM_INFINITY else value


MAX_GPU_INDEX = 1023
_HEX_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
# As nvidia-smi -L prints them, and as CUDA_VISIBLE_DEVICES takes them: a GPU UUID, a MIG device
# UUID (drivers >= R470), or the older MIG form naming its GPU, GPU instance and compute instance.
GPU_UUID = re.compile(f"GPU-{_HEX_UUID}")
MIG_UUID = re.compile(f"MIG-{_HEX_UUID}|MIG-GPU-{_HEX_UUID}/[0-9]+/[0-9]+")
_GPU_ITEM = ('a GPU index (0 to 1023), a GPU UUID ("GPU-...") or a MIG device UUID ("MIG-...") as '
             "nvidia-smi -L prints them")
_GPUS_EXPECTED = (f'expected an array of GPUs, each {_GPU_ITEM}, e.g. [0, 1] or '
                  '["MIG-377e0049-554c-540b-93c6-d0976f8426cb"], or "%i"')


def _gpu_ref(item: Any, position: int) -> int | str:
    """One `gpus` entry, or InvalidValue naming its position and what is wrong with it."""
    where = f"item {position + 1}"
    if isinstance(item, int) and not isinstance(item, bool):
        if 0 <= item <= MAX_GPU_INDEX:
            return item
        raise InvalidValue(f"{where}: expected a GPU index from 0 to {MAX_GPU_INDEX}, got {item}")
    if isinstance(item, str):
        if GPU_UUID.fullmatch(item) or MIG_UUID.fullmatch(item):
            return item
        if item.isdigit():
            raise InvalidValue(f'{where}: expected a GPU index as an integer, got the string {quote(item)} '
                               f"(write {int(item)})")
        if "," in item or item != item.strip():
            raise InvalidValue(f"{where}: expected one GPU per item, without commas or spaces, got {quote(item)}")
        if item.upper().startswith("MIG-"):
            raise InvalidValue(f'{where}: not a MIG device UUID: expected "MIG-" and 8-4-4-4-12 hexadecimal '
                               f'digits (or "MIG-GPU-<GPU UUID>/GI/CI"), got {quote(item)}')
        if item.upper().startswith("GPU-"):
            raise InvalidValue(f'{where}: not a GPU UUID: expected "GPU-" and 8-4-4-4-12 hexadecimal digits, '
                               f"got {quote(item)}")
        raise InvalidValue(f"{where}: expected {_GPU_ITEM}, got {quote(item)}")
    raise InvalidValue(f"{where}: expected {_GPU_ITEM}, got {describe(item)}")


def gpus(value: Any) -> tuple[int | str, ...] | str:
    if value == "%i":
        return value  # one GPU per instance; resolved at expansion
    if not isinstance(value, list):
        raise InvalidValue(f"{_GPUS_EXPECTED}, got {describe(value)}")
    refs = tuple(_gpu_ref(item, i) for i, item in enumerate(value))
    if len(set(refs)) != len(refs):
        raise InvalidValue(f"expected each GPU once, got {value!r}")
    return refs


def numa(value: Any) -> NumaMode | int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_NUMA_NODE:
        return value
    if value in ("auto", "off"):
        return NumaMode(value)
    raise InvalidValue(f'expected "auto" (the NUMA node of the unit\'s GPUs), "off", or a node number from 0 to '
                       f"{MAX_NUMA_NODE}, got {describe(value)}")


MAX_NUMA_NODE = 1023  # the kernel's MAX_NUMNODES is at most 1024


def parse_host_port(text: str) -> tuple[str, int]:
    """"HOST:PORT" or "[V6]:PORT" -> (host, port); ValueError saying what was expected."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    bad_host = not host or any(c in host for c in "[]/ \t\n") or (":" in host and not text.startswith("["))
    if not sep or bad_host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f'expected "HOST:PORT" (an IPv6 address in brackets: "[::1]:8000") with a port from 1 '
                         f"to 65535, got {quote(text)}")
    return host, int(port_text)


def group_name(value: Any) -> str:
    if isinstance(value, str) and UNIT_NAME.fullmatch(value):
        return value
    raise InvalidValue(f"expected a group name (a letter or digit, then letters, digits, '_', '.' or '-'), "
                       f"got {describe(value)}")


def http_url(value: Any) -> str:
    example = "http://127.0.0.1:8000/health"
    if isinstance(value, str):
        try:
            parts = urlsplit(value)
            _port = parts.port  # raises ValueError on a port that is not 0-65535
            host = parts.hostname
        except ValueError as exc:  # "Invalid IPv6 URL", "Port out of range 0-65535", ...
            raise InvalidValue(f'expected an http:// or https:// URL such as "{example}", got {describe(value)} '
                               f"({exc})") from None
        if parts.scheme in ("http", "https") and host and not any(c.isspace() for c in value):
            if not value.isascii():  # it goes on the request line as it is
                raise InvalidValue(f"expected a URL in ASCII (percent-encode the rest, e.g. %E2%82%AC), "
                                   f"got {describe(value)}")
            return value
    raise InvalidValue(f'expected an http:// or https:// URL such as "{example}", got {describe(value)}')


# Readers of one key each that are more than a type (omnid.model.keys names them).


def ready(value: Any) -> Ready:
    if value == "started":
        return Ready(ReadyKind.STARTED)
    if value == "notify":
        return Ready(ReadyKind.NOTIFY)
    if isinstance(value, dict) and len(value) == 1:
        (kind, target), = value.items()
        if kind == "http":
            return Ready(ReadyKind.HTTP, url=string(target))  # URL checked after %i expansion
        if kind == "tcp":
            return Ready(ReadyKind.TCP, url=string(target))  # split into host/port after expansion
    raise InvalidValue(f'expected "started", "notify", {{ http = URL }} or {{ tcp = "HOST:PORT" }}, '
                       f"got {describe(value)}")


def drain(value: Any) -> DrainHook:
    expected = 'a table { http = "http://127.0.0.1:8000/drain" } or { signal = "SIGUSR1" }'
    if isinstance(value, dict) and len(value) == 1:
        if "http" in value and isinstance(value["http"], str):
            return DrainHook(url=value["http"])  # the URL is checked after %i expansion
        if "signal" in value:
            try:
                sig = parse_signal(value["signal"])
            except InvalidValue as exc:
                raise InvalidValue(f"signal: {exc}") from None
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                raise InvalidValue(f"signal {sig.name} cannot ask a unit to drain (it cannot be handled); "
                                   f"expected e.g. SIGUSR1")
            return DrainHook(sig=sig)
    raise InvalidValue(f"expected {expected}, got {describe(value)}")


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidValue(f"expected true or false, got {describe(value)}")
    return value


def cache_name(value: Any) -> bool | str:
    """`cache_dir`: true, false, or one directory name under the daemon's cache root. Never a
    path: a unit file that could name any directory would have a root daemon chown it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and UNIT_NAME.fullmatch(value) and len(value) <= 200:
        return value
    raise InvalidValue('expected true, false or a directory name under the cache root (a letter or digit, then '
                       f'letters, digits, "_", "." or "-"; no "/"), got {describe(value)}')


def group_hosts(value: Any) -> tuple[str, ...]:
    hosts = string_list(value)
    if not 1 <= len(hosts) <= 64 or not all(HOST_NAME.fullmatch(h) for h in hosts):
        raise InvalidValue('expected 1 to 64 host names (letters, digits, "_", "." or "-"), the leading host first, '
                           f'e.g. ["node-a", "node-b"]; got {list(hosts)!r}')
    if len(set(hosts)) != len(hosts):
        raise InvalidValue(f"expected each host once, got {list(hosts)!r}")
    return hosts
