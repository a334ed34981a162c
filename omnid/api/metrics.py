"""Prometheus figures the daemon accumulates between scrapes (rendered by
omnid.api.health's /metrics). Base units: seconds and bytes."""

from __future__ import annotations

import bisect

from omnid.base import promtext

# pidfd wake-up to `failed`: ms on an idle host, longer when a leftover must be killed.
DEATH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Observations per bucket, per label value (the unit); omnid.base.promtext writes them
    (cumulative, with _sum and _count)."""

    def __init__(self, buckets: tuple[float, ...] = DEATH_BUCKETS) -> None:
        self.buckets = buckets
        self.series: dict[str, tuple[list[int], list[float]]] = {}  # unit -> (counts per bucket, [sum])

    def observe(self, unit: str, seconds: float) -> None:
        counts, total = self.series.setdefault(unit, ([0] * (len(self.buckets) + 1), [0.0]))
        counts[bisect.bisect_left(self.buckets, seconds)] += 1
        total[0] += seconds

    def write(self, page: promtext.Page, name: str, help_: str) -> None:
        """Onto `page` (omnid.promtext.Page): one histogram family, a series per unit."""
        fam = page.histogram(name, help_, self.buckets)
        for unit, (counts, total) in self.series.items():
            fam.add_series(counts, round(total[0], 6), unit=unit)


class DaemonMetrics:
    def __init__(self) -> None:
        self.death_detection = Histogram()
        self._deaths_seen: dict[str, int] = {}

    def handover(self) -> dict:
        return {"series": {u: [c, t] for u, (c, t) in self.death_detection.series.items()},
                "deaths_seen": dict(self._deaths_seen)}

    def take_over(self, d: dict) -> None:
        n = len(self.death_detection.buckets) + 1
        for unit, (counts, total) in d["series"].items():
            if len(counts) == n:
                self.death_detection.series[str(unit)] = ([int(c) for c in counts], [float(total[0])])
        self._deaths_seen = {str(k): int(v) for k, v in d["deaths_seen"].items()}

    def on_event(self, ev: dict, sup) -> None:
        """Called for every published state change: a new death of a unit is observed once."""
        if ev.get("to") != "failed":
            return
        u = sup.units.get(ev.get("unit"))
        if u is None or u.death_detect_ms is None:
            return
        if self._deaths_seen.get(u.name) == u.deaths:
            return
        self._deaths_seen[u.name] = u.deaths
        self.death_detection.observe(u.name, u.death_detect_ms / 1000.0)
