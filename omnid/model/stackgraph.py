"""From templates to a stack: instance expansion (%i, %n), dependency references, start
tiers (Kahn, linear) and worker groups."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

from omnid.model.unitfile import Template
from omnid.model.keys import GROUP_POLICY_KEYS
from omnid.model.unitmodel import (UNIT_NAME, Canary, DrainHook, ListenSocket, Liveness, Progress, Ready, ReadyKind, Unit,
                                   UnitFileError)
from omnid.model.unitvalues import InvalidValue, Table, http_url, quote, parse_host_port

R = TypeVar("R", Liveness, Canary)  # a probe that sends an HTTP request from a unit file


# --------------------------------------------------------------------------- expansion


# A dependency as written: NAME (every instance) or NAME@N.
_REFERENCE = re.compile(f"(?P<template>{UNIT_NAME.pattern})(?:@(?P<instance>[0-9]+))?")
# Only these: "%N" or "%s" in a unit's command (date +%s.%N) must reach it unchanged. The
# instance count is in the environment instead (OMNID_INSTANCES).
_SPECIFIER = re.compile(r"%[%in]")


def _expand(text: str, name: str, instance: int) -> str:
    # Only %i, %n and %% are specifiers; any other % stays as written (printf formats, dates).
    return _SPECIFIER.sub(lambda m: {"%%": "%", "%i": str(instance), "%n": name}[m.group()], text)


def instance_names(template: Template) -> list[tuple[str, int]]:
    if template.instances == 1:
        return [(template.name, 0)]
    return [(f"{template.name}@{i}", i) for i in range(template.instances)]


def expand_unit(
    template: Template,
    name: str,
    instance: int,
    directory: Path,
    dependencies: Mapping[str, list[str]],
    errors: list[UnitFileError],
) -> Unit:
    v = template.values
    x: Callable[[str], str] = lambda s: _expand(s, name, instance)  # noqa: E731
    t = Table(template.file, {}, errors)  # only for t.error(): values here are already typed

    env = {k: x(val) for k, val in v["env"].items()}
    gpus: tuple[int | str, ...] = ()
    if template.gpus == "%i":
        gpus = (instance,)
    elif isinstance(template.gpus, tuple):
        gpus = template.gpus
    if template.gpus is not None:
        # As CUDA reads it: indexes and UUIDs as written, comma-separated, no spaces. An explicit
        # env value wins: the operator may want another mapping.
        env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(map(str, gpus)))

    def url(key: str, raw: str) -> str:
        """`raw` with %i and %n expanded, checked as an HTTP URL; raw as it was when it is not one
        (the error, named by `key`, makes the stack invalid)."""
        try:
            return http_url(x(raw))
        except InvalidValue as exc:
            t.error(key, str(exc))
            return raw

    def request(probe: R) -> R:
        """A probe's body and header values, expanded (its URL goes through `url`)."""
        return replace(probe, body=x(probe.body), headers=tuple((k, x(val)) for k, val in probe.headers))

    ready: Ready = v["ready"]
    if ready.kind is ReadyKind.HTTP:
        ready = Ready(ReadyKind.HTTP, url=url("ready.http", ready.url))
    elif ready.kind is ReadyKind.TCP:
        try:
            host, port = parse_host_port(x(ready.url))
            ready = Ready(ReadyKind.TCP, host=host, port=port)
        except ValueError as exc:
            t.error("ready.tcp", str(exc))
    liveness: Liveness | None = v["liveness"]
    if liveness is not None:
        liveness = replace(request(liveness), exec=tuple(x(a) for a in liveness.exec))
        if liveness.url:
            liveness = replace(liveness, url=url("liveness.http", liveness.url))
    progress: Progress | None = v["progress"]
    if progress is not None and progress.metrics:
        progress = replace(progress, metrics=url("progress.metrics", progress.metrics))
    if progress is not None and progress.canary is not None and progress.canary.url:
        canary = request(progress.canary)
        progress = replace(progress, canary=replace(canary, url=url("progress.canary.http", canary.url)))
    drain: DrainHook | None = v["drain"]
    if drain is not None and drain.url:
        drain = DrainHook(url=url("drain.http", drain.url))
    sockets = _expand_sockets(v["sockets"], name, x, t)
    cwd = v["cwd"]
    if cwd is not None:
        # Relative to the stack directory: the daemon's own cwd is "/" under systemd.
        cwd = str(directory / x(cwd))

    # Every key of the table is a Unit field of its name: the values pass through as parsed,
    # but for those expanded or checked above.
    fields = {**v, "exec": tuple(x(a) for a in v["exec"]), "title": x(v["title"]), "cwd": cwd,
              "env": MappingProxyType(env), "gpus": gpus, "ready": ready, "liveness": liveness,
              "progress": progress, "drain": drain, "sockets": sockets}
    return Unit(name=name, template=template.name, instance=instance, instances=template.instances,
                file=template.file, after=tuple(dependencies["after"]), requires=tuple(dependencies["requires"]),
                **fields)


