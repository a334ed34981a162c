"""Unit files: omnid.unit(5) (the keys) and the parsing half of `omnid check`.

A stack directory holds one TOML file per unit (`NAME.toml`) and an optional
`omnid.toml` with daemon settings. `load_stack` reads them all once, expands
instances (`worker` with `instances = 2` -> `worker@0`, `worker@1`), resolves
dependencies and orders them, and returns frozen objects: nothing downstream
reads raw TOML. Every problem in every file is collected first and raised as
one `StackInvalid`, so `omnid check` reports all of them at once.

The work is split by responsibility: `omnid.model.unitmodel` (the frozen units and the
stack), `omnid.model.keys` (the table of unit keys: reader, default, reload class, doc),
`omnid.model.unitvalues` (one value -> typed, with the maxima), `omnid.model.unitfile`
(one file -> a template), `omnid.model.stackgraph` (expansion, dependencies, tiers,
worker groups). This module is the entry point and re-exports their public names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from types import MappingProxyType

from omnid.base.ownership import check_directory, check_unit_path
from omnid.model import accounts
from omnid.model.stackgraph import declared_dependencies, expand_unit, instance_names, check_socket_clashes, start_tiers, worker_groups
from omnid.model.unitfile import Template, parse_settings, parse_unit_file, read_toml
from omnid.model.unitmodel import DaemonSettings, SETTINGS_FILE, Stack, StackInvalid, Unit, UnitFileError, UNIT_NAME
from omnid.model.unitvalues import MAX_UNITS
from omnid.model.unitmodel import (  # noqa: F401 - re-exported
    DEFAULT_TITLE, DaemonSettings, DrainHook, GpuRef, KillMode, ListenSocket, Liveness, Progress, LogFormat, NumaMode, RESERVED_ENV, RLIMITS, Ready, ReadyKind, RestartPolicy, Rlimit, SETTINGS_FILE, Stack, StackInvalid, TORCH_ENV, TorchDistributed, Unit, UnitFileError, UpdatePolicy,
)
from omnid.model.unitvalues import (  # noqa: F401 - re-exported
    InvalidValue, MAX_INSTANCES, MAX_RLIMIT, MAX_SECONDS, MAX_UNITS, parse_host_port, parse_signal,
)
from omnid.model.unitfile import (  # noqa: F401 - re-exported
    LIVENESS_KEYS, MAX_UNIT_FILE_BYTES, PROGRESS_KEYS, SETTINGS_KEYS, SOCKET_KEYS, TORCH_DISTRIBUTED_KEYS,
)
from omnid.model.keys import GROUP_POLICY_KEYS, UNIT_KEY_TABLE, UNIT_KEYS, OnChange, UnitKey  # noqa: F401 - re-exported


# --------------------------------------------------------------------------- entry points


def load_stack(directory: str | PathLike[str], sources: Mapping[str, bytes] | None = None) -> Stack:
    """Read and validate a stack directory. Raises StackInvalid listing every error in every file.
    With `sources` (file name -> bytes, as `Stack.sources` holds them), parse those texts
    instead of the files: what a re-executed daemon does with the stack it ran."""
    stack, errors = _load(Path(directory), sources)
    if errors:
        raise StackInvalid(errors)
    assert stack is not None
    # Users and groups asked of NSS here, where the stack is read (never on the event loop).
    accounts.resolve_all((u.user, u.group) for u in stack.units.values())
    return stack


def check_stack(directory: str | PathLike[str]) -> tuple[UnitFileError, ...]:
    """Every error in a stack directory (empty when valid), for `omnid check`."""
    return _load(Path(directory))[1]


def _load(directory: Path, given: Mapping[str, bytes] | None = None) -> tuple[Stack | None, tuple[UnitFileError, ...]]:
    errors: list[UnitFileError] = []
    sources: dict[str, bytes] = dict(given) if given is not None else {}
    if os.geteuid() == 0 and given is None:
        # The directory and every one above it first (sshd's StrictModes): a user who owns one
        # of them can swap what is below it at will, between any check and any read.
        problem = check_directory(directory, "units directory")
        if problem:
            return None, (UnitFileError(directory, "", problem),)
    if given is not None:
        files = sorted(directory / name for name in given)
    elif not directory.is_dir():
        return None, (UnitFileError(directory, "", "not a directory; expected a directory of unit files (NAME.toml)"),)
    else:
        # Dotfiles are editor leftovers (.serve.toml.swp, .#serve.toml), not units.
        try:
            files = sorted(p for p in directory.glob("*.toml") if not p.name.startswith(".") and p.is_file())
        except OSError as exc:  # removed or replaced while listed
            return None, (UnitFileError(directory, "", f"cannot list ({exc.strerror}); expected a directory of "
                                        "unit files (NAME.toml)"),)
    if os.geteuid() == 0 and given is None:
        # A root daemon runs what these files say: only root may be able to change them.
        problem = check_unit_path(directory, directory=True)
        if problem:
            errors.append(UnitFileError(directory, "", problem))
        # Each file is checked on the fd it is read from (unitfile._read_toml), with every
        # directory above it: a check by path here and a read by path there could be swapped.
        if errors:
            return None, tuple(errors)

    settings = DaemonSettings()
    templates: dict[str, Template] = {}
    broken: set[str] = set()  # units whose file could not be read at all
    for file in files:
        raw = read_toml(file, errors, sources, given is not None)
        if file.name == SETTINGS_FILE:
            if raw is not None:
                settings = parse_settings(file, raw, directory, errors)
            continue
        name = file.name[: -len(".toml")]
        if not UNIT_NAME.fullmatch(name):
            errors.append(UnitFileError(file, "", f'unit name "{name}" (the file name) is not valid; expected a '
                                        "letter or digit, then letters, digits, '_', '.' or '-' (no '@')"))  # fmt: skip
            continue
        if raw is None:
            broken.add(name)
            continue
        templates[name] = parse_unit_file(file, name, raw, errors)
    if not templates and not broken:
        errors.append(UnitFileError(directory, "", "no unit files; expected at least one NAME.toml"))

    total = sum(t.instances for t in templates.values())
    if total > MAX_UNITS:
        errors.append(UnitFileError(directory, "", f"{total} units after expanding instances; expected at most "
                                    f"{MAX_UNITS} in one stack"))
        return None, tuple(errors)
    units: dict[str, Unit] = {}
    # unit -> {dependency: the key that declares it}, for cycle messages.
    edges: dict[str, dict[str, str]] = {}
    for template in templates.values():
        for name, instance in instance_names(template):
            declared = declared_dependencies(template, name, instance, templates, broken, errors)
            units[name] = expand_unit(template, name, instance, directory, declared, errors)
            # `requires` last, so an edge declared by both keys is named by `requires`.
            edges[name] = {dep: key for key in ("after", "requires") for dep in declared[key]}

    tiers, tier_of = start_tiers(units, edges, errors)
    groups = worker_groups(units, errors)
    _check_group_hosts(units, settings, errors)
    check_socket_clashes(units, errors)
    required_by: dict[str, list[str]] = {n: [] for n in units}
    for unit in units.values():
        for dep in unit.requires:
            required_by[dep].append(unit.name)

    # The same mistake in a template repeats once per instance: report it once.
    # Sorted by file (stable) so each file's errors read together.
    unique = tuple(sorted(dict.fromkeys(errors), key=lambda e: str(e.file)))
    if unique:
        return None, unique
    return (
        Stack(
            directory=directory,
            units=MappingProxyType(dict(sorted(units.items()))),
            settings=settings,
            _tiers=tiers,
            _tier_of=MappingProxyType(tier_of),
            _required_by=MappingProxyType({n: tuple(r) for n, r in required_by.items()}),
            groups=MappingProxyType(groups),
            sources=MappingProxyType(sources),
        ),
        (),
    )


def _check_group_hosts(units: Mapping[str, Unit], settings: DaemonSettings, errors: list[UnitFileError]) -> None:
    """A group across hosts needs [cluster] in omnid.toml, and this host among its hosts."""
    seen: set[str] = set()
    for unit in units.values():
        if not unit.group_hosts or unit.template in seen:
            continue
        seen.add(unit.template)
        cluster = settings.cluster
        if cluster is None:
            errors.append(UnitFileError(unit.file, "group_hosts", "needs [cluster] in omnid.toml (etcd endpoints, "
                                        "this host's name and address); expected a [cluster] table"))
        elif cluster.host not in unit.group_hosts:
            errors.append(UnitFileError(unit.file, "group_hosts", f"this host ({cluster.host}, cluster.host) is not "
                                        f"among {list(unit.group_hosts)}; expected it listed"))
