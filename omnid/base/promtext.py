"""The Prometheus text exposition format, read just far enough for the `progress` rule
(omnid.unit(5)): the sum of each named metric's samples over their labels.

Handles what real exporters write: `# HELP` / `# TYPE` and other comments, label values
with escaped quotes, backslashes and newlines (and `}`, `,` or spaces inside them), NaN
and +Inf/-Inf, optional timestamps after the value, and counters named with or without
their `_total` suffix (a name that has no sample of its own takes `NAME_total`'s, as
OpenMetrics names a counter family without it). Pure: no I/O."""

from __future__ import annotations

import math
from collections.abc import Iterable


class MalformedExposition(ValueError):
    """A line that is not a sample; the message names the line number."""


def _sample(line: str) -> tuple[str, float] | None:
    """(metric name, value) of one sample line, or None for a value that is not a number."""
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


def sums(text: str, names: Iterable[str]) -> dict[str, float | None]:
    """Each name's samples summed over their labels (NaN samples left out); None for a
    name with no sample at all. MalformedExposition for a line that cannot be read."""
    wanted = set(names)
    totals = {n + "_total": n for n in wanted if not n.endswith("_total")}
    found: dict[str, float] = {}
    found_total: dict[str, float] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            name, value = _sample(line)
        except ValueError as exc:
            raise MalformedExposition(f"line {lineno}: {exc}: {line[:80]!r}") from None
        if math.isnan(value):
            continue
        if name in wanted:
            found[name] = found.get(name, 0.0) + value
        elif name in totals:
            found_total[totals[name]] = found_total.get(totals[name], 0.0) + value
    return {n: found.get(n, found_total.get(n)) for n in wanted}
