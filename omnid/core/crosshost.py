"""Worker groups across hosts (omnid.unit(5) `group_hosts`), seen from the centre: the
bridge between a group's members here (omnid.core.groups) and its `ClusterGroup`
(omnid.cluster), which agrees generations with the other hosts through etcd.

- A generation opens here only once every host has joined it: while the members could
  start, `may_open` starts the join, and the group starts when it returns (its number
  is the group's generation; the members get the rank environment of omnid.cluster).
- A member failing here is reported (`member_failed`); the group's members being all
  down again is reported (`settled`, i.e. `left`).
- A generation going down elsewhere (`on_down`) is one more fact for the members here:
  the group's book records it, the restart policy decides as for a local failure, and
  converge stops the members (GROUP_DOWN), or kills them at once when this host is
  fenced (GROUP_FENCED).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from omnid.cluster import checked
from omnid.cluster.group import ClusterGroup, Generation, GroupDown, GroupRecord, GroupRefused, Phase
from omnid.cluster.session import ClusterRefused, ClusterSession, SessionRecord
from omnid.model.cluster import check_file
from omnid.core import policy
from omnid.core.centre import Centre
from omnid.core.lifecycle import Goal
from omnid.core.runtime import RestartBook, UnitRuntime
from omnid.model.units import RestartPolicy, Stack

log = structlog.get_logger("omnid.supervisor")


@dataclass
class _Link:
    cluster: ClusterGroup
    members: tuple[str, ...]
    admitted: Generation | None = None  # joined by every host, not opened here yet
    running: Generation | None = None  # opened here; until every member is down again
    joining: asyncio.Task | None = None
    down: GroupDown | None = None  # how the running generation went down (elsewhere or fenced)
    counters: dict = field(default_factory=lambda: {"fenced": 0, "remote_down": 0})


@dataclass(frozen=True)
class HandedGroup:
    """One group across hosts as a re-exec hands it over: its ClusterGroup, and the generation
    open here (or admitted: joined by every host, its members not started yet)."""

    cluster: GroupRecord
    admitted: Generation | None
    running: Generation | None
    down: GroupDown | None
    counters: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class HandedCluster:
    session: SessionRecord
    groups: Mapping[str, HandedGroup]


def _checked(where: str, read, *args):  # noqa: ANN001, ANN202 -- one reader of the record
    try:
        return read(*args)
    except (ValueError, KeyError, TypeError) as exc:
        what = str(exc) if isinstance(exc, ValueError) else f"missing or malformed {exc}"
        raise ValueError(f"cluster.{where}: {what}") from None


def read_handover(d: dict, stack: Stack, book_generations: Mapping[str, int]) -> HandedCluster:
    """The cluster part of a re-exec's handover, read back and checked against the stack (its
    [cluster] settings, its groups across hosts, their restart books' generations) and the
    kernel (the heartbeat socket). ValueError naming the key: the caller falls back."""
    cfg = stack.settings.cluster
    if cfg is None:
        raise ValueError("cluster: handed over, but the stack has no [cluster]")
    session = _checked("session", SessionRecord.from_json, _checked("session", checked.obj, d, "session"))
    if (session.host, session.prefix) != (cfg.host, cfg.prefix):
        raise ValueError(f"cluster.session: host {session.host!r} prefix {session.prefix!r}, the stack has "
                         f"host {cfg.host!r} prefix {cfg.prefix!r}")
    _check_peer_socket(session.peers.fd, cfg.address, cfg.peer_port)
    # The files the session reads when it is made (a certificate replaced by something unsafe
    # since the start): named now, before anything is taken over, not once it is.
    for key, path, private in (("cluster.ca", cfg.ca, False), ("cluster.cert", cfg.cert, False),
                               ("cluster.key", cfg.key, True), ("cluster.secret_file", cfg.secret_file, True)):
        if path is not None:
            check_file(key, path, private=private)
    wanted = {g: names for g, names in stack.groups.items() if stack.units[names[0]].group_hosts}
    raw = _checked("groups", checked.obj, d, "groups")
    if set(raw) != set(wanted):
        raise ValueError(f"cluster.groups: [{', '.join(sorted(raw))}] handed over, the stack's groups across "
                         f"hosts are [{', '.join(sorted(wanted))}]")
    groups = {}
    for name, names in wanted.items():
        g = _checked(f"groups.{name}", checked.obj, raw, name)
        missing = [k for k in ("cluster", "admitted", "running", "down") if k not in g]
        if missing:
            raise ValueError(f"cluster.groups.{name}: missing {', '.join(missing)}")
        gens = {k: None if g[k] is None else _checked(f"groups.{name}.{k}", Generation.from_json, g[k])
                for k in ("admitted", "running")}
        down = None if g["down"] is None else _checked(f"groups.{name}.down", GroupDown.from_json, g["down"])
        h = HandedGroup(_checked(f"groups.{name}.cluster", GroupRecord.from_json, g["cluster"]),
                        gens["admitted"], gens["running"], down,
                        tuple(_checked(f"groups.{name}", checked.counters, g, "counters",
                                       ("fenced", "remote_down")).items()))
        hosts = stack.units[names[0]].group_hosts
        for k, gen in gens.items():
            if gen is not None and (gen.group, gen.hosts, gen.local_size, gen.hosts[gen.host_index]) != (
                    name, tuple(hosts), len(names), cfg.host):
                raise ValueError(f"cluster.groups.{name}.{k}: generation {gen.number} is of group {gen.group} on "
                                 f"[{', '.join(gen.hosts)}] x {gen.local_size}; the stack has [{', '.join(hosts)}] "
                                 f"x {len(names)}, this host {cfg.host}")
        if h.running is not None and h.running.number != book_generations.get(name):
            raise ValueError(f"cluster.groups.{name}.running: generation {h.running.number}, its members' restart "
                             f"book says {book_generations.get(name)}")
        opened = h.running or h.admitted
        if h.cluster.phase is Phase.RUNNING and opened is not None and opened.number != h.cluster.generation:
            raise ValueError(f"cluster.groups.{name}: generation {h.cluster.generation} runs here, but "
                             f"{opened.number} is open")
        groups[name] = h
    return HandedCluster(session, groups)


def _check_peer_socket(fd: int, address: str, port: int) -> None:
    """The inherited heartbeat socket: open, UDP, bound to the settings' address and port."""
    try:
        dup = os.dup(fd)
    except OSError as exc:
        raise ValueError(f"cluster.session.peers.fd: fd {fd}: {exc.strerror}") from None
    try:
        sock = socket.socket(fileno=dup)
    except OSError as exc:
        os.close(dup)
        raise ValueError(f"cluster.session.peers.fd: fd {fd} is not a socket ({exc.strerror})") from None
    with sock:
        try:
            bound, kind = sock.getsockname(), sock.type
        except OSError as exc:
            raise ValueError(f"cluster.session.peers.fd: fd {fd}: {exc.strerror}") from None
    if kind != socket.SOCK_DGRAM or not isinstance(bound, tuple) or bound[1] != port \
            or ipaddress.ip_address(bound[0]) != ipaddress.ip_address(address):
        raise ValueError(f"cluster.session.peers.fd: fd {fd} is {bound!r} ({kind!r}); expected UDP on "
                         f"{address} port {port}")


