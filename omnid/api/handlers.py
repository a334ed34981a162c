"""The control commands (omnid-control(7)), one `handle_<cmd>` method each, dispatched by
name. Each checks its arguments (a bad one is a `bad_request` naming the argument),
then asks the supervisor or the daemon; none of them ever stops the daemon. A refusal
of the core (omnid.core.errors.RequestRefused) is answered here as a control error with
the same code and message: the core knows nothing of the control socket."""

from __future__ import annotations

import asyncio
import functools
import math
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from omnid.process import cgroup as cgroup_mod
from omnid.forensics import capture as forensics
from omnid.base import closer, linux
from omnid.process import output
from omnid import gpu as gpu_mod
from omnid.api.control import ControlError, Handler
from omnid.api.stackreads import StackReads
from omnid.core.errors import RequestRefused
from omnid.core.supervisor import UnitNotFound
from omnid.process.termination import StopRecord
from omnid.core.reload import plan
from omnid.model.units import InvalidValue, StackInvalid, check_stack, load_stack, parse_signal

CHECK_TIMEOUT_S = 30.0  # the `check` request (omnid-control(7))
MAX_TIMEOUT_S = 86400.0  # a control request's "timeout": at most a day (omnid-control(7))
MAX_LAST = 100  # the `dump` request's "last": captures per unit (omnid-control(7))


class NewProgram(Protocol):
    """What `reexec` reports of the program the daemon will become (omnid.handover.ProgramCheck)."""

    @property
    def argv(self) -> tuple[str, ...]: ...

    @property
    def version(self) -> str: ...


# The daemon's check of that program: it raises ControlError("reexec_refused", why) when the
# program does not start. Handed in by the daemon, which owns the re-exec (this module is below it).
CheckNewProgram = Callable[[], Awaitable[NewProgram]]


def answering(handler: Handler) -> Handler:
    """The handler, with a refusal of the core answered as the control error of the same code
    and message (the reply a client sees is the core's own words)."""

    @functools.wraps(handler)
    async def answered(args: dict) -> Any:
        try:
            return await handler(args)
        except RequestRefused as exc:
            raise ControlError(exc.code, exc.message) from None

    return answered


def units_arg(args: dict) -> list[str] | None:
    units = args.get("units")
    if units is None:
        return None
    if not isinstance(units, list) or not all(isinstance(x, str) and x for x in units):
        raise ControlError("bad_request", "\"units\" must be a list of unit names")
    return units or None


def timeout_arg(args: dict) -> float | None:
    t = args.get("timeout")
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
            or t <= 0 or t > MAX_TIMEOUT_S:
        raise ControlError("bad_request", f"\"timeout\" must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}, "
                                          f"got {str(t)[:60]!r}")
    return float(t)


def unit_arg(args: dict, cmd: str) -> str:
    unit = args.get("unit")
    if not isinstance(unit, str) or not unit:
        raise ControlError("bad_request", f"{cmd} needs \"unit\": a unit name")
    return unit


