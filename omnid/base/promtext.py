"""The Prometheus text exposition format (version 0.0.4), written and read in this one module.

Writing: every producer of omnid's /metrics page (omnid.api.health, omnid.api.metrics' histogram,
omnid.process.cgroup's figures, omnid.cluster.metrics) fills one `Page`: a family is declared once
with its HELP and TYPE (a second declaration of a name is an error, so no family is written
twice), a counter's name ends in `_total` and a gauge's does not, label values are escaped
(backslash, double quote, newline) and values formatted here (integers as integers, floats
by repr, NaN, +Inf, -Inf), histograms get their cumulative buckets, `_sum` and `_count`.

Why hand-built and not prometheus_client (bench/metrics_numbers.py: a 64-unit stack, 2,570
series, CPU time per page on the project's shared 2-core VM):
- The page is built on the loop that sees deaths, at scrape time, from the supervisor's
  state; nothing is accumulated in metric objects except one histogram, which must survive a
  re-exec (omnid.api.metrics hands it over). So prometheus_client would serve only as a text
  formatter (custom collectors of GaugeMetricFamily & co. plus generate_latest), and as one
  it costs ~5x the loop time of this writer: median 17.7 ms CPU a page against 3.7 ms
  (the three hand-built writers this module replaced: 6.0 ms).
- Its text differs for the same figures: it sorts label names (`{state="active",unit="a"}`
  where omnid writes `{unit="a",state="active"}`, the order the tests and operators' greps
  use) and writes every value as a float (`1.0`).
- It is one more dependency of the daemon (pure Python, none of its own, 650 KB; ~14 ms
  more to import at start beside aiohttp) for a format that is small and stable.
This writer is ~150 lines, pinned by tests/test_promtext.py (escaping, one family per name,
NaN/Inf, read back by `sums`, `promtool check metrics`) and by the promtool check of a real
daemon's page (tests/test_operators.py).
A Page is built by one caller and not shared: no lock is needed (the process figures it
shows come from health.UsageCache's thread as a finished snapshot).

Reading, just far enough for the `progress` rule (omnid.unit(5)): `sums` adds each named
metric's samples over their labels. It handles what real exporters write: `# HELP` / `# TYPE`
and other comments, label values with escaped quotes, backslashes and newlines (and `}`, `,`
or spaces inside them), NaN and +Inf/-Inf, optional timestamps after the value, and counters
named with or without their `_total` suffix (a name that has no sample of its own takes
`NAME_total`'s, as OpenMetrics names a counter family without it). Pure: no I/O."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence

FORMAT_VERSION = "0.0.4"  # the text format written (the X-Prometheus-Format header of /metrics)

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_label_names_ok: set[str] = set()  # label names already checked (a handful, reused every scrape)


def value_text(v: float | int | bool) -> str:
    """A sample value as the format writes it: integers as integers, floats by repr (the
    shortest text that reads back to the same float), NaN, +Inf, -Inf."""
    if v.__class__ is int:
        return str(v)
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(int(v))
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        return repr(v)
    raise TypeError(f"a sample value must be a number, not {type(v).__name__} ({v!r})")


def escape_label_value(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return v


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def label_text(labels: dict[str, object]) -> str:
    """`{k="v",...}` in the order given (empty for no labels); values taken by str()."""
    if not labels:
        return ""
    parts = []
    for k, v in labels.items():
        if k not in _label_names_ok:
            if not _LABEL_NAME.match(k) or k.startswith("__"):
                raise ValueError(f"{k!r} is not a Prometheus label name")
            _label_names_ok.add(k)
        parts.append(f'{k}="{escape_label_value(str(v))}"')
    return "{" + ",".join(parts) + "}"


class Family:
    """One counter or gauge family: its samples in the order added."""

    def __init__(self, name: str, kind: str, help_: str) -> None:
        self.name, self.kind, self.help = name, kind, help_
        self.lines: list[str] = []

    def add(self, value: float | int | bool, **labels: object) -> None:
        self.lines.append(f"{self.name}{label_text(labels)} {value_text(value)}")


class HistogramFamily(Family):
    """A histogram family: per label set, the observations counted per bucket."""

    def __init__(self, name: str, help_: str, buckets: Sequence[float]) -> None:
        super().__init__(name, "histogram", help_)
        if list(buckets) != sorted(buckets) or any(math.isinf(b) or math.isnan(b) for b in buckets):
            raise ValueError(f"{name}: buckets must be finite and ascending: {buckets!r}")
        self.bounds = [value_text(float(b)) for b in buckets]

    def add(self, value, **labels):  # type: ignore[override]
        raise TypeError(f"{self.name} is a histogram: add_series(counts, total, ...)")

    def add_series(self, counts: Sequence[int], total: float, **labels: object) -> None:
        """`counts`: observations per bucket, not cumulative, with one more for those above the
        last bound (len(buckets) + 1); `total`: their sum. Writes `_bucket` (cumulative, then
        le="+Inf"), `_sum` and `_count`."""
        if len(counts) != len(self.bounds) + 1:
            raise ValueError(f"{self.name}: {len(counts)} bucket counts for {len(self.bounds)} bounds (+Inf)")
        if "le" in labels:
            raise ValueError(f"{self.name}: 'le' is the histogram's own label")
        rest = label_text(labels)
        pre = "{" + rest[1:-1] + "," if rest else "{"
        cum = 0
        for bound, c in zip(self.bounds, counts):
            cum += c
            self.lines.append(f'{self.name}_bucket{pre}le="{bound}"}} {cum}')
        cum += counts[-1]
        self.lines.append(f'{self.name}_bucket{pre}le="+Inf"}} {cum}')
        self.lines.append(f"{self.name}_sum{rest} {value_text(total)}")
        self.lines.append(f"{self.name}_count{rest} {cum}")


class Page:
    """One exposition: families in the order declared, each declared (and written) once."""

    def __init__(self) -> None:
        self.families: list[Family] = []
        self._taken: dict[str, str] = {}  # every sample name a family writes -> that family

    def _declare(self, family: Family, samples: Iterable[str]) -> None:
        name = family.name
        if not _METRIC_NAME.match(name):
            raise ValueError(f"{name!r} is not a Prometheus metric name")
        for s in samples:
            if s in self._taken:
                raise ValueError(f"metric family {name} declared twice (or its sample {s} clashes "
                                 f"with family {self._taken[s]})")
        for s in samples:
            self._taken[s] = name
        self.families.append(family)

    def counter(self, name: str, help_: str) -> Family:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name} must be named NAME_total")
        f = Family(name, "counter", help_)
        self._declare(f, (name,))
        return f

    def gauge(self, name: str, help_: str) -> Family:
        if name.endswith("_total"):
            raise ValueError(f"gauge {name} must not be named like a counter (_total)")
        f = Family(name, "gauge", help_)
        self._declare(f, (name,))
        return f

    def histogram(self, name: str, help_: str, buckets: Sequence[float]) -> HistogramFamily:
        if name.endswith(("_total", "_bucket", "_sum", "_count")):
            raise ValueError(f"histogram {name} must be named without a sample suffix")
        f = HistogramFamily(name, help_, buckets)
        self._declare(f, (name, name + "_bucket", name + "_sum", name + "_count"))
        return f

    def text(self) -> str:
        out: list[str] = []
        for f in self.families:
            out.append(f"# HELP {f.name} {_escape_help(f.help)}")
            out.append(f"# TYPE {f.name} {f.kind}")
            out += f.lines
        return "\n".join(out) + "\n" if out else ""


# ----------------------------------------------------------------------------- reading

class MalformedExposition(ValueError):
    """A line that is not a sample; the message names the line number."""


def _sample(line: str) -> tuple[str, float]:
    """(metric name, value) of one sample line; ValueError naming what is wrong."""
    i, n = 0, len(line)
    if line.startswith("{"):  # Prometheus 3 UTF-8 names: {"my.metric", label="x"} value
        name = ""
    else:
        while i < n and not line[i].isspace() and line[i] != "{":
            i += 1
        name = line[:i]
        if not name:
            raise ValueError("no metric name")
    if i < n and line[i] == "{":
        i, quoted_name = _skip_labels(line, i)
        name = name or quoted_name
        if not name:
            raise ValueError("no metric name")
    rest = line[i:].split()
    if not rest:
        raise ValueError("no value")
    try:
        return name, float(rest[0])  # float() reads NaN, +Inf, -Inf as the format writes them
    except ValueError:
        raise ValueError(f"value {rest[0][:40]!r} is not a number") from None


def _skip_labels(line: str, i: int) -> tuple[int, str]:
    """From the `{` at i: the index after the matching `}`, and a quoted metric name found
    inside (a quoted string that is not a label's value), else ""."""
    n = len(line)
    i += 1
    name = ""
    expect_value = False
    while i < n:
        c = line[i]
        if c == "}":
            return i + 1, name
        if c == '"':
            j, text = _quoted(line, i)
            if not expect_value and not name:
                name = text
            expect_value = False
            i = j
            continue
        if c == "=":
            expect_value = True
        i += 1
    raise ValueError("labels not closed by '}'")


def _quoted(line: str, i: int) -> tuple[int, str]:
    """From the `"` at i: the index after the closing quote, and the unescaped text."""
    out = []
    i += 1
    n = len(line)
    while i < n:
        c = line[i]
        if c == "\\" and i + 1 < n:
            nxt = line[i + 1]
            out.append("\n" if nxt == "n" else nxt)
            i += 2
            continue
        if c == '"':
            return i + 1, "".join(out)
        out.append(c)
        i += 1
    raise ValueError("label value not closed by '\"'")


_BLOCK = 64 * 1024  # characters of a page split into lines at a time


def _blocks(text: str) -> Iterator[list[str]]:
    """The page's lines, a block of them at a time: a hostile page of 8 MiB of tiny lines
    would otherwise be a list of millions of strings (splitlines: ~170 MB) before its first
    line is judged. A line ends at \\n, the format's line end (a \\r before it is stripped with
    the blanks)."""
    start, end = 0, len(text)
    while start < end:
        stop = text.find("\n", start + _BLOCK)  # each block ends at a line's end
        if stop < 0:
            stop = end
        yield text[start:stop].split("\n")
        start = stop + 1


def sums(text: str, names: Iterable[str]) -> dict[str, float | None]:
    """Each name's samples summed over their labels (NaN samples left out); None for a
    name with no sample at all. MalformedExposition for a line that cannot be read."""
    wanted = set(names)
    totals = {n + "_total": n for n in wanted if not n.endswith("_total")}
    found: dict[str, float] = {}
    found_total: dict[str, float] = {}
    before = 0  # lines in the blocks before this one
    for block in _blocks(text):
        for k, raw in enumerate(block, before + 1):
            line = raw.strip()
            if not line or line[0] == "#":
                continue
            try:
                name, value = _sample(line)
            except ValueError as exc:
                raise MalformedExposition(f"line {k}: {exc}: {line[:80]!r}") from None
            if math.isnan(value):
                continue
            if name in wanted:
                found[name] = found.get(name, 0.0) + value
            elif name in totals:
                found_total[totals[name]] = found_total.get(totals[name], 0.0) + value
        before += len(block)
    return {n: found.get(n, found_total.get(n)) for n in wanted}
