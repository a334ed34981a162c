"""A worker group across hosts (omnid.unit(5) `group_hosts`), as one host daemon sees it.

The supervisor centre drives it with three calls and hears back through one callback:

    gen = await group.join(hint)        # returns when every host joined generation gen.number
    group.member_failed(gen.number, unit, reason)   # a local member failed
    group.left(gen.number)              # every local member of that generation is stopped
    on_down(GroupDown)                  # the generation is down for a cause the centre did not
                                        # report itself: a remote failure, a host gone, this
                                        # host's lease lost, or fencing

Generations are agreed in etcd (omnid.cluster.keys): a host joins generation N by putting
its join key on its lease in the same transaction that checks `current` is still N (or
moves it from N-1 to N), so two hosts never run two different generations: a host joins
N+1 only after leaving N, and N+1 starts only when every listed host joined it. A failure
is one key created once per generation (the first cause wins and names the host); it is
also sent straight to the peers (omnid.cluster.peers), which stop without waiting for etcd.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import structlog

from omnid.cluster import checked
from omnid.cluster import etcd as E
from omnid.cluster.etcd import EtcdError
from omnid.cluster.fencing import Action, judge
from omnid.cluster.keys import MAX_GENERATION, MAX_HOSTS, MAX_LOCAL_SIZE, MAX_REASON, DownRecord, JoinRecord, \
    current_value, down_value, join_value
from omnid.cluster.peers import DownNotice
from omnid.model.cluster import HOST_NAME
from omnid.cluster.session import ClusterSession

log = structlog.get_logger("omnid.cluster")


class GroupRefused(Exception):
    """The hosts disagree about the group (its hosts, or how many members each has)."""


class Phase(Enum):
    IDLE = "idle"  # in no generation
    JOINING = "joining"  # joined, waiting for every host
    RUNNING = "running"
    DOWN = "down"  # the generation is down; waiting for the local members to stop (left())
    REFUSED = "refused"


@dataclass(frozen=True)
class Generation:
    group: str
    number: int
    hosts: tuple[str, ...]
    host_index: int
    local_size: int
    master_addr: str

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.local_size

    def to_json(self) -> dict:
        return {"group": self.group, "number": self.number, "hosts": list(self.hosts), "host_index": self.host_index,
                "local_size": self.local_size, "master_addr": self.master_addr}

    @classmethod
    def from_json(cls, d: dict) -> Generation:
        hosts = checked.strings(d, "hosts", HOST_NAME, MAX_HOSTS)
        return cls(checked.text(d, "group", limit=64), checked.integer(d, "number", 1, MAX_GENERATION), hosts,
                   checked.integer(d, "host_index", 0, max(0, len(hosts) - 1)),
                   checked.integer(d, "local_size", 1, MAX_LOCAL_SIZE), checked.text(d, "master_addr", limit=64))

    def rank_env(self, local_index: int) -> dict[str, str]:
        """The environment of this host's member `local_index` (omnid.unit(5), `group_hosts`)."""
        if not 0 <= local_index < self.local_size:
            raise ValueError(f"worker group {self.group}: local index {local_index} outside 0..{self.local_size - 1}")
        rank = self.host_index * self.local_size + local_index
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(local_index),
                "LOCAL_WORLD_SIZE": str(self.local_size), "GROUP_RANK": str(self.host_index),
                "GROUP_WORLD_SIZE": str(len(self.hosts)),
                "MASTER_ADDR": self.master_addr, "OMNID_GENERATION": str(self.number),
                "OMNID_WORKER_GROUP": self.group, "OMNID_GROUP_RANK": str(rank),
                "OMNID_GROUP_SIZE": str(self.world_size), "OMNID_GROUP_HOSTS": ",".join(self.hosts)}


