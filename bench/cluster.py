"""Issue-18 figures: a worker group across hosts (2 hosts x 2 torch gloo ranks, each host its
own omnid, etcd in a namespace of its own; tests/netns.py), measured from outside (/proc and
the ranks' progress files):

- failure: SIGKILL a rank on host a -> every rank on host b gone (ms, p50/p95), and -> all
  four ranks all-reducing again in the next generation (s);
- partition: host a cut off from etcd and from b -> a's ranks gone (fenced, s) and b's ranks
  gone (s), both against lease_ttl; then healed -> all-reducing again (s);
- re-exec: `omnid reexec` of host a's daemon while the ranks all-reduce -> its handover (ms),
  the gap between the old program's last lease keepalive and the new one's first (s, and as a
  share of lease_ttl), the longest pause of any rank's progress, and whether any rank or
  generation changed (none may).

Run as root: .venv/bin/python -m bench.cluster [--failures 20] [--partitions 3] [--reexecs 10]
[--ttl 3] (prints JSON; ~3 min with the defaults on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from omnid.demo import rankprogress  # noqa: E402
from tests.harness import alive, free_port, temp_dir, wait_for  # noqa: E402
from tests.netns import HostDaemon, Testbed, ranks_stack, unavailable  # noqa: E402

HOSTS = ["a", "b"]


def all_reducing(progress: Path, generation: int, after: float) -> bool:
    p = rankprogress.read(progress)
    return len(p) == 4 and all(g == generation and it >= 2 and ts > after for g, it, ts, _pid in p.values())


def pids(d: HostDaemon) -> dict[str, int]:
    return {n: u["pid"] for n, u in d.units().items() if u["pid"]}


def current_generation(d: HostDaemon) -> int:
    return d.unit("ranks@0")["generation"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def gone_times(groups: dict[str, list[int]], t0: float, limit: float) -> dict[str, float]:
    """When every pid of each named set was gone (monotonic), polled at ~1 ms."""
    out: dict[str, float] = {}
    while len(out) < len(groups):
        for name, ps in groups.items():
            if name not in out and not any(alive(p) for p in ps):
                out[name] = time.monotonic()
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"not gone within {limit} s: {set(groups) - set(out)}")
        time.sleep(0.001)
    return out


def longest_pause(progress: Path, seconds: float, also: Callable[[], object] | None = None) -> float:
    """Watch the ranks' progress for `seconds` (while `also` runs in a thread, and until it
    returned): the longest time between two collectives of any rank."""
    seen = {r: v[2] for r, v in rankprogress.read(progress).items()}
    longest = 0.0
    worker = threading.Thread(target=also) if also is not None else None
    if worker is not None:
        worker.start()
    t_end = time.time() + seconds
    while time.time() < t_end or (worker is not None and worker.is_alive()):
        for r, v in rankprogress.read(progress).items():
            longest = max(longest, v[2] - seen[r])
            seen[r] = v[2]
        time.sleep(0.005)
    if worker is not None:
        worker.join()
    return longest


def reexec_round(a: HostDaemon, daemons: dict[str, HostDaemon], progress: Path) -> tuple[float, float, float, float]:
    """One re-exec of a's daemon: (handover ms, lease gap s, longest progress pause s across it,
    the same in the 2 s before, for comparison)."""
    before = {h: pids(d) for h, d in daemons.items()}
    gen = current_generation(a)
    quiet = longest_pause(progress, 2.0)
    pause = longest_pause(progress, 2.0, a.reexec)
    st = a.ok("status")["daemon"]
    if {h: pids(d) for h, d in daemons.items()} != before or current_generation(a) != gen:
        raise AssertionError(f"a re-exec changed a rank or the generation: {before}")
    gap = wait_for(lambda: a.ok("status")["daemon"]["cluster"].get("reexec_lease_gap_s"), 10, "the lease gap")
    return float(st["handover_ms"]), float(gap), pause, quiet


def run(failures: int, partitions: int, ttl: int, reexecs: int = 0) -> dict:
    bed = Testbed(HOSTS).open()
    progress = temp_dir("omranks-")
    port = free_port()
    # restart_max_sec = restart_sec: the figures are omnid's and the ranks' own, not a growing backoff
    daemons = {h: HostDaemon(bed, h, ranks_stack(bed, h, HOSTS, progress, port, ttl=ttl, restart_max_sec=0.2))
               for h in HOSTS}
    stopped_ms, again_s, fenced_s, peer_s, healed_s = [], [], [], [], []
    handover_ms, gap_s, pause_s, quiet_s = [], [], [], []
    try:
        for d in daemons.values():
            d.start()
        a, b = daemons["a"], daemons["b"]
        gen = 1
        wait_for(lambda: all_reducing(progress, gen, 0), 180, "generation 1 all-reducing")
        for _ in range(reexecs):
            ms, gap, pause, quiet = reexec_round(a, daemons, progress)
            handover_ms.append(ms)
            gap_s.append(gap)
            pause_s.append(pause)
            quiet_s.append(quiet)
            print(f"re-exec {len(gap_s)}: handover {ms:.0f} ms, lease gap {gap:.3f} s "
                  f"({100 * gap / ttl:.0f}% of lease_ttl), longest rank pause {pause:.2f} s "
                  f"({quiet:.2f} s in the 2 s before)", file=sys.stderr, flush=True)
        for _ in range(failures):
            gen = current_generation(a)
            pb = list(pids(b).values())
            victim = pids(a)["ranks@1"]
            t0, wall = time.monotonic(), time.time()
            os.kill(victim, signal.SIGKILL)
            got = gone_times({"b": pb}, t0, 30)
            stopped_ms.append((got["b"] - t0) * 1000)
            wait_for(lambda: all_reducing(progress, gen + 1, wall), 120, f"generation {gen + 1}", interval=0.01)
            again_s.append(time.monotonic() - t0)
            print(f"failure {len(again_s)}: b's ranks gone {stopped_ms[-1]:.1f} ms, all-reducing again "
                  f"{again_s[-1]:.2f} s", file=sys.stderr, flush=True)
        for _ in range(partitions):
            gen = current_generation(a)
            pa, pb = list(pids(a).values()), list(pids(b).values())
            t0 = time.monotonic()
            wall = bed.cut("a")
            got = gone_times({"a": pa, "b": pb}, t0, ttl + 15)
            fenced_s.append(got["a"] - t0)
            peer_s.append(got["b"] - t0)
            t_heal = time.monotonic()
            bed.heal("a")
            wait_for(lambda: (p := rankprogress.read(progress)) and len(p) == 4
                     and all(v[0] > gen and v[1] >= 2 and v[2] > wall for v in p.values()), 120, "healed group",
                     interval=0.01)
            healed_s.append(time.monotonic() - t_heal)
            print(f"partition {len(healed_s)}: a fenced {fenced_s[-1]:.2f} s, b stopped {peer_s[-1]:.2f} s, "
                  f"healed {healed_s[-1]:.2f} s", file=sys.stderr, flush=True)
    finally:
        for d in daemons.values():
            d.close()
        bed.close()
        shutil.rmtree(progress, ignore_errors=True)
    out: dict = {"hosts": 2, "ranks_per_host": 2, "lease_ttl_s": ttl}
    if gap_s:
        out["reexec"] = {"rounds": len(gap_s), "ranks_or_generation_changed": 0,
                         "handover_ms_median": round(statistics.median(handover_ms), 1),
                         "handover_ms_max": round(max(handover_ms), 1),
                         "lease_gap_s_median": round(statistics.median(gap_s), 3),
                         "lease_gap_s_max": round(max(gap_s), 3),
                         "lease_gap_share_of_ttl_max": round(max(gap_s) / ttl, 3),
                         "fencing_budget_s": ttl - max(0.5, ttl / 4),
                         "longest_rank_pause_s_max": round(max(pause_s), 2),
                         "longest_rank_pause_before_s_max": round(max(quiet_s), 2)}
    if stopped_ms:
        out["failure"] = {"faults": len(stopped_ms),
                          "remote_ranks_stopped_ms_p50": round(pct(stopped_ms, 0.5), 1),
                          "remote_ranks_stopped_ms_p95": round(pct(stopped_ms, 0.95), 1),
                          "all_reducing_again_s_median": round(statistics.median(again_s), 2),
                          "all_reducing_again_s_max": round(max(again_s), 2)}
    if fenced_s:
        out["partition"] = {"cuts": len(fenced_s),
                            "cut_off_host_fenced_s_median": round(statistics.median(fenced_s), 2),
                            "cut_off_host_fenced_s_max": round(max(fenced_s), 2),
                            "other_host_stopped_s_median": round(statistics.median(peer_s), 2),
                            "healed_to_all_reducing_s_median": round(statistics.median(healed_s), 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--failures", type=int, default=20)
    ap.add_argument("--partitions", type=int, default=3)
    ap.add_argument("--reexecs", type=int, default=10)
    ap.add_argument("--ttl", type=int, default=3)
    a = ap.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"bench.cluster: {why}")
    print(json.dumps(run(a.failures, a.partitions, a.ttl, a.reexecs), indent=1))


if __name__ == "__main__":
    main()
