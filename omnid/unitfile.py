"""Reading one unit file (or omnid.toml) into a typed, not yet expanded template: the key
table of omnid.unit(5) and the daemon-settings keys of omnid(8)."""

from __future__ import annotations

import ipaddress
import re
import signal
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnid.cluster.settings import HOST_NAME, parse_cluster
from omnid.ownership import UnsafePath, read_unit_file
from omnid.unitmodel import DEFAULT_TITLE, MAX_PASSED_FDS, DaemonSettings, DrainHook, KillMode, ListenSocket, Liveness, LogFormat, NumaMode, Progress, Ready, ReadyKind, RestartPolicy, TorchDistributed, UnitFileError, UpdatePolicy
from omnid.unitvalues import MAX_INSTANCES, InvalidValue, _Invalid, _Table, _argv, _cgroup_amount, _choice, _describe, _env, _gpus, _group_name, _integer, _limits, _nonempty_string, _numa, _quote, _seconds, _seconds_at_most, _string, _string_list, parse_host_port, parse_signal


# --------------------------------------------------------------------------- unit files


UNIT_KEYS = (
    "exec", "description", "role", "title", "instances", "after", "requires", "cwd", "env",
    "user", "group", "limits", "gpus", "ready", "ready_timeout", "liveness", "watchdog_sec",
    "stop_signal", "stop_timeout", "kill_timeout", "restart", "restart_sec", "restart_max_sec",
    "start_limit_burst", "start_limit_interval", "gpu_min_free_mib", "worker_group", "torch_distributed",
    "memory_max", "tasks_max", "capture_timeout", "drain", "drain_timeout", "group_hosts", "numa",
    "progress", "ready_interval", "kill_mode", "leftover_timeout", "private_tmp", "remove_ipc",
    "sockets", "update", "max_unavailable", "fd_store_max",
)  # fmt: skip
TORCH_DISTRIBUTED_KEYS = ("master_addr", "master_port")
# The restart policy of a worker group is one policy: every member must declare the same.
GROUP_POLICY_KEYS = ("restart", "restart_sec", "restart_max_sec", "start_limit_burst", "start_limit_interval")
LIVENESS_KEYS = ("http", "exec", "method", "body", "headers", "expect", "interval", "timeout", "failures")
PROGRESS_KEYS = ("metrics", "counter", "busy", "stall_sec", "interval")
SOCKET_KEYS = ("listen", "name", "backlog", "mode", "reuseport")
MAX_SOCKETS = 64  # per unit: held open by the daemon for as long as the unit is in the stack
SETTINGS_KEYS = ("control", "state_dir", "health_listen", "log_format", "cgroup_root", "drain_sec", "stop_deadline", "cluster",
                 "exit_when_failed")


@dataclass(frozen=True)
class _Template:
    """One unit file, typed but not yet expanded: strings may still hold %i / %n."""

    name: str
    file: Path
    instances: int
    values: Mapping[str, Any]  # Unit field -> typed value, for keys that are per-template
    after: tuple[str, ...]
    requires: tuple[str, ...]
    gpus: tuple[int | str, ...] | str | None


def _read_toml(file: Path, errors: list[UnitFileError], sources: dict[str, bytes] | None = None,
               given: bool = False) -> dict[str, Any] | None:
    """Parse one file. Its bytes are read from disk and recorded in `sources`, or, when
    `given`, taken from `sources` (the texts a running daemon loaded, across its re-exec)."""
    try:
        if given and sources is not None:
            data = sources[file.name]
        else:
            data = read_unit_file(file, MAX_UNIT_FILE_BYTES + 1)  # checked on the fd it reads (as root)
            if sources is not None:
                sources[file.name] = data
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
    except UnsafePath as exc:
        errors.append(UnitFileError(file, "", str(exc)))
    except OSError as exc:
        errors.append(UnitFileError(file, "", f"cannot read ({exc.strerror}); expected a readable file"))
    return None


MAX_UNIT_FILE_BYTES = 1 << 20


