"""The supervisor: units' state machine, the converge loop, start, stop, failure
and restart (DESIGN.md Part 1: "Unit state machine", "Stopping a stack",
"Failure detection and propagation").

Shape (after runit and s6): every unit has a `state` (kernel truth) and a `goal`
(operator intent). `_converge` is the only place that decides what to do next;
it runs after every event and launches at most one *op* per unit (start, stop,
fail). `_transition` is the only place where a state changes. A readable pidfd
is the death event: there is no polling loop for liveness of processes.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from omnid import linux, numa
from omnid.groups import RestartBook, WorkerGroups, book_field
from omnid.invariants import Invariants
from omnid.lifecycle import Event, Release, StartMonitors, UnitView, step
from omnid.lifecycle import Signal as LcSignal
from omnid.monitors import Monitors
from omnid.output import UnitOutput
from omnid.probes import ProbeFailed, http_probe, tcp_probe
from omnid.process import DAEMON_TAG, UNIT_TAG, ProcessHandle
from omnid.requests import OperatorRequests, Superseded  # noqa: F401 - Superseded is public here too
from omnid.cgroup import CgroupTarget, cgroup_limits
from omnid.spawnclient import ExitReport, Spawned, SpawnError, SpawnerClient, SpawnRequest
from omnid.states import Goal, UnitState, check_transition
from omnid.tasks import report_crash
from omnid.termination import ProcessGroupTarget, StopRecord, Target, terminate
from omnid.units import Stack
from omnid.units import Unit as UnitSpec

log = structlog.get_logger("omnid.supervisor")
S = UnitState
E = Event

RUNNER = str(Path(__file__).with_name("runner.py"))
_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")
GROUP_POLL_S = 0.005


class UnitNotFound(KeyError):
    pass


_PID_SUFFIX = re.compile(r" \(pid \d+, while \w+\)")


@dataclass
class Unit:
    spec: UnitSpec
    state: UnitState = S.INACTIVE
    goal: Goal = Goal.ACTIVE
    reason: str = ""
    since: float = field(default_factory=time.time)
    proc: ProcessHandle | None = None
    last_pgid: int = 0
    ready: bool = False
    restarts: int = 0
    book: RestartBook = field(default_factory=RestartBook)
    last_exit: str = ""
    last_exit_code: int | None = None
    last_signal: int | None = None
    active_since: float = 0.0  # monotonic
    op: asyncio.Task | None = None
    op_kind: str = ""
    output: UnitOutput | None = None
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)
    status_text: str = ""
    stopping_notified: bool = False
    watchdog_timer: asyncio.TimerHandle | None = None
    watchdog_last: float = 0.0
    monitor: asyncio.Task | None = None
    last_stop: StopRecord | None = None
    death_detect_ms: float | None = None  # pidfd wake-up -> state change, last death
    # After the last stop or failure: ms until its pids held no GPU memory (None: cannot
    # tell or still held), and what was still held at the deadline.
    gpu_release_ms: float | None = None
    gpu_held: list[str] = field(default_factory=list)
    deaths: int = 0
    cause: str = ""  # the last failure, without pid: what dependents' reasons name
    ready_deadline: float = 0.0  # monotonic: when a `starting` unit is failed for not being ready
    goal_seq: int = 0  # bumped by every operator start/stop: a waiter sees it was overtaken
    goal_by: str = ""  # "start" or "stop": the last operator request on this unit

    start_times = book_field("start_times")
    consecutive_failures = book_field("consecutive_failures")
    restart_at = book_field("restart_at")
    restart_pending = book_field("restart_pending")
    gave_up = book_field("gave_up")

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dead(self) -> bool:
        """The main process exited (pidfd readable) and the failure is on its way: from
        this moment on the unit counts as failed for /health, before the op records it."""
        return self.proc is not None and self.proc.exited.is_set() and self.op_kind != "stop"

    def snapshot(self) -> dict:
        p = self.proc
        return {
            "name": self.name,
            "role": self.spec.role,
            "description": self.spec.description,
            "state": self.state.value,
            "goal": self.goal.value,
            "pid": p.pid if p else None,
            "pgid": p.pgid if p else None,
            "restarts": self.restarts,
            "since": self.since,
            "reason": self.reason,
            "ready": self.ready,
            "status_text": self.status_text,
            "last_exit": self.last_exit,
            "last_exit_code": self.last_exit_code,
            "last_signal": linux.signal_name(self.last_signal) if self.last_signal else None,
            "gave_up": self.gave_up,
            "instance": self.spec.instance,
            "gpus": list(self.spec.gpus),
            "placement": numa.status(self.spec),  # omnid.numa: CPUs and memory node at spawn
            "generation": self.book.generation,
            "gpu_release_ms": self.gpu_release_ms,
            "gpu_held": list(self.gpu_held),
            **({"worker_group": self.spec.worker_group} if self.spec.worker_group else {}),
        }


class Supervisor(OperatorRequests, Monitors, Invariants, WorkerGroups):
    """Units' state and the ops that change it; operator requests, monitors and the
    invariant check are mixed in from omnid.requests, omnid.monitors, omnid.invariants."""

    def __init__(
        self,
        stack: Stack,
        spawner: SpawnerClient,
        *,
        token: str,
        notify_socket: str | None = None,
        publish: Callable[[dict], None] | None = None,
        on_pids_changed: Callable[[], None] | None = None,
        check_invariants: bool = False,
        gpu: object | None = None,
        echo_output: bool = True,
        cgroups: object | None = None,
    ) -> None:
        self.stack = stack
        self.spawner = spawner
        self.token = token
        self.notify_socket = notify_socket
        self.publish = publish or (lambda ev: None)
        self.on_pids_changed = on_pids_changed or (lambda: None)
        self.check_invariants = check_invariants
        self.gpu = gpu
        self.cgroups = cgroups  # omnid.cgroup.CgroupRoot or None (process groups)
        self.order: list[str] = [u.name for tier in stack.tiers() for u in tier]  # start order
        self.units: dict[str, Unit] = {}
        books = {g: RestartBook() for g in stack.groups}  # a worker group restarts as one
        for name, spec in stack.units.items():
            u = Unit(spec=spec, book=books[spec.worker_group] if spec.worker_group else RestartBook())
            u.output = UnitOutput(name, echo=echo_output)
            self.units[name] = u
        self._dependents_after: dict[str, list[str]] = {n: [] for n in self.order}
        for name, spec in stack.units.items():
            for dep in spec.dependencies:
                self._dependents_after[dep].append(name)
        self._by_pid: dict[int, tuple[Unit, ProcessHandle]] = {}
        self._early_exits: dict[int, ExitReport] = {}
        self._early_notify: dict[int, list[dict[str, str]]] = {}  # session id -> messages before its spawn reply
        self._converge_pending = False
        self._waiting_on_requirement: set[str] = set()  # inactive units whose reason names a requirement
        self._changed = asyncio.Condition()
        self._waker: asyncio.Task | None = None
        self.invariant_violations: list[str] = []
        self.shutting_down = False
        self.started_at = time.time()
        self.gpu_mib: dict[str, float] = {}  # unit -> GPU memory of its processes (last GPU watch)
        self.degraded: dict[str, str] = {}  # unit -> why (gpu_min_free_mib)

    # ------------------------------------------------------------------ lookup
    def get(self, name: str) -> Unit:
        try:
            return self.units[name]
        except KeyError:
            raise UnitNotFound(name) from None

    def expand(self, names: Iterable[str], whole_groups: bool = True) -> list[str]:
        """Unit names as the operator typed them: templates mean all instances, and a member of
        a worker group means the whole group (its ranks are one thing)."""
        out: list[str] = []
        for n in names:
            if n in self.units:
                out.extend(self.stack.group_members(n) if whole_groups else (n,))
                continue
            inst = [u for u in self.order if self.units[u].spec.template == n]
            if not inst:
                raise UnitNotFound(n)
            for i in inst:
                out.extend(self.stack.group_members(i) if whole_groups else (i,))
        return list(dict.fromkeys(out))

    # -------------------------------------------------------------- transition
    def _transition(self, u: Unit, event: Event, reason: str, *, failing: bool = False,
                    leftovers: bool = False) -> tuple:
        """The only place where a unit's state changes: lifecycle.step decides the new
        state; the synchronous actions (Release, StartMonitors, Publish) are carried out
        here and all actions are returned: the op that fed the event in carries out the
        timed ones (the Signal with its ArmTimers is one `terminate` call)."""
        frm = u.state
        to, actions = step(UnitView(u.name, frm, u.goal, failing=failing, leftovers=leftovers), event)
        check_transition(u.name, frm, to)
        u.state = to
        u.reason = reason
        u.since = time.time()
        if to is S.INACTIVE and reason.startswith("stopped: requires "):
            self._waiting_on_requirement.add(u.name)
        else:
            self._waiting_on_requirement.discard(u.name)
        if to is not S.ACTIVE:
            u.ready = False
            self._stop_monitors(u)
        pid = u.proc.pid if u.proc else None
        for action in actions:
            if isinstance(action, Release):
                self._release(u)
        if to in (S.INACTIVE, S.FAILED) and u.spec.worker_group and u.book.up \
                and self._group_settled(u, frozenset({u.name})):
            u.book.up = False  # every member is down: the next start is a new generation
        started_monitors = any(isinstance(a, StartMonitors) for a in actions)
        log.info("unit state", unit=u.name, **{"from": frm.value, "to": to.value}, on=event.value, reason=reason,
                 pid=pid)
        self.publish({"ts": time.time(), "unit": u.name, "pid": pid, "from": frm.value, "to": to.value,
                      "reason": reason})
        if self.check_invariants:
            for problem in self.verify_unit(u, settled=True):
                self.invariant_violations.append(problem)
                log.error("invariant violated", unit=u.name, problem=problem)
        self._notify_changed()
        self._kick()
        if started_monitors:
            self._start_monitors(u)
        return actions

    def _signal_of(self, u: Unit, actions: tuple) -> tuple[int, bool]:
        """The first signal step asked for, as a number, and whether SIGCONT follows it."""
        for a in actions:
            if isinstance(a, LcSignal):
                sig = u.spec.stop_signal if a.sig == "stop_signal" else int(getattr(signal, a.sig))
                return sig, a.cont
        raise RuntimeError(f"{u.name}: lifecycle step gave no signal to send: {actions}")

    def _notify_changed(self) -> None:
        """Wake every wait_until(); coalesced into one task per loop iteration."""
        if self._waker is not None and not self._waker.done():
            return

        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        self._waker = report_crash(asyncio.get_running_loop().create_task(wake()), "wait_until wake-up")

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        async def waiter() -> None:
            async with self._changed:
                await self._changed.wait_for(predicate)

        try:
            await asyncio.wait_for(waiter(), timeout)
            return True
        except asyncio.TimeoutError:
            return predicate()

    def _release(self, u: Unit) -> None:
        """A unit that is inactive or failed holds no fd for its processes."""
        h = u.proc
        if h is not None:
            h.close()
            self._by_pid.pop(h.pid, None)
            u.proc = None
            self.on_pids_changed()
        if u.output is not None:
            u.output.detach()

    # ----------------------------------------------------------------- converge
    def _kick(self) -> None:
        if not self._converge_pending:
            self._converge_pending = True
            asyncio.get_running_loop().call_soon(self._converge)

    def _down(self, u: Unit, seen: frozenset = frozenset()) -> bool:
        """Is this unit unavailable to units that require it (not active, or on its way down)?"""
        if u.state is not S.ACTIVE or u.goal is Goal.INACTIVE:
            return True
        if u.name in seen:
            return False
        return any(self._down(self.units[r], seen | {u.name}) for r in u.spec.requires)

    def _must_stop(self, u: Unit) -> str | None:
        """Why a running unit has to stop now, or None."""
        if u.goal is Goal.INACTIVE:
            return "stopped by request" if not self.shutting_down else "stack stopping"
        if u.spec.worker_group and u.book.down_reason is not None:
            return f"stopped: worker group {u.spec.worker_group} is down: {u.book.down_reason}"
        for r in u.spec.requires:
            if self._down(self.units[r]):
                return f"stopped: requires {self._root_cause(r)}"
        return None

    def _root_cause(self, name: str, seen: frozenset = frozenset()) -> str:
        """Why unit `name` is unavailable, down to the unit that started it:
        "engine@0, which requires worker@1, which failed: killed by SIGKILL"."""
        ru = self.units[name]
        if ru.state is S.FAILED or ru.dead or ru.op_kind in ("fail", "recover"):
            return f"{name}, which failed: {ru.cause or ru.reason}"
        if ru.goal is Goal.INACTIVE:
            return f"{name}, which {'is stopping with the stack' if self.shutting_down else 'was stopped by request'}"
        if name not in seen:
            for r in ru.spec.requires:
                if self._down(self.units[r], seen | {name}):
                    return f"{name}, which requires {self._root_cause(r, seen | {name})}"
        return f"{name}, which is {ru.state.value}" + (f" ({ru.reason})" if ru.reason else "")

    def _refresh_waiting_reasons(self) -> None:
        """A unit stopped for a requirement keeps naming the current root cause."""
        for name in list(self._waiting_on_requirement):
            u = self.units[name]
            if u.state is not S.INACTIVE or u.op is not None or not u.reason.startswith("stopped: requires "):
                continue
            for r in u.spec.requires:
                if self._down(self.units[r]):
                    why = f"stopped: requires {self._root_cause(r)}"
                    if why != u.reason:
                        u.reason = why
                        self._notify_changed()
                    break

    def _blocked_by_dependents(self, u: Unit) -> bool:
        """Units ordered after this one that are going down must be gone first."""
        for d in self._dependents_after[u.name]:
            du = self.units[d]
            if du.state is S.STOPPING:
                return True
            if du.state in (S.STARTING, S.ACTIVE) and (self._must_stop(du) or du.op_kind == "fail"):
                return True
        return False

    def _will_start(self, u: Unit) -> bool:
        """Would this unit be started (now or later) without an operator?"""
        if u.goal is not Goal.ACTIVE or u.gave_up or self._group_down_for_good(u):
            return False
        if u.state is S.FAILED:
            return u.restart_pending
        return True

    def _may_start(self, u: Unit, now: float) -> bool:
        if u.op is not None or u.goal is not Goal.ACTIVE or u.gave_up or self.shutting_down:
            return False
        if u.spec.worker_group:
            return self._member_may_start(u, now)
        if u.state is S.FAILED:
            if not u.restart_pending or now < u.restart_at:
                return False
        elif u.state is not S.INACTIVE:
            return False
        return self._requirements_up(u)

    def _requirements_up(self, u: Unit) -> bool:
        for r in u.spec.requires:
            ru = self.units[r]
            if ru.state is not S.ACTIVE or self._down(ru):
                return False
        for a in u.spec.dependencies:
            au = self.units[a]
            if au.state is S.ACTIVE:
                continue
            if au.state in (S.STARTING, S.STOPPING) or self._will_start(au):
                return False
        return True

    def _converge(self) -> None:
        self._converge_pending = False
        now = time.monotonic()
        to_stop: list[tuple[Unit, str]] = []
        for name in reversed(self.order):
            u = self.units[name]
            if u.state not in (S.STARTING, S.ACTIVE):
                continue
            why = self._must_stop(u)
            if why is None:
                continue
            if u.op is not None:
                if u.op_kind == "start" and u.proc is not None and not u.op.done():
                    # Waiting for readiness: cancel; it comes back here as a plain
                    # STARTING unit. (Never cancelled mid-spawn: the child would be lost.)
                    u.op.cancel()
                continue
            if self._blocked_by_dependents(u):
                continue
            to_stop.append((u, why))
        if to_stop:
            self._launch_stop(to_stop)
        for name in self.order:
            u = self.units[name]
            if self._may_start(u, now):
                if u.spec.worker_group and not u.book.up:
                    self._open_generation(u, now)
                self._launch(u, "start", self._start(u))
            elif u.state is S.STARTING and u.op is None and u.proc is not None and self._must_stop(u) is None:
                # Its readiness wait was cancelled for a stop that another request then took
                # back before the stop began: wait for readiness again (same deadline), or the
                # unit would sit in `starting` with nobody watching it (found by the FM-22 storm).
                self._launch(u, "start", self._await_ready(u, u.proc))
        self._refresh_waiting_reasons()

    def _launch(self, u: Unit, kind: str, coro: Awaitable[None]) -> None:
        u.op_kind = kind
        u.op = asyncio.get_running_loop().create_task(self._run_op(u, kind, coro))

    async def _run_op(self, u: Unit, kind: str, coro: Awaitable[None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            if kind != "start":
                log.error("op cancelled", unit=u.name, op=kind)
        except Exception as exc:  # noqa: BLE001 - no op failure goes unseen
            log.exception("op crashed", unit=u.name, op=kind)
            if u.op is asyncio.current_task():
                u.op = None
                u.op_kind = ""
            self._after_crash(u, kind, exc)
            return
        finally:
            if u.op is asyncio.current_task():
                u.op = None
                u.op_kind = ""
                self._kick()
                self._notify_changed()

    def _after_crash(self, u: Unit, kind: str, exc: BaseException) -> None:
        """Never leave a unit half-managed after a bug in one of its ops: it fails."""
        what = f"internal error during {kind}: {type(exc).__name__}: {exc}"
        if u.op is not None:
            return  # another op already took over
        if u.state in (S.STARTING, S.ACTIVE):
            if u.proc is None:  # crashed before a process existed: nothing to stop
                self._record_failure(u, what)
                self._transition(u, E.EXITED, self._failure_reason(u, what))
            else:
                self._launch(u, "fail", self._fail_alive(u, what, E.INTERNAL_ERROR))
        elif u.state is S.STOPPING:
            if kind == "recover":
                self._abandon(u, what)
            else:
                self._launch(u, "recover", self._recover_stopping(u, what))

    async def _recover_stopping(self, u: Unit, what: str) -> None:
        """A stop or failure op crashed mid-way: SIGKILL what is left, then failed."""
        h = u.proc
        self._record_failure(u, what)
        if h is not None:
            await terminate(self._target(u, h), signal.SIGKILL, u.spec.kill_timeout, 0.0, send_cont=False)
        self._transition(u, E.GONE, self._failure_reason(u, what), failing=True)

    def _abandon(self, u: Unit, what: str) -> None:
        """Last resort when even the recovery crashed: SIGKILL by pidfd, and failed."""
        if u.proc is not None:
            u.proc.signal(signal.SIGKILL)
            u.proc.signal_group(signal.SIGKILL, self.token)
        self._transition(u, E.KILL_TIMEOUT, what, failing=True)

    # -------------------------------------------------------------------- start
    def _argv(self, spec: UnitSpec) -> list[str]:
        argv = list(spec.exec)
        if spec.title and len(argv) >= 2 and _PYTHON_RE.match(os.path.basename(argv[0])):
            if argv[1] == "-m" and len(argv) >= 3 or not argv[1].startswith("-"):
                # Python units run through the runner, which sets the title and
                # hands over to the module or script unchanged.
                return [argv[0], RUNNER, spec.title, *argv[1:]]
        return argv

    def _env(self, u: Unit) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items()
                if k not in ("LISTEN_FDS", "LISTEN_PID", "OMNID_CONTROL", "INVOCATION_ID")}
        # Units named `python3 -m ...` find the interpreter omnid runs under first.
        pybin = os.path.dirname(sys.executable)
        base["PATH"] = pybin + os.pathsep + base.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        env = u.spec.environ(base, self.notify_socket)
        env[DAEMON_TAG] = self.token  # proof of ownership for leftover cleanup
        env.update(self._group_env(u))
        if u.spec.gpus and "CUDA_DEVICE_ORDER" not in u.spec.env:
            # NVML numbers GPUs in PCI order; make CUDA agree so gpus = [1] is the same card.
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        return env

    def _count_start(self, u: Unit, now: float) -> int:
        window = u.spec.start_limit_interval
        while u.start_times and now - u.start_times[0] > window:
            u.start_times.popleft()
        return len(u.start_times)

    def _begin_start(self, u: Unit) -> str:
        """Count the start (a worker group's was counted when its generation opened) and
        return the reason the `starting` state will carry."""
        automatic = u.state is S.FAILED
        if not u.spec.worker_group:
            now = time.monotonic()
            self._count_start(u, now)
            u.start_times.append(now)
            u.book.generation += 1
            u.restart_pending = False
        elif u.book.generation > 1:
            automatic = True
        if automatic:
            u.restarts += 1
        u.ready_event = asyncio.Event()
        u.stopping_notified = False
        u.status_text = ""
        if u.spec.worker_group and u.book.generation > 1:
            return f"worker group {u.spec.worker_group} generation {u.book.generation}"
        return f"restart {u.restarts} after: {u.last_exit}" if automatic else "starting"

    def _spawn_failed(self, u: Unit, what: str) -> None:
        """No process came of this start: failed at once (restart policy applies)."""
        if self.cgroups:
            self.cgroups.release(u.name)  # cgroup hook: nothing runs in it
        self._record_failure(u, what)
        self._transition(u, E.SPAWN_FAILED, self._failure_reason(u, what))

    async def _spawn(self, u: Unit) -> tuple[Spawned, int, int] | None:
        """Everything a spawn needs, then the spawn: (the spawner's answer, the read ends of the
        unit's stdout and stderr pipes), or None after a failed spawn (already reported)."""
        spec = u.spec
        held = self._gpu_held_by_leftover(u)
        if held:
            self._spawn_failed(u, held)
            return None
        try:  # cgroup hook: the instance's cgroup exists before the child joins it (pre-exec)
            cg_path = self.cgroups.create(u.name, cgroup_limits(spec)).path if self.cgroups else None
        except OSError as exc:
            self._spawn_failed(u, f"cannot create the unit's cgroup: {exc}")
            return None
        pipes: list[int] = []
        try:
            pipes.extend(os.pipe2(os.O_CLOEXEC))  # stdout
            pipes.extend(os.pipe2(os.O_CLOEXEC))  # stderr
        except OSError as exc:  # EMFILE is a failed spawn (backoff), not a crashed op
            for fd in pipes:
                os.close(fd)
            code = errno.errorcode.get(exc.errno or 0, exc.errno)
            self._spawn_failed(u, f"spawn failed: {code}: cannot create the output pipes ({exc.strerror})")
            return None
        r, w, r_err, w_err = pipes
        req = SpawnRequest(unit=u.name, argv=tuple(self._argv(spec)), env=self._env(u), cwd=spec.cwd,
                           user=spec.user, group=spec.group, rlimits=tuple(spec.limits), cgroup=cg_path,
                           placement=numa.placement_for(spec))
        try:
            return await self.spawner.spawn(req, w, w_err), r, r_err
        except SpawnError as exc:
            os.close(r)
            os.close(r_err)
            self._spawn_failed(u, str(exc))
            return None
        finally:
            os.close(w)
            os.close(w_err)

    async def _start(self, u: Unit) -> None:
        spec = u.spec
        reason = self._begin_start(u)
        # The unit becomes `starting` only once its process exists and its pidfd is
        # held (the invariant); a spawn that fails goes straight to `failed`.
        spawned = await self._spawn(u)
        if spawned is None:
            return
        sp, r, r_err = spawned
        assert u.output is not None
        u.output.attach(r, r_err)
        h = ProcessHandle(unit=u.name, pid=sp.pid, pidfd=sp.pidfd, pgid=sp.pid, start_time=sp.start_time)
        u.proc = h
        u.last_pgid = h.pgid
        self._by_pid[h.pid] = (u, h)
        early = self._early_exits.pop(h.pid, None)
        if early is not None:
            self.on_exit_report(early)
        for fields in self._early_notify.pop(h.pgid, []):
            self._apply_notify(u, fields)
        asyncio.get_running_loop().add_reader(h.pidfd, self._on_pidfd, u, h)
        self.on_pids_changed()
        u.ready_deadline = time.monotonic() + spec.ready_timeout
        self._transition(u, E.SPAWNED, reason)  # kicks converge: a stop may be waiting for this spawn
        log.debug("spawned", unit=u.name, pid=h.pid, argv=list(spec.exec))
        await self._await_ready(u, h)

    def _gpu_held_by_leftover(self, u: Unit) -> str | None:
        """A unit must not start on a GPU that a leftover omnid process still holds."""
        backend = self.gpu
        if backend is None or not u.spec.gpus or not getattr(backend, "available", False) \
                or not getattr(backend, "pids_local", False):
            return None
        from omnid import gpu as gpu_mod

        ours = {x.proc.pid for x in self.units.values() if x.proc is not None}
        for holder in gpu_mod.holders_of(backend, u.spec.gpus):
            if holder.pid in ours:
                continue
            tag = linux.read_environ_var(holder.pid, UNIT_TAG)
            if tag is not None:
                return (f"GPU {holder.gpu} is held by pid {holder.pid} ({holder.used_mib:.0f} MiB, a leftover "
                        f"omnid process of unit {tag} not managed by this daemon): refusing to start")
            log.warning("GPU used by a process outside omnid", unit=u.name, gpu=holder.gpu, pid=holder.pid,
                        used_mib=holder.used_mib)
        return None

    async def _await_ready(self, u: Unit, h: ProcessHandle) -> None:
        """Wait for readiness until u.ready_deadline (also when resumed after a cancelled wait)."""
        spec = u.spec
        ready_task = asyncio.get_running_loop().create_task(self._readiness(u))
        exit_task = asyncio.get_running_loop().create_task(h.exited.wait())
        try:
            left = max(0.0, u.ready_deadline - time.monotonic())
            done, _ = await asyncio.wait({ready_task, exit_task}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (ready_task, exit_task):
                t.cancel()
        if exit_task in done or h.exited.is_set():
            await self._fail_after_exit(u, h)
            return
        if ready_task in done:
            exc = ready_task.exception()
            if exc is None:
                self._become_active(u)
                return
            await self._fail_alive(u, f"readiness check failed: {exc}", E.NOT_READY_IN_TIME)
            return
        await self._fail_alive(u, f"not ready after {spec.ready_timeout:g} s", E.NOT_READY_IN_TIME)

    async def _readiness(self, u: Unit) -> None:
        ready = u.spec.ready
        if ready.kind == "started":
            return
        if ready.kind == "notify":
            await u.ready_event.wait()
            return
        delay = 0.02
        last = ""
        while True:
            try:
                if ready.kind == "http":
                    await http_probe(ready.url, timeout=2.0)
                else:
                    await tcp_probe(ready.host, ready.port, timeout=2.0)
                return
            except ProbeFailed as exc:
                if str(exc) != last:
                    log.debug("not ready yet", unit=u.name, probe=str(exc))
                    last = str(exc)
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def _become_active(self, u: Unit) -> None:
        u.ready = True
        u.active_since = time.monotonic()
        self._transition(u, E.READY, "ready" if u.spec.ready.kind != "started" else "started")

    # -------------------------------------------------------------- death path
    def _on_pidfd(self, u: Unit, h: ProcessHandle) -> None:
        asyncio.get_running_loop().remove_reader(h.pidfd)
        h.exit_seen = time.monotonic()
        h.exited.set()
        if u.proc is not h:
            return
        u.ready = False  # /health turns 503 now, not when the failure op finishes
        self._notify_changed()
        if u.op is None and u.state in (S.STARTING, S.ACTIVE):
            self._launch(u, "fail", self._fail_after_exit(u, h))

    def on_exit_report(self, rep: ExitReport) -> None:
        entry = self._by_pid.get(rep.pid)
        if entry is None:
            if not rep.adopted:
                self._early_exits[rep.pid] = rep
                if len(self._early_exits) > 4096:
                    self._early_exits.pop(next(iter(self._early_exits)))
            return
        _u, h = entry
        h.exit_status = rep.status
        h.reaped.set()

    def _record_failure(self, u: Unit, what: str) -> None:
        u.last_exit = what
        u.cause = _PID_SUFFIX.sub("", what)
        u.deaths += 1
        if u.spec.worker_group:
            self._member_failed(u, what)

    def _failure_reason(self, u: Unit, what: str) -> str:
        """Decide restart or give-up; returns the reason text for the FAILED state."""
        spec = u.spec
        now = time.monotonic()
        if spec.worker_group:
            if u.book.failure_counted:  # one failure of the group, seen again through another member
                return f"{what} (worker group {spec.worker_group} already down: {u.book.down_reason})"
            u.book.failure_counted = True
        if u.active_since and now - u.active_since >= spec.restart_max_sec:
            u.consecutive_failures = 0
        u.active_since = 0.0
        u.consecutive_failures += 1
        u.restart_pending = False
        if spec.restart == "no" or u.goal is not Goal.ACTIVE or self.shutting_down:
            return what
        starts = self._count_start(u, now)
        if starts >= spec.start_limit_burst:
            u.gave_up = True
            return (f"{what}; start limit hit ({starts} starts within {spec.start_limit_interval:g} s), "
                    "not restarting until `omnid start`")
        delay = min(spec.restart_sec * (2 ** (u.consecutive_failures - 1)), spec.restart_max_sec)
        u.restart_pending = True
        u.restart_at = now + delay
        asyncio.get_running_loop().call_later(delay, self._kick)
        return f"{what}; restarting in {delay:g} s"

    async def _fail_after_exit(self, u: Unit, h: ProcessHandle) -> None:
        """The main process exited while nobody asked: kill what is left of the unit at once, then failed."""
        t_wake = h.exit_seen or time.monotonic()
        try:
            await asyncio.wait_for(h.reaped.wait(), 2.0)
        except asyncio.TimeoutError:
            log.error("no exit status from the spawner within 2 s", unit=u.name, pid=h.pid)
        if h.exit_status is not None:
            code, sig, what = linux.describe_wait_status(h.exit_status)
        else:
            code, sig, what = None, None, "exited (status unknown)"
        u.last_exit_code, u.last_signal = code, sig
        if u.stopping_notified:
            what += " after STOPPING=1"
        what = f"{what} (pid {h.pid}, while {u.state.value})"
        self._record_failure(u, what)
        target = self._target(u, h)
        leftovers = target.members()
        every_pid = [h.pid, *(s.pid for s in leftovers)]
        if leftovers:
            # A half-dead unit never lingers: SIGKILL its group and escaped orphans now
            # (the same policy as a stop, with SIGKILL first).
            actions = self._transition(u, E.EXITED, f"{what}; killing {len(leftovers)} leftover process(es)",
                                       leftovers=True)
            sig, cont = self._signal_of(u, actions)
            rec = await terminate(target, sig, u.spec.kill_timeout, 0.0, send_cont=cont)
            if rec.unkillable:
                log.error("unkillable processes after failure", unit=u.name, survivors=rec.unkillable)
        if self.cgroups:
            self.cgroups.release(u.name)  # cgroup hook: rmdir once populated 0
        u.death_detect_ms = (time.monotonic() - t_wake) * 1000
        self._transition(u, E.GONE if u.state is S.STOPPING else E.EXITED, self._failure_reason(u, what), failing=True)
        if self._gpu_on():
            # `failed` is published first (its milliseconds matter); the op then holds the
            # unit until the driver has freed the dead pids' GPU memory (bounded), so a
            # restart never meets the corpse's allocation and dies of out-of-memory.
            u.gpu_release_ms, u.gpu_held = await self._gpu_release(u.name, every_pid, u.spec.kill_timeout)

    async def _fail_alive(self, u: Unit, what: str, event: Event) -> None:
        """A unit whose main process lives but failed (timeout, watchdog, liveness): stop it, then failed."""
        h = u.proc
        assert h is not None
        self._record_failure(u, what)
        # A hung unit gets no SIGCONT (step says so): SIGKILL at stop_timeout if it does not exit.
        sig, cont = self._signal_of(u, self._transition(u, event, what))
        rec = await self._terminate(u, h, sig, send_cont=cont)
        if h.exit_status is not None:
            code, sig, _ = linux.describe_wait_status(h.exit_status)
            u.last_exit_code, u.last_signal = code, sig
        u.last_stop = rec
        self._transition(u, E.KILL_TIMEOUT if rec.unkillable else E.GONE, self._failure_reason(u, what), failing=True)

    # -------------------------------------------------------------------- stop
    def _launch_stop(self, batch: list[tuple[Unit, str]]) -> None:
        # One read of the subreaper's children for the whole tier: the escaped orphans
        # that get the stop signal with their unit's group (the sweep after each stop
        # reads it again, fresh).
        orphans = [p for p in linux.children_of(self.spawner.pid) if p not in self._by_pid]
        for u, why in batch:
            self._launch(u, "stop", self._stop(u, why, orphans))

    async def _stop(self, u: Unit, why: str, orphans: list[int] | None = None) -> None:
        h = u.proc
        assert h is not None  # starting and active units always hold their process
        was = u.state.value
        event = E.DEPENDENCY_DOWN if why.startswith("stopped: requires") else E.STOP_REQUESTED
        sig, cont = self._signal_of(u, self._transition(u, event, why))
        rec = await self._terminate(u, h, sig, send_cont=cont, orphans=orphans)
        rec.was = was
        u.last_stop = rec
        if h.exit_status is not None:
            code, sig, what = linux.describe_wait_status(h.exit_status)
            u.last_exit_code, u.last_signal = code, sig
            u.last_exit = f"{what} (pid {h.pid}, stopped)"
        final = why
        if rec.unkillable:
            final = f"{why}; UNKILLABLE: {'; '.join(rec.unkillable)}"
        self._transition(u, E.KILL_TIMEOUT if rec.unkillable else E.GONE, final)

    def _target(self, u: Unit, h: ProcessHandle, orphans: list[int] | None = None) -> Target:
        """What of this unit the kill policy acts on (a cgroup backend plugs in here)."""
        cg = self.cgroups.get(u.name) if self.cgroups else None
        if cg is not None:  # cgroup hook
            return CgroupTarget(u.name, h, self.token, cg)
        # mains: a live view, not a copy per stop (h.pid itself is skipped as the pgid).
        return ProcessGroupTarget(u.name, h, self.spawner.pid, self.token, mains=self._by_pid.keys(),
                                  orphans=orphans)

    async def _terminate(self, u: Unit, h: ProcessHandle, first: int, *, send_cont: bool,
                         orphans: list[int] | None = None) -> StopRecord:
        """The one kill policy (omnid.termination) on this unit, then the GPU release check."""
        spec = u.spec
        target = self._target(u, h, orphans)
        gpu_on = self._gpu_on()
        every_pid = [h.pid, *(s.pid for s in target.members())] if gpu_on else []
        rec = await terminate(target, first, spec.stop_timeout, spec.kill_timeout, send_cont=send_cont)
        if self.cgroups:
            self.cgroups.release(u.name)  # cgroup hook: rmdir once populated 0
        if gpu_on:
            rec.gpu_release_ms, rec.gpu_held = await self._gpu_release(u.name, every_pid, spec.kill_timeout)
            u.gpu_release_ms, u.gpu_held = rec.gpu_release_ms, list(rec.gpu_held)
        log.info("stopped", unit=u.name, signal=rec.signal, seconds=rec.seconds, escalated=rec.escalated,
                 residue=len(rec.residue), unkillable=len(rec.unkillable))
        return rec

    def _gpu_on(self) -> bool:
        return self.gpu is not None and bool(getattr(self.gpu, "available", False))

    async def _gpu_release(self, name: str, pids: list[int], timeout: float) -> tuple[float | None, list[str]]:
        """Wait (at most `timeout`) until none of a stopped or dead unit's `pids` holds GPU
        memory: (ms, []) once free; (None, what is still held) at the deadline; (None, [])
        when the backend cannot tell. Memory still held is logged as an error, by pid."""
        from omnid import gpu as gpu_mod

        try:
            ms, left = await gpu_mod.wait_released(self.gpu, pids, timeout)
        except Exception as exc:  # noqa: BLE001 - a GPU read error must not break a stop
            log.warning("gpu release check failed", unit=name, error=str(exc))
            return None, []
        held = [f"pid {p.pid} holds {p.used_mib:.0f} MiB on GPU {p.gpu}" for p in left]
        if held:
            log.error("GPU memory still held after the unit's processes were killed", unit=name,
                      timeout_s=timeout, held=held)
        elif ms is not None:
            log.info("gpu memory released", unit=name, ms=round(ms, 1))
        return ms, held

    def on_spawner_gone(self) -> None:
        """Every unit died with the spawner (PDEATHSIG); realign state with that."""
        for u in self.units.values():
            if u.proc is not None:
                u.proc.exited.set()
                u.proc.reaped.set()
