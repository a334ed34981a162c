"""omnid.cluster against a real etcd (Debian's etcd-server), with hosts that are network
namespaces (tests/netns.py). Each host runs tests/cluster_agent.py: one ClusterSession and
one ClusterGroup, whose members are real processes started per generation with the rank
environment; the tests read that environment and liveness from /proc, and cut, heal and
kill the network and etcd underneath.

A short lease (3 s) keeps these quick; every figure printed here is for reading, the
measured ones are in bench/cluster.py.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.harness import alive, wait_for
from tests.netns import HostAgent, Testbed, unavailable

pytest.importorskip("aetcd", reason="the cluster tests need the etcd client (pip install '.[cluster]')")
_why = unavailable()
# One testbed at a time (xdist group "netns"): each runs an etcd whose 3 s leases the tests time
# against, and two beds' etcds and hosts at once starve each other on two cores.
pytestmark = [pytest.mark.skipif(_why is not None, reason=f"hosts as network namespaces with etcd: {_why}"),
              pytest.mark.xdist_group("netns")]

TTL = 3


@pytest.fixture
def bed():
    b = Testbed(["a", "b"]).open()
    agents: list[HostAgent] = []
    b.agents = agents
    try:
        yield b
    finally:
        for ag in agents:
            ag.close()
        b.close()


def agent(bed: Testbed, host: str, **kw) -> HostAgent:
    kw.setdefault("hosts", ["a", "b"])
    kw.setdefault("ttl", TTL)
    ag = HostAgent(bed, host, **kw)
    bed.agents.append(ag)
    return ag


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode().split("\0") if "=" in item)


def both_running(a: HostAgent, b: HostAgent, gen: int, timeout: float = 30) -> tuple[dict, dict]:
    return a.wait("running", timeout, gen=gen), b.wait("running", timeout, gen=gen)


def both_running_after(a: HostAgent, b: HostAgent, after: int, timeout: float) -> tuple[dict, dict]:
    """Both hosts running the first generation past `after` that runs at all. A healed host whose
    lease ran out while it was joining abandons the generation it had joined under that lease
    (its join key went with the lease), so the next to run may be after+2; a skipped one must
    never have run anywhere."""
    def first(ag: HostAgent) -> dict | None:
        later = [e for e in ag.find("running") if e["gen"] > after]
        return min(later, key=lambda e: e["gen"]) if later else None
    ra, rb = wait_for(lambda: (x := first(a)) and (y := first(b)) and (x, y), timeout,
                      lambda: f"both hosts running a generation after {after} "
                              f"(a: {a.find('running')}, b: {b.find('running')}); a's log:\n{a.log_with_stacks()}\n"
                              f"b's log:\n{b.log_with_stacks()}")
    assert ra["gen"] == rb["gen"], (ra, rb)
    print(f"after generation {after}, both hosts run generation {ra['gen']}")
    return ra, rb


def gone(pids: list[int]) -> bool:
    return not any(alive(p) for p in pids)


def test_cluster_barrier_a_late_host_starts_the_generation_and_ranks_span_hosts(bed):
    a = agent(bed, "a")
    a.wait("open", 20)
    st = wait_for(lambda: "waiting for b" in (s := a.status())["group"]["reason"] and s, 20, "a waiting for b")
    assert st["group"]["hosts"] == {"a": "joined", "b": "gone"}, st
    assert "b: no omnid running there" in st["group"]["reason"]
    assert not a.find("running"), "a started a generation alone"
    b = agent(bed, "b")
    ra, rb = both_running(a, b, 1)
    ranks = {}
    for run in (ra, rb):
        for pid in run["pids"]:
            env = environ(pid)  # the kernel's copy, not the agent's report
            ranks[int(env["RANK"])] = env
    assert sorted(ranks) == [0, 1, 2, 3], ranks
    assert {e["WORLD_SIZE"] for e in ranks.values()} == {"4"}
    assert {e["MASTER_ADDR"] for e in ranks.values()} == {bed.address["a"]}
    assert {e["OMNID_GENERATION"] for e in ranks.values()} == {"1"}
    assert [ranks[r]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert [ranks[r]["LOCAL_RANK"] for r in range(4)] == ["0", "1", "0", "1"]
    assert a.status()["group"]["hosts"] == {"a": "up", "b": "up"}


def test_cluster_member_failure_on_a_stops_b_and_both_start_a_new_generation(bed):
    a, b = agent(bed, "a"), agent(bed, "b")
    ra, rb = both_running(a, b, 1)
    a.send(cmd="fail", index=1)
    failed = a.wait("failed", 10)
    down = b.wait("down", 10, gen=1)
    assert down["reason"] == "worker group tp generation 1 is down: a: ranks@1 failed: killed by SIGKILL", down
    assert gone(rb["pids"]), "b's members of generation 1 survived a's failure"
    print(f"failure on a -> b's members stopped: {(down['stopped'] - failed['t']) * 1000:.1f} ms")
    ra2, rb2 = both_running(a, b, 2)
    assert not set(ra2["pids"] + rb2["pids"]) & set(ra["pids"] + rb["pids"])
    assert {environ(p)["OMNID_GENERATION"] for p in ra2["pids"] + rb2["pids"]} == {"2"}


def test_cluster_host_daemon_killed_the_other_stops_when_its_lease_expires(bed):
    a, b = agent(bed, "a"), agent(bed, "b")
    ra, rb = both_running(a, b, 1)
    t = time.time()
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    wait_for(lambda: gone(ra["pids"]), 5, "a's members to die with a's daemon")
    down = b.wait("down", TTL + 3, gen=1)
    assert "a is gone (its etcd lease ended)" in down["reason"] or "no heartbeat from a" in down["reason"], down
    assert down["t"] - t <= TTL + 1, f"b noticed a gone after {down['t'] - t:.2f} s (lease {TTL} s)"
    assert gone(rb["pids"])
    st = wait_for(lambda: (s := b.status())["group"]["state"] == "joining" and s, 10, "b waiting in generation 2")
    assert st["group"]["hosts"]["a"] == "gone", st
    a2 = agent(bed, "a")  # the host comes back: a new daemon, a new generation
    both_running(a2, b, 2, timeout=TTL + 20)


def test_cluster_partition_cut_off_host_fences_before_its_lease_expires_then_heals(bed):
    a, b = agent(bed, "a"), agent(bed, "b")
    ra, rb = both_running(a, b, 1)
    t_cut = bed.cut("a")
    da = a.wait("down", TTL + 2, gen=1)
    db = b.wait("down", TTL + 3, gen=1)
    assert da["fenced"] and "a: cut off from etcd" in da["reason"] and "and from b" in da["reason"], da
    assert gone(ra["pids"]) and gone(rb["pids"])
    # a stopped its own ranks before b gave the generation up: never a rank of an abandoned generation.
    assert da["stopped"] < db["t"], (da, db)
    assert da["stopped"] - t_cut < TTL and da["kill_by_in_s"] > 0, da
    print(f"partition -> a fenced after {da['stopped'] - t_cut:.2f} s; b stopped after {db['t'] - t_cut:.2f} s "
          f"(lease {TTL} s)")
    assert not a.find("running", gen=2) and not b.find("running", gen=2)
    bed.heal("a")
    ra2, rb2 = both_running_after(a, b, 1, timeout=TTL + 20)
    ranks = sorted(int(environ(p)["RANK"]) for p in ra2["pids"] + rb2["pids"])
    assert ranks == [0, 1, 2, 3]


def test_cluster_cut_off_from_etcd_only_fences_while_its_peer_reaches_etcd(bed):
    a, b = agent(bed, "a"), agent(bed, "b")
    ra, rb = both_running(a, b, 1)
    t_cut = bed.cut("a", peers=False)
    da = a.wait("down", TTL + 2, gen=1)
    assert da["fenced"] and "while b reaches it" in da["reason"], da
    db = b.wait("down", TTL + 3, gen=1)
    assert da["stopped"] < db["t"] and da["stopped"] - t_cut < TTL, (da, db)
    bed.heal("a")
    both_running_after(a, b, 1, timeout=TTL + 20)


def test_cluster_etcd_down_for_everyone_keeps_a_healthy_group_running(bed):
    a, b = agent(bed, "a"), agent(bed, "b")
    ra, rb = both_running(a, b, 1)
    pids = ra["pids"] + rb["pids"]
    bed.kill_etcd()
    wait_for(lambda: "unreachable" in a.status()["session"]["etcd"] and "unreachable" in b.status()["session"]["etcd"],
             TTL + 5, "both hosts to see etcd unreachable")
    # Past the moment a cut-off host would fence (lease_ttl): an observation window, not a wait.
    deadline = time.monotonic() + TTL * 1.5
    while time.monotonic() < deadline:
        assert not a.find("down") and not b.find("down"), (a.events[-2:], b.events[-2:])
        assert all(alive(p) for p in pids)
        time.sleep(0.1)
    st = a.status()
    assert st["group"]["state"] == "running" and st["session"]["peers"]["b"]["etcd_ok"] is False, st
    bed.start_etcd()
    wait_for(lambda: a.status()["session"]["etcd"] == "ok" and b.status()["session"]["etcd"] == "ok", 20,
             "both hosts to reach etcd again")
    assert all(alive(p) for p in pids) and not a.find("down") and not b.find("down"), (a.events[-3:], b.events[-3:], a.log())
    assert sorted(int(environ(p)["RANK"]) for p in pids) == [0, 1, 2, 3]  # no duplicate rank
    # and the group still works as one after it
    a.send(cmd="fail", index=0)
    both_running(a, b, 2)


def test_cluster_no_new_generation_starts_while_etcd_is_down(bed):
    a, b = agent(bed, "a"), agent(bed, "b")
    both_running(a, b, 1)
    bed.kill_etcd()
    wait_for(lambda: "unreachable" in a.status()["session"]["etcd"], TTL + 5, "a to see etcd unreachable")
    a.send(cmd="fail", index=1)
    down = b.wait("down", 5, gen=1)  # told directly by a, without etcd
    assert "a: ranks@1 failed: killed by SIGKILL" in down["reason"], down
    deadline = time.monotonic() + 2.0  # observation window: nothing may start without etcd
    while time.monotonic() < deadline:
        assert not a.find("running", gen=2) and not b.find("running", gen=2)
        time.sleep(0.1)
    bed.start_etcd()
    ra, rb = both_running(a, b, 2, timeout=30)
    assert sorted(int(environ(p)["RANK"]) for p in ra["pids"] + rb["pids"]) == [0, 1, 2, 3]


@pytest.mark.parametrize("b_kw, words", [
    ({"local": 3}, "member counts differ between hosts: "),
    ({"hosts": ["a", "b", "c"]}, "group_hosts differ between hosts: "),
])
def test_cluster_hosts_that_disagree_are_refused_on_every_host(bed, b_kw, words):
    a, b = agent(bed, "a"), agent(bed, "b", **b_kw)
    ea, eb = a.wait("refused", 20), b.wait("refused", 20)
    assert words in ea["reason"] and words in eb["reason"], (ea, eb)
    assert ea["reason"].startswith("worker group tp: ")
    assert not a.find("running") and not b.find("running")


def test_cluster_hostile_keys_and_datagrams_are_ignored(bed):
    prefix = f"/omnid/t{bed.id}"
    big = "x" * 200_000
    for key, value in [
        (f"{prefix}/groups/tp/current", "garbage"),
        (f"{prefix}/groups/tp/gen/1/down", "{not json"),
        (f"{prefix}/groups/tp/gen/1/join/mallory",
         '{"hosts": ["a", "b"], "local_size": 2, "address": "10.9.9.9", "boot": "0011223344556677"}'),
        (f"{prefix}/hosts/evil", big),
        (f"{prefix}/whatever/else", "x"),
        (f"{prefix}/groups/tp/gen/999999999999999999999/down", "{}"),
    ]:
        bed.etcdctl("put", key, stdin=value.encode()) if len(value) > 1000 else bed.etcdctl("put", key, value)
    a, b = agent(bed, "a"), agent(bed, "b")
    ra, rb = a.wait("running", 30), b.wait("running", 30)
    assert ra["gen"] == rb["gen"]
    # more hostile values while running, and datagrams from outside
    bed.etcdctl("put", f"{prefix}/groups/tp/gen/{ra['gen']}/join/zed", "[]")
    sender = bed.popen("b", [sys.executable, "-c",
                             "import socket,sys\n"
                             "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                             "for d in (b'x'*2000, b'OMNID-HB1'+b'0'*40, b'hello'):\n"
                             "    s.sendto(d,(sys.argv[1],9322))\n", bed.address["a"]])
    assert sender.wait(10) == 0
    # All three counted, not the first one or two: a status taken between them said 2 (load 15).
    st = wait_for(lambda: sum((s := a.status())["session"]["datagrams_dropped"].values()) >= 3 and s, 10,
                  lambda: f"a to count the three datagrams: {a.status()['session'].get('datagrams_dropped')}")
    assert st["session"]["hostile_values"] >= 3, st
    assert a.proc.poll() is None and b.proc.poll() is None
    log = a.log()
    assert "Traceback" not in log, log
    assert log.count("etcd value ignored") == len(set(line.split("key=")[1].split()[0] for line in log.splitlines()
                                                       if "etcd value ignored" in line)), log
    # still one group: a failure still takes both down and both come back
    a.send(cmd="fail", index=0)
    b.wait("down", 10, gen=ra["gen"])
    both_running(a, b, ra["gen"] + 1)


def test_cluster_operator_stop_on_one_host_stops_the_other_which_then_waits(bed):
    a, b = agent(bed, "a"), agent(bed, "b")
    ra, rb = both_running(a, b, 1)
    a.send(cmd="stop")
    down = b.wait("down", 10, gen=1)
    assert "a: stopped by the operator" in down["reason"], down
    wait_for(lambda: gone(ra["pids"] + rb["pids"]), 5, "every member stopped")
    st = wait_for(lambda: "waiting for a" in (s := b.status())["group"]["reason"] and s, 10, "b waiting for a")
    assert st["group"]["hosts"]["a"] == "waiting", st
    a.send(cmd="start")
    both_running(a, b, 2)


def test_cluster_two_daemons_claiming_one_host_name_the_second_is_refused(bed):
    a = agent(bed, "a")
    a.wait("open", 20)
    wait_for(lambda: a.status()["session"]["etcd"] == "ok", 20, "a holding its lease")
    # b's namespace, a's name: a second machine configured as host "a" too
    dup = _agent_named(bed, "b", "a")
    bed.agents.append(dup)
    st = wait_for(lambda: (s := dup.status())["session"]["refused"] and s, TTL + 10, "the second 'a' to be refused")
    assert "another omnid holds host name 'a'" in st["session"]["refused"], st


def _agent_named(bed: Testbed, ns_host: str, name: str) -> HostAgent:
    """An agent in ns_host's namespace that calls itself `name`."""
    ag = HostAgent.__new__(HostAgent)
    real_ns, real_addr = bed.ns.get(name), bed.address.get(name)
    bed.ns[name], bed.address[name] = bed.ns[ns_host], bed.address[ns_host]
    try:
        HostAgent.__init__(ag, bed, name, hosts=["a", "b"], ttl=TTL)
    finally:
        bed.ns[name], bed.address[name] = real_ns, real_addr
    return ag


