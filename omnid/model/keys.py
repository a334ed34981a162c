"""The keys of a unit file (omnid.unit(5)), each written once: its name, the man page
subsection that documents it, its reader, its default, what a change of it does on
`omnid reload`, and one line saying what it is.

A default is written once, on the field of omnid.model.unitmodel.Unit of the key's name (a
Unit made in code gets it as well), and a row reads it from there (`FIELD`); a row writes
its own only where the field has none or means another thing (exec, instances, gpus).
Not the other way round: this table imports the model (its readers' types, its enums).

The parser (omnid.model.unitfile) reads every key through this table and accepts no other;
the reload planner (omnid.core.reload) takes its supervision-only keys from it; the
stack graph passes the parsed values through to the Unit by name; tests/test_unit_keys.py
holds the table, the parser, the planner, the Unit fields and the man page together.

A new key is one row here, a field of omnid.model.unitmodel.Unit of the same name (with its
default), and its entry in man/omnid.unit.5; code in omnid.model.unitfile only when it is
checked against another key. The rows are in the order the parser reads them, which is
the order of its error messages for one file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from omnid.model.unitmodel import MAX_PASSED_FDS, KillMode, RestartPolicy, Unit, UpdatePolicy
from omnid.model.unitvalues import (MAX_INSTANCES, argv, boolean, cache_name, cgroup_amount, choice, drain, env, gpus,
                              group_hosts, group_name, integer, limits, nonempty_string, numa, parse_signal, ready,
                              seconds, seconds_at_most, string, string_list)

__all__ = ["FIELD", "GROUP_POLICY_KEYS", "TEMPLATE_KEYS", "UNIT_KEY_BY_NAME", "UNIT_KEY_TABLE", "UNIT_KEYS",
           "OnChange", "UnitKey", "unit_default"]


class OnChange(StrEnum):
    """What `omnid reload` does to a running unit instance when the key changed."""

    RESTART = "restart"  # the key shapes the process: stopped and started again (or rolled)
    SUPERVISION = "supervision"  # only how omnid watches it: applied in place, same pid
    INSTANCES = "instances"  # instances are added or removed; the others are not touched


class _FieldDefault:
    """A row's default that is the one written on Unit's field of the same name."""

    def __repr__(self) -> str:
        return "FIELD"


FIELD: Any = _FieldDefault()
_UNIT_FIELDS = {f.name: f for f in dataclasses.fields(Unit)}


def unit_default(name: str) -> Any:
    """The default written on Unit's field `name`."""
    f = _UNIT_FIELDS[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"unit key {name}: Unit.{name} has no default; its row in the key table must write one")


@dataclass(frozen=True)
class UnitKey:
    name: str
    section: str  # the omnid.unit(5) subsection (.SS) that documents it
    # raw TOML value -> typed value, or InvalidValue; None: a table read by omnid.model.unitfile's own code
    parse: Callable[[Any], Any] | None
    default: Any  # when the key is absent (or invalid: the stack is then refused); FIELD: Unit's
    change: OnChange
    doc: str

    def __post_init__(self) -> None:
        if self.default is FIELD:
            object.__setattr__(self, "default", unit_default(self.name))


RUN, ORDER, HEALTH, STOP = "What to run", "Order and dependencies", "Readiness and health", "Stopping"
RESTARTING, SOCKETS, FDSTORE, GROUPS = "Restarting", "Listening sockets", "The fd store", "Worker groups"
R, S, I = OnChange.RESTART, OnChange.SUPERVISION, OnChange.INSTANCES

