"""A stack across hosts, the parts that need no network: `[cluster]` settings and their named
errors, the keys and hostile values under the prefix, the fencing rule, and the peer
heartbeat's checks on datagrams (on loopback)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import socket
import time
from pathlib import Path

import pytest

from omnid.cluster import keys as K
from omnid.cluster.fencing import Action, judge
from omnid.cluster.peers import MAGIC, DownNotice, PeerLink, PeerView, derive_key
from omnid.model.cluster import ClusterSettings, Endpoint, parse_cluster
from omnid.model.units import check_stack, load_stack

pytestmark = pytest.mark.fast


# ------------------------------------------------------------------ settings


def _settings(tmp_path: Path, text: str) -> list[str]:
    (tmp_path / "w.toml").write_text('exec = ["true"]\n')
    (tmp_path / "omnid.toml").write_text(text)
    return [str(e) for e in check_stack(tmp_path)]


def test_cluster_settings_parsed_with_defaults(tmp_path):
    (tmp_path / "w.toml").write_text('exec = ["true"]\n')
    (tmp_path / "omnid.toml").write_text('[cluster]\netcd = ["http://10.0.0.1:2379", "http://10.0.0.5:2379"]\n'
                                         'host = "node-a"\naddress = "10.0.0.2"\n')
    c = load_stack(tmp_path).settings.cluster
    assert c.endpoints == (Endpoint("10.0.0.1", 2379), Endpoint("10.0.0.5", 2379))
    assert (c.host, c.address, c.lease_ttl, c.tls) == ("node-a", "10.0.0.2", 5, False)
    assert c.prefix == "/omnid/" + tmp_path.name


def test_no_cluster_section_means_no_cluster(tmp_path):
    (tmp_path / "w.toml").write_text('exec = ["true"]\n')
    assert load_stack(tmp_path).settings.cluster is None


@pytest.mark.parametrize("text, key, words", [
    ('[cluster]\naddress = "10.0.0.2"\n', "cluster.etcd", "missing"),
    ('[cluster]\netcd = ["http://e:2379"]\n', "cluster.address", "missing"),
    ('[cluster]\netcd = []\naddress = "10.0.0.2"\n', "cluster.etcd", "non-empty array"),
    ('[cluster]\netcd = ["ftp://e:2379"]\naddress = "10.0.0.2"\n', "cluster.etcd", "http://HOST:PORT"),
    ('[cluster]\netcd = ["http://e"]\naddress = "10.0.0.2"\n', "cluster.etcd", "http://HOST:PORT"),
    ('[cluster]\netcd = ["http://e:99999"]\naddress = "10.0.0.2"\n', "cluster.etcd", "not a URL"),
    ('[cluster]\netcd = ["http://e:1", "https://f:2"]\naddress = "10.0.0.2"\n', "cluster.etcd", "mixes"),
    ('[cluster]\netcd = ["http://e:1/v3"]\naddress = "10.0.0.2"\n', "cluster.etcd", "no path"),
    ('[cluster]\netcd = ["http://e:1"]\naddress = "node-b.example"\n', "cluster.address", "numeric IP"),
    ('[cluster]\netcd = ["http://e:1"]\naddress = "0.0.0.0"\n', "cluster.address", "own address"),
    ('[cluster]\netcd = ["http://e:1"]\naddress = "10.0.0.2"\nlease_ttl = 1\n', "cluster.lease_ttl", "from 2"),
    ('[cluster]\netcd = ["http://e:1"]\naddress = "10.0.0.2"\nlease_ttl = 2.5\n', "cluster.lease_ttl", "whole seconds"),
    ('[cluster]\netcd = ["http://e:1"]\naddress = "10.0.0.2"\nlease_ttl = true\n', "cluster.lease_ttl", "boolean"),
    ('[cluster]\netcd = ["http://e:1"]\naddress = "10.0.0.2"\nhost = "a/b"\n', "cluster.host", "host name"),
    ('[cluster]\netcd = ["http://e:1"]\naddress = "10.0.0.2"\nprefix = "omnid x"\n', "cluster.prefix", "key prefix"),
    ('[cluster]\netcd = ["http://e:1"]\naddress = "10.0.0.2"\npeer_port = 0\n', "cluster.peer_port", "UDP port"),
    ('[cluster]\netcd = ["http://e:1"]\naddress = "10.0.0.2"\nleasettl = 3\n', "cluster.leasettl", "unknown key"),
    ('[cluster]\netcd = ["http://e:1"]\naddress = "10.0.0.2"\nca = "ca.pem"\n', "cluster.ca", "cannot read"),
    ('cluster = 3\n', "cluster", "expected a table"),
])
def test_cluster_settings_mistakes_are_named(tmp_path, text, key, words):
    errors = _settings(tmp_path, text)
    assert any(f"omnid.toml: {key}: " in e and words in e for e in errors), errors


def test_cluster_tls_files_are_checked_like_root_reads_them(tmp_path):
    for name in ("ca.pem", "c.pem", "k.pem"):
        (tmp_path / name).write_text("x")
        os.chmod(tmp_path / name, 0o600)
    base = '[cluster]\netcd = ["https://e:2379"]\naddress = "10.0.0.2"\nca = "ca.pem"\n'
    assert _settings(tmp_path, base + 'cert = "c.pem"\nkey = "k.pem"\n') == []
    os.chmod(tmp_path / "k.pem", 0o644)
    assert any("cluster.key" in e and "readable by group or others" in e
               for e in _settings(tmp_path, base + 'cert = "c.pem"\nkey = "k.pem"\n'))
    os.chmod(tmp_path / "k.pem", 0o600)
    os.chmod(tmp_path / "ca.pem", 0o666)
    assert any("cluster.ca" in e and "writable by group or others" in e for e in _settings(tmp_path, base))
    os.chmod(tmp_path / "ca.pem", 0o644)
    assert any("cluster.key" in e and "go together" in e for e in _settings(tmp_path, base + 'cert = "c.pem"\n'))
    plain = '[cluster]\netcd = ["http://e:2379"]\naddress = "10.0.0.2"\nca = "ca.pem"\n'
    assert any("cluster.ca" in e and "https://" in e for e in _settings(tmp_path, plain))


def test_cluster_settings_parse_collects_every_error(tmp_path):
    errors: list = []
    got = parse_cluster(tmp_path / "omnid.toml", {"etcd": 3, "address": "x", "lease_ttl": 0}, tmp_path, errors)
    assert got is None
    assert {e.key for e in errors} == {"cluster.etcd", "cluster.address", "cluster.lease_ttl"}, [str(e) for e in errors]


# ------------------------------------------------------------------ keys and hostile values


def test_keys_of_ours_are_taken_apart_and_others_refused():
    ks = K.KeySpace("/omnid/s")
    assert ks.parse(ks.join("tp", 7, "node-b")) == K.Key("join", host="node-b", group="tp", generation=7)
    assert ks.parse(ks.down("tp", 7)) == K.Key("down", group="tp", generation=7)
    assert ks.parse(ks.current("tp")).kind == "current"
    assert ks.parse(ks.host("node-a")).kind == "host"
    for foreign in (b"/omnid/s/zzz", b"/omnid/s/groups/tp/gen/x/down", b"/omnid/s/groups/tp/gen/0/down",
                    b"/omnid/s/groups/tp/gen/1/join/a/b", b"/omnid/s/hosts/\xff", b"/omnid/s/" + b"a" * 600,
                    b"/omnid/s/groups/tp/gen/99999999999999999/down"):
        with pytest.raises(K.HostileValue):
            ks.parse(foreign)


@pytest.mark.parametrize("parser, value", [
    (K.parse_join, b"not json"),
    (K.parse_join, b"[1, 2]"),
    (K.parse_join, b'{"hosts": ["a", "a"], "local_size": 2, "address": "10.0.0.1", "boot": "00112233"}'),
    (K.parse_join, b'{"hosts": ["a"], "local_size": 0, "address": "10.0.0.1", "boot": "00112233"}'),
    (K.parse_join, b'{"hosts": ["a"], "local_size": 2, "address": "node-a", "boot": "00112233"}'),
    (K.parse_down, b'{"host": "a", "reason": "x\\u0000y"}'),
    (K.parse_down, b'{"host": "a b", "reason": "x"}'),
    (K.parse_down, b'{"host": "a", "reason": "x", "final": "yes"}'),
    (K.parse_current, b'{"generation": -1}'),
    (K.parse_current, b'{"generation": true}'),
    (K.parse_current, b"[" * 100000),
    (K.parse_host, b'{"address": "10.0.0.1", "peer_port": 70000, "boot": "00112233", "pid": 1}'),
    (K.parse_down, b'{"host": "a", "reason": "' + b"x" * 5000 + b'"}'),
])
def test_hostile_values_are_refused_with_a_reason(parser, value):
    with pytest.raises(K.HostileValue) as e:
        parser(value)
    assert str(e.value)


def test_hostile_log_says_once_per_key_and_counts(capsys):
    h = K.HostileLog()
    for _ in range(5):
        h.ignored(b"/p/x", "not ours")
    assert h.count == 5


# ------------------------------------------------------------------ fencing


def _view(heard_at: float, etcd_ok: bool) -> PeerView:
    return PeerView("b", "00112233", 1, time.time(), heard_at, etcd_ok)


@pytest.mark.parametrize("etcd_ok, last_ok, peer, expect", [
    (True, 9.9, _view(9.9, True), Action.RUN),  # all well
    (False, 8.0, None, Action.RUN),  # etcd silent 2 s of a 10 s lease: a blip
    (False, 1.0, _view(9.9, False), Action.HOLD),  # etcd down for both: run on
    (False, 1.0, _view(9.9, True), Action.FENCE),  # the peer reaches etcd, we do not: we are cut off
    (False, 1.0, _view(2.0, False), Action.FENCE),  # peer unheard for 8 s: cut off from both
    (False, 1.0, None, Action.FENCE),
    (True, 9.9, _view(1.0, True), Action.DOWN),  # etcd fine, peer silent 9 s: hosts cannot talk
])
def test_fencing_rule(etcd_ok, last_ok, peer, expect):
    v = judge(peers={"b": peer}, now=10.0, etcd_ok=etcd_ok, last_ok_sent=last_ok, ttl=5, margin=1.25,
              peer_timeout=2.5, peer_down_after=7.5, running_since=0.0)
    assert v.action is expect, v
    if expect is Action.FENCE:
        assert v.reason.startswith("cut off from etcd") and "lease (5 s)" in v.reason


def test_fencing_gives_a_new_generation_time_to_hear_its_peers():
    v = judge(peers={"b": None}, now=10.0, etcd_ok=True, last_ok_sent=9.9, ttl=5, margin=1.25,
              peer_timeout=2.5, peer_down_after=7.5, running_since=9.0)
    assert v.action is Action.RUN


# ------------------------------------------------------------------ peer heartbeat


def test_peer_datagrams_checked_and_hostile_ones_dropped_and_counted():
    async def run():
        notices: list[DownNotice] = []
        a = PeerLink(host="a", address="127.0.0.1", port=0, prefix="/omnid/s", on_down=notices.append)
        b = PeerLink(host="b", address="127.0.0.1", port=0, prefix="/omnid/s", on_down=lambda n: None)
        await a.open()
        await b.open()
        try:
            a_port = a._transport.get_extra_info("sockname")[1]
            b_port = b._transport.get_extra_info("sockname")[1]
            for link in (a, b):
                link.set_secret(b"s" * 32)
            a.set_peers({"b"}, {"b": ("127.0.0.1", b_port)})
            b.set_peers({"a"}, {"a": ("127.0.0.1", a_port)})
            b.beat(True, {"tp": 3})
            b.notify_down(DownNotice("tp", 3, "b", "ranks@1 failed: killed by SIGKILL"), ("a", "b"), True, {"tp": 3})
            deadline = time.monotonic() + 5
            while (not notices or a.received < 2) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert notices == [DownNotice("tp", 3, "b", "ranks@1 failed: killed by SIGKILL")]
            assert a.views["b"].groups == {"tp": 3} and a.views["b"].etcd_ok

            raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            key = derive_key(b"s" * 32, "/omnid/s")

            def signed(body: dict) -> bytes:
                data = json.dumps(body).encode()
                return MAGIC + hmac.new(key, data, hashlib.sha256).digest() + data

            good = {"h": "b", "b": b.boot, "s": 1, "t": time.time(), "e": True, "g": {}, "d": []}
            hostile = [
                b"x" * 3000,  # oversized
                b"hello",  # not ours
                MAGIC + b"\0" * 32 + b"{}",  # bad MAC
                MAGIC + hmac.new(derive_key(b"s" * 32, "/omnid/other"), b"{}", hashlib.sha256).digest() + b"{}",
                signed({"h": "b"}),  # signed, wrong shape
                signed(dict(good, h="mallory")),  # not a peer
                signed(dict(good, t=time.time() - 3600)),  # an hour old
                signed(good),  # replay: seq 1 of b's boot, already past
                signed(dict(good, s=10**6, d=[["tp", 3, "x" * 5000]])),  # notice too long
            ]
            for d in hostile:
                raw.sendto(d, ("127.0.0.1", a_port))
            deadline = time.monotonic() + 5
            while sum(a.dropped.values()) < len(hostile) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            raw.close()
            assert a.dropped.get("malformed", 0) >= 4 and a.dropped.get("bad-mac") == 2, a.dropped
            assert a.dropped.get("foreign") == 1 and a.dropped.get("clock") == 1 and a.dropped.get("replay") == 1, a.dropped
            assert len(notices) == 1
        finally:
            a.close()
            b.close()

    asyncio.run(run())


def test_cluster_settings_object_is_frozen():
    c = ClusterSettings(endpoints=(Endpoint("e", 1),), tls=False, host="a", address="10.0.0.1", lease_ttl=3,
                        prefix="/omnid/x")
    with pytest.raises(AttributeError):
        c.host = "b"  # type: ignore[misc]


# ------------------------------------------------------------------ group_hosts


_CLUSTER = '[cluster]\netcd = ["http://10.0.0.1:2379"]\nhost = "node-a"\naddress = "10.0.0.2"\n'


def test_group_hosts_parsed_on_every_member(tmp_path):
    (tmp_path / "omnid.toml").write_text("exit_when_failed = true\n" + _CLUSTER)
    (tmp_path / "ranks.toml").write_text('exec = ["r"]\ninstances = 2\nworker_group = "tp"\n'
                                         'group_hosts = ["node-a", "node-b"]\n')
    stack = load_stack(tmp_path)
    assert stack["ranks@1"].group_hosts == ("node-a", "node-b")
    assert stack.settings.exit_when_failed is True


@pytest.mark.parametrize("settings, unit, key, words", [
    (_CLUSTER, 'exec = ["r"]\ngroup_hosts = ["node-a"]\n', "group_hosts", "needs worker_group"),
    ("", 'exec = ["r"]\nworker_group = "tp"\ngroup_hosts = ["node-a"]\n', "group_hosts", "needs [cluster]"),
    (_CLUSTER, 'exec = ["r"]\nworker_group = "tp"\ngroup_hosts = ["node-b", "node-c"]\n', "group_hosts",
     "this host (node-a, cluster.host) is not among"),
    (_CLUSTER, 'exec = ["r"]\nworker_group = "tp"\ngroup_hosts = ["node-a", "node-a"]\n', "group_hosts", "each host once"),
    (_CLUSTER, 'exec = ["r"]\nworker_group = "tp"\ngroup_hosts = ["node a"]\n', "group_hosts", "host names"),
    (_CLUSTER, 'exec = ["r"]\nworker_group = "tp"\ngroup_hosts = []\n', "group_hosts", "host names"),
    ("exit_when_failed = 1\n" + _CLUSTER, 'exec = ["r"]\n', "exit_when_failed", "true or false"),
])
def test_group_hosts_mistakes_are_named(tmp_path, settings, unit, key, words):
    (tmp_path / "omnid.toml").write_text(settings)
    (tmp_path / "ranks.toml").write_text(unit)
    errors = [str(e) for e in check_stack(tmp_path)]
    assert any(f": {key}: " in e and words in e for e in errors), errors


def test_group_hosts_differ_between_members_of_one_group(tmp_path):
    (tmp_path / "omnid.toml").write_text(_CLUSTER)
    (tmp_path / "a.toml").write_text('exec = ["r"]\nworker_group = "tp"\ngroup_hosts = ["node-a", "node-b"]\n')
    (tmp_path / "b.toml").write_text('exec = ["r"]\nworker_group = "tp"\ngroup_hosts = ["node-a"]\n')
    errors = [str(e) for e in check_stack(tmp_path)]
    assert any("group_hosts" in e and "spans one set of hosts" in e for e in errors), errors
