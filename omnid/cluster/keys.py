"""The keys omnid keeps under a stack's etcd prefix, and the checked values they hold.

    P/secret                           the peer heartbeat's shared secret (no lease)
    P/hosts/HOST                       a host daemon is alive (its lease)
    P/groups/G/current                 the group's newest generation number (compare-and-swap)
    P/groups/G/gen/N/join/HOST         HOST joined generation N (its lease): hosts, local size, address
    P/groups/G/gen/N/down              generation N is down: which host, why (created once)

Anyone with write access to etcd can put anything there: every value is parsed into a
frozen object or refused with a reason, and `HostileLog` says so once per key.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any

import structlog

from omnid.model.cluster import HOST_NAME

log = structlog.get_logger("omnid.cluster")

MAX_KEY_BYTES = 512
MAX_VALUE_BYTES = 4096
MAX_REASON = 400
MAX_HOSTS = 64
MAX_LOCAL_SIZE = 1024
MAX_GENERATION = 1 << 53
_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_HEX = re.compile(r"[0-9a-f]{8,64}")


class HostileValue(ValueError):
    """A key or value under the prefix that omnid did not write, or not like this."""


@dataclass(frozen=True)
class HostRecord:
    address: str
    peer_port: int
    boot: str  # random per daemon start: tells one instance of a host from the next
    pid: int


@dataclass(frozen=True)
class JoinRecord:
    hosts: tuple[str, ...]
    local_size: int
    address: str
    boot: str


@dataclass(frozen=True)
class DownRecord:
    host: str
    reason: str
    final: bool = False  # the group will not start again by itself (start limit, restart = "no", refused)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "reason": self.reason, "final": self.final}

    @classmethod
    def from_json(cls, d: Any) -> DownRecord:
        """From a re-exec's handover (ValueError naming the field, as for a value in etcd)."""
        if not isinstance(d, dict):
            raise ValueError("a down record: expected an object")
        return parse_down(encode(d))


@dataclass(frozen=True)
class Key:
    """A key of ours, taken apart. kind: secret, host, current, join, down."""

    kind: str
    host: str = ""
    group: str = ""
    generation: int = 0