@dataclass(frozen=True)
class GroupDown:
    """Generation `generation` of `group` is down; stop this host's members of it."""

    group: str
    generation: int
    reason: str  # "worker group tp generation 3 is down: node-b: ranks@1 failed: killed by SIGKILL"
    fenced: bool = False  # this host is cut off: members must be gone by `kill_by`, no grace
    final: bool = False  # the host where it failed gave up for good (start limit, restart = "no")
    kill_by: float | None = None  # monotonic time the lease may expire at (fencing only)

    def to_json(self) -> dict:
        return {"group": self.group, "generation": self.generation, "reason": self.reason, "fenced": self.fenced,
                "final": self.final, "kill_by": self.kill_by}

    @classmethod
    def from_json(cls, d: dict) -> GroupDown:
        return cls(checked.text(d, "group", limit=64), checked.integer(d, "generation", 1, MAX_GENERATION),
                   checked.text(d, "reason", limit=4 * MAX_REASON), checked.flag(d, "fenced"), checked.flag(d, "final"),
                   None if d["kill_by"] is None else checked.number(d, "kill_by"))


@dataclass(frozen=True)
class GroupRecord:
    """What a re-exec hands over of a ClusterGroup (omnid(8), RE-EXEC): the same generation in
    the same phase, on the same lease. A join still waiting for other hosts is handed over as
    not joined: the next program joins again and finds its own join key (the lease is the same),
    so no new generation begins for it."""

    phase: Phase
    generation: int
    reason: str
    last: int
    since: float
    heard: tuple[DownNotice, ...]
    unwritten: tuple[tuple[int, DownRecord], ...]  # down records not yet in etcd: written by the next program
    held: bool
    grace_from: float
    counters: tuple[tuple[str, int], ...]

    def to_json(self) -> dict:
        return {"phase": self.phase.value, "generation": self.generation, "reason": self.reason, "last": self.last,
                "since": self.since, "heard": [n.to_json() for n in self.heard],
                "unwritten": [[n, r.to_json()] for n, r in self.unwritten], "held": self.held,
                "grace_from": self.grace_from, "counters": dict(self.counters)}

    @classmethod
    def from_json(cls, d: dict) -> GroupRecord:
        phase = checked.text(d, "phase", limit=16)
        if phase not in {p.value for p in Phase}:
            raise ValueError(f"phase: {phase!r} is none of {', '.join(p.value for p in Phase)}")
        def unwritten(item: list) -> tuple[int, DownRecord]:
            if not isinstance(item, list) or len(item) != 2:
                raise ValueError("expected a [generation, down record] pair")
            return checked.integer(item, 0, 1, MAX_GENERATION), DownRecord.from_json(item[1])

        return cls(Phase(phase), checked.integer(d, "generation", 0, MAX_GENERATION),
                   checked.text(d, "reason", limit=4 * MAX_REASON), checked.integer(d, "last", 0, MAX_GENERATION),
                   checked.number(d, "since"), checked.each(d, "heard", DownNotice.from_json, 16),
                   checked.each(d, "unwritten", unwritten, 16), checked.flag(d, "held"), checked.number(d, "grace_from"),
                   tuple(checked.counters(d, "counters", ("generations", "fenced", "down")).items()))