def _drain(value: Any) -> DrainHook:
    expected = 'a table { http = "http://127.0.0.1:8000/drain" } or { signal = "SIGUSR1" }'
    if isinstance(value, dict) and len(value) == 1:
        if "http" in value and isinstance(value["http"], str):
            return DrainHook(url=value["http"])  # the URL is checked after %i expansion
        if "signal" in value:
            try:
                sig = parse_signal(value["signal"])
            except InvalidValue as exc:
                raise _Invalid(f"signal: {exc}") from None
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                raise _Invalid(f"signal {sig.name} cannot ask a unit to drain (it cannot be handled); "
                               f"expected e.g. SIGUSR1")
            return DrainHook(sig=sig)
    raise _Invalid(f"expected {expected}, got {_describe(value)}")


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
        "capture_timeout": t.get("capture_timeout", 3.0, _seconds_at_most(300.0)),
        "drain": t.get("drain", None, _drain),
        "drain_timeout": t.get("drain_timeout", 30.0, _seconds(zero_ok=False)),
        "restart": t.get("restart", RestartPolicy.NO, _choice(RestartPolicy)),
        # 0 = restart at once (systemd's RestartSec=0); the start limit still ends a crash loop.
        "restart_sec": t.get("restart_sec", 1.0, _seconds(zero_ok=True)),
        "restart_max_sec": t.get("restart_max_sec", 60.0, _seconds(zero_ok=True)),  # >= restart_sec, below
        "start_limit_burst": t.get("start_limit_burst", 5, _integer(1)),
        "start_limit_interval": t.get("start_limit_interval", 60.0, _seconds(zero_ok=False)),
        "gpu_min_free_mib": t.get("gpu_min_free_mib", 0, _integer(0)),
        "worker_group": t.get("worker_group", None, _group_name),
        "group_hosts": t.get("group_hosts", (), _group_hosts),
        "torch_distributed": None,
        "memory_max": t.get("memory_max", None, _cgroup_amount(bytes_=True)),
        "tasks_max": t.get("tasks_max", None, _cgroup_amount(bytes_=False)),
        "liveness": None,
        "progress": None,
        "ready_interval": t.get("ready_interval", 5.0, _seconds(zero_ok=True)),
        "kill_mode": t.get("kill_mode", KillMode.CONTROL_GROUP, _choice(KillMode)),
        "leftover_timeout": t.get("leftover_timeout", 3.0, _seconds(zero_ok=True)),
        "private_tmp": t.get("private_tmp", True, _boolean),
        "remove_ipc": t.get("remove_ipc", True, _boolean),
        "numa": t.get("numa", NumaMode.AUTO, _numa),
        "sockets": (),
        "update": t.get("update", UpdatePolicy.RESTART, _choice(UpdatePolicy)),
        "max_unavailable": t.get("max_unavailable", 1, _integer(1, MAX_INSTANCES)),
        "fd_store_max": t.get("fd_store_max", 0, _integer(0, MAX_PASSED_FDS)),
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
        v["liveness"] = _liveness(file, raw["liveness"], errors)
    if "progress" in raw:
        v["progress"] = _progress(file, raw["progress"], errors)
    if "sockets" in raw:
        v["sockets"] = _sockets(file, raw["sockets"], errors)
    if v["fd_store_max"] + len(v["sockets"]) > MAX_PASSED_FDS:
        t.error("fd_store_max", f"expected at most {MAX_PASSED_FDS - len(v['sockets'])} with {len(v['sockets'])} "
                f"sockets (a unit is passed at most {MAX_PASSED_FDS} fds), got {v['fd_store_max']}")
    if v["watchdog_sec"] > 0 and v["ready"].kind is not ReadyKind.NOTIFY:
        t.error("watchdog_sec", f'needs ready = "notify" (the watchdog is fed by WATCHDOG=1 notifications), '
                f'got ready = "{v["ready"].kind}"')  # fmt: skip
    if v["group_hosts"] and v["worker_group"] is None:
        t.error("group_hosts", 'needs worker_group: the members on each listed host form one group; expected e.g. '
                'worker_group = "tp"')
    if v["restart_max_sec"] < v["restart_sec"]:
        t.error("restart_max_sec", f"expected seconds >= restart_sec ({v['restart_sec']:g}), "
                f"got {v['restart_max_sec']:g}")  # fmt: skip
    instances = t.get("instances", 1, _integer(1, MAX_INSTANCES))
    if v["update"] is UpdatePolicy.ROLLING and v["worker_group"] is not None:
        t.error("update", 'a worker group is one thing and restarts as a group; expected update = "restart" '
                'with worker_group')
    if v["update"] is UpdatePolicy.ROLLING and instances > 1 and v["max_unavailable"] >= instances:
        t.error("max_unavailable", f"expected fewer than instances ({instances}): a roll keeps at least one "
                f"instance up, got {v['max_unavailable']}")
    return _Template(
        name=name,
        file=file,
        instances=instances,
        values=v,
        after=t.get("after", (), _string_list),
        requires=t.get("requires", (), _string_list),
        gpus=t.get("gpus", None, _gpus),
    )


