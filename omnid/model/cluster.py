"""The `[cluster]` table of omnid.toml (omnid(8), CLUSTER): typed, checked once at load.

Nothing here talks to etcd or imports its client library: `omnid check` and a daemon
without `[cluster]` pay nothing for it. Files named here (TLS certificates, the peer
secret) are checked like every file omnid reads as root: a regular file, owned by root
or by the daemon's user, not writable by anyone else, small; private keys and the secret
not readable by anyone else either.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from omnid.base.ownership import UnsafePath, open_checked, read_checked
from omnid.model.unitmodel import UnitFileError

CLUSTER_KEYS = ("etcd", "host", "address", "lease_ttl", "prefix", "ca", "cert", "key", "peer_port", "secret_file")
DEFAULT_LEASE_TTL = 5
# etcd grants no lease shorter than 1.5 election timeouts (2 s with its defaults); a
# longer one than an hour would leave a dead host's ranks' peers waiting that long.
MIN_LEASE_TTL, MAX_LEASE_TTL = 2, 3600
DEFAULT_PEER_PORT = 9322
MAX_FILE_BYTES = 1 << 20
MIN_SECRET_BYTES = 16
MAX_ENDPOINTS = 16
# A host name is a key segment in etcd and a word in reasons: no '/', no spaces.
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_PREFIX = re.compile(r"(/[A-Za-z0-9_.-]+)+")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ClusterSettings:
    """A stack across hosts: where etcd is, who this host is, how long its lease lives."""

    endpoints: tuple[Endpoint, ...]
    tls: bool  # https:// endpoints
    host: str
    address: str  # numeric; MASTER_ADDR when this host leads a group; the peer heartbeat binds it
    lease_ttl: int  # seconds
    prefix: str  # no trailing "/"
    peer_port: int = DEFAULT_PEER_PORT
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    secret_file: Path | None = None


class SettingsError(ValueError):
    """One bad value: `key` is the dotted key in omnid.toml (cluster.lease_ttl)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def _describe(value: Any) -> str:
    names = {str: "string", int: "integer", float: "float", bool: "boolean", list: "array", dict: "table"}
    kind = names.get(type(value), "date/time")
    return kind if isinstance(value, (list, dict)) else f"{kind} {value!r}"


