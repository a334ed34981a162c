"""The keys of one stack in etcd as this host last saw them: read in one snapshot, then kept
up to date by the session's prefix watch. Only keys of interest are kept (host keys, and each
group of ours' `current` and its newest generations); every value is parsed once on the way
in, and a hostile one is kept as None (so a compare-and-swap can still replace it) and said
once by the HostileLog.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omnid.cluster import etcd as E
from omnid.cluster.etcd import KV, EtcdLink
from omnid.cluster.keys import HostileLog, HostileValue, Key, KeySpace, parse_current, parse_down, parse_host, parse_join

PARSERS: dict[str, Callable[[bytes], Any]] = {"host": parse_host, "current": parse_current, "join": parse_join,
                                               "down": parse_down}
MAX_HOST_KEYS = 256


@dataclass(frozen=True)
class Entry:
    """A key of ours as last seen in etcd: `value` is the parsed record, None when hostile."""

    key: Key
    value: Any
    mod_revision: int
    lease: int


class Mirror:
    def __init__(self, keys: KeySpace, hostile: HostileLog) -> None:
        self.keys = keys
        self.hostile = hostile
        self.entries: dict[bytes, Entry] = {}
        self.addresses: dict[str, tuple[str, int]] = {}  # host -> (address, peer_port), kept when it goes

    def current(self, group: str) -> tuple[int, int]:
        """(the group's newest generation, the key's mod revision); (0, 0) when absent. A
        hostile value reads as generation 0 with its revision, so it can be replaced."""
        e = self.entries.get(self.keys.current(group))
        if e is None:
            return 0, 0
        return (e.value if isinstance(e.value, int) else 0), e.mod_revision

    async def read(self, link: EtcdLink, groups: Iterable[str]) -> int:
        """Read every key of interest in one snapshot; returns its revision (the watch goes on
        from there). The generations to read depend on `current`: read until two reads agree."""
        groups = list(groups)
        currents: dict[str, int] = {}
        for attempt in range(4):
            ops = [E.get_prefix(self.keys.root + b"hosts/", MAX_HOST_KEYS)]
            for name in groups:
                ops.append(E.get(self.keys.current(name)))
                n = currents.get(name, 0)
                ops.extend(E.get_prefix(self.keys.generation(name, g)) for g in (n - 1, n, n + 1) if g >= 1)
            r = await link.txn([], ops)
            self.entries = {}
            for kv in r.kvs:  # in request order: each group's current before its generations
                self.apply(kv, True, groups)
            seen = {name: self.current(name)[0] for name in groups}
            if all(seen[n] == currents.get(n, 0) for n in seen) or attempt == 3:
                break
            currents = seen
        return r.revision

    def _interesting(self, key: Key, groups: Iterable[str] | Mapping[str, Any]) -> bool:
        if key.kind == "host":
            return True
        if key.group not in groups:
            return False
        if key.kind == "current":
            return True
        return key.kind in ("join", "down") and key.generation >= self.current(key.group)[0] - 1

    def apply(self, kv: KV, put: bool, groups: Iterable[str] | Mapping[str, Any]) -> None:
        """One put or delete under the prefix (from the snapshot or the watch)."""
        try:
            key = self.keys.parse(kv.key)
        except HostileValue as exc:
            self.hostile.ignored(kv.key, str(exc))
            return
        if key.kind == "secret" or not self._interesting(key, groups):
            return
        if not put:
            self.entries.pop(kv.key, None)
            return
        if key.kind == "host" and kv.key not in self.entries and sum(
                1 for e in self.entries.values() if e.key.kind == "host") >= MAX_HOST_KEYS:
            self.hostile.ignored(kv.key, f"more than {MAX_HOST_KEYS} host keys")
            return
        try:
            value = PARSERS[key.kind](kv.value)
        except HostileValue as exc:
            self.hostile.ignored(kv.key, str(exc))
            value = None
        self.entries[kv.key] = Entry(key, value, kv.mod_revision, kv.lease)
        if key.kind == "host" and value is not None:
            self.addresses[key.host] = (value.address, value.peer_port)
        if key.kind == "current" and isinstance(value, int):
            stale = [k for k, e in self.entries.items()
                     if e.key.group == key.group and e.key.kind in ("join", "down") and e.key.generation < value - 1]
            for k in stale:
                del self.entries[k]
