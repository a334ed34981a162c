"""Shapes of JSON values, declared once and checked whole: the types a schema is written in
(omnid.daemon.record's). A value that does not fit raises ShapeError naming where
(`supervisor.units.api.proc.pid: expected an integer >= 0, got "x"`), never a traceback.
Knows no unit: a leaf helper.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any


class ShapeError(ValueError):
    """A value is not of its shape: `path` names where (dotted: `units.api.proc[0]`), `why` what is wrong."""

    def __init__(self, why: str, path: list[str] | None = None) -> None:
        self.why = why
        self.path = path or []
        super().__init__(why)

    def within(self, key: str | int) -> ShapeError:
        self.path.insert(0, f"[{key}]" if isinstance(key, int) else str(key))
        return self

    def __str__(self) -> str:
        where = "".join(p if p.startswith("[") or i == 0 else f".{p}" for i, p in enumerate(self.path))
        return f"{where}: {self.why}" if where else self.why


def _shown(v: Any) -> str:
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------ the types of the schema
class Shape:
    """A type: `check` raises ShapeError (its path filled in on the way up, so that a value
    that fits costs no string at all)."""

    what = "a value"
    # The exact Python types JSON gives for a value of this shape, when its type is all there
    # is to check (a long list of them is then checked a column at a time: see ListOf).
    exact: frozenset[type] | None = None

    def check(self, v: Any, strict: bool) -> None:
        raise NotImplementedError

    def bad(self, v: Any) -> ShapeError:
        return ShapeError(f"expected {self.what}, got {_shown(v)}")


class Int(Shape):
    def __init__(self, minimum: int | None = None) -> None:
        self.minimum = minimum
        self.what = "an integer" if minimum is None else f"an integer >= {minimum}"
        self.exact = frozenset({int}) if minimum is None else None

    def check(self, v: Any, strict: bool) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or (self.minimum is not None and v < self.minimum):
            raise self.bad(v)


class Num(Shape):
    what = "a number"
    exact = frozenset({int, float})

    def check(self, v: Any, strict: bool) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.bad(v)


class Str(Shape):
    def __init__(self, empty: bool = True) -> None:
        self.empty = empty
        self.what = "a string" if empty else "a non-empty string"
        self.exact = frozenset({str}) if empty else None

    def check(self, v: Any, strict: bool) -> None:
        if not isinstance(v, str) or (not self.empty and not v):
            raise self.bad(v)


class Bool(Shape):
    what = "true or false"
    exact = frozenset({bool})

    def check(self, v: Any, strict: bool) -> None:
        if not isinstance(v, bool):
            raise self.bad(v)


class Fd(Shape):
    """An fd number the previous program left open for this one: it must be open now."""

    what = "an fd number"

    def check(self, v: Any, strict: bool) -> None:
        Int(0).check(v, strict)
        try:
            os.fstat(v)
        except OSError:
            raise ShapeError(f"fd {v} is not open") from None


class OneOf(Shape):
    def __init__(self, enum: type) -> None:
        self.values = frozenset(e.value for e in enum)
        self.what = "one of " + ", ".join(sorted(self.values))

    def check(self, v: Any, strict: bool) -> None:
        if not isinstance(v, str) or v not in self.values:
            raise self.bad(v)


class Opt(Shape):
    def __init__(self, inner: Shape) -> None:
        self.inner = inner

    def check(self, v: Any, strict: bool) -> None:
        if v is not None:
            self.inner.check(v, strict)


class ListOf(Shape):
    what = "a list"

    def __init__(self, item: Shape) -> None:
        self.item = item

    def check(self, v: Any, strict: bool) -> None:
        if not isinstance(v, list):
            raise self.bad(v)
        if self._fits_by_columns(v):
            return
        check = self.item.check  # one at a time: finds what does not fit, and where
        for i, x in enumerate(v):
            try:
                check(x, strict)
            except ShapeError as exc:
                raise exc.within(i) from None


    def _fits_by_columns(self, v: list) -> bool:
        """The whole list at once, a set of types per column, when the item is a plain scalar or
        a tuple of them (a unit's kept output lines: 256 units x 2,000 lines are 512,000 tuples,
        checked one by one in ~0.7 s of a re-exec's handover, by columns in a fraction)."""
        item = self.item
        if item.exact is not None:
            return {type(x) for x in v} <= item.exact
        columns = getattr(item, "columns", None)
        if columns is None or not {type(x) for x in v} <= {list} or {len(x) for x in v} - {len(columns)}:
            return False
        return all({type(x[i]) for x in v} <= types for i, types in enumerate(columns))


class Tuple(Shape):
    """A fixed-length list: [a, b, ...]."""

    def __init__(self, *items: Shape) -> None:
        self.items = items
        self.columns = tuple(i.exact for i in items) if all(i.exact for i in items) else None
        self.what = f"a list of {len(items)}"

    def check(self, v: Any, strict: bool) -> None:
        if not isinstance(v, list) or len(v) != len(self.items):
            raise self.bad(v)
        for i, (shape, x) in enumerate(zip(self.items, v)):
            try:
                shape.check(x, strict)
            except ShapeError as exc:
                raise exc.within(i) from None


class DictOf(Shape):
    """An object whose keys are names (units, groups, counters) and values all of one type."""

    what = "an object"

    def __init__(self, value: Shape) -> None:
        self.value = value

    def check(self, v: Any, strict: bool) -> None:
        if not isinstance(v, dict):
            raise self.bad(v)
        for k, x in v.items():
            try:
                self.value.check(x, strict)
            except ShapeError as exc:
                raise exc.within(k) from None


class Obj(Shape):
    """An object with named fields; `optional` ones may be absent (written since a later
    program). Unknown fields are ignored when read (a newer program's record read by an older
    one), refused when `strict` (the test that keeps this schema and the writers the same)."""

    what = "an object"

    def __init__(self, fields: dict[str, Shape], optional: dict[str, Shape] | None = None) -> None:
        self.fields = fields
        self.optional = optional or {}

    def check(self, v: Any, strict: bool) -> None:
        if not isinstance(v, dict):
            raise self.bad(v)
        for k, shape in self.fields.items():
            if k not in v:
                raise ShapeError("missing").within(k)
        for k, x in v.items():
            shape = self.fields.get(k) or self.optional.get(k)
            if shape is None:
                if strict:
                    raise ShapeError("not in the schema").within(k)
                continue
            try:
                shape.check(x, strict)
            except ShapeError as exc:
                raise exc.within(k) from None


class Record(Shape):
    """A part whose fields are declared by a typed record of its own, read by its `from_json`
    (the cluster's records, omnid/cluster: each field there with its type and bounds)."""

    what = "an object"

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def check(self, v: Any, strict: bool) -> None:
        if not isinstance(v, dict):
            raise self.bad(v)
        cls = getattr(importlib.import_module(self.module), self.name)  # imported only with [cluster]
        try:
            cls.from_json(v)
        except (ValueError, KeyError, TypeError) as exc:
            raise ShapeError(str(exc) if isinstance(exc, ValueError) else f"missing or malformed {exc}") from None


INT, COUNT, NUM, STR, BOOL, FD = Int(), Int(0), Num(), Str(), Bool(), Fd()