def _obj(value: bytes) -> dict[str, Any]:
    if len(value) > MAX_VALUE_BYTES:
        raise HostileValue(f"value of {len(value)} bytes; expected at most {MAX_VALUE_BYTES}")
    try:
        obj = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise HostileValue(f"not a JSON object ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise HostileValue("not a JSON object")
    return obj


def _int(obj: dict, name: str, lo: int, hi: int) -> int:
    v = obj.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise HostileValue(f"{name}: expected an integer from {lo} to {hi}")
    return v


def _str(obj: dict, name: str, pattern: re.Pattern | None = None, limit: int = 256) -> str:
    v = obj.get(name)
    if not isinstance(v, str) or len(v) > limit or (pattern is not None and not pattern.fullmatch(v)):
        raise HostileValue(f"{name}: expected {'a matching ' if pattern else 'a '}string of at most {limit} characters")
    return v


def _ip(obj: dict, name: str) -> str:
    text = _str(obj, name, limit=64)
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise HostileValue(f"{name}: expected a numeric IP address") from None


def parse_host(value: bytes) -> HostRecord:
    o = _obj(value)
    return HostRecord(_ip(o, "address"), _int(o, "peer_port", 1, 65535), _str(o, "boot", _HEX),
                      _int(o, "pid", 1, 1 << 31))


def parse_current(value: bytes) -> int:
    return _int(_obj(value), "generation", 1, MAX_GENERATION)


def parse_join(value: bytes) -> JoinRecord:
    o = _obj(value)
    hosts = o.get("hosts")
    if (not isinstance(hosts, list) or not 1 <= len(hosts) <= MAX_HOSTS
            or not all(isinstance(h, str) and HOST_NAME.fullmatch(h) for h in hosts) or len(set(hosts)) != len(hosts)):
        raise HostileValue(f"hosts: expected 1 to {MAX_HOSTS} distinct host names")
    return JoinRecord(tuple(hosts), _int(o, "local_size", 1, MAX_LOCAL_SIZE), _ip(o, "address"), _str(o, "boot", _HEX))


def parse_down(value: bytes) -> DownRecord:
    o = _obj(value)
    reason = _str(o, "reason", limit=MAX_REASON)
    if not reason.isprintable():
        raise HostileValue("reason: expected printable text")
    final = o.get("final", False)
    if not isinstance(final, bool):
        raise HostileValue("final: expected true or false")
    return DownRecord(_str(o, "host", HOST_NAME), reason, final)


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def host_value(r: HostRecord) -> bytes:
    return encode({"address": r.address, "peer_port": r.peer_port, "boot": r.boot, "pid": r.pid})


def join_value(r: JoinRecord) -> bytes:
    return encode({"hosts": list(r.hosts), "local_size": r.local_size, "address": r.address, "boot": r.boot})


def down_value(r: DownRecord) -> bytes:
    return encode({"host": r.host, "reason": r.reason[:MAX_REASON], "final": r.final})


def current_value(generation: int) -> bytes:
    return encode({"generation": generation})


class KeySpace:
    """Key names under one stack's prefix, and the reverse: a key of ours taken apart."""

    def __init__(self, prefix: str) -> None:
        self.root = prefix.rstrip("/").encode() + b"/"

    def secret(self) -> bytes:
        return self.root + b"secret"

    def host(self, host: str) -> bytes:
        return self.root + b"hosts/" + host.encode()

    def group(self, group: str) -> bytes:
        return self.root + b"groups/" + group.encode() + b"/"

    def current(self, group: str) -> bytes:
        return self.group(group) + b"current"

    def generation(self, group: str, n: int) -> bytes:
        return self.group(group) + b"gen/%d/" % n

    def join(self, group: str, n: int, host: str) -> bytes:
        return self.generation(group, n) + b"join/" + host.encode()

    def down(self, group: str, n: int) -> bytes:
        return self.generation(group, n) + b"down"

    def parse(self, key: bytes) -> Key:
        """A key under the prefix -> Key; HostileValue when it is not one omnid writes."""
        if len(key) > MAX_KEY_BYTES or not key.startswith(self.root):
            raise HostileValue("not a key omnid writes")
        try:
            parts = key[len(self.root):].decode("ascii").split("/")
        except UnicodeDecodeError:
            raise HostileValue("not an ASCII key") from None
        if parts == ["secret"]:
            return Key("secret")
        if len(parts) == 2 and parts[0] == "hosts" and HOST_NAME.fullmatch(parts[1]):
            return Key("host", host=parts[1])
        if len(parts) >= 3 and parts[0] == "groups" and _GROUP.fullmatch(parts[1]):
            group, rest = parts[1], parts[2:]
            if rest == ["current"]:
                return Key("current", group=group)
            if len(rest) >= 3 and rest[0] == "gen" and rest[1].isdigit() and len(rest[1]) <= 16:
                n = int(rest[1])
                if 1 <= n <= MAX_GENERATION:
                    if rest[2:] == ["down"]:
                        return Key("down", group=group, generation=n)
                    if len(rest) == 4 and rest[2] == "join" and HOST_NAME.fullmatch(rest[3]):
                        return Key("join", group=group, generation=n, host=rest[3])
        raise HostileValue("not a key omnid writes")


class HostileLog:
    """Say once per key that a value was ignored (anyone with etcd access can write there;
    a flood of such keys must not become a flood of log lines), and count them."""

    LIMIT = 1000

    def __init__(self) -> None:
        self._seen: set[bytes] = set()
        self.count = 0

    def ignored(self, key: bytes, why: str) -> None:
        self.count += 1
        if key in self._seen:
            return
        if len(self._seen) >= self.LIMIT:
            if len(self._seen) == self.LIMIT:
                self._seen.add(b"")  # one line for the rest
                log.warning("more hostile etcd values ignored; not logging each any more", limit=self.LIMIT)
            return
        self._seen.add(key)
        log.warning("etcd value ignored", key=key[:MAX_KEY_BYTES].decode("utf-8", "replace"), reason=why)
