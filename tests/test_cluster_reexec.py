"""`omnid reexec` of a daemon with [cluster], the parts that need no network (the end-to-end
test, real hosts and gloo ranks, is in test_cluster_e2e.py): a host's membership handed over
reads back the same in the next program (lease, boot, heartbeat sender and socket, groups);
a cluster part that is malformed or does not fit the stack is refused with its key named
(the new program then falls back); fencing counts the handover as a silence of etcd."""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import time

import pytest

pytest.importorskip("aetcd", reason="the cluster modules need the etcd client (pip install '.[cluster]')")

from omnid.cluster.group import ClusterGroup, Generation, GroupDown, Phase  # noqa: E402
from omnid.cluster.peers import DownNotice, PeerView  # noqa: E402
from omnid.cluster.session import ClusterSession  # noqa: E402
from omnid.core.crosshost import read_handover  # noqa: E402
from omnid.model.units import load_stack  # noqa: E402

pytestmark = pytest.mark.fast


def _stack(tmp_path, port: int):
    # etcd at a port nobody listens on: nothing here may need it.
    (tmp_path / "omnid.toml").write_text(f'[cluster]\netcd = ["http://127.0.0.1:9"]\nhost = "a"\n'
                                         f'address = "127.0.0.1"\npeer_port = {port}\nlease_ttl = 3\n')
    (tmp_path / "ranks.toml").write_text('exec = ["r"]\ninstances = 2\nworker_group = "tp"\ngroup_hosts = ["a", "b"]\n')
    return load_stack(tmp_path)


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _running_host(stack, downs: list) -> tuple[ClusterSession, ClusterGroup, dict]:
    """Host a in generation 4 of tp, as the old program has it just before the exec; and the
    cluster part of its handover, through JSON as in the memfd."""
    s = ClusterSession(stack.settings.cluster)
    g = ClusterGroup(s, "tp", ("a", "b"), 2, downs.append)
    await s.peers.open()
    now = time.monotonic()
    s.lease_id, s.etcd_ok, s.last_ok_sent = 0x1DEA, True, now - 0.1
    s.counters["etcd_outages"] = 2
    s.mirror.addresses["b"] = ("127.0.0.2", 9322)
    s.peers.set_secret(b"s" * 32)
    s.peers.set_peers({"a", "b"}, s.mirror.addresses)
    s.peers.beat(True, {"tp": 4})
    s.peers.views["b"] = PeerView("b", "0011223344556677", 90, time.time(), now - 0.2, True, {"tp": 4})
    g.phase, g.generation, g._last, g._since, g._lease = Phase.RUNNING, 4, 3, now - 30, s.lease_id
    g.remote_down(DownNotice("tp", 3, "b", "ranks@0 failed: exited with status 1"))
    gen = Generation("tp", 4, ("a", "b"), 0, 2, "127.0.0.1")
    d = {"session": s.handover().to_json(),
         "groups": {"tp": {"cluster": g.handover().to_json(), "admitted": None, "running": gen.to_json(),
                           "down": None, "counters": {"fenced": 0, "remote_down": 1}}}}
    return s, g, json.loads(json.dumps(d))


def test_cluster_handover_reads_back_the_same_lease_boot_heartbeat_and_generation(tmp_path):
    stack = _stack(tmp_path, _free_udp_port())

    async def run():
        s, g, d = await _running_host(stack, [])
        try:
            handed = read_handover(d, stack, {"tp": 4})
            s2 = ClusterSession(stack.settings.cluster)
            g2 = ClusterGroup(s2, "tp", ("a", "b"), 2, lambda down: None)
            s2.take_over(handed.session)
            g2.take_over(handed.groups["tp"].cluster)
            assert (s2.lease_id, s2.boot, s2.last_ok_sent, s2.counters) == (s.lease_id, s.boot, s.last_ok_sent,
                                                                            s.counters)
            assert (s2.peers.boot, s2.peers._seq, s2.peers._key) == (s.peers.boot, s.peers._seq, s.peers._key)
            assert s2.peers.views == s.peers.views and s2.mirror.addresses == s.mirror.addresses
            assert handed.session.peers.fd == s.peers.fileno()
            assert not s2.etcd_ok, "until etcd answers the next program, the handover counts as its silence"
            assert (g2.phase, g2.generation, g2._last, g2._since, g2._lease) == (Phase.RUNNING, 4, 3, g._since,
                                                                                 s.lease_id)
            assert g2._heard == g._heard and handed.groups["tp"].running.number == 4
        finally:
            s.peers.close()

    asyncio.run(run())


def test_cluster_handover_a_join_under_way_is_joined_again(tmp_path):
    stack = _stack(tmp_path, _free_udp_port())

    async def run():
        s, g, d = await _running_host(stack, [])
        s.peers.close()
        d["groups"]["tp"]["cluster"]["phase"] = "joining"
        d["groups"]["tp"]["running"] = None
        g2 = ClusterGroup(ClusterSession(stack.settings.cluster), "tp", ("a", "b"), 2, lambda down: None)
        g2.take_over(read_handover(d, stack, {"tp": 3}).groups["tp"].cluster)
        assert g2.phase is Phase.IDLE and g2._last == 3  # joins 4 again, finding its own join key

    asyncio.run(run())


