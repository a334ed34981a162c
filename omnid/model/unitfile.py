"""Reading one unit file (or omnid.toml) into a typed, not yet expanded template: every key
through the table of omnid.model.keys, then what the table cannot say (the nested tables
liveness, progress, sockets and torch_distributed, and the checks of one key against
another); and the daemon-settings keys of omnid(8)."""

from __future__ import annotations

import ipaddress
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnid.model.cluster import parse_cluster
from omnid.base.ownership import UnsafePath, read_unit_file
from omnid.model.keys import TEMPLATE_KEYS, UNIT_KEY_BY_NAME, UNIT_KEY_TABLE, UNIT_KEYS
from omnid.model.unitmodel import DEFAULT_BACKLOG, MAX_PASSED_FDS, Canary, DaemonSettings, ListenSocket, Liveness, LogFormat, Progress, ReadyKind, TorchDistributed, UnitFileError, UpdatePolicy
from omnid.model.unitvalues import InvalidValue, Table, argv, boolean, choice, describe, integer, nonempty_string, quote, seconds, string, string_list, parse_host_port


# --------------------------------------------------------------------------- unit files


TORCH_DISTRIBUTED_KEYS = ("master_addr", "master_port")
LIVENESS_KEYS = ("http", "exec", "method", "body", "headers", "expect", "interval", "timeout", "failures")
PROGRESS_KEYS = ("metrics", "counter", "busy", "stall_sec", "interval", "canary")
CANARY_KEYS = ("http", "method", "body", "headers")
SOCKET_KEYS = ("listen", "name", "backlog", "mode", "reuseport")
MAX_SOCKETS = 64  # per unit: held open by the daemon for as long as the unit is in the stack
SETTINGS_KEYS = ("control", "state_dir", "health_listen", "log_format", "cgroup_root", "daemon_nice", "drain_sec", "stop_deadline", "cluster",
                 "exit_when_failed", "cache_root")


@dataclass(frozen=True)
class Template:
    """One unit file, typed but not yet expanded: strings may still hold %i / %n."""

    name: str
    file: Path
    instances: int
    values: Mapping[str, Any]  # Unit field -> typed value, for keys that are per-template
    after: tuple[str, ...]
    requires: tuple[str, ...]
    gpus: tuple[int | str, ...] | str | None


