"""What GET /health answers, computed from the supervisor's state at the moment it is asked:
shared by the health API (omnid.api.health) and `omnid status` (omnid.api.handlers). Kept
apart from the health API so that a `status` asked before the health API is up never
imports aiohttp on the event loop (~200 ms during which no death would be seen)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnid.core.lifecycle import UnitState

if TYPE_CHECKING:
    from omnid.core.runtime import UnitRuntime as Unit
    from omnid.core.supervisor import Supervisor

S = UnitState


def gpu_view(sup: Supervisor) -> dict[str, dict]:
    """GPU conditions that reach a unit of the stack ({label: {"status", "reason", "units"}}),
    from what the GPU backend already knows (no NVML call: a hung driver cannot stall /health)."""
    backend = getattr(sup, "gpu", None)
    if backend is None or not hasattr(backend, "conditions"):
        return {}
    from omnid.gpu import health_view

    return health_view(backend, [(u.name, u.spec.gpus) for u in sup.units.values()])


HEALTH_VERDICTS = ("ok", "starting", "degraded", "failed", "draining", "stopping")  # what overall() answers


def overall(sup: Supervisor, degraded: dict[str, str], gpus: dict[str, dict] | None = None) -> str:
    """`gpus`: gpu_view(sup); a GPU that has fallen off the bus is "failed", another
    condition of a unit's GPU "degraded"."""
    from omnid.gpu import worst

    if sup.draining():
        return "draining"  # load balancers stop sending; accepted requests finish
    if sup.shutting_down:
        return "stopping"
    units = sup.units.values()
    gpu = worst(gpus or {})
    if any(u.state is S.FAILED or u.dead for u in units) or gpu == "failed":
        return "failed"  # (u.dead: the main process died; the failure op is about to record it)
    if any(u.state is S.STOPPING or u.goal.value == "inactive" for u in units) or degraded or gpu == "degraded":
        return "degraded"
    if all(u.state is S.ACTIVE and u.ready for u in units):
        return "ok"
    return "starting"


def unit_reason(u: Unit, degraded: dict[str, str]) -> str:
    if u.name in degraded:
        return degraded[u.name]
    if u.dead:
        return "main process exited; failing"
    return u.reason