class ControlHandlers:
    def __init__(self, daemon: Any, check_new_program: CheckNewProgram) -> None:
        self.d = daemon  # omnid.daemon.Daemon (which imports this module)
        self.check_new_program = check_new_program
        self.reads = StackReads()  # check's and reload's reads of a stack directory

    @property
    def sup(self):  # noqa: ANN201 - the supervisor, once the daemon made it
        assert self.d.sup is not None
        return self.d.sup

    def table(self) -> dict:
        """{cmd: coroutine function} for the control server."""
        return {name[len("handle_"):]: answering(getattr(self, name)) for name in dir(self)
                if name.startswith("handle_")}

    def known(self, names: list[str] | None) -> None:
        if names:
            try:
                self.sup.expand(names)
            except UnitNotFound as exc:
                raise ControlError("unknown_unit", f"no unit named {exc.args[0]!r} in {self.d.cfg.units_dir}; "
                                                   f"units: {', '.join(self.sup.order)}") from None

    async def handle_status(self, args: dict) -> dict:
        sup, d = self.sup, self.d
        names = units_arg(args)
        self.known(names)
        wanted = set(sup.expand(names, whole_groups=False)) if names else None
        units = [s for s in sup.snapshot() if wanted is None or s["name"] in wanted]
        output.add_counters(units, sup.units)  # what a flooding unit cost
        forensics.add_last_capture(units, d.captures)
        out: dict = {"units": units, "daemon": {"pid": os.getpid(), "spawner_pid": d.spawner.pid,
                                               "spawner_exec_path": d.spawner.exec_path,
                                               "units_dir": d.cfg.units_dir, "since": sup.started_at,
                                               "shutting_down": sup.shutting_down,
                                               **cgroup_mod.backend(d.cgroups),
                                               "notify": dict(d.notify.counters) if d.notify else {},
                                               "foreign_fd_closes": closer.status(),
                                               "gpu": gpu_mod.status(d.gpu, sup),
                                               "events": {"subscriptions": d.control.subscriptions
                                                          if d.control else 0},
                                               **d.identity(),
                                               # `omnid status`'s first lines: the verdict /health
                                               # gives, and the start order to group units by
                                               "health": self.health_verdict(),
                                               "health_listen": d.cfg.health_listen,
                                               "tiers": [[u.name for u in t] for t in sup.stack.tiers()],
                                               "down_because": self.down_because(),
                                               **({"handover_error": d.handover_error} if d.handover_error
                                                  else {})}}
        if args.get("verify"):
            problems = sup.verify()
            if problems:
                # The kernel may be a few ms ahead of the loop (a death not yet processed): look again.
                await asyncio.sleep(0.1)
                problems = sup.verify()
            out["verify"] = {"ok": not problems, "problems": problems,
                             "invariant_violations": list(sup.invariant_violations)}
        return out

    def health_verdict(self) -> str:
        """What GET /health says now (ok, starting, degraded, failed, draining, stopping)."""
        from omnid.api import verdict

        sup = self.sup
        return verdict.overall(sup, sup.degraded, verdict.gpu_view(sup))

    def down_because(self) -> dict[str, str]:
        """{unit: the failed unit it requires (directly or through others)} for each unit that
        wants to run and is not up because a requirement failed: `omnid status`'s root cause."""
        from omnid.core.lifecycle import Goal, UnitState

        sup = self.sup

        def failed_under(name: str, seen: set[str]) -> str | None:
            for r in sup.units[name].spec.requires:
                for req in sup.stack.resolve(r):
                    if req.name in seen:
                        continue
                    seen.add(req.name)
                    if sup.units[req.name].state is UnitState.FAILED:
                        return req.name
                    found = failed_under(req.name, seen)
                    if found:
                        return found
            return None

        out = {}
        for rt in sup.units.values():
            if rt.goal is Goal.ACTIVE and rt.state in (UnitState.INACTIVE, UnitState.STOPPING):
                cause = failed_under(rt.name, {rt.name})
                if cause:
                    out[rt.name] = cause
        return out

    async def handle_start(self, args: dict) -> dict:
        if self.sup.shutting_down:
            raise ControlError("shutting_down", "the daemon is stopping; start it again afterwards")
        names = units_arg(args)
        self.known(names)
        units = await self.sup.requests.start_units(names, timeout_arg(args))
        return {"ok": all(u["state"] == "active" for u in units), "units": units}

    async def handle_stop(self, args: dict) -> dict:
        names = units_arg(args)
        if names is None:
            raise ControlError("bad_request", "stop needs \"units\"; to stop the whole stack use \"shutdown\"")
        self.known(names)
        recs = await self.sup.requests.stop_units(names, timeout_arg(args), for_good=True)
        return {"summary": [r.to_json() for r in recs], "units": self.sup.snapshot()}

    async def handle_restart(self, args: dict) -> dict:
        names = units_arg(args)
        if names is None:
            raise ControlError("bad_request", "restart needs \"units\"")
        self.known(names)
        rolling = args.get("rolling", False)
        if not isinstance(rolling, bool):
            raise ControlError("bad_request", f"\"rolling\" must be true or false, got {rolling!r}")
        if rolling:
            refused = self.sup.requests.roll_refusal(names)
            if refused:
                raise ControlError("bad_request", refused)
            if args.get("dry_run"):
                return {"dry_run": True, "plan": self.roll_plan(names)}
            units, why = await self.sup.requests.roll(names, timeout_arg(args))
            return {"ok": not why and all(u["state"] == "active" for u in units), "units": units,
                    "rolling": True, **({"stopped": why} if why else {})}
        if args.get("dry_run"):
            return {"dry_run": True, "plan": self.restart_plan(names)}
        units = await self.sup.requests.restart_units(names, timeout_arg(args))
        return {"ok": all(u["state"] == "active" for u in units), "units": units}

    def roll_plan(self, names: list[str]) -> list[dict]:
        """What `restart --rolling` does: the instances in turn, nothing else."""
        sup = self.sup
        named = sup.expand(names, whole_groups=False)
        step = min(sup.units[n].spec.max_unavailable for n in named)
        return [{"unit": n, "why": f"rolled: {step} at a time, the next once the new one is ready; units that "
                                   f"require it keep running"} for n in named]

    def restart_plan(self, names: list[str]) -> list[dict]:
        """What a restart of `names` stops and starts again, each unit with why, in start
        order: the named units, the rest of their worker groups, then the units that require
        one of them (directly or through others) and are up now (`omnid restart` prints it
        before it acts, as systemctl lists the jobs a transaction pulls in)."""
        sup = self.sup
        named = sup.expand(names, whole_groups=False)
        targets = sup.expand(names)
        out = [{"unit": n, "why": "named"} for n in named]
        out += [{"unit": n, "why": f"worker group {sup.units[n].spec.worker_group}: its ranks restart together"}
                for n in targets if n not in named]
        going = set(targets)
        for n in sorted(sup.requests.dependents_up(targets), key=sup.order.index):
            reqs = [r for r in sup.units[n].spec.requires if any(u.name in going for u in sup.stack.resolve(r))]
            out.append({"unit": n, "why": f"requires {', '.join(reqs)}: stopped before it, started after it"})
            going.add(n)
        return out

    async def handle_kill(self, args: dict) -> dict:
        unit = unit_arg(args, "kill")
        self.known([unit])
        raw = args.get("signal", "SIGTERM")
        if isinstance(raw, int) and not isinstance(raw, bool):
            # omnid-control(7): a name or a number. Any signal the kernel knows, 0 excluded.
            if not 1 <= raw <= signal.SIGRTMAX:
                raise ControlError("bad_request", f"bad \"signal\": {raw} is not a signal number "
                                                  f"(1 to {int(signal.SIGRTMAX)})")
            sig = raw
        else:
            try:
                sig = int(parse_signal(raw))
            except InvalidValue as exc:
                raise ControlError("bad_request", f"bad \"signal\": {exc}") from None
        hit = self.sup.requests.kill_unit(unit, sig)
        if not hit:
            raise ControlError("not_running", f"unit {unit!r} has no running process to signal")
        return {"signalled": hit, "signal": linux.signal_name(sig)}

    async def handle_logs(self, args: dict) -> dict:
        unit = unit_arg(args, "logs")
        self.known([unit])
        n = args.get("n", 50)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ControlError("bad_request", f"\"n\" must be a non-negative integer, got {n!r}")
        return {name: self.sup.units[name].output.tail(n) for name in self.sup.expand([unit], whole_groups=False)}

    async def handle_shutdown(self, args: dict) -> dict:
        d = self.d
        assert d.shutdown_requested is not None and d.shutdown_result is not None
        d.shutdown_requested.set()
        recs: list[StopRecord] = await asyncio.shield(d.shutdown_result)
        return {"summary": [r.to_json() for r in recs]}

    async def handle_check(self, args: dict) -> dict:
        directory = args.get("units_dir") or self.d.cfg.units_dir
        if not isinstance(directory, str):
            raise ControlError("bad_request", "\"units_dir\" must be a path")
        # Off the loop (a big stack takes seconds to read) and bounded: /health and deaths
        # keep their milliseconds while it runs; a read stuck on a hung mount holds a thread of
        # its own (omnid.api.stackreads).
        try:
            errors = await self.reads.run(f"check {directory}", lambda: check_stack(directory), CHECK_TIMEOUT_S)
        except TimeoutError:
            raise ControlError("timeout", f"checking {directory} took more than {CHECK_TIMEOUT_S:g} s") from None
        return {"ok": not errors, "units_dir": directory, "errors": [str(e) for e in errors]}

    async def handle_dump(self, args: dict) -> dict:
        """Hang forensics (omnid.forensics): {"unit": U, "last": N, "now": bool} -> {"captures": [...]},
        the kept captures of a unit, or one taken now, each {"unit", "text", "capture"} (the JSON
        form), oldest first per unit."""
        sup = self.sup
        unit = unit_arg(args, "dump")
        last = args.get("last", 1)
        if isinstance(last, bool) or not isinstance(last, int) or not 1 <= last <= MAX_LAST:
            raise ControlError("bad_request", f"\"last\" must be a whole number from 1 to {MAX_LAST}, "
                                              f"got {str(last)[:40]!r}")
        now = args.get("now", False)
        if not isinstance(now, bool):
            raise ControlError("bad_request", f"\"now\" must be true or false, got {str(now)[:40]!r}")
        try:
            names = sup.expand([unit], whole_groups=False)
        except KeyError:
            raise ControlError("unknown_unit", f"no unit named {unit[:100]!r}; units: "
                                               f"{', '.join(list(sup.units)[:20])}") from None
        running = [n for n in names if sup.units[n].proc is not None] if now else []
        if now and not running:
            raise ControlError("not_running", f"unit {unit!r} has no running process to capture "
                                              f"(`omnid dump {unit}` shows the captures omnid kept)")
        return {"captures": await forensics.dump(sup, self.d.captures, names, last, capture_now=running)}

    async def handle_wait(self, args: dict) -> dict:
        """Wait (up to "timeout") for the daemon's first start of the stack to settle, without
        starting anything: `omnid start` launching a fresh daemon uses it, so a unit that
        failed with restart = "no" runs once."""
        d = self.d
        assert d.settled is not None and d.shutdown_requested is not None
        timeout = timeout_arg(args)
        waits = [asyncio.ensure_future(d.settled.wait()), asyncio.ensure_future(d.shutdown_requested.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if d.shutdown_requested.is_set() and not d.settled.is_set():
            raise ControlError("shutting_down", "the daemon is stopping (see its log for why)")
        units = self.sup.snapshot()
        return {"ok": d.settled.is_set() and all(u["state"] == "active" for u in units),
                "settled": d.settled.is_set(), "units": units}

    async def handle_reload(self, args: dict) -> dict:
        """Re-read the stack directory and apply only the difference (omnid(8), RELOAD).
        An invalid stack changes nothing: `invalid_stack`, every error named."""
        d = self.d
        dry_run = args.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise ControlError("bad_request", f"\"dry_run\" must be true or false, got {dry_run!r}")
        timeout = timeout_arg(args)
        if self.sup.shutting_down and not dry_run:
            raise ControlError("shutting_down", "the stack is stopping; reload refused (nothing changed)")
        directory = d.cfg.units_dir
        try:
            new = await self.reads.run(f"reload {directory}", lambda: load_stack(directory), CHECK_TIMEOUT_S)
        except StackInvalid as exc:
            raise ControlError("invalid_stack", f"{directory}: {len(exc.errors)} error(s); nothing changed:\n"
                               + "\n".join(f"  {e}" for e in exc.errors)) from None
        except TimeoutError:
            raise ControlError("timeout", f"reading {directory} took more than {CHECK_TIMEOUT_S:g} s; "
                                          "nothing changed") from None
        try:
            cgroup_mod.check_stack_keys(d.cgroups, new)
        except cgroup_mod.CgroupError as exc:
            raise ControlError("invalid_stack", f"{directory}: {exc}; nothing changed") from None
        p = plan(self.sup.stack, new, {k: d.cfg.source(k) for k in ("control", "state_dir", "health_listen",
                                                                      "cgroup_root", "log_format")})
        out = {**p.to_json(), "dry_run": dry_run}
        if dry_run:
            return out
        try:  # SIGHUP calls this method directly, not through table(): the refusal is answered here
            units = await self.sup.reloader.apply(new, p, timeout)
        except RequestRefused as exc:  # a reload refused, or its stop overtaken by a request
            raise ControlError(exc.code, exc.message) from None
        d.stack = new
        units, why = units
        out["units"] = units
        out["ok"] = not why and all(u["state"] == "active" for u in units)
        if why:
            out["stopped"] = why
        return out

    async def handle_reexec(self, args: dict) -> dict:
        """Replace the daemon's program with the omnid installed now, same pid, every unit kept
        (omnid(8), RE-EXEC). Answers once the new program is known to start; the handover
        follows right after the answer."""
        from omnid.version import version

        d = self.d
        if self.sup.shutting_down:
            raise ControlError("shutting_down", "the stack is stopping; re-exec refused")
        if d.reexec is not None and not d.reexec.done():
            raise ControlError("busy", "a re-exec is already under way")
        if self.sup.crosshost is not None and (why := self.sup.crosshost.exec_refusal()) is not None:
            raise ControlError("reexec_refused", f"{why}; nothing changed")
        check = await self.check_new_program()  # ControlError("reexec_refused") when it does not start
        d.start_reexec(check)
        return {"pid": os.getpid(), "old_version": version(), "new_version": check.version,
                "reexecs": d.reexecs, "program_since": d.program_since, "program": " ".join(check.argv)}
