"""`omnid reload`: apply an edited stack directory to a running one, changing only what
changed (omnid(8), RELOAD). A GPU stack takes minutes to load: a needless restart is
an outage, so each unit instance is compared key by key:

- added: started;
- removed: stopped, in reverse dependency order, with its own stop settings;
- restarted: a key that shapes the process changed (exec, env, cwd, user, group,
  limits, gpus, title, numa, cgroup limits, worker-group keys and membership): stopped
  and started with the new definition; units that require it follow as after any
  restart; a unit with `update = "rolling"` and several instances is rolled instead
  (`OperatorRequests.roll`): `max_unavailable` instances at a time, its dependents kept;
- updated: only supervision settings changed: it keeps running (same pid) and the new
  settings apply from now on;
- unchanged: not touched.

`plan` is pure; `Reloader.apply` carries a plan out on the supervisor: the updated
specs first (so that a unit no longer requiring a removed one is not taken down with
it), then the stops, then the new stack, then the starts, waiting like `restart`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from omnid.core.centre import Centre
from omnid.core.errors import RequestRefused
from omnid.core.lifecycle import Goal, UnitState
from omnid.core.runtime import RestartBook, UnitRuntime
from omnid.process.output import UnitOutput
from omnid.model.keys import UNIT_KEY_TABLE, OnChange
from omnid.model.units import ReadyKind, Stack, UpdatePolicy
from omnid.model.units import Unit as UnitSpec

log = structlog.get_logger("omnid.reload")
S = UnitState

# Fields that say who a unit instance is, not what it runs (a change of `instances` adds or
# removes instances and leaves the others alone).
_IDENTITY = frozenset({"name", "template", "instance", "file"} |
                      {k.name for k in UNIT_KEY_TABLE if k.change is OnChange.INSTANCES})
# Keys that only say how omnid supervises a running process: changed in place (omnid.model.keys).
SUPERVISION_KEYS = frozenset(k.name for k in UNIT_KEY_TABLE if k.change is OnChange.SUPERVISION)
# Daemon settings a running daemon cannot change (its sockets, files and cgroup root).
FIXED_SETTINGS = ("control", "state_dir", "health_listen", "cgroup_root", "log_format", "cluster", "exit_when_failed")


@dataclass(frozen=True)
class Plan:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    restarted: dict[str, list[str]] = field(default_factory=dict)  # unit -> the keys that changed
    updated: dict[str, list[str]] = field(default_factory=dict)
    unchanged: list[str] = field(default_factory=list)
    settings: list[dict[str, Any]] = field(default_factory=list)  # omnid.toml changes, and what applies them
    notes: dict[str, str] = field(default_factory=dict)  # unit -> a caveat for the operator

    def to_json(self) -> dict[str, Any]:
        return {"added": list(self.added), "removed": list(self.removed), "restarted": sorted(self.restarted),
                "updated": sorted(self.updated), "unchanged": list(self.unchanged),
                "changes": {**self.restarted, **self.updated}, "settings": list(self.settings),
                "notes": dict(self.notes)}

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.restarted or self.updated)


def changed_keys(old: UnitSpec, new: UnitSpec) -> list[str]:
    out = []
    for f in dataclasses.fields(old):
        if f.name in _IDENTITY:
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if f.name == "env":
            a, b = dict(a), dict(b)
        if a != b:
            out.append(f.name)
    return out


def plan(old: Stack, new: Stack, sources: dict[str, str] | None = None) -> Plan:
    """What a reload from `old` to `new` does, unit instance by unit instance. `sources`
    ({setting: "flag" | "env" | "omnid.toml" | "default"}) says where each daemon setting
    came from, so that an omnid.toml change that a flag overrides is reported as such."""
    p = Plan()
    for name in new.units:
        if name not in old.units:
            p.added.append(name)
    for name in old.units:
        if name not in new.units:
            p.removed.append(name)
            continue
        keys = changed_keys(old.units[name], new.units[name])
        if old.group_members(name) != new.group_members(name) and old.units[name].worker_group:
            keys.append("worker_group members")
        if not keys:
            p.unchanged.append(name)
        elif any(k not in SUPERVISION_KEYS for k in keys):
            p.restarted[name] = keys
        else:
            p.updated[name] = keys
            note = _watchdog_note(old.units[name], new.units[name])
            if note:
                p.notes[name] = note
    # A member of a worker group restarts its whole group (its ranks are one job).
    for name in list(p.restarted):
        for m in new.group_members(name):
            if m in p.updated or m in p.unchanged:
                p.restarted[m] = p.updated.pop(m, []) + [f"worker group member {name} restarts"]
                if m in p.unchanged:
                    p.unchanged.remove(m)
    for key in FIXED_SETTINGS:
        a, b = getattr(old.settings, key, None), getattr(new.settings, key, None)
        if a != b:
            origin = (sources or {}).get(key, "omnid.toml")
            applies = ("no effect: set by the " + origin) if origin in ("flag", "env") else \
                "needs a restart of the daemon (omnid reexec keeps the running daemon's sockets and files)"
            p.settings.append({"key": key, "from": _str(a), "to": _str(b), "applies": applies})
    return p


def rolled_units(old: Stack, new: Stack, p: Plan) -> list[str]:
    """The restarted instances a reload rolls instead of restarting at once: those of a unit
    with `update = "rolling"` and more than one instance, in the old stack and the new, that
    is no worker group (a group restarts as one thing) and whose every instance restarts."""
    by_template: dict[str, list[str]] = {}
    for n in p.restarted:
        spec = new.units[n]
        by_template.setdefault(spec.template, []).append(n)
    out: list[str] = []
    for template, names in by_template.items():
        specs = [new.units[n] for n in names]
        if any(s.update is not UpdatePolicy.ROLLING or s.worker_group or s.instances < 2 for s in specs):
            continue
        if any(old.units[n].worker_group for n in names):
            continue
        olds = [u for u in old.units.values() if u.template == template]
        if len(olds) != len(names) or len(names) != specs[0].instances:  # instances added or removed
            continue
        out.extend(sorted(names, key=lambda n: new.units[n].instance))
    return out


def _watchdog_note(old: UnitSpec, new: UnitSpec) -> str:
    gains_notify = old.ready.kind is not ReadyKind.NOTIFY and new.ready.kind is ReadyKind.NOTIFY
    if gains_notify and new.watchdog_sec > 0:
        return ("watchdog_sec applies from its next start: the running process was started without "
                "NOTIFY_SOCKET and cannot ping")
    if old.watchdog_sec > 0 and 0 < new.watchdog_sec < old.watchdog_sec:
        return (f"the running process keeps the WATCHDOG_USEC it was started with ({old.watchdog_sec:g} s); "
                f"a shorter watchdog_sec ({new.watchdog_sec:g} s) may expire before its next ping")
    return ""


def _str(v: Any) -> str | None:
    return None if v is None else str(v)


class ReloadError(RequestRefused):
    """A reload refused before it changed anything (busy, the stack is stopping)."""


class Reloader:
    """One reload at a time; none while the stack stops."""

    def __init__(self, sup: Centre) -> None:
        self.sup = sup
        self.running_since: float | None = None
        self.idle = asyncio.Event()  # set while no reload is being applied
        self.idle.set()

    async def apply(self, new: Stack, p: Plan, timeout: float | None) -> tuple[list[dict], str]:
        """Carry the plan out; returns the snapshots of what it started and why a roll
        stopped ("" when none did)."""
        sup = self.sup
        if sup.shutting_down:
            raise ReloadError("shutting_down", "the stack is stopping; reload refused (nothing changed)")
        if self.running_since is not None:
            raise ReloadError("busy", f"a reload is already being applied (for "
                                      f"{time.monotonic() - self.running_since:.1f} s); try again when it is done")
        self.running_since = time.monotonic()
        self.idle.clear()
        try:
            return await self._apply(new, p, timeout)
        finally:
            self.running_since = None
            self.idle.set()

    async def _apply(self, new: Stack, p: Plan, timeout: float | None) -> tuple[list[dict], str]:
        sup = self.sup
        deadline = None if timeout is None else time.monotonic() + timeout
        log.info("reload", added=p.added, removed=p.removed, restarted=sorted(p.restarted), updated=sorted(p.updated))
        for name in p.updated:  # first: a unit that stops requiring a removed one must not stop with it
            self._update(sup.units[name], new.units[name], p.notes.get(name, ""))
        rolled = rolled_units(sup.stack, new, p)
        restarted = [n for n in p.restarted if n not in rolled]
        took_down = sup.requests.dependents_up(restarted)
        stopping = [*p.removed, *restarted]
        if stopping:
            await sup.requests.stop_units(stopping, timeout)
        old_specs = {n: sup.units[n].spec for n in rolled}
        self._swap(new, p)
        for n, spec in old_specs.items():  # until the roll reaches it, an instance runs its old spec
            sup.units[n].spec = spec
        starting = [*p.added, *restarted]
        for name in starting:
            sup.units[name].goal = Goal.ACTIVE
        back = [n for n in sup.order if n in starting or n in took_down]
        out: list[dict] = []
        if back:
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            out = await sup.requests.start_units(back, left)
        if not rolled:
            return out, ""
        left = None if deadline is None else max(0.1, deadline - time.monotonic())
        units, why = await sup.requests.roll(rolled, left, {n: new.units[n] for n in rolled})
        return out + units, why

    def _update(self, rt: UnitRuntime, spec: UnitSpec, note: str) -> None:
        """New supervision settings for a running unit: from now on, same process."""
        old = rt.spec
        rt.spec = spec
        if rt.state is S.ACTIVE and (old.liveness, old.watchdog_sec, old.progress, old.ready, old.ready_interval) != (
                spec.liveness, spec.watchdog_sec, spec.progress, spec.ready, spec.ready_interval):
            self.sup.monitors.restart(rt, keep_watchdog_off=bool(note) and "next start" in note)

    def _swap(self, new: Stack, p: Plan) -> None:
        """The new stack is in force: runtimes for added units, new specs for restarted ones,
        removed ones forgotten (they are stopped: no fd is held for them)."""
        sup = self.sup
        old_units = sup.units
        books: dict[str, RestartBook] = {}
        for g, members in new.groups.items():
            same = [m for m in members if m in old_units and old_units[m].spec.worker_group == g]
            keep = old_units[same[0]].book if same and sup.stack.groups.get(g) == members else None
            books[g] = keep if keep is not None else RestartBook()
        units: dict[str, UnitRuntime] = {}
        for tier in new.tiers():
            for spec in tier:
                rt = old_units.get(spec.name)
                book = books[spec.worker_group] if spec.worker_group else None
                if rt is None:
                    rt = UnitRuntime(spec=spec, book=book or RestartBook(),
                                     output=UnitOutput(spec.name, echo=sup.echo_output))
                else:
                    if spec.worker_group or rt.spec.worker_group:
                        rt.book = book or RestartBook()
                    rt.spec = spec
                units[spec.name] = rt
        for name in p.removed:
            sup.executor.forget(name)
        sup.replace_stack(new, units)
        sup.sockets.keep_only(new.units.values())  # a changed one is replaced at the unit's start
        sup.fdstore.keep_only(new.units)  # a removed instance's stored fds are closed