_LIVENESS_EXPECTED = ('a table { http = URL, interval = 5, timeout = 2, failures = 3 } (also method, body, '
                      'headers, expect) or { exec = ["program", "arg"], interval, timeout, failures }')
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _liveness(file: Path, raw: Any, errors: list[UnitFileError]) -> Liveness | None:
    if not isinstance(raw, dict):
        errors.append(UnitFileError(file, "liveness", f"expected {_LIVENESS_EXPECTED}, got {_describe(raw)}"))
        return None
    lt = _Table(file, raw, errors, prefix="liveness.")
    lt.check_keys(LIVENESS_KEYS)
    common = dict(interval=lt.get("interval", 5.0, _seconds(zero_ok=False)),
                  timeout=lt.get("timeout", 2.0, _seconds(zero_ok=False)),
                  failures=lt.get("failures", 3, _integer(1)))
    if ("http" in raw) == ("exec" in raw):
        lt.error("http", 'expected exactly one of http = "http://HOST:PORT/PATH" or exec = ["program", ...], '
                 f"got {'both' if 'http' in raw else 'neither'}")
        return None
    if "exec" in raw:
        for key in ("method", "body", "headers", "expect"):
            if key in raw:
                lt.error(key, "applies to the http form only; expected it absent with exec")
        return Liveness(exec=lt.get("exec", ("true",), _argv), **common)
    method = lt.get("method", "GET", _choice_of("GET", "POST"))
    body = lt.get("body", "", _string)
    if body and method != "POST":
        lt.error("body", 'is sent with method = "POST" only; expected method = "POST" or no body')
    return Liveness(
        url=lt.get("http", "", _string),  # URL checked after %i expansion
        method=method,
        body=body,
        headers=lt.get("headers", (), _headers),
        expect=lt.get("expect", (), _statuses),
        **common,
    )


def _choice_of(*words: str) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if value in words:
            return value
        raise _Invalid(f"expected one of {', '.join(_quote(w) for w in words)}, got {_describe(value)}")

    return convert


def _headers(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise _Invalid(f'expected a table of strings such as {{ "Content-Type" = "application/json" }}, '
                       f"got {_describe(value)}")
    out = []
    for name, text in value.items():
        if not _HEADER_NAME.fullmatch(name) or name.lower() in ("host", "content-length", "connection"):
            raise _Invalid("expected an HTTP header name (letters, digits, '-'; not Host, Content-Length or "
                           f"Connection, which omnid sets), got {_quote(name)}", name)
        if not isinstance(text, str) or any(c in text for c in "\r\n\0"):
            raise _Invalid(f"expected a string without line breaks, got {_describe(text)}", name)
        out.append((name, text))
    return tuple(out)


def _statuses(value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) and 100 <= v <= 599 for v in items):
        raise _Invalid(f"expected an HTTP status (100 to 599) or an array of them, e.g. [200, 204], "
                       f"got {_describe(value)}")
    return tuple(items)


def _metric_name(value: Any) -> str:
    if isinstance(value, str) and _METRIC_NAME.fullmatch(value):
        return value
    raise _Invalid(f'expected a Prometheus metric name such as "vllm:generation_tokens_total", got {_describe(value)}')


def _metric_names(value: Any) -> tuple[str, ...]:
    names = _string_list(value)
    if not names:
        raise _Invalid('expected at least one gauge name, e.g. ["vllm:num_requests_running"]')
    return tuple(_metric_name(n) for n in names)


def _progress(file: Path, raw: Any, errors: list[UnitFileError]) -> Progress | None:
    expected = ('a table { metrics = URL, counter = NAME, busy = [NAME, ...], stall_sec = 60, interval = 5 }')
    if not isinstance(raw, dict):
        errors.append(UnitFileError(file, "progress", f"expected {expected}, got {_describe(raw)}"))
        return None
    pt = _Table(file, raw, errors, prefix="progress.")
    pt.check_keys(PROGRESS_KEYS)
    for key in ("metrics", "counter", "busy"):
        if key not in raw:
            pt.error(key, f"missing; expected {expected}")
    p = Progress(
        metrics=pt.get("metrics", "", _string),  # URL checked after %i expansion
        counter=pt.get("counter", "", _metric_name),
        busy=pt.get("busy", (), _metric_names),
        stall_sec=pt.get("stall_sec", 60.0, _seconds(zero_ok=False)),
        interval=pt.get("interval", 5.0, _seconds(zero_ok=False)),
    )
    if p.interval > p.stall_sec:
        pt.error("interval", f"expected seconds <= stall_sec ({p.stall_sec:g}): a stall is seen only between "
                 f"two scrapes; got {p.interval:g}")
    return p


