"""Prometheus families for a stack across hosts (/metrics, omnid(8) METRICS): generations,
fencing, the etcd connection, hostile values and datagrams. Written by omnid.api.health onto its
page (omnid.promtext.Page) only when `[cluster]` is set."""

from __future__ import annotations

from omnid.base import promtext


def write(crosshost, page: promtext.Page) -> None:
    """`crosshost`: omnid.core.crosshost.CrossHost; `page`: omnid.promtext.Page."""
    per_group = crosshost.metrics()
    for name, key, help_ in (
            ("omnid_group_generations_total", "generations", "generations of a group across hosts started here"),
            ("omnid_group_fenced_total", "fenced", "times this host fenced a group's members (cut off)"),
            ("omnid_group_down_total", "down", "generations of a group across hosts that went down"),
    ):
        fam = page.counter(name, help_)
        for g, c in per_group.items():
            fam.add(c[key], group=g)
    fam = page.gauge("omnid_group_generation", "the generation a group across hosts runs here (0: none)")
    for g, lk in crosshost.links.items():
        fam.add(lk.cluster.running_generation(), group=g)
    s = crosshost.session
    page.gauge("omnid_cluster_etcd_up", "1 while etcd answers this host's keepalives").add(int(s.etcd_ok))
    page.counter("omnid_cluster_etcd_outages_total", "times etcd stopped answering").add(s.counters["etcd_outages"])
    page.counter("omnid_cluster_lease_expired_total", "times this host's etcd lease expired").add(
        s.counters["lease_expired"])
    page.counter("omnid_cluster_hostile_values_total",
                 "values under the prefix ignored (malformed, oversized, foreign)").add(s.hostile.count)
    fam = page.counter("omnid_cluster_datagrams_total", "peer heartbeat datagrams, accepted or dropped by reason")
    fam.add(s.peers.received, outcome="accepted")
    for why, n in sorted(s.peers.dropped.items()):
        fam.add(n, outcome=why)
