"""A stack across hosts (omnid(8), CLUSTER): one omnid per host, meeting in etcd v3.

- settings  the `[cluster]` table of omnid.toml (no etcd client imported: `omnid check` stays light)
- keys      the keys under the stack's prefix and their checked values
- etcd      the one door to etcd, through the aetcd client library (why aetcd: its docstring)
- peers     authenticated UDP heartbeats between the hosts' daemons: the second signal
- fencing   the pure rule that decides whether a host's members may keep running
- mirror    the stack's keys as last seen (a snapshot, then the watch), values checked once
- session   one per daemon: lease, keepalive, watch, heartbeat, the fencing clock
- group     one per cross-host worker group: the generation barrier, failures, rank environment
- metrics   its Prometheus lines (omnid.api.health renders them)

Only `settings` may be imported by a daemon without `[cluster]`; the rest loads gRPC.
"""