def read_toml(file: Path, errors: list[UnitFileError], sources: dict[str, bytes] | None = None,
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


def parse_unit_file(file: Path, name: str, raw: Mapping[str, Any], errors: list[UnitFileError]) -> Template:
    t = Table(file, raw, errors)
    t.check_keys(UNIT_KEYS)
    if "exec" not in raw:
        t.error("exec", 'missing; expected the program and its arguments, e.g. exec = ["vllm", "serve"]')
    # The keys of one value, in the table's order (the order of their errors); the keys read
    # by code of their own (nested tables) start at their default and are read below.
    v: dict[str, Any] = {k.name: t.get(k.name, k.default, k.parse) if k.parse else k.default
                         for k in UNIT_KEY_TABLE if k.name not in TEMPLATE_KEYS}
    td = raw.get("torch_distributed", False)
    if td is True or isinstance(td, dict):
        tt = Table(file, td if isinstance(td, dict) else {}, errors, prefix="torch_distributed.")
        tt.check_keys(TORCH_DISTRIBUTED_KEYS)
        v["torch_distributed"] = TorchDistributed(
            master_addr=tt.get("master_addr", "127.0.0.1", nonempty_string),
            master_port=tt.get("master_port", 29500, integer(1)),
        )
        if v["torch_distributed"].master_port > 65535:
            tt.error("master_port", f"expected a port from 1 to 65535, got {v['torch_distributed'].master_port}")
        if v["worker_group"] is None:
            t.error("torch_distributed", "needs worker_group: ranks that do not fail and restart together hang "
                    "in their next collective when one of them dies; expected e.g. worker_group = \"tp0\"")
    elif td is not False:
        t.error("torch_distributed", f"expected true, false or a table {{ master_addr = \"127.0.0.1\", "
                f"master_port = 29500 }}, got {describe(td)}")
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
    instances = _template_key(t, "instances")
    if v["update"] is UpdatePolicy.ROLLING and v["worker_group"] is not None:
        t.error("update", 'a worker group is one thing and restarts as a group; expected update = "restart" '
                'with worker_group')
    if v["update"] is UpdatePolicy.ROLLING and instances > 1 and v["max_unavailable"] >= instances:
        t.error("max_unavailable", f"expected fewer than instances ({instances}): a roll keeps at least one "
                f"instance up, got {v['max_unavailable']}")
    return Template(
        name=name,
        file=file,
        instances=instances,
        values=v,
        after=_template_key(t, "after"),
        requires=_template_key(t, "requires"),
        gpus=_template_key(t, "gpus"),
    )


def _template_key(t: Table, name: str) -> Any:
    """One of TEMPLATE_KEYS, read through its row of the table."""
    key = UNIT_KEY_BY_NAME[name]
    assert key.parse is not None  # each template key is one value (tests/test_unit_keys.py)
    return t.get(name, key.default, key.parse)


_LIVENESS_EXPECTED = ('a table { http = URL, interval = 5, timeout = 2, failures = 3 } (also method, body, '
                      'headers, expect) or { exec = ["program", "arg"], interval, timeout, failures }')
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _liveness(file: Path, raw: Any, errors: list[UnitFileError]) -> Liveness | None:
    if not isinstance(raw, dict):
        errors.append(UnitFileError(file, "liveness", f"expected {_LIVENESS_EXPECTED}, got {describe(raw)}"))
        return None
    lt = Table(file, raw, errors, prefix="liveness.")
    lt.check_keys(LIVENESS_KEYS)
    common = dict(interval=lt.get("interval", 5.0, seconds(zero_ok=False)),
                  timeout=lt.get("timeout", 2.0, seconds(zero_ok=False)),
                  failures=lt.get("failures", 3, integer(1)))
    if ("http" in raw) == ("exec" in raw):
        lt.error("http", 'expected exactly one of http = "http://HOST:PORT/PATH" or exec = ["program", ...], '
                 f"got {'both' if 'http' in raw else 'neither'}")
        return None
    if "exec" in raw:
        for key in ("method", "body", "headers", "expect"):
            if key in raw:
                lt.error(key, "applies to the http form only; expected it absent with exec")
        return Liveness(exec=lt.get("exec", ("true",), argv), **common)
    return Liveness(**_request(lt, "GET"), expect=lt.get("expect", (), _statuses), **common)


def _request(t: Table, method: str) -> dict[str, Any]:
    """The HTTP request a probe sends (liveness, the progress canary): url, method (`method`
    when absent), body (POST only), headers. The URL is checked after %i expansion."""
    method = t.get("method", method, _choice_of("GET", "POST"))
    body = t.get("body", "", string)
    if body and method != "POST":
        t.error("body", 'is sent with method = "POST" only; expected method = "POST" or no body')
    return dict(url=t.get("http", "", string), method=method, body=body, headers=t.get("headers", (), _headers))


def _choice_of(*words: str) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if value in words:
            return value
        raise InvalidValue(f"expected one of {', '.join(quote(w) for w in words)}, got {describe(value)}")

    return convert


def _headers(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise InvalidValue(f'expected a table of strings such as {{ "Content-Type" = "application/json" }}, '
                           f"got {describe(value)}")
    out = []
    for name, text in value.items():
        if not _HEADER_NAME.fullmatch(name) or name.lower() in ("host", "content-length", "connection"):
            raise InvalidValue("expected an HTTP header name (letters, digits, '-'; not Host, Content-Length or "
                               f"Connection, which omnid sets), got {quote(name)}", name)
        if not isinstance(text, str) or any(c in text for c in "\r\n\0") or not text.isascii():
            raise InvalidValue(f"expected an ASCII string without line breaks, got {describe(text)}", name)
        out.append((name, text))
    return tuple(out)


def _statuses(value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) and 100 <= v <= 599 for v in items):
        raise InvalidValue(f"expected an HTTP status (100 to 599) or an array of them, e.g. [200, 204], "
                           f"got {describe(value)}")
    return tuple(items)


def _metric_name(value: Any) -> str:
    if isinstance(value, str) and _METRIC_NAME.fullmatch(value):
        return value
    raise InvalidValue(f'expected a Prometheus metric name such as "vllm:generation_tokens_total", '
                       f"got {describe(value)}")


def _metric_names(value: Any) -> tuple[str, ...]:
    names = string_list(value)
    if not names:
        raise InvalidValue('expected at least one gauge name, e.g. ["vllm:num_requests_running"]')
    return tuple(_metric_name(n) for n in names)


def _progress(file: Path, raw: Any, errors: list[UnitFileError]) -> Progress | None:
    expected = ('a table { metrics = URL, counter = NAME, busy = [NAME, ...], stall_sec = 60, interval = 5 }')
    if not isinstance(raw, dict):
        errors.append(UnitFileError(file, "progress", f"expected {expected}, got {describe(raw)}"))
        return None
    pt = Table(file, raw, errors, prefix="progress.")
    pt.check_keys(PROGRESS_KEYS)
    for key in ("metrics", "counter", "busy"):
        if key not in raw:
            pt.error(key, f"missing; expected {expected}")
    p = Progress(
        metrics=pt.get("metrics", "", string),  # URL checked after %i expansion
        counter=pt.get("counter", "", _metric_name),
        busy=pt.get("busy", (), _metric_names),
        stall_sec=pt.get("stall_sec", 60.0, seconds(zero_ok=False)),
        interval=pt.get("interval", 5.0, seconds(zero_ok=False)),
        canary=_canary(file, raw["canary"], errors) if "canary" in raw else None,
    )
    if p.interval > p.stall_sec:
        pt.error("interval", f"expected seconds <= stall_sec ({p.stall_sec:g}): a stall is seen only between "
                 f"two scrapes; got {p.interval:g}")
    return p


def _canary(file: Path, raw: Any, errors: list[UnitFileError]) -> Canary | None:
    expected = ('a table { http = "http://HOST:PORT/v1/completions", method = "POST", headers = { ... }, '
                'body = "..." }')
    if not isinstance(raw, dict):
        errors.append(UnitFileError(file, "progress.canary", f"expected {expected}, got {describe(raw)}"))
        return None
    ct = Table(file, raw, errors, prefix="progress.canary.")
    ct.check_keys(CANARY_KEYS)
    if "http" not in raw:
        ct.error("http", f"missing; expected {expected}")
    return Canary(**_request(ct, "POST"))


_SOCKET_EXPECTED = ('an array of tables { listen = "HOST:PORT" or "/path.sock", name = "http", '
                    f'backlog = {DEFAULT_BACKLOG}, mode = "0660", reuseport = false }}')


def _fd_name(value: Any) -> str:
    # sd_listen_fds_with_names(3): printable ASCII, no ':' (the separator), at most 255.
    if isinstance(value, str) and 0 < len(value) <= 255 and all(" " < c <= "~" and c != ":" for c in value):
        return value
    raise InvalidValue(f"expected a name of 1 to 255 printable ASCII characters without ':' or spaces, "
                       f"got {describe(value)}")


def _file_mode(value: Any) -> int:
    if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3}", value):
        return int(value, 8)
    raise InvalidValue(f'expected an octal file mode as a string, e.g. "0660", got {describe(value)}')