_SUN_PATH_MAX = 107  # sockaddr_un's sun_path holds 108 bytes with the NUL


def _expand_sockets(sockets: tuple[ListenSocket, ...], name: str, x: Callable[[str], str],
                    t: Table) -> tuple[ListenSocket, ...]:
    """`sockets` with %i / %n expanded and each address checked: a numeric HOST:PORT (no
    resolver thread in the daemon) or an absolute path that fits sockaddr_un."""
    out: list[ListenSocket] = []
    seen: dict[str, int] = {}
    for i, s in enumerate(sockets):
        key = f"sockets[{i}]"
        if not s.listen:
            continue  # an entry its file's reader already reported
        listen = x(s.listen)
        if listen.startswith("/"):
            if len(listen.encode()) > _SUN_PATH_MAX or "\0" in listen:
                t.error(f"{key}.listen", f"expected a Unix socket path of at most {_SUN_PATH_MAX} bytes, "
                        f"got {quote(listen)}")
                continue
        else:
            try:
                host, port = parse_host_port(listen)
                ipaddress.ip_address(host)
            except ValueError as exc:
                msg = str(exc) if "HOST:PORT" in str(exc) else (
                    f'expected a numeric address ("127.0.0.1:8000", "[::]:8000") or an absolute Unix socket '
                    f"path, got {quote(listen)}")
                t.error(f"{key}.listen", msg)
                continue
            if s.mode is not None:
                t.error(f"{key}.mode", "applies to a Unix socket path only; expected it absent for HOST:PORT")
            listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if listen in seen:
            t.error(f"{key}.listen", f"the same address as sockets[{seen[listen]}]; expected each address once")
            continue
        seen[listen] = i
        out.append(replace(s, listen=listen, name=x(s.name) if s.name else name,
                           mode=0o660 if s.mode is None else s.mode))
    return tuple(out)


def check_socket_clashes(units: Mapping[str, Unit], errors: list[UnitFileError]) -> None:
    """Two units on one address: the second bind would fail at its start, unless every
    socket on it sets reuseport (then the kernel spreads the connections). The instances of
    one unit on one TCP address without reuseport share one socket (omnid.process.sockets)."""
    first: dict[str, tuple[Unit, int, bool]] = {}
    for unit in units.values():
        for i, s in enumerate(unit.sockets):
            other = first.setdefault(s.listen, (unit, i, s.reuseport))
            if other[0] is unit:
                continue
            if not s.unix and not s.reuseport and not other[2] and other[0].template == unit.template:
                continue  # one socket, shared by the instances
            if s.unix or not (s.reuseport and other[2]):
                errors.append(UnitFileError(unit.file, f"sockets[{i}].listen", (
                    f"{quote(s.listen)} is also a socket of {other[0].name}; expected each address once "
                    f"(instances of one unit share it, or each has its own with reuseport = true on each)")))


def _resolve_reference(
    reference: str, templates: Mapping[str, Template], broken: set[str]
) -> tuple[list[str], str | None]:
    """A dependency as written -> unit names, or an error message saying what was expected."""
    match = _REFERENCE.fullmatch(reference)
    if match is None:
        return [], f"expected a unit name (NAME or NAME@N), got {quote(reference)}"
    target = templates.get(match["template"])
    if target is None:
        if match["template"] in broken:
            return [], None  # that file's own errors are already reported
        known = ", ".join(sorted(templates)) or "none"
        return [], f"unknown unit {quote(reference)}; expected one of the units in this directory: {known}"
    if match["instance"] is None:
        return [n for n, _ in instance_names(target)], None
    if target.instances == 1:
        return [], f'unknown unit "{reference}"; {target.name} has no instances, expected "{target.name}"'
    if int(match["instance"]) >= target.instances or match["instance"] != str(int(match["instance"])):
        return [], (
            f'unknown unit "{reference}"; expected {target.name}@0 to {target.name}@{target.instances - 1} '
            f'or "{target.name}" for all of them'
        )
    return [reference], None


def declared_dependencies(
    template: Template,
    name: str,
    instance: int,
    templates: Mapping[str, Template],
    broken: set[str],
    errors: list[UnitFileError],
) -> dict[str, list[str]]:
    """`after` and `requires` of one instance, as full unit names ({"after": [...], "requires": [...]})."""
    declared: dict[str, list[str]] = {}
    for key in ("after", "requires"):
        names: list[str] = []
        for reference in getattr(template, key):
            expanded = _expand(reference, name, instance)
            # "worker" inside worker.toml means all instances, this one included. Messages
            # quote the reference as written, so N instances report the same mistake once.
            if expanded in (name, template.name):
                errors.append(UnitFileError(template.file, key, f'"{reference}" is this unit itself; '
                                            "expected the names of other units"))  # fmt: skip
                continue
            resolved, problem = _resolve_reference(expanded, templates, broken)
            if problem:
                errors.append(UnitFileError(template.file, key, problem))
            names.extend(n for n in resolved if n not in names)
        declared[key] = names
    return declared


