"""What a critical Xid means for the units on that GPU (omnid(8) GPU FAULTS).

NVML reports Xid errors (the driver's error codes) as nvmlEventTypeXidCriticalError
events. Each code known here has a meaning for people and an action:

- FAIL_GPU_LOST: the GPU is gone (fallen off the bus). Its units fail, /health says
  failed, and no unit starts on it again until the daemon restarts (after a reset).
- FAIL: its units fail (their GPU state is corrupt or their work is lost) and may
  start again (restart policy); /health says degraded naming the GPU.
- DEGRADE: the units keep running; /health says degraded naming the GPU.
- NOTICE: the units keep running and /health is not changed; `omnid status` shows it
  (the GPU wants a reset at the next chance, or its memory is wearing).
- LOG: logged only: an application's own error that its process sees itself (an
  illegal address, a kill), which is no reason to fail other units sharing the GPU.

An Xid not in the table is logged and marks the GPU degraded, naming the code. Except
for a lost GPU, a condition ends HOLD_S after the last event of its kind.
Meanings are omnid's own short wording of NVIDIA's Xid catalog.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


HOLD_S = 300.0


class XidAction(StrEnum):
    FAIL_GPU_LOST = "fail, GPU lost"
    FAIL = "fail"
    DEGRADE = "degrade"
    NOTICE = "notice"
    LOG = "log"


@dataclass(frozen=True)
class XidInfo:
    xid: int
    meaning: str
    action: XidAction

    @property
    def fails_units(self) -> bool:
        return self.action in (XidAction.FAIL, XidAction.FAIL_GPU_LOST)

    @property
    def status(self) -> str:
        """The GPU's condition afterwards: "failed" for a lost GPU, "degraded" when /health
        should say so, "notice" for `omnid status` only, "" for nothing."""
        if self.action is XidAction.FAIL_GPU_LOST:
            return "failed"
        if self.action is XidAction.LOG:
            return ""
        return "notice" if self.action is XidAction.NOTICE else "degraded"


_A = XidAction
_TABLE: dict[int, tuple[str, XidAction]] = {
    13: ("graphics engine exception (an application's illegal access)", _A.LOG),
    31: ("GPU memory page fault (an application's illegal address)", _A.LOG),
    43: ("GPU stopped processing a channel (an application fault)", _A.LOG),
    45: ("channel torn down early (a process was killed or an earlier error)", _A.LOG),
    48: ("double-bit ECC error: uncorrectable GPU memory error", _A.FAIL),
    63: ("ECC page retirement or row remapping recorded: takes effect at the next GPU reset", _A.NOTICE),
    64: ("ECC page retirement or row remapping failed: the GPU needs a reset or service", _A.FAIL),
    74: ("NVLink error: a link is down or failing", _A.FAIL),
    79: ("GPU has fallen off the bus: it no longer answers on PCIe", _A.FAIL_GPU_LOST),
    92: ("high single-bit ECC error rate", _A.NOTICE),
    94: ("contained ECC error: the applications on the affected memory must restart", _A.FAIL),
    95: ("uncontained ECC error: every application on the GPU is affected; the GPU needs a reset", _A.FAIL),
    # Sometimes transient: the units' own watchdog or liveness tells whether they still work.
    119: ("GSP firmware RPC timeout: the GPU's system processor did not answer", _A.DEGRADE),
    120: ("GSP firmware error", _A.DEGRADE),
}


def classify(xid: int) -> XidInfo:
    """The meaning and action of an Xid; an unknown one degrades the GPU and says so."""
    known = _TABLE.get(xid)
    if known is None:
        return XidInfo(xid, f"Xid {xid} (not in omnid's table; see NVIDIA's Xid catalog)", XidAction.DEGRADE)
    return XidInfo(xid, known[0], known[1])


def describe(xid: int) -> str:
    """"Xid 79: GPU has fallen off the bus ..." for reasons and logs."""
    info = classify(xid)
    return info.meaning if info.meaning.startswith("Xid ") else f"Xid {xid}: {info.meaning}"
