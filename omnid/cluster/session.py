"""One host daemon's membership of a stack across hosts (omnid(8), CLUSTER): its etcd lease
and keepalive, a mirror of the stack's keys kept by one prefix watch, the heartbeat to its
peer hosts, and the clock that asks `omnid.cluster.fencing` every tick whether the members
of each cross-host group may keep running. The groups themselves are `ClusterGroup`s.

Timing, all from `lease_ttl` (T): a keepalive every T/6 with a deadline of T/4; a heartbeat
to each peer every T/10; a peer counts as heard for T/2 after its last heartbeat; members
are fenced T/4 (at least 0.5 s) before the earliest moment etcd may drop the lease.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from omnid.cluster import checked
from omnid.cluster import etcd as E
from omnid.cluster.etcd import EtcdError, EtcdLink, KV
from omnid.cluster.keys import HostileLog, HostileValue, HostRecord, KeySpace, host_value, parse_host
from omnid.cluster.mirror import Entry, Mirror
from omnid.cluster.peers import DownNotice, PeerLink, PeerLinkRecord
from omnid.model.cluster import HOST_NAME, ClusterSettings, read_secret
from omnid.base.tasks import DaemonTask, report_crash

log = structlog.get_logger("omnid.cluster")
_BOOT = re.compile(r"[0-9a-f]{8,64}")



class ClusterRefused(Exception):
    """This host cannot take part: its address is not its own, or another omnid is this host."""


class ExecRefused(Exception):
    """A re-exec now would risk this host's lease (etcd does not answer); nothing was changed."""