# FIELD: Unit's default. Rows with their own: exec is required (its default is never run), Unit has
# no default instances, and gpus' None is "not written" (CUDA_VISIBLE_DEVICES untouched; Unit's ()).
UNIT_KEY_TABLE: tuple[UnitKey, ...] = (
    UnitKey("exec", RUN, argv, ("true",), R, "the program and its arguments, run without a shell; required"),
    UnitKey("description", RUN, string, FIELD, S, "free text, shown in status"),
    UnitKey("role", RUN, string, FIELD, S, "what the unit is in the stack (serve, engine, worker, ...), shown in status"),
    UnitKey("title", RUN, string, FIELD, R, 'the process title of Python units; "" leaves it alone'),
    UnitKey("cwd", RUN, nonempty_string, FIELD, R, "the working directory, relative to the stack directory"),
    UnitKey("env", RUN, env, FIELD, R, "extra environment variables, %i and %n expanded"),
    UnitKey("user", RUN, nonempty_string, FIELD, R, "the user to run as, when the daemon runs as root"),
    UnitKey("group", RUN, nonempty_string, FIELD, R, "the group to run as, when the daemon runs as root"),
    UnitKey("limits", RUN, limits, FIELD, R, "resource limits, one key per rlimit (nofile, memlock, ...)"),
    UnitKey("ready", HEALTH, ready, FIELD, S, 'when the unit is ready: "started", "notify", { http } or { tcp }'),
    UnitKey("ready_timeout", HEALTH, seconds(zero_ok=False), FIELD, S, "seconds to become ready before it fails"),
    UnitKey("watchdog_sec", HEALTH, seconds(zero_ok=True), FIELD, S, "the WATCHDOG=1 deadline (notify units); 0 = off"),
    UnitKey("stop_signal", STOP, parse_signal, FIELD, S, "the signal that asks the unit to stop"),
    UnitKey("stop_timeout", STOP, seconds(zero_ok=False), FIELD, S, "seconds after stop_signal before SIGKILL"),
    UnitKey("kill_timeout", STOP, seconds(zero_ok=False), FIELD, S, "seconds after SIGKILL before it gives up"),
    UnitKey("capture_timeout", STOP, seconds_at_most(300.0), FIELD, S, "seconds the hang capture may take; 0 = none"),
    UnitKey("drain", STOP, drain, FIELD, S, "how a planned stop asks the unit to stop taking work: http or signal"),
    UnitKey("drain_timeout", STOP, seconds(zero_ok=False), FIELD, S, "the longest wait for a drain"),
    UnitKey("restart", RESTARTING, choice(RestartPolicy), FIELD, S, "no, on-failure or always"),
    UnitKey("restart_sec", RESTARTING, seconds(zero_ok=True), FIELD, S, "the first wait before a restart; 0 = at once"),
    UnitKey("restart_max_sec", RESTARTING, seconds(zero_ok=True), FIELD, S, "the longest wait between restarts"),
    UnitKey("start_limit_burst", RESTARTING, integer(1), FIELD, S, "more starts than this within the interval: failed"),
    UnitKey("start_limit_interval", RESTARTING, seconds(zero_ok=False), FIELD, S, "the start limit's window, seconds"),
    UnitKey("gpu_min_free_mib", RUN, integer(0), FIELD, S, "free memory on a GPU of the unit below this: degraded"),
    UnitKey("worker_group", GROUPS, group_name, FIELD, R, "units that fail, stop and restart together"),
    UnitKey("group_hosts", GROUPS, group_hosts, FIELD, R, "the hosts a worker group spans, the leading host first"),
    UnitKey("torch_distributed", GROUPS, None, FIELD, R, "torch.distributed env:// rendezvous for a worker group"),
    UnitKey("memory_max", RUN, cgroup_amount(bytes_=True), FIELD, R, "the unit cgroup's memory.max"),
    UnitKey("tasks_max", RUN, cgroup_amount(bytes_=False), FIELD, R, "the unit cgroup's pids.max"),
    UnitKey("liveness", HEALTH, None, FIELD, S, "a periodic http or exec probe while active"),
    UnitKey("progress", HEALTH, None, FIELD, S, "a forward-progress watchdog on a Prometheus endpoint"),
    UnitKey("ready_interval", HEALTH, seconds(zero_ok=True), FIELD, S, "an http/tcp ready probe's period while active"),
    UnitKey("kill_mode", STOP, choice(KillMode), FIELD, S, "who gets stop_signal, as systemd's"),
    UnitKey("leftover_timeout", STOP, seconds(zero_ok=True), FIELD, S, "seconds the leftovers of an exited unit get"),
    UnitKey("private_tmp", STOP, boolean, FIELD, R, "TMPDIR is a directory of the instance's own"),
    UnitKey("remove_ipc", STOP, boolean, FIELD, S, "the unit's IPC objects are removed when it is gone"),
    UnitKey("cache_dir", STOP, cache_name, FIELD, R, "a directory of its own that outlives restarts (compile caches)"),
    UnitKey("numa", RUN, numa, FIELD, R, 'CPU and memory placement: "auto", "off" or a node number'),
    UnitKey("sockets", SOCKETS, None, FIELD, R, "listening sockets held by the daemon, passed from fd 3"),
    UnitKey("update", RESTARTING, choice(UpdatePolicy), FIELD, S, "how a reload replaces instances"),
    UnitKey("max_unavailable", RESTARTING, integer(1, MAX_INSTANCES), FIELD, S, "instances a roll takes down at a time"),
    UnitKey("fd_store_max", FDSTORE, integer(0, MAX_PASSED_FDS), FIELD, R, "fds the unit may keep in the daemon (FDSTORE=1)"),
    UnitKey("abort_timeout", STOP, seconds(zero_ok=False), FIELD, S, "stop_timeout for a unit failed alive (hung)"),
    # The template's own keys: read after the keys above (omnid.model.unitfile).
    UnitKey("instances", RUN, integer(1, MAX_INSTANCES), 1, I, "how many units the file defines (NAME@0, ...)"),
    UnitKey("after", ORDER, string_list, FIELD, S, "units that must be ready before this one starts"),
    UnitKey("requires", ORDER, string_list, FIELD, S, "as after, and this unit stops when one of them fails"),
    UnitKey("gpus", RUN, gpus, None, R, 'the GPUs the unit uses (indexes, UUIDs, or "%i"); CUDA_VISIBLE_DEVICES'),
)  # fmt: skip

UNIT_KEYS = tuple(k.name for k in UNIT_KEY_TABLE)
UNIT_KEY_BY_NAME: Mapping[str, UnitKey] = MappingProxyType({k.name: k for k in UNIT_KEY_TABLE})
# Read by the parser after the cross-key checks; stored on the template, not among its values.
TEMPLATE_KEYS = ("instances", "after", "requires", "gpus")
# The restart policy of a worker group is one policy: every member must declare the same.
GROUP_POLICY_KEYS = ("restart", "restart_sec", "restart_max_sec", "start_limit_burst", "start_limit_interval")