def _sockets(file: Path, raw: Any, errors: list[UnitFileError]) -> tuple[ListenSocket, ...]:
    """`sockets`: the addresses are checked after %i expansion (omnid.model.stackgraph)."""
    if not isinstance(raw, list) or len(raw) > MAX_SOCKETS:
        got = f"an array of {len(raw)}" if isinstance(raw, list) else describe(raw)
        errors.append(UnitFileError(file, "sockets", f"expected {_SOCKET_EXPECTED} (at most {MAX_SOCKETS}), "
                                    f"got {got}"))
        return ()
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            errors.append(UnitFileError(file, f"sockets[{i}]", f"expected a table {{ listen = \"HOST:PORT\" }}, "
                                        f"got {describe(item)}"))
            out.append(ListenSocket("", ""))  # keeps the next ones' indexes; the stack is invalid
            continue
        st = Table(file, item, errors, prefix=f"sockets[{i}].")
        st.check_keys(SOCKET_KEYS)
        if "listen" not in item:
            st.error("listen", 'missing; expected "HOST:PORT" (e.g. "127.0.0.1:8000", "[::1]:8000") or an '
                     'absolute Unix socket path')
            out.append(ListenSocket("", ""))
            continue
        mode = st.get("mode", None, _file_mode)  # None: not written (checked after expansion)
        out.append(ListenSocket(
            listen=st.get("listen", "", nonempty_string), name=st.get("name", "", _fd_name),
            backlog=st.get("backlog", DEFAULT_BACKLOG, integer(1, 65535)), mode=mode,
            reuseport=st.get("reuseport", False, boolean)))
    return tuple(out)






def parse_settings(file: Path, raw: Mapping[str, Any], directory: Path, errors: list[UnitFileError]) -> DaemonSettings:
    t = Table(file, raw, errors)
    t.check_keys(SETTINGS_KEYS)

    def path(value: Any) -> Path:
        # Relative to the stack directory, not to wherever the daemon happens to start.
        return directory / nonempty_string(value)

    def listen(value: Any) -> str:
        try:
            host, _port = parse_host_port(string(value))
            ipaddress.ip_address(host)
        except ValueError as exc:
            # A host name makes aiohttp start a resolver thread (ARCHITECTURE.md, "Threads"): numeric only.
            raise InvalidValue(f'expected "ADDRESS:PORT" with a numeric address such as "127.0.0.1:9321" '
                               f"({exc})") from None
        return value

    return DaemonSettings(
        file=file,
        control=t.get("control", None, path),
        state_dir=t.get("state_dir", None, path),
        health_listen=t.get("health_listen", None, listen),
        log_format=t.get("log_format", None, choice(LogFormat)),
        cgroup_root=t.get("cgroup_root", None, path),
        cache_root=t.get("cache_root", None, path),
        drain_sec=t.get("drain_sec", None, seconds(zero_ok=True)),
        stop_deadline=t.get("stop_deadline", None, seconds(zero_ok=False)),
        cluster=parse_cluster(file, raw["cluster"], directory, errors) if "cluster" in raw else None,
        exit_when_failed=t.get("exit_when_failed", False, boolean),
        daemon_nice=t.get("daemon_nice", None, integer(-20, 19)),
    )
