"""A unit's death, top to bottom: every sign that its main process died, reconciled into
one EXITED event for the unit, and what that event carries (omnid.core.supervisor feeds it).

The signs, each an entry point of `Deaths`, in the order they usually come:

1. `pidfd_readable`: the process exited (the loop's reader on its pidfd, set by
   Supervisor.adopt; there is no polling for liveness). Once the spawner has reaped it the
   kernel also gives its wait status (PIDFD_INFO_EXIT, Linux 6.15:
   ProcessHandle.status_from_pidfd); the spawner's report, on its way, is then dropped.
2. `exit_report`: the spawner reaped the process and reports its wait status. A report may
   come before the reply of the spawn it ends (kept `early` until the unit adopts its
   process: `adopted`), or belong to a helper the daemon spawned for a unit (an exec probe:
   `ExitBook.expect_helper`), never to a unit.
3. `status_overdue`: no status within EXIT_STATUS_WAIT_S of the pidfd; the death is told
   with its status unknown.
4. A process taken over from the previous program of this daemon (omnid reexec,
   core/takeover.py) that died meanwhile: its record carries the status (reaped), and its
   pidfd is readable at once on adoption, so its death enters as 1.
The spawner's own death (`spawner_gone`) marks every unit's process exited and reaped;
their pidfds, readable, tell each death as 1.

Every sign ends in `Deaths._reconcile`, the one place a death becomes EXITED: once per
process, once its pidfd has fired and its status is known or given up on. Then
`Deaths.facts` (called by the supervisor as it steps EXITED) records how it died and
whether the kernel proves the unit empty (omnid.process.unitprocs: main reaped, nothing left) or
something outlived the main process (leftovers).

`ExitBook` (omnid.core.exitbook) keeps what does not meet its unit in order.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from omnid.base import linux
from omnid.core.centre import Centre
from omnid.core.exitbook import ExitBook
from omnid.core.executor import EXIT_STATUS_WAIT_S
from omnid.core.lifecycle import Event, UnitState
from omnid.core.runtime import UnitRuntime
from omnid.process.handle import ProcessHandle
from omnid.process.spawnclient import ExitReport

log = structlog.get_logger("omnid.supervisor")
S = UnitState


class Deaths:
    """The death path of every unit's main process (one per supervisor)."""

    def __init__(self, sup: Centre, book: ExitBook) -> None:
        self.sup = sup
        self.book = book

    # ------------------------------------------------------------------ the signs
    def adopted(self, rt: UnitRuntime, h: ProcessHandle) -> None:
        """`h` is now the unit's main process: a report that came before its spawn's reply
        is the second sign of a death that has happened already."""
        if (early := self.book.take_early(h)) is not None:
            self.exit_report(early)

    def pidfd_readable(self, rt: UnitRuntime, h: ProcessHandle) -> None:
        """Sign 1: the process exited."""
        asyncio.get_running_loop().remove_reader(h.pidfd)
        h.exit_seen = time.monotonic()
        h.exited.set()
        if rt.proc is h:
            rt.ready = False  # /health turns 503 now, before the failure is recorded
            self.sup.notify_changed()
        self._reconcile(rt, h)

    def exit_report(self, rep: ExitReport) -> None:
        """Sign 2: the spawner reaped a process (for a unit, a helper, or none yet)."""
        if self.book.helper_exit(rep) or self.book.already_read(rep.pid):
            return
        entry = self.sup.by_pid.get(rep.pid)
        if entry is None:
            if not rep.adopted:  # the exit of a spawn whose reply is still on its way
                self.book.keep_early(rep)
            return
        rt, h = entry
        h.exit_status = rep.status
        h.reaped.set()
        self._reconcile(rt, h)

    def status_overdue(self, rt: UnitRuntime, h: ProcessHandle) -> None:
        """Sign 3: the pidfd fired EXIT_STATUS_WAIT_S ago and no status came."""
        self.sup.executor.of(rt).exit_wait = None  # this timer, fired
        self._reconcile(rt, h, overdue=True)

    def spawner_gone(self) -> None:
        """Every unit died with the spawner (PDEATHSIG): nobody will reap or report them."""
        for rt in self.sup.units.values():
            if rt.proc is not None:
                rt.proc.exited.set()
                rt.proc.reaped.set()

    # ------------------------------------------------------------------ one event
    def _reconcile(self, rt: UnitRuntime, h: ProcessHandle, *, overdue: bool = False) -> None:
        """Where every sign ends: EXITED is fed to the unit once per main process, when
        - the process is still the unit's (an earlier one's death was told before its release);
        - its pidfd has fired (a status that comes first, from a report or a taken-over
          record, waits for it: a reaped process's pidfd is readable, so that is one turn);
        - and its status is known: from the spawner's report, from the pidfd (only on its
          own sign; then the report is dropped when it comes), or given up on."""
        if rt.proc is not h or not h.exited.is_set() or h.exit_told:
            return
        w = self.sup.executor.of(rt)
        if not h.reaped.is_set() and not overdue:
            if h.status_from_pidfd():
                self.book.read_from_pidfd(h.pid)
            else:  # the spawner's exit report is on its way; without it in 2 s: status unknown
                w.exit_wait = asyncio.get_running_loop().call_later(EXIT_STATUS_WAIT_S, self.status_overdue, rt, h)
                return
        if w.exit_wait is not None:
            w.exit_wait.cancel()
            w.exit_wait = None
        if not h.reaped.is_set():
            log.error("no exit status from the spawner within 2 s", unit=rt.name, pid=h.pid)
        h.exit_told = True
        self.sup.feed(rt, Event.EXITED)

    # ------------------------------------------------------------------ what it carries
    def facts(self, rt: UnitRuntime) -> tuple[bool, str]:
        """The main process is gone: record how (the supervisor, stepping EXITED). Returns
        (leftovers, a note for the reason): leftovers when the kernel cannot prove the unit
        empty yet (processes outlived it, or zombies of its group are not reaped yet)."""
        h = rt.proc
        if h is None:
            return False, ""
        if h.exit_status is not None:
            code, sig, what = linux.describe_wait_status(h.exit_status)
        else:
            code, sig, what = None, None, "exited (status unknown)"
        rt.last_exit_code, rt.last_signal = code, sig
        if rt.stopping_notified:
            what += " after STOPPING=1"
        rt.last_exit_what = f"{what} (pid {h.pid}, while {rt.state.value})"
        if rt.state not in (S.STARTING, S.ACTIVE):
            return False, ""
        rt.death_detect_ms = (time.monotonic() - (h.exit_seen or time.monotonic())) * 1000
        sup, w = self.sup, self.sup.executor.of(rt)
        procs = sup.executor.target(rt, h).procs
        # `gone` first: the kernel's proof, without the scan of /proc that listing the
        # leftovers can take (0.3-0.7 s on a loaded host), which would hold the failure's
        # report; the list is read only where the GPU check needs their pids.
        if procs.gone():
            # The main process alone held the unit: its GPU memory is what a restart waits for.
            w.dead_pids = [h.pid] if sup.gpu_on() else []
            return False, ""
        left = procs.members() if sup.gpu_on() else []
        w.dead_pids = [h.pid, *(s.pid for s in left)] if sup.gpu_on() else []
        if rt.spec.leftover_timeout > 0:
            return True, (f"; what outlived it gets {linux.signal_name(rt.spec.stop_signal)}, "
                          f"SIGKILL after {rt.spec.leftover_timeout:g} s")
        return True, "; killing what outlived it"