def _set(d: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for p in parents:
        d = d[int(p)] if isinstance(d, list) else d[p]
    if value is _DELETE:
        del d[last]
    else:
        d[int(last) if isinstance(d, list) else last] = value


_DELETE = object()


@pytest.mark.parametrize("path, value, words", [
    ("session.lease_id", -1, "cluster.session: lease_id: expected an integer"),
    ("session.host", "b", "cluster.session: host 'b'"),
    ("session.last_ok_sent", "soon", "cluster.session: last_ok_sent: expected a finite number"),
    ("session.peers.key", "zz", "cluster.session: peers.key: expected 64 hex digits"),
    ("session.peers.views.0.heard_at", None, "peers.views[0].heard_at: expected a finite number"),
    ("session.peers.fd", 0, "cluster.session.peers.fd: fd 0"),
    ("session.counters", {"etcd_outages": 1}, "counters: expected the counters"),
    ("groups", {}, "cluster.groups: [] handed over, the stack's groups across hosts are [tp]"),
    ("groups.tp.cluster.phase", "sideways", "cluster.groups.tp.cluster: phase: 'sideways' is none of"),
    ("groups.tp.cluster.unwritten", [[0, {"host": "a", "reason": "x"}]], "unwritten[0]"),
    ("groups.tp.running.hosts", ["a", "c"], "cluster.groups.tp.running: generation 4 is of group tp on [a, c]"),
    ("groups.tp.running.number", 5, "its members' restart book says 4"),
    ("groups.tp.cluster.generation", 7, "generation 7 runs here, but 4 is open"),
    ("groups.tp.down", {"group": "tp"}, "cluster.groups.tp.down: missing or malformed 'generation'"),
    ("groups.tp.counters", _DELETE, "cluster.groups.tp: missing or malformed 'counters'"),
    ("groups.tp.running", _DELETE, "cluster.groups.tp: missing running"),
    ("session.peers.outbox", [["x", 1]], "cluster.session: peers.outbox[0]."),
    ("session.addresses", [["b", "10.0.0.2", 0]], "addresses[0].2: expected an integer from 1 to 65535"),
])
def test_cluster_handover_malformed_or_foreign_is_refused_naming_the_key(tmp_path, path, value, words):
    stack = _stack(tmp_path, _free_udp_port())

    async def run():
        s, _g, d = await _running_host(stack, [])
        try:
            bad = copy.deepcopy(d)
            _set(bad, path, value)
            with pytest.raises(ValueError) as exc:
                read_handover(bad, stack, {"tp": 4})
            assert words in str(exc.value), str(exc.value)
            read_handover(d, stack, {"tp": 4})  # the untouched one is fine
        finally:
            s.peers.close()

    asyncio.run(run())


@pytest.mark.parametrize("handover_s, fenced", [(1.0, False), (2.4, True)])
def test_cluster_handover_longer_than_the_lease_budget_fences_at_the_first_tick(tmp_path, handover_s, fenced):
    """lease_ttl 3 s, margin 0.75 s: a handover of 1 s runs on; one of 2.4 s (past 2.25 s, and
    no peer heard since) means the lease may expire unseen, so the members are killed at once."""
    stack = _stack(tmp_path, _free_udp_port())

    async def run():
        s, _g, d = await _running_host(stack, [])
        s.peers.close()
        ago = d["session"]["last_ok_sent"] - (time.monotonic() - handover_s)
        d["session"]["last_ok_sent"] -= ago
        d["session"]["peers"]["views"][0]["heard_at"] -= ago
        downs: list[GroupDown] = []
        s2 = ClusterSession(stack.settings.cluster)
        g2 = ClusterGroup(s2, "tp", ("a", "b"), 2, downs.append)
        handed = read_handover(d, stack, {"tp": 4})
        s2.take_over(handed.session)
        g2.take_over(handed.groups["tp"].cluster)
        g2.tick(time.monotonic())
        for t in list(s2._tasks):  # the down record's write to an etcd that is not there: not begun
            t.cancel()
        s2.lease_id = 0  # (nor a lease to give back)
        await s2.close()
        assert g2._unwritten == ({4: g2._unwritten[4]} if fenced else {}), "kept for the next write"
        return downs

    downs = asyncio.run(run())
    if not fenced:
        assert downs == []
    else:
        assert len(downs) == 1 and downs[0].fenced and downs[0].generation == 4, downs
        assert "a: cut off from etcd" in downs[0].reason, downs[0].reason


def test_cluster_handover_refused_when_a_file_the_session_reads_became_unsafe(tmp_path):
    """A secret (or TLS key) that others may read now is named before anything is taken over,
    not when the new program makes its session with every unit already in its hands."""
    secret = tmp_path / "peer.secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    _stack(tmp_path, _free_udp_port())
    (tmp_path / "omnid.toml").write_text((tmp_path / "omnid.toml").read_text() + 'secret_file = "peer.secret"\n')
    stack = load_stack(tmp_path)

    async def run():
        s, _g, d = await _running_host(stack, [])
        try:
            read_handover(d, stack, {"tp": 4})
            secret.chmod(0o644)
            with pytest.raises(ValueError, match=r"cluster\.secret_file.*readable by group or others"):
                read_handover(d, stack, {"tp": 4})
        finally:
            s.peers.close()

    asyncio.run(run())