def _endpoints(value: Any) -> tuple[tuple[Endpoint, ...], bool]:
    example = 'etcd = ["http://10.0.0.1:2379"]'
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise SettingsError("etcd", f"expected a non-empty array of etcd v3 URLs, e.g. {example}; got {_describe(value)}")
    if len(value) > MAX_ENDPOINTS:
        raise SettingsError("etcd", f"expected at most {MAX_ENDPOINTS} endpoints, got {len(value)}")
    out, schemes = [], set()
    for url in value:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise SettingsError("etcd", f"{url!r} is not a URL ({exc}); expected e.g. {example}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise SettingsError("etcd", f"expected http://HOST:PORT or https://HOST:PORT, got {url!r}")
        if parts.path not in ("", "/") or parts.query or parts.username:
            raise SettingsError("etcd", f"expected only scheme, host and port in {url!r} (no path, user or query)")
        schemes.add(parts.scheme)
        out.append(Endpoint(parts.hostname, port))
    if len(schemes) > 1:
        raise SettingsError("etcd", "mixes http:// and https:// endpoints; expected one scheme for all")
    return tuple(out), schemes == {"https"}


def _host(value: Any) -> str:
    if isinstance(value, str) and HOST_NAME.fullmatch(value):
        return value
    raise SettingsError("host", "expected a host name of letters, digits, '_', '.' or '-' (at most 63), "
                        f"got {_describe(value)}")


def _address(value: Any) -> str:
    if not isinstance(value, str):
        raise SettingsError("address", f'expected this host\'s IP address, e.g. address = "10.0.0.2"; got {_describe(value)}')
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        # A name would be resolved by a thread in the daemon, and ranks on other hosts
        # resolve it their own way: a number means the same thing everywhere.
        raise SettingsError("address", f"expected a numeric IP address that other hosts reach, got {value!r}") from None
    if ip.is_unspecified or ip.is_multicast:
        raise SettingsError("address", f"expected this host's own address, got {value!r}")
    return str(ip)


def _lease_ttl(value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not MIN_LEASE_TTL <= value <= MAX_LEASE_TTL:
        raise SettingsError("lease_ttl", f"expected whole seconds from {MIN_LEASE_TTL} (etcd's shortest lease) "
                            f"to {MAX_LEASE_TTL}, got {_describe(value)}")
    return value


def _prefix(value: Any) -> str:
    if isinstance(value, str):
        text = value.rstrip("/")
        if len(text) <= 128 and _PREFIX.fullmatch(text):
            return text
    raise SettingsError("prefix", 'expected a key prefix such as "/omnid/llama-405b" (segments of letters, digits, '
                        f"'_', '.' or '-'; at most 128 characters), got {_describe(value)}")


def _port(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535:
        return value
    raise SettingsError("peer_port", f"expected a UDP port from 1 to 65535, got {_describe(value)}")


def _trusted() -> tuple[int, ...]:
    return (0,) if os.geteuid() == 0 else (0, os.geteuid())


def check_file(key: str, path: Path, *, private: bool) -> None:
    """A file omnid reads as root: regular, small, owned by root or us, nobody else may write
    it (a user who could would choose what omnid trusts); a private one nobody else may read."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise SettingsError(key, f"cannot read {path} ({exc.strerror}); expected an existing file") from None
    if not stat.S_ISREG(st.st_mode):
        raise SettingsError(key, f"{path} is not a regular file")
    if st.st_size > MAX_FILE_BYTES:
        raise SettingsError(key, f"{path} is {st.st_size} bytes; expected at most {MAX_FILE_BYTES}")
    if st.st_uid not in (0, os.geteuid()):
        raise SettingsError(key, f"{path} is owned by uid {st.st_uid}; expected root or the daemon's user")
    if st.st_mode & 0o022:
        raise SettingsError(key, f"{path} is writable by group or others (mode {st.st_mode & 0o777:04o}); "
                            "expected chmod go-w")
    if private and st.st_mode & 0o044:
        raise SettingsError(key, f"{path} is readable by group or others (mode {st.st_mode & 0o777:04o}); "
                            "expected chmod 600")
    # The same again on an fd opened without following a symlink, with every directory above
    # it (sshd's StrictModes): what read_file reads is what this checked.
    try:
        os.close(open_checked(path, key, trusted=_trusted(), private=private))
    except UnsafePath as exc:
        raise SettingsError(key, str(exc)) from None


def read_file(key: str, path: Path, *, private: bool) -> bytes:
    """check_file, then the contents (checked again: the file may have changed since `omnid check`)."""
    check_file(key, path, private=private)
    try:
        data = read_checked(path, key, MAX_FILE_BYTES + 1, trusted=_trusted(), private=private)
    except UnsafePath as exc:
        raise SettingsError(key, str(exc)) from None
    if len(data) > MAX_FILE_BYTES:
        raise SettingsError(key, f"{path} is larger than {MAX_FILE_BYTES} bytes")
    return data


def read_secret(settings: ClusterSettings) -> bytes | None:
    """The peer heartbeat's shared secret from `secret_file`, or None (then it comes from etcd)."""
    if settings.secret_file is None:
        return None
    data = read_file("cluster.secret_file", settings.secret_file, private=True).strip()
    if len(data) < MIN_SECRET_BYTES:
        raise SettingsError("cluster.secret_file", f"{settings.secret_file} holds {len(data)} bytes; "
                            f"expected at least {MIN_SECRET_BYTES} random bytes")
    return data


def parse_cluster(file: Path, raw: Any, directory: Path, errors: list[UnitFileError]) -> ClusterSettings | None:
    """`[cluster]` -> ClusterSettings, or None with every problem appended to `errors`."""
    def err(key: str, message: str) -> None:
        errors.append(UnitFileError(file, f"cluster.{key}" if key else "cluster", message))

    if not isinstance(raw, Mapping):
        err("", f"expected a table [cluster] with etcd = [...], host, address, lease_ttl, prefix; got {_describe(raw)}")
        return None
    before = len(errors)
    for key in raw:
        if key not in CLUSTER_KEYS:
            err(key, f"unknown key; expected one of: {', '.join(CLUSTER_KEYS)}")
    if "etcd" not in raw:
        err("etcd", 'missing; expected the etcd v3 endpoints, e.g. etcd = ["http://10.0.0.1:2379"]')
    if "address" not in raw:
        err("address", 'missing; expected the IP address other hosts reach this one at, e.g. address = "10.0.0.2"')

    def get(key: str, default: Any, convert) -> Any:
        if key not in raw:
            return default
        try:
            return convert(raw[key])
        except SettingsError as exc:
            err(exc.key, exc.message)
            return default

    endpoints, tls = get("etcd", ((), False), _endpoints)
    host = get("host", None, _host)
    if host is None and "host" not in raw:
        try:
            host = _host(socket.gethostname())
        except SettingsError:
            err("host", f"missing, and this machine's hostname {socket.gethostname()!r} is not usable as one; "
                'expected host = "node-a"')

    def path(key: str, private: bool):
        def convert(value: Any) -> Path:
            if not isinstance(value, str) or not value:
                raise SettingsError(key, f"expected a file path, got {_describe(value)}")
            p = directory / value  # relative to the stack directory, like every path in omnid.toml
            check_file(key, p, private=private)
            return p
        return convert

    ca = get("ca", None, path("ca", False))
    cert = get("cert", None, path("cert", False))
    key = get("key", None, path("key", True))
    if (cert is None) != (key is None) and "cert" in raw and "key" in raw:
        pass  # one of them was invalid: already reported
    elif (cert is None) != (key is None):
        err("cert" if cert is None else "key", "cert and key go together (a TLS client certificate and its private key)")
    if (ca or cert) and not tls and endpoints:
        err("ca" if ca else "cert", "TLS files are set but the etcd endpoints are http://; expected https:// URLs")
    settings = ClusterSettings(
        endpoints=endpoints, tls=tls, host=host or "",
        address=get("address", "", _address),
        lease_ttl=get("lease_ttl", DEFAULT_LEASE_TTL, _lease_ttl),
        prefix=get("prefix", "/omnid/" + (directory.resolve().name or "stack"), _prefix),
        peer_port=get("peer_port", DEFAULT_PEER_PORT, _port),
        ca=ca, cert=cert, key=key,
        secret_file=get("secret_file", None, path("secret_file", True)),
    )
    if "prefix" not in raw:
        try:
            _prefix(settings.prefix)
        except SettingsError:
            err("prefix", f"missing, and the stack directory's name {directory.resolve().name!r} makes no key prefix; "
                'expected prefix = "/omnid/NAME"')
    return None if len(errors) > before else settings