@dataclass(frozen=True)
class SessionRecord:
    """What a re-exec hands over of this host's membership (omnid(8), RE-EXEC): the same lease
    and boot (to etcd and the peers this host never left), when etcd last answered (fencing
    counts the handover as a silence of etcd), and the heartbeat."""

    host: str
    prefix: str
    lease_id: int  # 0: none held yet (the next program acquires one)
    boot: str
    last_ok_sent: float  # monotonic: the clock survives exec
    counters: tuple[tuple[str, int], ...]
    hostile_values: int
    addresses: tuple[tuple[str, str, int], ...]  # host, address, peer port: beats go out before the watch reads
    peers: PeerLinkRecord

    def to_json(self) -> dict:
        return {"host": self.host, "prefix": self.prefix, "lease_id": self.lease_id, "boot": self.boot,
                "last_ok_sent": self.last_ok_sent, "counters": dict(self.counters),
                "hostile_values": self.hostile_values, "addresses": [list(a) for a in self.addresses],
                "peers": self.peers.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> SessionRecord:
        try:
            peers = PeerLinkRecord.from_json(checked.obj(d, "peers"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"peers.{exc}" if isinstance(exc, ValueError) else f"peers: missing or bad {exc}") from None
        return cls(checked.text(d, "host", HOST_NAME), checked.text(d, "prefix", limit=256),
                   checked.integer(d, "lease_id", 0, checked.MAX_INT), checked.text(d, "boot", _BOOT),
                   checked.number(d, "last_ok_sent"),
                   tuple(checked.counters(d, "counters", ("etcd_outages", "lease_expired")).items()),
                   checked.integer(d, "hostile_values"), checked.each(d, "addresses", checked.address, 256), peers)


class ClusterSession:
    def __init__(self, settings: ClusterSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.host = settings.host
        self.clock = clock
        ttl = float(settings.lease_ttl)
        self.ttl = ttl
        self.keepalive_every = ttl / 6
        self.call_timeout = max(0.3, ttl / 4)
        self.margin = max(0.5, ttl / 4)
        self.beat_every = max(0.05, ttl / 10)
        self.peer_timeout = max(0.5, ttl / 2)
        self.tick = min(0.05, ttl / 40)
        self.keys = KeySpace(settings.prefix)
        self.hostile = HostileLog()
        self.link = EtcdLink(settings, timeout=self.call_timeout)
        self.boot = os.urandom(8).hex()
        self.peers = PeerLink(host=self.host, address=settings.address, port=settings.peer_port,
                              prefix=settings.prefix, on_down=self._peer_down, clock=clock)
        self.groups: dict[str, Any] = {}  # name -> ClusterGroup
        self.mirror = Mirror(self.keys, self.hostile)
        self.lease_id = 0
        self.etcd_ok = False
        self.last_ok_sent = -1e18  # when the last keepalive etcd answered was sent
        self._outage_since: float | None = None
        self._last_reset = 0.0
        self.synced = False
        self.refused: str | None = None
        self._ready = asyncio.Event()
        self._leased = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[DaemonTask] = []
        self._watch: DaemonTask | None = None
        self._closed = False
        self.counters = {"etcd_outages": 0, "lease_expired": 0}
        self._peer_fd: int | None = None  # the heartbeat socket a previous program bound (re-exec)
        self._handed_at: float | None = None  # re-exec: when the previous program's last keepalive was sent
        self.lease_gap_s: float | None = None  # re-exec: from that keepalive to the first one answered here

    # -- life -------------------------------------------------------------------------------
    async def open(self) -> None:
        """Bind the heartbeat socket and start the loops; etcd is reached in the background
        (a daemon starts, and says so, whether or not etcd answers yet)."""
        try:
            await self.peers.open(self._peer_fd)
        except OSError as exc:
            raise ClusterRefused(f"cluster.address: cannot listen on {self.settings.address} port "
                                 f"{self.settings.peer_port} for peer heartbeats ({exc.strerror or exc}); "
                                 "expected an address of this host and a free UDP port") from None
        secret = read_secret(self.settings)
        if secret is not None:
            self.peers.set_secret(secret)
        self._start_loops()
        log.info("cluster membership starting", host=self.host, etcd=[str(e) for e in self.settings.endpoints],
                 prefix=self.settings.prefix, lease_ttl=self.settings.lease_ttl,
                 **({"lease": f"{self.lease_id:x}", "taken_over": True} if self._handed_at is not None else {}))

    def _start_loops(self) -> None:
        loop = asyncio.get_running_loop()
        for name, coro in (("lease", self._lease_loop), ("monitor", self._monitor_loop)):
            self._loops.append(DaemonTask(f"cluster {name}", lambda c=coro: loop.create_task(c())).start())
        self._start_watch()
        for g in list(self.groups.values()):
            g.write_unwritten()

    async def _stop_loops(self) -> None:
        loops = [*self._loops, *([self._watch] if self._watch else [])]
        self._loops, self._watch = [], None
        for d in loops:
            d.close()
        for t in self._tasks:
            t.cancel()
        for t in [*(d.task for d in loops if d.task is not None), *self._tasks]:
            try:
                await t
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # noqa: BLE001 -- already logged when it crashed; stopping anyway
                log.debug("cluster task ended with an error when stopped", error=repr(exc))

    async def close(self) -> None:
        """Stop the loops, give the lease back (peers see this host leave at once), close."""
        self._closed = True
        if self._tasks:  # the down records of the stop just made: written before the lease goes
            await asyncio.wait(set(self._tasks), timeout=self.call_timeout)
        await self._stop_loops()
        if self.lease_id:
            try:
                await self.link.revoke(self.lease_id, self.call_timeout)
            except EtcdError as exc:
                log.info("could not give the lease back; it expires by itself", error=str(exc))
        await self.link.close()
        self.peers.close()

    # -- re-exec (omnid.daemon.handover) --------------------------------------------------------------
    async def pause_for_exec(self) -> None:
        """Before a re-exec: the down records still being written get a moment; the loops and
        the watch stop; the lease is renewed once more, so the next program starts with a whole
        lease_ttl (and is NOT given back: that is close()); the etcd connection closes. The
        heartbeat socket stays open, for the next program. ExecRefused (loops running again)
        when etcd does not renew the lease."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=min(1.0, self.call_timeout))
        await self._stop_loops()
        if self.lease_id:
            sent = self.clock()
            try:
                ttl = await self.link.keepalive(self.lease_id, self.call_timeout)
            except EtcdError as exc:
                self._etcd_failed(str(exc))
                self._start_loops()
                raise ExecRefused(f"etcd did not renew this host's lease before the re-exec: {exc}") from None
            if ttl <= 0:
                self._lease_expired()
                self._start_loops()
                raise ExecRefused("this host's etcd lease expired just before the re-exec") from None
            self._etcd_answered(sent)
        await self.link.close()

    def resume_after_failed_exec(self) -> None:
        """The exec did not happen: this program goes on (the etcd connection dials again)."""
        self._start_loops()

    def handover(self) -> SessionRecord:
        return SessionRecord(self.host, self.settings.prefix, self.lease_id, self.boot, self.last_ok_sent,
                             tuple(self.counters.items()), self.hostile.count,
                             tuple((h, a, p) for h, (a, p) in self.mirror.addresses.items()), self.peers.handover())

    def take_over(self, rec: SessionRecord) -> None:
        """Go on with the lease, boot and heartbeat of the previous program of this daemon (before
        open()). Until etcd answers here, the handover counts as etcd's silence: fencing judges
        from the previous program's last keepalive, as it would for any outage."""
        self.lease_id, self.boot, self.last_ok_sent = rec.lease_id, rec.boot, rec.last_ok_sent
        self.counters.update(dict(rec.counters))
        self.hostile.count = rec.hostile_values
        self.mirror.addresses.update({h: (a, p) for h, a, p in rec.addresses})
        self.peers.take_over(rec.peers)
        self._peer_fd = rec.peers.fd
        if self.lease_id:
            self._handed_at = rec.last_ok_sent
            self._leased.set()

    def spawn(self, coro: Coroutine, what: str) -> asyncio.Task:
        """A background etcd write whose failure is logged, never lost."""
        task = report_crash(asyncio.get_running_loop().create_task(coro), what)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def register(self, group) -> None:
        self.groups[group.name] = group
        if self._watch is not None:
            self._start_watch()  # read the new group's keys, then watch on

    async def ready(self) -> None:
        """Until this host holds a lease, its mirror is in sync and etcd answers."""
        while True:
            if self.refused:
                raise ClusterRefused(self.refused)
            if self._ready.is_set():
                return
            await self._ready.wait()

    def _set_ready(self) -> None:
        if self.lease_id and self.synced and self.etcd_ok and not self.refused:
            self._ready.set()
        else:
            self._ready.clear()

    # -- the lease ----------------------------------------------------------------------------
    async def _lease_loop(self) -> None:
        while True:
            if not self.lease_id:
                await self._acquire()
                continue
            sent = self.clock()
            try:
                ttl = await self.link.keepalive(self.lease_id, self.call_timeout)
            except EtcdError as exc:
                self._etcd_failed(str(exc))
            else:
                if ttl > 0:
                    self._etcd_answered(sent)
                else:
                    self._lease_expired()
                    continue
            await asyncio.sleep(max(0.0, sent + self.keepalive_every - self.clock()))

    def _etcd_answered(self, sent: float) -> None:
        self.last_ok_sent = max(self.last_ok_sent, sent)
        if self._handed_at is not None and self.lease_gap_s is None:
            self.lease_gap_s = round(sent - self._handed_at, 3)
            log.info("cluster lease kept across the re-exec", lease=f"{self.lease_id:x}", gap_s=self.lease_gap_s,
                     lease_ttl=self.ttl, fencing_after_s=self.ttl - self.margin,
                     used=f"{100 * self.lease_gap_s / self.ttl:.0f}% of lease_ttl")
        if not self.etcd_ok and self._outage_since is not None:
            log.info("etcd answers again", endpoint=self.link.endpoint,
                     after_s=round(self.clock() - self._outage_since, 2))
        self._outage_since = None
        self.etcd_ok = True
        self._set_ready()

    def _etcd_failed(self, error: str) -> None:
        now = self.clock()
        if self._outage_since is None:
            self._outage_since = now
            self.counters["etcd_outages"] += 1
            log.warning("etcd does not answer", error=error, lease_ttl=self.ttl)
        self.etcd_ok = False
        self._set_ready()
        # gRPC does not notice a silently dead connection for minutes: dial again.
        if now - self._last_reset > self.ttl / 3:
            self._last_reset = now
            self.link.reset(error)

    def _lease_expired(self) -> None:
        log.warning("this host's etcd lease expired: every generation it was in is over", host=self.host)
        self.counters["lease_expired"] += 1
        self.lease_id = 0
        self._leased.clear()
        self._set_ready()
        for g in list(self.groups.values()):
            g.lease_lost()

    async def _acquire(self) -> None:
        """A new lease, this host's key on it, and the stack's secret."""
        first_seen: float | None = None
        while True:
            try:
                found = await self.link.txn([], [E.get(self.keys.host(self.host))])
                if found.kvs and self._ours(found.kvs[0]):
                    # Our own put, whose answer was lost: that lease is ours.
                    sent, lease_id, granted = self.clock(), found.kvs[0].lease, int(self.ttl)
                    await self._fetch_secret()
                elif found.kvs:
                    # Another instance (a previous one whose lease still runs, or another machine
                    # with this host name): wait for its lease to run out; two would mean duplicate ranks.
                    first_seen = first_seen or self.clock()
                    self._refuse_if_long(found.kvs[0], first_seen)
                    await asyncio.sleep(self.keepalive_every)
                    continue
                else:
                    sent = self.clock()
                    lease_id, granted = await self.link.grant(int(self.ttl))
                    record = HostRecord(self.settings.address, self.settings.peer_port, self.boot, os.getpid())
                    put = await self.link.txn([E.absent(self.keys.host(self.host))],
                                              [E.put(self.keys.host(self.host), host_value(record), lease_id)])
                    if not put.succeeded:
                        await self.link.revoke(lease_id, self.call_timeout)
                        continue
                    await self._fetch_secret()
            except EtcdError as exc:
                self._etcd_failed(str(exc))
                await asyncio.sleep(self.keepalive_every)
                continue
            if granted != int(self.ttl):
                log.info("etcd granted another lease TTL", asked=int(self.ttl), granted=granted)
            self.lease_id = lease_id
            self._leased.set()
            self.refused = None
            self._etcd_answered(sent)
            log.info("cluster lease held", host=self.host, lease=f"{lease_id:x}", ttl=granted)
            self._start_watch()
            return

    def _ours(self, kv: KV) -> bool:
        try:
            return parse_host(kv.value).boot == self.boot
        except HostileValue:
            return False

    def _refuse_if_long(self, kv: KV, since: float) -> None:
        if self.clock() - since <= self.ttl + 2 or self.refused:
            return
        try:
            other = parse_host(kv.value)
            who = f"pid {other.pid} at {other.address}"
        except HostileValue as exc:
            who = f"an unreadable record ({exc})"
        self.refused = (f"another omnid holds host name {self.host!r} in {self.settings.prefix} ({who}) and keeps "
                        f"its lease alive; expected one daemon per host name (cluster.host)")
        log.error("cluster membership refused", reason=self.refused)
        self._set_ready()

    async def _fetch_secret(self) -> None:
        if self.settings.secret_file is not None:
            return
        key = self.keys.secret()
        r = await self.link.txn([E.absent(key)], [E.put(key, os.urandom(32).hex().encode())], [E.get(key)])
        if not r.succeeded:
            value = r.kvs[0].value if r.kvs else b""
            if not 16 <= len(value) <= 256:
                self.hostile.ignored(key, f"a secret of {len(value)} bytes; expected 16 to 256 (delete the key, "
                                     "or set cluster.secret_file)")
                return
            self.peers.set_secret(value)
        else:
            again = await self.link.txn([], [E.get(key)])
            if again.kvs:
                self.peers.set_secret(again.kvs[0].value)

    # -- the mirror -------------------------------------------------------------------------------
    def _start_watch(self) -> None:
        """(Re)start the watch: it reads every key of interest afresh, then follows the prefix."""
        if self._closed:
            return
        if self._watch is not None:
            self._watch.close()
        loop = asyncio.get_running_loop()
        self._watch = DaemonTask("cluster watch", lambda: loop.create_task(self._watch_loop())).start()

    async def _watch_loop(self) -> None:
        while True:
            await self._leased.wait()
            try:
                revision = await self._resync()
                async for ev in self.link.watch(self.keys.root, revision + 1):
                    self._apply(ev.kv, ev.put)
                    self._changed()
            except EtcdError as exc:
                self.synced = False
                self._set_ready()
                log.info("etcd watch interrupted; reading again", error=str(exc))
                await asyncio.sleep(self.keepalive_every)

    async def _resync(self) -> int:
        revision = await self.mirror.read(self.link, list(self.groups))
        self.synced = True
        self._set_ready()
        self._changed()
        return revision

    def _apply(self, kv: KV, put: bool) -> None:
        self.mirror.apply(kv, put, self.groups)

    def _changed(self) -> None:
        for g in list(self.groups.values()):
            g.changed()

    # Reading the mirror.
    def entry(self, key: bytes) -> Entry | None:
        return self.mirror.entries.get(key)

    def current(self, group: str) -> tuple[int, int]:
        return self.mirror.current(group)

    def host_alive(self, host: str) -> bool:
        return self.keys.host(host) in self.mirror.entries

    # -- the clock -----------------------------------------------------------------------------------
    async def _monitor_loop(self) -> None:
        next_beat = 0.0
        while True:
            now = self.clock()
            if now >= next_beat:
                next_beat = now + self.beat_every
                self._beat()
            for g in list(self.groups.values()):
                g.tick(now)
            await asyncio.sleep(self.tick)

    def _beat(self) -> None:
        wanted: set[str] = set()
        for g in self.groups.values():
            wanted.update(g.hosts)
        self.peers.set_peers(wanted, self.mirror.addresses)
        self.peers.beat(self.etcd_ok, self.running())

    def running(self) -> dict[str, int]:
        return {name: g.running_generation() for name, g in self.groups.items()}

    def notify_down(self, group, generation: int, reason: str) -> None:
        self.peers.notify_down(DownNotice(group.name, generation, self.host, reason), group.hosts, self.etcd_ok,
                               self.running())

    def _peer_down(self, notice: DownNotice) -> None:
        g = self.groups.get(notice.group)
        if g is not None:
            g.remote_down(notice)

    # -- status -------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = self.clock()
        peers = {}
        for host, v in self.peers.views.items():
            peers[host] = {"heard_s_ago": round(now - v.heard_at, 3), "etcd_ok": v.etcd_ok}
        return {
            "host": self.host, "prefix": self.settings.prefix, "lease_ttl": self.ttl,
            "etcd": "ok" if self.etcd_ok else (f"unreachable for {now - self._outage_since:.1f} s"
                                              if self._outage_since is not None else "not reached yet"),
            "endpoint": self.link.endpoint, "refused": self.refused, "peers": peers,
            "hostile_values": self.hostile.count, "datagrams_dropped": dict(self.peers.dropped),
            **self.counters,
            **({"reexec_lease_gap_s": self.lease_gap_s} if self.lease_gap_s is not None else {}),
        }
