"""The direct signal between the host daemons of a stack: small authenticated UDP heartbeats.

etcd alone cannot tell "I am cut off" from "etcd is down for all of us": both look like a
lease that cannot be renewed. So every daemon also sends each peer host, a few times per
lease, a datagram saying who it is, whether it reaches etcd, which generation of each group
it runs, and which of them just went down here. omnid(8), CLUSTER, has the policy built on it.

Every datagram is hostile until checked, cheapest check first: size, a rate limit, the
magic, an HMAC-SHA256 over the body with a key derived from the stack's secret and prefix
(constant-time compare), then the JSON, a sender that is one of our peers, a send time
within CLOCK_SKEW_S of ours and a sequence number that only grows per sender start (a
replayed datagram is dropped). Dropped datagrams are counted per reason; none is logged
more than once per reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import structlog

from omnid.cluster import checked
from omnid.cluster.keys import MAX_GENERATION, MAX_REASON
from omnid.model.cluster import HOST_NAME

log = structlog.get_logger("omnid.cluster")

MAGIC = b"OMNID-HB1"
MAC_BYTES = 32
MAX_DATAGRAM = 1400  # one Ethernet frame: nothing of ours is larger
MAX_NOTICES = 4  # down notices carried by one datagram
CLOCK_SKEW_S = 30.0
RATE_PER_S = 500  # datagrams handled per second at most; the rest dropped and counted
_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_BOOT = re.compile(r"[0-9a-f]{8,64}")


@dataclass(frozen=True)
class DownNotice:
    group: str
    generation: int
    host: str  # where it went down
    reason: str

    def to_json(self) -> dict:
        return {"group": self.group, "generation": self.generation, "host": self.host, "reason": self.reason}

    @classmethod
    def from_json(cls, d: dict) -> DownNotice:
        return cls(checked.text(d, "group", _GROUP), checked.integer(d, "generation", 1, MAX_GENERATION),
                   checked.text(d, "host", HOST_NAME), checked.text(d, "reason", limit=MAX_REASON))


@dataclass
class PeerView:
    """What a peer host last told us about itself."""

    host: str
    boot: str
    seq: int
    sent_at: float  # its wall clock
    heard_at: float  # our monotonic clock
    etcd_ok: bool
    groups: dict[str, int] = field(default_factory=dict)  # group -> generation it runs (0: none)

    def to_json(self) -> dict:
        return {"host": self.host, "boot": self.boot, "seq": self.seq, "sent_at": self.sent_at,
                "heard_at": self.heard_at, "etcd_ok": self.etcd_ok, "groups": dict(self.groups)}

    @classmethod
    def from_json(cls, d: dict) -> PeerView:
        groups = checked.obj(d, "groups")
        if len(groups) > 64 or not all(_GROUP.fullmatch(g) for g in groups):
            raise ValueError("groups: expected at most 64 group names")
        return cls(checked.text(d, "host", HOST_NAME), checked.text(d, "boot", _BOOT), checked.integer(d, "seq"),
                   checked.number(d, "sent_at"), checked.number(d, "heard_at"), checked.flag(d, "etcd_ok"),
                   {g: checked.integer(groups, g, 0, MAX_GENERATION) for g in groups})


@dataclass(frozen=True)
class PeerLinkRecord:
    """What a re-exec hands over of the heartbeat (omnid(8), RE-EXEC): the same sender (boot,
    sequence: peers see no restart, nothing looks replayed), its key, and what it heard (so the
    fencing rule does not misjudge the first seconds of the new program)."""

    fd: int  # the bound UDP socket, inherited: datagrams sent meanwhile wait in it
    boot: str
    seq: int
    key: str | None  # hex; None until the stack's secret was known
    views: tuple[PeerView, ...]
    outbox: tuple[tuple[DownNotice, int], ...]
    hosts: tuple[str, ...]
    peers: tuple[tuple[str, str, int], ...]  # host, address, port
    received: int
    dropped: tuple[tuple[str, int], ...]

    def to_json(self) -> dict:
        return {"fd": self.fd, "boot": self.boot, "seq": self.seq, "key": self.key,
                "views": [v.to_json() for v in self.views], "outbox": [[n.to_json(), left] for n, left in self.outbox],
                "hosts": list(self.hosts), "peers": [list(p) for p in self.peers], "received": self.received,
                "dropped": dict(self.dropped)}

    @classmethod
    def from_json(cls, d: dict) -> PeerLinkRecord:
        key = d["key"]
        if key is not None and not (isinstance(key, str) and re.fullmatch(r"[0-9a-f]{64}", key)):
            raise ValueError("key: expected 64 hex digits or null")
        def notice(item: list) -> tuple[DownNotice, int]:
            if not isinstance(item, list) or len(item) != 2:
                raise ValueError("expected a [notice, repeats] pair")
            return DownNotice.from_json(item[0]), checked.integer(item, 1, 0, 16)

        dropped = checked.obj(d, "dropped")
        if len(dropped) > 16 or not all(re.fullmatch(r"[a-z-]{1,16}", k) for k in dropped):
            raise ValueError("dropped: expected at most 16 reasons")
        return cls(checked.integer(d, "fd", 0, 1 << 20), checked.text(d, "boot", _BOOT), checked.integer(d, "seq"), key,
                   checked.each(d, "views", PeerView.from_json), checked.each(d, "outbox", notice),
                   checked.strings(d, "hosts", HOST_NAME), checked.each(d, "peers", checked.address),
                   checked.integer(d, "received"),
                   tuple((k, checked.integer(dropped, k)) for k in dropped))


def derive_key(secret: bytes, prefix: str) -> bytes:
    # One stack's datagrams never count for another stack that shares the secret.
    return hmac.new(secret, b"omnid peer heartbeat\0" + prefix.encode(), hashlib.sha256).digest()


class PeerLink(asyncio.DatagramProtocol):
    def __init__(self, *, host: str, address: str, port: int, prefix: str,
                 on_down: Callable[[DownNotice], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.address = address
        self.port = port
        self.prefix = prefix
        self._key: bytes | None = None  # until the stack's secret is known: nothing sent, all dropped
        self._on_down = on_down
        self._clock = clock
        self.boot = os.urandom(8).hex()
        self._seq = 0
        self._transport: asyncio.DatagramTransport | None = None
        self._hosts: set[str] = set()
        self._peers: dict[str, tuple[str, int]] = {}  # host -> (address, port)
        self.views: dict[str, PeerView] = {}
        self._outbox: list[tuple[DownNotice, int]] = []  # notice, beats left to repeat it
        self.dropped: dict[str, int] = {}
        self.received = 0
        self._bucket = float(RATE_PER_S)
        self._bucket_at = clock()
        self._logged: set[str] = set()

    # -- life ---------------------------------------------------------------------------
    async def open(self, fd: int | None = None) -> None:
        """Bind address:port (UDP); OSError names why (an address that is not this host's).
        `fd`: the socket a previous program of this daemon bound (a re-exec), used as it is."""
        loop = asyncio.get_running_loop()
        if fd is not None:
            os.set_inheritable(fd, False)
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            self._transport, _ = await loop.create_datagram_endpoint(lambda: self, sock=sock)
            return
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: self, local_addr=(self.address, self.port), family=family)

    def fileno(self) -> int:
        assert self._transport is not None
        return self._transport.get_extra_info("socket").fileno()

    # -- re-exec ----------------------------------------------------------------------------
    def handover(self) -> PeerLinkRecord:
        """For the next program of this daemon (its socket stays open across exec)."""
        return PeerLinkRecord(self.fileno(), self.boot, self._seq, self._key.hex() if self._key else None,
                              tuple(self.views.values()), tuple(self._outbox), tuple(sorted(self._hosts)),
                              tuple((h, a, p) for h, (a, p) in self._peers.items()), self.received,
                              tuple(self.dropped.items()))

    def take_over(self, rec: PeerLinkRecord) -> None:
        """Go on as the sender the previous program was (before open(rec.fd))."""
        self.boot, self._seq = rec.boot, rec.seq
        self._key = bytes.fromhex(rec.key) if rec.key else None
        self.views = {v.host: v for v in rec.views}
        self._outbox = list(rec.outbox)
        self._hosts = set(rec.hosts)
        self._peers = {h: (a, p) for h, a, p in rec.peers}
        self.received = rec.received
        self.dropped = dict(rec.dropped)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def set_secret(self, secret: bytes) -> None:
        self._key = derive_key(secret, self.prefix)

    def set_peers(self, hosts: set[str], addresses: Mapping[str, tuple[str, int]]) -> None:
        """The peer hosts (of every group of ours), and where those known so far listen."""
        self._hosts = hosts - {self.host}
        self._peers = {h: a for h, a in addresses.items() if h in self._hosts}

    # -- sending ---------------------------------------------------------------------------
    def beat(self, etcd_ok: bool, groups: Mapping[str, int]) -> None:
        """One heartbeat to every peer, carrying the down notices not yet repeated enough."""
        notices = [n for n, _ in self._outbox[:MAX_NOTICES]]
        self._outbox = [(n, left - 1) for n, left in self._outbox if left > 1]
        self._send(etcd_ok, groups, notices, self._peers.keys())

    def notify_down(self, notice: DownNotice, hosts: tuple[str, ...], etcd_ok: bool, groups: Mapping[str, int]) -> None:
        """Tell the group's hosts at once (and again in the next beats: a datagram can be lost)."""
        self._outbox.append((notice, 3))
        self._send(etcd_ok, groups, [notice], [h for h in hosts if h in self._peers])

    def _send(self, etcd_ok: bool, groups: Mapping[str, int], notices: list[DownNotice], to) -> None:
        if self._transport is None or self._key is None:
            return
        self._seq += 1
        # Shorter and shorter until it fits one datagram: the beat itself matters most.
        for cut in (MAX_REASON, 80, 0):
            body = json.dumps({"h": self.host, "b": self.boot, "s": self._seq, "t": time.time(), "e": etcd_ok,
                               "g": dict(list(groups.items())[:16] if cut == 0 else groups),
                               "d": [[n.group, n.generation, n.reason[:cut]] for n in notices] if cut else []},
                              separators=(",", ":")).encode()
            if len(MAGIC) + MAC_BYTES + len(body) <= MAX_DATAGRAM:
                break
        datagram = MAGIC + hmac.new(self._key, body, hashlib.sha256).digest() + body
        for host in to:
            addr = self._peers.get(host)
            if addr is not None:
                self._transport.sendto(datagram, addr)

    # -- receiving ------------------------------------------------------------------------
    def heard_within(self, host: str, seconds: float) -> PeerView | None:
        v = self.views.get(host)
        return v if v is not None and self._clock() - v.heard_at <= seconds else None

    def _drop(self, why: str, detail: str = "") -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1
        if why not in self._logged:
            self._logged.add(why)
            log.warning("peer datagram dropped", why=why, detail=detail[:200],
                        note="further drops of this kind are counted, not logged")

    def datagram_received(self, data: bytes, addr) -> None:  # noqa: C901 (one check per line)
        now = self._clock()
        self._bucket = min(float(RATE_PER_S), self._bucket + (now - self._bucket_at) * RATE_PER_S)
        self._bucket_at = now
        if self._bucket < 1:
            return self._drop("rate", f"more than {RATE_PER_S}/s")
        self._bucket -= 1
        if len(data) > MAX_DATAGRAM or not data.startswith(MAGIC) or len(data) < len(MAGIC) + MAC_BYTES + 2:
            return self._drop("malformed", f"{len(data)} bytes from {addr}")
        if self._key is None:
            return self._drop("no-secret", "the stack's secret is not known yet (etcd not reached since start)")
        mac, body = data[len(MAGIC):len(MAGIC) + MAC_BYTES], data[len(MAGIC) + MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self._key, body, hashlib.sha256).digest()):
            return self._drop("bad-mac", f"from {addr}: not signed with this stack's secret")
        try:
            m = json.loads(body)
            host, boot, seq, sent, etcd_ok = m["h"], m["b"], m["s"], m["t"], m["e"]
            groups, notices = m["g"], m["d"]
        except (ValueError, KeyError, TypeError, RecursionError):
            return self._drop("malformed", f"signed but unreadable body from {addr}")
        if not (isinstance(host, str) and HOST_NAME.fullmatch(host) and isinstance(boot, str) and _BOOT.fullmatch(boot)
                and isinstance(seq, int) and isinstance(sent, (int, float)) and isinstance(etcd_ok, bool)
                and isinstance(groups, dict) and len(groups) <= 64 and isinstance(notices, list)
                and len(notices) <= MAX_NOTICES):
            return self._drop("malformed", f"signed body of the wrong shape from {addr}")
        if host == self.host or host not in self._hosts:
            return self._drop("foreign", f"host {host!r} from {addr} is not a peer of this host")
        if abs(time.time() - sent) > CLOCK_SKEW_S:
            return self._drop("clock", f"{host}'s clock is {time.time() - sent:+.1f} s from ours; check NTP")
        old = self.views.get(host)
        if old is not None and ((boot == old.boot and seq <= old.seq) or (boot != old.boot and sent <= old.sent_at)):
            return self._drop("replay", f"from {host} at {addr}")
        gens = {g: n for g, n in groups.items()
                if isinstance(g, str) and _GROUP.fullmatch(g) and isinstance(n, int) and 0 <= n < 1 << 53}
        self.received += 1
        self.views[host] = PeerView(host, boot, seq, float(sent), now, etcd_ok, gens)
        for item in notices:
            if (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and _GROUP.fullmatch(item[0])
                    and isinstance(item[1], int) and 1 <= item[1] < 1 << 53 and isinstance(item[2], str)
                    and len(item[2]) <= MAX_REASON and item[2].isprintable()):
                self._on_down(DownNotice(item[0], item[1], host, item[2]))
            else:
                self._drop("malformed", f"a down notice of the wrong shape from {host}")

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable from a peer whose daemon is not up yet: expected, not news.
        self._drop("send-error", str(exc))
