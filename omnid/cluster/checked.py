"""Typed reads of the cluster part of a re-exec's handover (omnid(8), RE-EXEC): the previous
program of this daemon wrote it, but the new one takes nothing over before every value was
read back as the type and range it must have. Each reader raises ValueError naming the key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeVar, Union

from omnid.model.cluster import HOST_NAME

T = TypeVar("T")
Key = Union[str, int]  # an object's key, or a list's index
MAX_INT = 1 << 63


def obj(d: Any, key: Key) -> dict[str, Any]:
    v = d[key]
    if not isinstance(v, dict):
        raise ValueError(f"{key}: expected an object")
    return v


def seq(d: Any, key: Key, limit: int = 4096) -> list[Any]:
    v = d[key]
    if not isinstance(v, list) or len(v) > limit:
        raise ValueError(f"{key}: expected a list of at most {limit} items")
    return v


def integer(d: Any, key: Key, lo: int = 0, hi: int = MAX_INT) -> int:
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{key}: expected an integer from {lo} to {hi}, got {v!r:.40}")
    return v


def number(d: Any, key: Key) -> float:
    """A finite float (monotonic times: the clock survives exec, the process is the same)."""
    v = d[key]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{key}: expected a finite number, got {v!r:.40}")
    return float(v)


def text(d: Any, key: Key, pattern: re.Pattern | None = None, limit: int = 1024) -> str:
    v = d[key]
    if not isinstance(v, str) or len(v) > limit or (pattern is not None and not pattern.fullmatch(v)):
        raise ValueError(f"{key}: expected {'a matching ' if pattern else 'a '}string of at most {limit} characters")
    return v


def each(d: Any, key: Key, read: Callable[[Any], T], limit: int = 64) -> tuple[T, ...]:
    """Every item of a list read by `read`; an error names the item (`views[2].seq: ...`)."""
    out = []
    for i, item in enumerate(seq(d, key, limit)):
        try:
            out.append(read(item))
        except (ValueError, KeyError, TypeError) as exc:
            what = str(exc) if isinstance(exc, ValueError) else f"missing or malformed {exc}"
            raise ValueError(f"{key}[{i}].{what}") from None
    return tuple(out)


def address(item: Any) -> tuple[str, str, int]:
    """[host, address, port]: where a peer's heartbeat goes."""
    if not isinstance(item, list) or len(item) != 3:
        raise ValueError("expected [host, address, port]")
    return text(item, 0, HOST_NAME), text(item, 1, limit=64), integer(item, 2, 1, 65535)


def strings(d: Any, key: Key, pattern: re.Pattern | None = None, limit: int = 64) -> tuple[str, ...]:
    """A list of at most `limit` strings, each matching `pattern`."""
    items = seq(d, key, limit)
    return tuple(text(items, i, pattern) for i in range(len(items)))


def flag(d: Any, key: Key) -> bool:
    v = d[key]
    if not isinstance(v, bool):
        raise ValueError(f"{key}: expected true or false")
    return v


def counters(d: Any, key: Key, names: tuple[str, ...]) -> dict[str, int]:
    """A counters object with exactly these names."""
    o = obj(d, key)
    if set(o) != set(names):
        raise ValueError(f"{key}: expected the counters {', '.join(names)}")
    return {n: integer(o, n) for n in names}