class ClusterGroup:
    def __init__(self, session: ClusterSession, name: str, hosts: tuple[str, ...], local_size: int,
                 on_down: Callable[[GroupDown], None]) -> None:
        if session.host not in hosts:
            raise GroupRefused(f"worker group {name}: this host ({session.host}) is not in group_hosts "
                               f"[{', '.join(hosts)}]")
        if len(set(hosts)) != len(hosts):
            raise GroupRefused(f"worker group {name}: group_hosts names a host twice: [{', '.join(hosts)}]")
        self.session = session
        self.name = name
        self.hosts = tuple(hosts)
        self.local_size = local_size
        self.on_down = on_down
        self.phase = Phase.IDLE
        self.generation = 0  # the one joined, running, or last run
        self.reason = ""
        self._last = 0  # no generation at or below this is joined again
        self._lease = 0  # the lease our join key is on
        self._since = 0.0
        self._heard: dict[int, DownNotice] = {}  # generation -> a peer's notice that it went down
        self._pending: set[asyncio.Task] = set()
        self._unwritten: dict[int, DownRecord] = {}  # generation -> its down record, until it is in etcd
        self._wake = asyncio.Event()
        self._hold_logged = False
        self.on_reason: Callable[[], None] | None = None  # the barrier's reason changed (who is missing)
        self._held = False  # during this etcd outage, etcd was down for every host of the group
        self._grace_from = -1e18
        self.counters = {"generations": 0, "fenced": 0, "down": 0}
        session.register(self)

    # -- reading the mirror --------------------------------------------------------------------
    def _joins(self, n: int) -> dict[str, JoinRecord | None]:
        return {e.key.host: e.value for e in self.session.mirror.entries.values()
                if e.key.kind == "join" and e.key.group == self.name and e.key.generation == n}

    def _down_record(self, n: int) -> DownRecord | None:
        e = self.session.entry(self.session.keys.down(self.name, n))
        if e is not None and isinstance(e.value, DownRecord):
            return e.value
        heard = self._heard.get(n)
        return DownRecord(heard.host, heard.reason) if heard else None

    def _mismatch(self, joins: dict[str, JoinRecord | None]) -> str | None:
        me = self.session.host
        for host, rec in sorted(joins.items()):
            if rec is None or host == me:
                continue
            if host not in rec.hosts:  # not a daemon's own join: someone wrote it by hand
                self.session.hostile.ignored(self.session.keys.join(self.name, self.generation, host),
                                             f"a join by {host}, which its own group_hosts does not list")
            elif rec.hosts != self.hosts:
                return (f"group_hosts differ between hosts: {me} has [{', '.join(self.hosts)}], "
                        f"{host} has [{', '.join(rec.hosts)}]")
            elif rec.local_size != self.local_size:
                return f"member counts differ between hosts: {me} has {self.local_size}, {host} has {rec.local_size}"
        return None

    def running_generation(self) -> int:
        return self.generation if self.phase is Phase.RUNNING else 0

    # -- joining --------------------------------------------------------------------------------
    async def join(self, generation_hint: int = 0) -> Generation:
        """Join the group's next generation and wait until every host has joined it.
        Raises GroupRefused when the hosts disagree; waits (no timeout) while etcd is away."""
        if self.phase in (Phase.RUNNING, Phase.DOWN):
            raise RuntimeError(f"worker group {self.name}: join while generation {self.generation} was not left")
        self._last = max(self._last, generation_hint)
        if self._pending:  # the reason a generation went down is written before the next one starts
            await asyncio.wait(set(self._pending))
        joined = 0
        try:
            while True:
                await self.session.ready()
                try:
                    target = await self._put_join()
                except EtcdError as exc:
                    log.info("joining a cross-host group: etcd failed; trying again", group=self.name, error=str(exc))
                    await self._sleep(self.session.keepalive_every)
                    continue
                if target == 0:
                    await self._sleep(0.5)  # lost a race: the watch brings the winner's keys
                    continue
                joined, self.generation, self.phase = target, target, Phase.JOINING
                gen = await self._barrier(target)
                self._last = target
                joined = 0
                if gen is None:
                    self.phase = Phase.IDLE
                    continue
                self.phase, self._since = Phase.RUNNING, self.session.clock()
                self.reason = ""
                self.counters["generations"] += 1
                log.info("cross-host generation starts", group=self.name, generation=target, hosts=list(self.hosts),
                         master_addr=gen.master_addr)
                return gen
        finally:
            if joined:  # cancelled, or refused, after our join key was written and before the start
                self._last = max(self._last, joined)
                if self.phase is not Phase.REFUSED:  # (a refusal recorded itself)
                    self.phase = Phase.IDLE
                    self._record_down(joined, DownRecord(self.session.host, f"left before generation {joined} started"))

    async def _put_join(self) -> int:
        """One attempt: our join key in the generation to join; its number, or 0 when we lost a race."""
        s, me = self.session, self.session.host
        n, rev = s.current(self.name)
        joins = self._joins(n) if n else {}
        mine = s.entry(s.keys.join(self.name, n, me)) if n else None
        fresh = n >= 1 and n > self._last and self._down_record(n) is None
        if fresh and (problem := self._mismatch(joins)):
            self._refuse(n, problem)
        if fresh and mine is not None and mine.lease == s.lease_id:
            return n  # our own earlier attempt went through though its answer was lost
        record = join_value(JoinRecord(self.hosts, self.local_size, s.settings.address, s.boot))
        self._lease = s.lease_id
        if fresh and any(h != me for h in joins):  # others wait in n: join them
            # "not down": no down key, or the hostile one we ignored (compared by its revision)
            down = s.entry(s.keys.down(self.name, n))
            r = await s.link.txn([E.mod_revision_is(s.keys.current(self.name), rev),
                                  E.mod_revision_is(s.keys.down(self.name, n), down.mod_revision if down else 0)],
                                 [E.put(s.keys.join(self.name, n, me), record, s.lease_id)])
            return n if r.succeeded else 0
        target = max(n, self._last) + 1
        guard = E.mod_revision_is(s.keys.current(self.name), rev) if rev else E.absent(s.keys.current(self.name))
        ops = [E.put(s.keys.current(self.name), current_value(target)),
               E.put(s.keys.join(self.name, target, me), record, s.lease_id)]
        if target > 2:
            ops.append(E.delete_prefix(s.keys.generation(self.name, target - 2)))
        r = await s.link.txn([guard], ops)
        return target if r.succeeded else 0

    async def _barrier(self, n: int) -> Generation | None:
        """Until every host joined n (its Generation), or n went down before it started (None)."""
        s = self.session
        while True:
            if s.lease_id != self._lease:
                self.reason = f"worker group {self.name} generation {n}: this host's etcd lease expired while joining"
                return None
            down = self._down_record(n)
            if down is not None and down.final:  # another host refused the group, or gave up for good
                self._refuse(n, f"{down.host}: {down.reason}", record=False)
            if down is not None:
                self.reason = f"worker group {self.name} generation {n} is down: {down.host}: {down.reason}"
                return None
            if s.current(self.name)[0] > n:
                return None
            joins = self._joins(n)
            problem = self._mismatch(joins)
            if problem:
                self._refuse(n, problem)
            missing = [h for h in self.hosts if h not in joins]
            if not missing:
                lead = joins[self.hosts[0]]
                assert lead is not None  # a hostile value fails the hosts check above
                return Generation(self.name, n, self.hosts, self.hosts.index(s.host), self.local_size, lead.address)
            away = [h for h in missing if not s.host_alive(h)]
            reason = (f"worker group {self.name} generation {n}: waiting for {', '.join(missing)} to join"
                      + (f" ({', '.join(away)}: no omnid running there)" if away else ""))
            if reason != self.reason:
                self.reason = reason
                if self.on_reason is not None:
                    self.on_reason()
            await self._sleep(None)

    def _refuse(self, n: int, problem: str, record: bool = True) -> None:
        """The hosts disagree: refuse here, and (as a final down record of n) on every host."""
        self.phase, self.reason = Phase.REFUSED, f"worker group {self.name}: {problem}"
        log.error("cross-host group refused", group=self.name, generation=n, reason=self.reason)
        if record:
            self._record_down(n, DownRecord(self.session.host, problem, final=True))
        raise GroupRefused(self.reason)

    async def _sleep(self, timeout: float | None) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # -- what the centre reports ---------------------------------------------------------------------
    def member_failed(self, generation: int, unit: str, reason: str, final: bool = False) -> None:
        """A local member of `generation` failed: every other host stops its members now."""
        if self.phase is not Phase.RUNNING or generation != self.generation:
            log.debug("member failure for a generation not running here", group=self.name, generation=generation)
            return
        what = f"{unit} failed: {reason}"
        self._down(f"{self.session.host}: {what}", DownRecord(self.session.host, what, final), local=True)

    def gave_up(self, generation: int, reason: str) -> None:
        """This host will not start the group again by itself (start limit, restart = "no"):
        the other hosts, which would wait for it in the next generation, fail for good too."""
        self._record_down(generation + 1, DownRecord(self.session.host, f"gave up: {reason}", final=True))

    def left(self, generation: int, reason: str = "its members were stopped") -> None:
        """Every local member of `generation` is stopped. A generation still running (an operator
        stop, not a failure) goes down everywhere: the others' ranks would wait for ours."""
        if generation != self.generation:
            return
        if self.phase is Phase.RUNNING:
            self._down(f"{self.session.host}: {reason}", DownRecord(self.session.host, reason), local=True)
        if self.phase is Phase.DOWN:
            self.phase = Phase.IDLE
        self._last = max(self._last, generation)

    # -- what the session reports ------------------------------------------------------------------------
    def changed(self) -> None:
        """The mirror changed."""
        self._wake.set()
        if self.phase is not Phase.RUNNING:
            return
        s, n = self.session, self.generation
        down = self._down_record(n)
        if down is not None:
            return self._down(f"{down.host}: {down.reason}", None, final=down.final)
        if not s.synced:
            return  # during an outage the mirror is old: absence proves nothing
        gone = [h for h in self.hosts if h not in self._joins(n)]
        if gone:
            return self._down(f"{gone[0]} is gone (its etcd lease ended)", DownRecord(gone[0], "is gone (its etcd lease ended)"))
        if s.current(self.name)[0] > n:
            self._down(f"generation {s.current(self.name)[0]} began", None)

    def lease_lost(self) -> None:
        self._wake.set()
        if self.phase is Phase.RUNNING:
            what = "its etcd lease expired"
            self._down(f"{self.session.host}: {what}", DownRecord(self.session.host, what), tell_peers=True)

    def remote_down(self, notice: DownNotice) -> None:
        if notice.host not in self.hosts:
            return
        self._heard[notice.generation] = notice
        for old in [g for g in self._heard if g < notice.generation - 2]:
            del self._heard[old]
        self._wake.set()
        if self.phase is Phase.RUNNING and notice.generation == self.generation:
            self._down(f"{notice.host}: {notice.reason}", DownRecord(notice.host, notice.reason))

    def tick(self, now: float) -> None:
        if self.phase is not Phase.RUNNING:
            return
        s = self.session
        if s.etcd_ok:
            self._held, self._grace_from = False, -1e18
        views = {p: s.peers.views.get(p) for p in self.hosts if p != s.host}

        def verdict_from(last_ok: float):
            return judge(peers=views, now=now, etcd_ok=s.etcd_ok, last_ok_sent=last_ok, ttl=s.ttl,
                         margin=s.margin, peer_timeout=s.peer_timeout, peer_down_after=1.5 * s.ttl,
                         running_since=self._since)

        verdict = verdict_from(max(s.last_ok_sent, self._grace_from))
        if verdict.action is Action.FENCE and self._held and self._grace_from < 0:
            # etcd was down for every host, and is back for a peer first: a restarted etcd
            # renews every lease, so ours runs from now, not from our last keepalive. Reconnect
            # within a lease, or fence then.
            self._grace_from = now
            s.link.reset("a peer reaches etcd again")
            verdict = verdict_from(now)
        if verdict.action is Action.HOLD:
            self._held = True
        if verdict.action is Action.FENCE:
            self.counters["fenced"] += 1
            self._down(f"{s.host}: {verdict.reason}", DownRecord(s.host, verdict.reason), fenced=True,
                       kill_by=max(s.last_ok_sent, self._grace_from) + s.ttl)
        elif verdict.action is Action.DOWN:
            self._down(f"{s.host}: {verdict.reason}", DownRecord(s.host, verdict.reason), tell_peers=True)
        elif verdict.action is Action.HOLD and not self._hold_logged:
            self._hold_logged = True
            log.warning("etcd is down for every host of the group; its generation runs on", group=self.name,
                        generation=self.generation, reason=verdict.reason)
        elif verdict.action is Action.RUN:
            self._hold_logged = False

    # -- going down -----------------------------------------------------------------------------------------
    def _down(self, tail: str, record: DownRecord | None, *, local: bool = False, tell_peers: bool = False,
              fenced: bool = False, final: bool = False, kill_by: float | None = None) -> None:
        """The generation running here is down: say so once, to etcd, the peers and (unless the
        centre reported it itself: `local`) the centre."""
        if self.phase is not Phase.RUNNING:
            return
        n = self.generation
        self.phase = Phase.DOWN
        self.counters["down"] += 1
        self.reason = f"worker group {self.name} generation {n} is down: {tail}"
        log.warning("cross-host generation down", group=self.name, generation=n, reason=self.reason, fenced=fenced)
        if local or tell_peers:
            self.session.notify_down(self, n, record.reason if record else tail)
        if record is not None:
            self._record_down(n, record)
        if not local:
            try:
                self.on_down(GroupDown(self.name, n, self.reason, fenced=fenced, final=final, kill_by=kill_by))
            except Exception:  # noqa: BLE001 -- the centre's bug must not stop the cluster loops
                log.exception("on_down handler failed", group=self.name, generation=n)

    def _record_down(self, n: int, record: DownRecord) -> None:
        self._unwritten.setdefault(n, record)
        task = self.session.spawn(self._write_down(n, record), f"cluster group {self.name} down record")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write_down(self, n: int, record: DownRecord) -> None:
        s = self.session
        key = s.keys.down(self.name, n)
        while s.current(self.name)[0] <= n + 1:
            e = s.entry(key)
            if e is not None and isinstance(e.value, DownRecord):
                break  # the first cause is recorded already
            try:  # created once; a hostile value there (ignored) is replaced
                r = await s.link.txn([E.mod_revision_is(key, e.mod_revision if e else 0)], [E.put(key, down_value(record))])
                if r.succeeded:
                    break
                await asyncio.sleep(0.05)  # it changed meanwhile: look again once the watch brings it
            except EtcdError:
                await asyncio.sleep(s.keepalive_every)
        self._unwritten.pop(n, None)  # (not when cancelled: a re-exec hands it over)

    def write_unwritten(self) -> None:
        """Write again the down records a re-exec interrupted (the session's loops run)."""
        for n, record in list(self._unwritten.items()):
            task = self.session.spawn(self._write_down(n, record), f"cluster group {self.name} down record")
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    # -- re-exec ------------------------------------------------------------------------------------------
    def handover(self) -> GroupRecord:
        return GroupRecord(self.phase, self.generation, self.reason, self._last, self._since,
                           tuple(self._heard.values()), tuple(self._unwritten.items()), self._held, self._grace_from,
                           tuple(self.counters.items()))

    def take_over(self, rec: GroupRecord) -> None:
        """Go on from what the previous program of this daemon handed over (before the session's
        loops start; the lease is the same one, so our join keys in etcd are still ours)."""
        self.phase = Phase.IDLE if rec.phase is Phase.JOINING else rec.phase
        self.generation, self.reason, self._last, self._since = rec.generation, rec.reason, rec.last, rec.since
        self._lease = self.session.lease_id
        self._heard = {n.generation: n for n in rec.heard}
        self._unwritten = dict(rec.unwritten)
        self._held, self._grace_from = rec.held, rec.grace_from
        self.counters.update(dict(rec.counters))

    # -- status ---------------------------------------------------------------------------------------------
    def status(self) -> dict:
        """{"name", "generation", "state", "reason", "hosts": {HOST: STATE}}."""
        s, n = self.session, self.generation
        joins = self._joins(n) if n else {}
        down = self._down_record(n) if n else None
        hosts = {}
        for h in self.hosts:
            if h == s.host and self.phase is Phase.DOWN and "fenced" in self.reason:
                state = "fenced"
            elif down is not None and down.host == h:
                state = "failed"
            elif h in joins:
                state = {Phase.JOINING: "joined", Phase.RUNNING: "up"}.get(self.phase, "stopped")
            elif s.host_alive(h):
                state = "waiting"
            elif s.synced:
                state = "gone"
            else:  # the mirror is being read again (a re-exec, a watch that ended): not known yet
                state = "unknown (etcd not read yet)"
            if h != s.host and not s.etcd_ok:
                state += "" if s.peers.heard_within(h, s.peer_timeout) else " (unreachable)"
            hosts[h] = state
        return {"name": self.name, "generation": n, "state": self.phase.value, "reason": self.reason, "hosts": hosts}
