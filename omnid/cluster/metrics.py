"""Prometheus lines for a stack across hosts (/metrics, omnid(8) METRICS): generations,
fencing, the etcd connection, hostile values and datagrams. Rendered by omnid.health
only when `[cluster]` is set."""

from __future__ import annotations

from collections.abc import Callable


def render(crosshost, metric: Callable[[str, str, str], None], lbl: Callable[..., str]) -> list[str]:
    """`crosshost`: omnid.core.crosshost.CrossHost."""
    out: list[str] = []
    per_group = crosshost.metrics()
    for name, kind, key, help_ in (
            ("omnid_group_generations_total", "counter", "generations", "generations of a group across hosts started here"),
            ("omnid_group_fenced_total", "counter", "fenced", "times this host fenced a group's members (cut off)"),
            ("omnid_group_down_total", "counter", "down", "generations of a group across hosts that went down"),
    ):
        metric(name, kind, help_)
        out.extend(f"{name}{lbl(group=g)} {c[key]}" for g, c in per_group.items())
    metric("omnid_group_generation", "gauge", "the generation a group across hosts runs here (0: none)")
    out.extend(f"omnid_group_generation{lbl(group=g)} {lk.cluster.running_generation()}"
               for g, lk in crosshost.links.items())
    s = crosshost.session
    metric("omnid_cluster_etcd_up", "gauge", "1 while etcd answers this host's keepalives")
    out.append(f"omnid_cluster_etcd_up {int(s.etcd_ok)}")
    metric("omnid_cluster_etcd_outages_total", "counter", "times etcd stopped answering")
    out.append(f"omnid_cluster_etcd_outages_total {s.counters['etcd_outages']}")
    metric("omnid_cluster_lease_expired_total", "counter", "times this host's etcd lease expired")
    out.append(f"omnid_cluster_lease_expired_total {s.counters['lease_expired']}")
    metric("omnid_cluster_hostile_values_total", "counter", "values under the prefix ignored (malformed, oversized, foreign)")
    out.append(f"omnid_cluster_hostile_values_total {s.hostile.count}")
    metric("omnid_cluster_datagrams_total", "counter", "peer heartbeat datagrams, accepted or dropped by reason")
    out.append(f"omnid_cluster_datagrams_total{lbl(outcome='accepted')} {s.peers.received}")
    out.extend(f"omnid_cluster_datagrams_total{lbl(outcome=why)} {n}" for why, n in sorted(s.peers.dropped.items()))
    return out
