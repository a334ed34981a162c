"""Should this host's members of a cross-host generation keep running? A pure function of
what this host knows (omnid(8), CLUSTER: "Fencing" and "When etcd is down"):

- etcd answers: etcd decides (failures and gone hosts arrive through it). One more check: a
  peer that sent no heartbeat for `peer_timeout` while etcd answers is a broken network
  between the hosts; the generation is down (its ranks would wait in a collective).
- etcd has not answered, but the lease cannot have expired yet: run on (a blip).
- the lease could expire soon (`margin` before the earliest moment etcd may drop it) and every
  peer of the group is heard directly and none of them reaches etcd either: etcd is down for
  everyone. Nobody can give this generation up (no host can write to etcd), so run on; no
  new generation starts until etcd is back.
- otherwise (a peer unheard, or a peer that reaches etcd while we do not): this host is the
  one cut off, and the others will give the generation up when its lease expires. Fence:
  stop the members now, before that moment.
- (in omnid.cluster.group) after etcd was down for everyone, the first peer to reach it again
  does not make the others fence at once: a restarted etcd renews every lease, so each host
  gets a lease's time from that moment to reconnect, and fences only if it cannot.

The trade-off: the direct signal is only as good as the hosts' own network. A host that
hears its peers but not etcd, while they do not hear etcd either, runs on for as long as
that lasts; if etcd was in fact up for a host outside the group, nothing of the group is
affected (only the group's hosts act on it). A host that cannot hear its peers fences even
when etcd is merely down for everyone: losing both signals at once is a partition as far
as it can tell, and stopping is the side that can never run two generations at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from omnid.cluster.peers import PeerView


class Action(Enum):
    RUN = "run"  # nothing to do
    HOLD = "hold"  # etcd is down for every host of the group: run on, start nothing new
    FENCE = "fence"  # this host is cut off: stop the members before the lease can expire
    DOWN = "down"  # etcd answers but a peer is unreachable directly: the generation is down


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str = ""


def judge(*, peers: Mapping[str, PeerView | None], now: float, etcd_ok: bool, last_ok_sent: float,
          ttl: float, margin: float, peer_timeout: float, peer_down_after: float, running_since: float) -> Verdict:
    """`peers`: each peer host's last heartbeat (None: none yet). `last_ok_sent`: when the last
    keepalive that etcd answered was sent (the lease expires no earlier than that plus `ttl`).
    A peer counts as heard for `peer_timeout`; one silent for `peer_down_after` while etcd
    answers takes the generation down. `running_since`: when this generation started here."""
    def silent_for(view: PeerView | None) -> float:
        return now - max(view.heard_at if view else running_since, running_since)

    if etcd_ok:
        lost = [p for p, v in peers.items() if silent_for(v) > peer_down_after]
        if lost:
            return Verdict(Action.DOWN, f"no heartbeat from {', '.join(sorted(lost))} for "
                                        f"{peer_down_after:g} s while etcd answers: the hosts cannot reach each "
                                        "other (UDP peer_port)")
        return Verdict(Action.RUN)
    silent = now - last_ok_sent
    if now < last_ok_sent + ttl - margin:
        return Verdict(Action.RUN)
    heard = {p: v for p, v in peers.items() if v is not None and now - v.heard_at <= peer_timeout}
    unheard = sorted(p for p in peers if p not in heard)
    with_etcd = sorted(p for p, v in heard.items() if v.etcd_ok)
    if not unheard and not with_etcd:
        return Verdict(Action.HOLD, f"etcd unreachable from every host of the group for {silent:.1f} s: "
                                    "running on; no new generation until it is back")
    if with_etcd:
        why = f"while {', '.join(with_etcd)} {'reaches' if len(with_etcd) == 1 else 'reach'} it"
    else:
        why = f"and from {', '.join(unheard)}"
    return Verdict(Action.FENCE, f"cut off from etcd for {silent:.1f} s {why}; fenced before its "
                                 f"lease ({ttl:g} s) could expire")