# --------------------------------------------------------------------------- ordering


def start_tiers(
    units: Mapping[str, Unit], edges: Mapping[str, Mapping[str, str]], errors: list[UnitFileError]
) -> tuple[tuple[tuple[Unit, ...], ...], dict[str, int]]:
    """Layer units by dependencies (Kahn); report each dependency cycle once."""
    tier_of: dict[str, int] = {}
    remaining = set(units)
    tiers: list[tuple[Unit, ...]] = []
    # Kahn with in-degrees: linear in units + edges (a 10,000-unit chain is not a hang).
    waiting = {n: len(edges[n]) for n in units}
    dependents: dict[str, list[str]] = {n: [] for n in units}
    for n in units:
        for d in edges[n]:
            if d in dependents:
                dependents[d].append(n)
    layer = sorted(n for n, k in waiting.items() if k == 0)
    while layer:
        for n in layer:
            tier_of[n] = len(tiers)
        remaining.difference_update(layer)
        tiers.append(tuple(units[n] for n in layer))
        ready = []
        for n in layer:
            for m in dependents[n]:
                waiting[m] -= 1
                if waiting[m] == 0:
                    ready.append(m)
        layer = sorted(ready)

    # Every unit left waits for another unit left, so walking "waits for" edges
    # from any of them must loop. Walks that reach an already-reported cycle are
    # units stuck behind it, not cycles of their own.
    explained: set[str] = set()
    reported: set[tuple[str, ...]] = set()
    for start in sorted(remaining):
        path: list[str] = []
        on_path: set[str] = set()
        node = start
        while node not in explained and node not in on_path:
            path.append(node)
            on_path.add(node)
            node = min(d for d in edges[node] if d in remaining)
        explained.update(path)
        if node not in path:
            continue
        cycle = path[path.index(node):]
        first = cycle.index(min(cycle))
        cycle = cycle[first:] + cycle[:first]
        templates = tuple(units[n].template for n in cycle)
        if templates in reported:  # the same loop through other instances of the same templates
            continue
        reported.add(templates)
        head = units[cycle[0]]
        errors.append(UnitFileError(
            head.file, edges[cycle[0]][cycle[1 % len(cycle)]],
            f"dependency cycle {' -> '.join([*cycle, cycle[0]])}; expected units that can be started in an order "
            f"(files: {', '.join(sorted({units[n].file.name for n in cycle}))})",
        ))  # fmt: skip
    return tuple(tiers), tier_of


def worker_groups(units: Mapping[str, Unit], errors: list[UnitFileError]) -> dict[str, tuple[str, ...]]:
    """worker_group -> members in rank order; members must share one restart policy and must
    not wait for each other (they start together: a rank that waits for a peer's readiness,
    which needs the rank itself, would never start)."""
    members: dict[str, list[Unit]] = {}
    for unit in units.values():
        if unit.worker_group:
            members.setdefault(unit.worker_group, []).append(unit)
    groups: dict[str, tuple[str, ...]] = {}
    for group, found in sorted(members.items()):
        found.sort(key=lambda u: (u.template, u.instance))
        names = {u.name for u in found}
        first = found[0]
        for unit in found:
            for dep in unit.dependencies:
                if dep in names:
                    errors.append(UnitFileError(unit.file, "worker_group", (
                        f"{unit.name} waits for {dep} (after/requires), but both are in worker_group "
                        f'"{group}", whose members start together; expected no dependency between members')))
            for key in GROUP_POLICY_KEYS:
                if getattr(unit, key) != getattr(first, key):
                    errors.append(UnitFileError(unit.file, key, (
                        f'worker_group "{group}" restarts as one: expected the same {key} as {first.name} '
                        f"({first.file.name}: {getattr(first, key)}), got {getattr(unit, key)}")))
            if unit.group_hosts != first.group_hosts:
                errors.append(UnitFileError(unit.file, "group_hosts", (
                    f'worker_group "{group}" spans one set of hosts: expected the same group_hosts as {first.name} '
                    f"({first.file.name}: {list(first.group_hosts)}), got {list(unit.group_hosts)}")))
            if (unit.torch_distributed is None) != (first.torch_distributed is None) or (
                    unit.torch_distributed and unit.torch_distributed != first.torch_distributed):
                errors.append(UnitFileError(unit.file, "torch_distributed", (
                    f'worker_group "{group}" is one torch.distributed job or none: expected the same '
                    f"torch_distributed as {first.name} ({first.file.name})")))
        groups[group] = tuple(u.name for u in found)
    return groups
