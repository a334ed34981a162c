"""What a unit's `gpus` names (omnid.unit(5)): an NVML index (int), a GPU UUID
("GPU-...") or a MIG device UUID ("MIG-...", one slice of a GPU in MIG mode)."""

from __future__ import annotations

GpuItem = int | str


def label(item: GpuItem | None) -> str:
    """"GPU 0" for an index; a UUID names itself ("GPU-8f1c...", "MIG-1e2d..."); None is
    every GPU (a fault of NVML itself)."""
    if item is None:
        return "NVML"
    return f"GPU {item}" if isinstance(item, int) else item


def is_mig(item: GpuItem | None) -> bool:
    return isinstance(item, str) and item.startswith("MIG-")