_SOCKET_EXPECTED = ('an array of tables { listen = "HOST:PORT" or "/path.sock", name = "http", backlog = 1024, '
                    'mode = "0660", reuseport = false }')


def _fd_name(value: Any) -> str:
    # sd_listen_fds_with_names(3): printable ASCII, no ':' (the separator), at most 255.
    if isinstance(value, str) and 0 < len(value) <= 255 and all(" " < c <= "~" and c != ":" for c in value):
        return value
    raise _Invalid(f"expected a name of 1 to 255 printable ASCII characters without ':' or spaces, "
                   f"got {_describe(value)}")


def _file_mode(value: Any) -> int:
    if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3}", value):
        return int(value, 8)
    raise _Invalid(f'expected an octal file mode as a string, e.g. "0660", got {_describe(value)}')


def _sockets(file: Path, raw: Any, errors: list[UnitFileError]) -> tuple[ListenSocket, ...]:
    """`sockets`: the addresses are checked after %i expansion (omnid.stackgraph)."""
    if not isinstance(raw, list) or len(raw) > MAX_SOCKETS:
        got = f"an array of {len(raw)}" if isinstance(raw, list) else _describe(raw)
        errors.append(UnitFileError(file, "sockets", f"expected {_SOCKET_EXPECTED} (at most {MAX_SOCKETS}), "
                                    f"got {got}"))
        return ()
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            errors.append(UnitFileError(file, f"sockets[{i}]", f"expected a table {{ listen = \"HOST:PORT\" }}, "
                                        f"got {_describe(item)}"))
            out.append(ListenSocket("", ""))  # keeps the next ones' indexes; the stack is invalid
            continue
        st = _Table(file, item, errors, prefix=f"sockets[{i}].")
        st.check_keys(SOCKET_KEYS)
        if "listen" not in item:
            st.error("listen", 'missing; expected "HOST:PORT" (e.g. "127.0.0.1:8000", "[::1]:8000") or an '
                     'absolute Unix socket path')
            out.append(ListenSocket("", ""))
            continue
        mode = st.get("mode", None, _file_mode)  # None: not written (checked after expansion)
        out.append(ListenSocket(
            listen=st.get("listen", "", _nonempty_string), name=st.get("name", "", _fd_name),
            backlog=st.get("backlog", 1024, _integer(1, 65535)), mode=mode,
            reuseport=st.get("reuseport", False, _boolean)))
    return tuple(out)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"expected true or false, got {_describe(value)}")
    return value


def _group_hosts(value: Any) -> tuple[str, ...]:
    hosts = _string_list(value)
    if not 1 <= len(hosts) <= 64 or not all(HOST_NAME.fullmatch(h) for h in hosts):
        raise _Invalid('expected 1 to 64 host names (letters, digits, "_", "." or "-"), the leading host first, '
                       f'e.g. ["node-a", "node-b"]; got {list(hosts)!r}')
    if len(set(hosts)) != len(hosts):
        raise _Invalid(f"expected each host once, got {list(hosts)!r}")
    return hosts


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
            # A host name makes aiohttp start a resolver thread (ARCHITECTURE.md, "Threads"): numeric only.
            raise _Invalid(f'expected "ADDRESS:PORT" with a numeric address such as "127.0.0.1:9321" ({exc})') from None
        return value

    return DaemonSettings(
        file=file,
        control=t.get("control", None, path),
        state_dir=t.get("state_dir", None, path),
        health_listen=t.get("health_listen", None, listen),
        log_format=t.get("log_format", None, _choice(LogFormat)),
        cgroup_root=t.get("cgroup_root", None, path),
        drain_sec=t.get("drain_sec", None, _seconds(zero_ok=True)),
        stop_deadline=t.get("stop_deadline", None, _seconds(zero_ok=False)),
        cluster=parse_cluster(file, raw["cluster"], directory, errors) if "cluster" in raw else None,
        exit_when_failed=t.get("exit_when_failed", False, _boolean),
    )