@pytest.mark.skipif(shutil.which("openssl") is None, reason="making test certificates needs openssl")
def test_cluster_over_tls_with_client_certificates(bed):
    tls = bed.make_tls()
    bed.restart_etcd_with_tls(tls)
    a, b = agent(bed, "a", tls=tls), agent(bed, "b", tls=tls)
    both_running(a, b, 1)
    # without a client certificate etcd refuses the connection: named, and nothing starts
    anon = HostAgent(bed, "a", hosts=["a", "c"], group="other", tls={"ca": tls["ca"]},
                     prefix=f"/omnid/anon{bed.id}", peer_port=9323)
    bed.agents.append(anon)
    wait_for(lambda: (s := anon.status())["session"]["etcd"] != "ok" and "etcd does not answer" in anon.log()
                  and s, 20, "the agent without a client certificate to say etcd does not answer")
    assert not anon.find("running"), anon.events
    assert f"etcd {bed.etcd_url.split('//')[1]}" in anon.log(), anon.log()


def test_cluster_jitter_within_the_lease_budget_is_no_failure(bed):
    if not bed.netem_available():
        pytest.skip("this kernel has no sch_netem (tc qdisc netem): delay and loss cannot be made here")
    a, b = agent(bed, "a"), agent(bed, "b")
    ra, rb = both_running(a, b, 1)
    for dev in ("eth0", "eth1"):  # the peer and the etcd network of host a
        subprocess.run(["ip", "netns", "exec", bed.ns["a"], "tc", "qdisc", "add", "dev", dev, "root", "netem",
                        "delay", "100ms", "50ms", "loss", "10%"], check=True, capture_output=True)
    deadline = time.monotonic() + TTL * 2  # an observation window: nothing may go down
    while time.monotonic() < deadline:
        assert not a.find("down") and not b.find("down"), (a.events[-2:], b.events[-2:])
        time.sleep(0.1)
    assert all(alive(p) for p in ra["pids"] + rb["pids"])