class CrossHost:
    def __init__(self, sup: Centre, session: ClusterSession) -> None:
        self.sup = sup
        self.session = session
        self.links: dict[str, _Link] = {}
        self.restack()

    def restack(self) -> None:
        """The stack's groups across hosts (again, after a reload): a group whose hosts or
        members changed gets a new ClusterGroup (its members were restarted by the reload)."""
        for group in [g for g in self.links if g not in self.sup.stack.groups]:
            self._drop(group)
        for group, names in self.sup.stack.groups.items():
            spec = self.sup.stack.units[names[0]]
            lk = self.links.get(group)
            if lk is not None and (not spec.group_hosts or lk.members != names
                                   or lk.cluster.hosts != spec.group_hosts):
                self._drop(group)
                lk = None
            if spec.group_hosts and lk is None:
                cg = ClusterGroup(self.session, group, spec.group_hosts, len(names),
                                  lambda d, g=group: self._on_down(g, d))
                cg.on_reason = self.refresh_reasons
                self.links[group] = _Link(cg, names)

    def _drop(self, group: str) -> None:
        lk = self.links.pop(group)
        if lk.joining is not None:
            lk.joining.cancel()
        self._withdraw(lk, "its unit files changed")
        if lk.running is not None:
            lk.cluster.left(lk.running.number, "its unit files changed")
        self.session.groups.pop(group, None)

    def link(self, rt: UnitRuntime) -> _Link | None:
        return self.links.get(rt.spec.worker_group or "")

    # -- opening a generation ------------------------------------------------------------
    def may_open(self, rt: UnitRuntime) -> bool:
        """The members here could start a new generation: may they, i.e. has every host joined?"""
        lk = self.link(rt)
        if lk is None:
            return True
        if lk.admitted is not None and lk.cluster.running_generation() != lk.admitted.number:
            self._withdraw(lk, "it went down before it started here")  # it went down while we waited
        if lk.admitted is not None:
            return True
        if lk.running is not None:  # every member is down here (the caller checked): leave it first
            self.settled(rt)
        if lk.joining is None:
            lk.joining = asyncio.get_running_loop().create_task(self._join(lk, rt.book))
        return False

    async def _join(self, lk: _Link, book: RestartBook) -> None:
        try:
            gen = await lk.cluster.join(book.generation)
        except (GroupRefused, ClusterRefused) as exc:
            book.down_reason = str(exc)
            book.gave_up = True
            book.up = False
            self._set_reasons(lk, str(exc))
            log.error("worker group across hosts refused", group=lk.cluster.name, reason=str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- a bug here must not leave the group waiting silently
            log.exception("joining a group across hosts failed", group=lk.cluster.name)
            self._set_reasons(lk, f"worker group {lk.cluster.name}: joining failed: {type(exc).__name__}: {exc}")
        else:
            lk.admitted = gen
        finally:
            lk.joining = None
            self.sup.kick()

    def opened(self, rt: UnitRuntime) -> int:
        """The generation opens here now: its number (agreed by every host)."""
        lk = self.link(rt)
        assert lk is not None and lk.admitted is not None
        lk.running, lk.admitted, lk.down = lk.admitted, None, None
        return lk.running.number

    def environment(self, rt: UnitRuntime) -> dict[str, str]:
        lk = self.link(rt)
        if lk is None or lk.running is None:
            return {}
        env = lk.running.rank_env(lk.members.index(rt.name))
        td = rt.spec.torch_distributed
        if td is not None:
            env["MASTER_PORT"] = str(td.master_port)
        return env

    # -- what happens here -------------------------------------------------------------------
    def member_failed(self, rt: UnitRuntime, what: str) -> None:
        lk = self.link(rt)
        if lk is not None and lk.running is not None:
            lk.cluster.member_failed(lk.running.number, rt.name, what)

    def decided(self, rt: UnitRuntime, decision: policy.Decision) -> None:
        """The restart policy decided after the group failed here: when it will not start again by
        itself, the other hosts (waiting for this one in the next generation) are told."""
        lk = self.link(rt)
        if lk is None or lk.running is None:
            return
        if decision.outcome is policy.Outcome.GAVE_UP or (
                decision.outcome is policy.Outcome.NONE and rt.spec.restart is RestartPolicy.NO
                and rt.goal is Goal.ACTIVE and not self.sup.shutting_down):
            lk.cluster.gave_up(lk.running.number, decision.note or 'restart = "no"')

    def settled(self, rt: UnitRuntime) -> None:
        """Every member here is down: the generation is left here."""
        lk = self.link(rt)
        if lk is None or lk.running is None:
            return
        why = "stopped by the operator" if any(self.sup.units[m].goal is Goal.INACTIVE for m in lk.members) \
            else "its members were stopped"
        lk.cluster.left(lk.running.number, why)
        lk.running = None

    def converged(self) -> None:
        """After each converge: a group no longer wanted here (an operator's stop, the stack
        stopping) withdraws from a generation it joined but did not start, so that the other
        hosts' ranks do not wait for ours."""
        for lk in self.links.values():
            if lk.joining is None and lk.admitted is None:
                continue
            if self.sup.shutting_down or any(self.sup.units[m].goal is Goal.INACTIVE for m in lk.members):
                if lk.joining is not None:
                    lk.joining.cancel()  # ClusterGroup.join records that it left before the start
                if lk.admitted is not None:
                    self._withdraw(lk, "stopped by the operator before it started here")

    def _withdraw(self, lk: _Link, why: str) -> None:
        gen, lk.admitted = lk.admitted, None
        if gen is not None:
            lk.cluster.left(gen.number, why)

    # -- what happens elsewhere ------------------------------------------------------------------
    def _on_down(self, group: str, d: GroupDown) -> None:
        lk = self.links[group]
        if lk.admitted is not None and lk.admitted.number == d.generation:
            self._withdraw(lk, "it went down before it started here")
            self.sup.kick()  # join the next one
            return
        if lk.running is None or lk.running.number != d.generation:
            return
        lk.down = d
        lk.counters["fenced" if d.fenced else "remote_down"] += 1
        book = self.sup.units[lk.members[0]].book
        if book.down_reason is None:
            book.down_reason = d.reason
            book.up = False
            spec = self.sup.units[lk.members[0]].spec
            rt0 = self.sup.units[lk.members[0]]
            now = time.monotonic()
            ran_for = (now - rt0.active_since) if rt0.active_since else None
            f = policy.Failure(now=now, wanted=rt0.goal is Goal.ACTIVE and not self.sup.shutting_down,
                               ran_for=ran_for, first_start=not book.ever_up)
            decision = policy.decide(spec, book, f)
            if d.final and decision.outcome is policy.Outcome.AGAIN:
                book.restart_pending, book.gave_up = False, True  # the host where it failed gave up
            if decision.outcome is policy.Outcome.AGAIN and not d.final:
                asyncio.get_running_loop().call_later(decision.delay, self.sup.kick)
            log.warning("worker group across hosts: generation down", group=group, generation=d.generation,
                        reason=d.reason, fenced=d.fenced, restart=decision.outcome.value)
        self.sup.kick()

    def stop_event(self, rt: UnitRuntime) -> tuple[bool, str] | None:
        """(fenced, reason) when converge must stop this member because its generation is down
        (cross-host groups only); None to let omnid.core.schedule word it."""
        lk = self.link(rt)
        if lk is None:
            return None
        if lk.down is not None:
            return lk.down.fenced, f"stopped: {lk.down.reason}"
        if lk.cluster.reason and rt.book.down_reason is not None:
            return False, f"stopped: {lk.cluster.reason}"
        return None

    # -- telling ------------------------------------------------------------------------------------
    def _set_reasons(self, lk: _Link, reason: str) -> None:
        for m in lk.members:
            rt = self.sup.units[m]
            if not rt.busy and rt.state.value in ("inactive", "failed"):
                rt.reason = reason
        self.sup.notify_changed()

    def refresh_reasons(self) -> None:
        """Members waiting for other hosts say for which (called by converge): the stopped
        ones and the one that failed alike (its exit stays in `last_exit`), or the failed one
        would say "restarting in 0.2 s" for as long as the other hosts take."""
        for lk in self.links.values():
            if lk.joining is not None and lk.cluster.reason:
                for m in lk.members:
                    rt = self.sup.units[m]
                    if not rt.busy and rt.state.value in ("inactive", "failed") and rt.reason != lk.cluster.reason:
                        rt.reason = lk.cluster.reason
                        self.sup.notify_changed()

    def status(self, rt: UnitRuntime) -> dict | None:
        lk = self.link(rt)
        return lk.cluster.status() if lk is not None else None

    def metrics(self) -> dict[str, dict[str, int]]:
        out = {}
        for g, lk in self.links.items():
            c = lk.cluster.counters
            out[g] = {"generations": c["generations"], "fenced": c["fenced"], "down": c["down"],
                      "remote_down": lk.counters["remote_down"]}
        return out

    # -- re-exec (omnid.daemon.handover) ---------------------------------------------------------------------
    def exec_refusal(self) -> str | None:
        """Why a re-exec must not go on now, or None."""
        s = self.session
        if s.lease_id and not s.etcd_ok:
            return (f"etcd does not answer ({s.status()['etcd']}): the next program could not renew this host's "
                    f"lease (lease_ttl {s.ttl:g} s) and the peers would stop the groups; try again once it answers")
        for name, lk in self.links.items():
            if lk.cluster.phase is Phase.DOWN:
                return f"worker group {name} generation {lk.cluster.generation} is down here: {lk.cluster.reason}"
        return None

    def joining(self) -> list[str]:
        """The groups whose join is under way (waiting for etcd or for other hosts)."""
        return [name for name, lk in self.links.items() if lk.joining is not None]

    def handover(self) -> dict:
        """For the next program (after session.pause_for_exec). A join under way is not handed
        over: its task ends with this program, and the next one joins again."""
        return {"session": self.session.handover().to_json(),
                "groups": {name: {"cluster": lk.cluster.handover().to_json(),
                                  "admitted": lk.admitted.to_json() if lk.admitted else None,
                                  "running": lk.running.to_json() if lk.running else None,
                                  "down": lk.down.to_json() if lk.down else None, "counters": dict(lk.counters)}
                           for name, lk in self.links.items()}}

    def take_over(self, handed: HandedCluster) -> None:
        """Go on where the previous program of this daemon was (before the session opens)."""
        self.session.take_over(handed.session)
        for name, h in handed.groups.items():
            lk = self.links[name]
            lk.cluster.take_over(h.cluster)
            lk.admitted, lk.running, lk.down = h.admitted, h.running, h.down
            lk.counters.update(dict(h.counters))

    async def close(self) -> None:
        for lk in self.links.values():
            if lk.joining is not None:
                lk.joining.cancel()
                try:
                    await lk.joining
                except asyncio.CancelledError:
                    pass
