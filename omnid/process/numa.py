"""NUMA placement at birth (omnid.unit(5) `numa`): which CPUs and which memory node a unit's
process gets, decided from its GPUs' place in the machine and applied by the spawner between
fork and exec, so the first instruction already runs where its GPU is.

The topology comes from the kernel, read without NVML:

- the GPUs, in PCI bus order (the index order of NVML, nvidia-smi and
  CUDA_DEVICE_ORDER=PCI_BUS_ID, which omnid sets): /proc/driver/nvidia/gpus/BUS/information
  (which also gives each GPU's UUID), else NVIDIA display and 3D controllers in
  /sys/bus/pci/devices;
- each GPU's node and local CPUs: /sys/bus/pci/devices/BUS/numa_node and local_cpulist;
- the nodes: /sys/devices/system/node/online and nodeN/cpulist.

A MIG device UUID names a slice of a GPU; the GPU is found from the old MIG form
("MIG-GPU-<GPU UUID>/GI/CI") directly, from the new one ("MIG-<UUID>") through NVML when
nvidia-ml-py is installed and a driver answers.

Test switch (omnid.base.testswitch: obeyed only in omnid's test suite): OMNID_SYSFS_ROOT=DIR
reads DIR/sys/... and DIR/proc/driver/... instead of /sys and /proc (a fake tree; omnid(8),
ENVIRONMENT). What this process may use (its CPU affinity, its
cpuset's memory nodes) is always read from the real kernel: a placement never names a CPU or
node the spawner could not set.

The memory policy is MPOL_PREFERRED (MPOL_PREFERRED_MANY for GPUs on several nodes), not
MPOL_BIND: with the CPU affinity already local, first-touch allocations land on the GPU's node;
PREFERRED keeps the rest there too but, when that node is full, takes memory from another node
instead of having the OOM killer end a worker that BIND would have confined (pinned host
buffers, CPU offload). `numa = N` means the same, on node N.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from omnid.base import testswitch
from omnid.model.unitmodel import GpuRef, NumaMode, Unit

SYSFS_ROOT_ENV = testswitch.SYSFS_ROOT_ENV

# set_mempolicy(2) modes (linux/mempolicy.h).
MPOL_PREFERRED = 1
MPOL_PREFERRED_MANY = 5
MEMORY_POLICY_NAMES = {MPOL_PREFERRED: "preferred", MPOL_PREFERRED_MANY: "preferred-many"}

# Programs and flags by which a unit places itself: with numa = "auto", omnid leaves it to them.
OWN_PLACEMENT_PROGRAMS = frozenset({"numactl", "taskset", "hwloc-bind"})
OWN_PLACEMENT_FLAGS = ("--numa-bind",)  # vLLM's own numactl at spawn
# Variables that pin a unit's threads to CPU lists of their own: placed anyway, and said.
AFFINITY_ENV = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES")

NVIDIA_VENDOR = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers (data-centre GPUs are 3D)
_BUS_ID = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
_LEGACY_MIG = re.compile(r"MIG-(GPU-[0-9a-fA-F-]{36})/[0-9]+/[0-9]+")
MAX_LIST_ITEMS = 8192  # CPUs or nodes in one sysfs list; more is not a kernel's answer


class TopologyError(ValueError):
    """A sysfs or /proc value that is not what the kernel writes there."""


@dataclass(frozen=True)
class GpuDevice:
    """One GPU as the kernel sees it."""

    index: int  # PCI bus order
    bus_id: str  # "0000:3b:00.0"
    uuid: str | None  # "GPU-...", from the driver's information file
    node: int | None  # NUMA node; None when it cannot be read; -1 when the kernel reports none
    cpus: tuple[int, ...]  # local_cpulist
    problem: str = ""  # why node or cpus could not be read


@dataclass(frozen=True)
class Topology:
    root: str
    gpus: tuple[GpuDevice, ...]
    nodes: Mapping[int, tuple[int, ...]]  # online node -> its CPUs
    problem: str = ""  # why the GPUs or nodes could not be listed


@dataclass(frozen=True)
class Placement:
    """Where a unit's process is born: `cpus` for sched_setaffinity, `memory` (a set_mempolicy
    mode, 0 = leave the default) over `mem_nodes`. Empty `cpus` = no placement; `note` says why
    or what else to know; `error` (numa = N that this host cannot honour) fails the spawn."""

    nodes: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()
    memory: int = 0
    mem_nodes: tuple[int, ...] = ()
    source: str = ""  # 'gpus [0]' or 'numa = 1'
    note: str = ""
    error: str = ""

    @property
    def active(self) -> bool:
        return bool(self.cpus) or bool(self.memory)

    def to_wire(self) -> dict | None:
        """For the spawner (omnid/process/spawner.py): None = nothing to set."""
        if self.error:
            return {"error": self.error}
        if not self.active:
            return None
        return {"cpus": list(self.cpus), "mempolicy": self.memory, "nodes": list(self.mem_nodes)}

    def to_json(self) -> dict:
        """For `status --json` and /units: the placement decided for the unit's next spawn."""
        return {"nodes": list(self.nodes), "cpus": format_list(self.cpus),
                "memory": MEMORY_POLICY_NAMES.get(self.memory, "default"),
                "memory_nodes": format_list(self.mem_nodes), "source": self.source, "note": self.note,
                "error": self.error}

    def describe(self) -> str:
        if self.error:
            return f"none: {self.error}"
        if not self.active:
            return "none" + (f" ({self.note})" if self.note else "")
        node = "node" + ("s " if len(self.nodes) > 1 else " ") + format_list(self.nodes)
        memory = (f"memory {MEMORY_POLICY_NAMES[self.memory]} on {format_list(self.mem_nodes)}" if self.memory
                  else "memory default")
        return f"{node} from {self.source}: CPUs {format_list(self.cpus)}, {memory}" + (
            f"; {self.note}" if self.note else "")


NO_PLACEMENT = Placement()


# --------------------------------------------------------------------------- kernel lists


def parse_list(text: str, what: str) -> tuple[int, ...]:
    """A kernel list such as "0-3,8-11" (cpulist(7) format) -> (0, 1, 2, 3, 8, ...)."""
    out: set[int] = set()
    text = text.strip()
    if not text:
        return ()
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise TopologyError(f"{what}: expected a list such as 0-3,8-11, got {text[:80]!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a or b - a + len(out) >= MAX_LIST_ITEMS:
            raise TopologyError(f"{what}: expected a list of at most {MAX_LIST_ITEMS} items, got {text[:80]!r}")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


def format_list(items: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8"."""
    xs = sorted(set(items))
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def sysfs_root() -> str:
    return testswitch.value(SYSFS_ROOT_ENV) or "/"


def _read(root: str, path: str, limit: int = 65536) -> str:
    with open(os.path.join(root, path.lstrip("/")), encoding="ascii", errors="replace") as f:
        return f.read(limit)


# --------------------------------------------------------------------------- topology


def _gpu_bus_ids(root: str) -> tuple[list[tuple[str, str | None]], str]:
    """[(bus id, UUID or None)] in PCI bus order, and a problem text when none can be listed."""
    proc = os.path.join(root, "proc/driver/nvidia/gpus")
    try:
        names = os.listdir(proc)
    except FileNotFoundError:
        names = None
    except OSError as exc:
        return [], f"cannot list {proc}: {exc.strerror}"
    if names is not None:
        out = []
        for name in sorted(n for n in names if _BUS_ID.fullmatch(n)):
            uuid = None
            try:
                for line in _read(root, f"proc/driver/nvidia/gpus/{name}/information").splitlines():
                    key, _, value = line.partition(":")
                    if key.strip() == "GPU UUID":
                        uuid = value.strip() or None
            except OSError:
                pass  # the UUID is only needed for UUID-named GPUs; said when one is asked for
            out.append((name.lower(), uuid))
        return out, ""
    pci = os.path.join(root, "sys/bus/pci/devices")
    try:
        devices = sorted(d for d in os.listdir(pci) if _BUS_ID.fullmatch(d))
    except OSError as exc:
        return [], f"cannot list {pci}: {exc.strerror}"
    out = []
    for dev in devices:
        try:
            vendor = _read(root, f"sys/bus/pci/devices/{dev}/vendor", 64).strip()
            cls = _read(root, f"sys/bus/pci/devices/{dev}/class", 64).strip()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and cls.startswith(_GPU_CLASSES):
            out.append((dev.lower(), None))
    return out, ""


def _gpu_device(root: str, index: int, bus_id: str, uuid: str | None) -> GpuDevice:
    base = f"sys/bus/pci/devices/{bus_id}"
    try:
        text = _read(root, f"{base}/numa_node", 64).strip()
        node = int(text)
        if node < -1:
            raise ValueError(text)
    except FileNotFoundError:
        return GpuDevice(index, bus_id, uuid, None, (), f"{os.path.join(root, base)}/numa_node does not exist")
    except OSError as exc:
        return GpuDevice(index, bus_id, uuid, None, (), f"cannot read {os.path.join(root, base)}/numa_node: "
                                                       f"{exc.strerror}")
    except ValueError:
        return GpuDevice(index, bus_id, uuid, None, (), f"{os.path.join(root, base)}/numa_node: expected a node "
                                                       f"number or -1, got {text[:40]!r}")
    try:
        cpus = parse_list(_read(root, f"{base}/local_cpulist"), f"{os.path.join(root, base)}/local_cpulist")
    except (OSError, TopologyError) as exc:
        return GpuDevice(index, bus_id, uuid, node, (), str(exc) if isinstance(exc, TopologyError) else
                         f"cannot read {os.path.join(root, base)}/local_cpulist: {exc.strerror}")
    return GpuDevice(index, bus_id, uuid, node, cpus)


@functools.lru_cache(maxsize=8)
def topology(root: str | None = None) -> Topology:
    """The GPUs and nodes under `root` (default: OMNID_SYSFS_ROOT or /), read once per process:
    PCI topology does not change under a running stack."""
    root = root or sysfs_root()
    bus_ids, problem = _gpu_bus_ids(root)
    gpus = tuple(_gpu_device(root, i, bus, uuid) for i, (bus, uuid) in enumerate(bus_ids))
    nodes: dict[int, tuple[int, ...]] = {}
    try:
        for node in parse_list(_read(root, "sys/devices/system/node/online", 4096), "node/online"):
            nodes[node] = parse_list(_read(root, f"sys/devices/system/node/node{node}/cpulist"),
                                     f"node{node}/cpulist")
    except (OSError, TopologyError) as exc:
        problem = problem or (str(exc) if isinstance(exc, TopologyError) else
                              f"cannot read the NUMA nodes under {os.path.join(root, 'sys/devices/system/node')}: "
                              f"{exc.strerror}")
    return Topology(root, gpus, nodes, problem)


@functools.lru_cache(maxsize=1)
def usable() -> tuple[frozenset[int], frozenset[int] | None]:
    """(CPUs, memory nodes) this process may place children on: its own affinity and its
    cpuset's Mems_allowed_list (None when that cannot be read)."""
    cpus = frozenset(os.sched_getaffinity(0))
    mems = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Mems_allowed_list:"):
                    mems = frozenset(parse_list(line.split(":", 1)[1], "Mems_allowed_list"))
    except (OSError, TopologyError):
        pass
    return cpus, mems


# --------------------------------------------------------------------------- GPU references


def mig_parent_uuid(mig_uuid: str) -> str | None:
    """The UUID of the GPU a MIG device is a slice of: from the old form directly, from the new
    one through NVML (None when nvidia-ml-py or a driver is missing, or NVML does not know it)."""
    m = _LEGACY_MIG.fullmatch(mig_uuid)
    if m:
        return m.group(1)
    return _nvml_mig_parent(mig_uuid)


@functools.lru_cache(maxsize=256)
def _nvml_mig_parent(mig_uuid: str) -> str | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: the caller says the GPU cannot be found
        return None
    try:
        mig = pynvml.nvmlDeviceGetHandleByUUID(mig_uuid.encode())
        parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        uuid = pynvml.nvmlDeviceGetUUID(parent)
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    except Exception:  # noqa: BLE001 - unknown to NVML: the caller names the device
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - nothing held that matters
            pass


def find_gpu(topo: Topology, ref: GpuRef) -> tuple[GpuDevice | None, str]:
    """The device `gpus` names with `ref`, or (None, why not)."""
    if isinstance(ref, int):
        if ref < len(topo.gpus):
            return topo.gpus[ref], ""
        found = f"{len(topo.gpus)} GPU{'s' if len(topo.gpus) != 1 else ''}" if topo.gpus else "no NVIDIA GPU"
        return None, f"GPU {ref}: this host has {found}" + (f" ({topo.problem})" if topo.problem else "")
    uuid = ref
    if ref.startswith("MIG-"):
        parent = mig_parent_uuid(ref)
        if parent is None:
            return None, f"{ref}: its GPU cannot be found without NVML (nvidia-ml-py and a driver)"
        uuid = parent
    for dev in topo.gpus:
        if dev.uuid and dev.uuid.lower() == uuid.lower():
            return dev, ""
    return None, f"{ref}: no GPU with UUID {uuid} in {os.path.join(topo.root, 'proc/driver/nvidia/gpus')}"


def own_placement(spec: Unit) -> str:
    """How the unit places itself, in words, or "" when it does not."""
    prog = os.path.basename(spec.exec[0]) if spec.exec else ""
    if prog in OWN_PLACEMENT_PROGRAMS:
        return f"its exec runs {prog}"
    for arg in spec.exec[1:]:
        if arg in OWN_PLACEMENT_FLAGS or any(arg.startswith(f + "=") for f in OWN_PLACEMENT_FLAGS):
            return f"its exec passes {arg.split('=', 1)[0]}"
    return ""


# --------------------------------------------------------------------------- the decision


def placement_for(spec: Unit) -> Placement:
    """The placement of `spec`'s next process (cheap: topology is read once per process)."""
    if spec.numa is NumaMode.OFF or (spec.numa is NumaMode.AUTO and not spec.gpus):
        return NO_PLACEMENT
    return _placement(sysfs_root(), spec.gpus, spec.numa, own_placement(spec))


@functools.lru_cache(maxsize=1024)
def _placement(root: str, gpus: tuple[GpuRef, ...], numa: NumaMode | int, own: str) -> Placement:
    topo = topology(root)
    cpus_ok, mems_ok = usable()
    if isinstance(numa, int):
        return _node_placement(topo, numa, cpus_ok, mems_ok, own)
    if own:
        return Placement(source=_gpus_source(gpus), note=f"left to the unit: {own}")
    nodes: set[int] = set()
    cpus: set[int] = set()
    unread: list[str] = []
    for ref in gpus:
        dev, why = find_gpu(topo, ref)
        if dev is None:
            unread.append(why)
        elif dev.node is None:
            unread.append(f"GPU {ref}: {dev.problem}")
        elif dev.node < 0:
            if len(topo.nodes) > 1:
                unread.append(f"GPU {ref}: the kernel reports no NUMA node for {dev.bus_id} on a host with "
                              f"{len(topo.nodes)} nodes")
        else:
            nodes.add(dev.node)
            cpus.update(dev.cpus or topo.nodes.get(dev.node, ()))
    source = _gpus_source(gpus)
    if unread:
        return Placement(source=source, note="; ".join(unread))
    if not nodes or len(topo.nodes) == 1:
        return Placement(source=source, note="one NUMA node: nothing to place")
    return _fit(tuple(sorted(nodes)), cpus, cpus_ok, mems_ok, source)


def _gpus_source(gpus: tuple[GpuRef, ...]) -> str:
    return "gpus [" + ", ".join(str(g) if isinstance(g, int) else f'"{g}"' for g in gpus) + "]"


def _node_placement(topo: Topology, node: int, cpus_ok: frozenset[int], mems_ok: frozenset[int] | None,
                    own: str) -> Placement:
    source = f"numa = {node}"
    if node not in topo.nodes:
        online = format_list(topo.nodes) or "none readable"
        why = f" ({topo.problem})" if topo.problem else ""
        return Placement(source=source, error=f"numa = {node}: no NUMA node {node} on this host "
                                              f"(online: {online}){why}")
    cpus = set(topo.nodes[node]) & cpus_ok
    if not cpus:
        return Placement(source=source, error=f"numa = {node}: node {node}'s CPUs ({format_list(topo.nodes[node])}) "
                                              f"are all outside this daemon's ({format_list(cpus_ok)})")
    if mems_ok is not None and node not in mems_ok:
        return Placement(source=source, error=f"numa = {node}: this daemon's cpuset may not use memory of node "
                                              f"{node} (Mems_allowed_list {format_list(mems_ok)})")
    note = f"the unit's own placement applies after omnid's: {own}" if own else ""
    return Placement((node,), tuple(sorted(cpus)), MPOL_PREFERRED, (node,), source, note)


def _fit(nodes: tuple[int, ...], cpus: set[int], cpus_ok: frozenset[int], mems_ok: frozenset[int] | None,
         source: str) -> Placement:
    """The GPUs' nodes and CPUs, less what this daemon may not use (a container's cpuset)."""
    notes = []
    usable_cpus = cpus & cpus_ok
    if not usable_cpus:
        notes.append(f"the GPUs' CPUs ({format_list(cpus)}) are all outside this daemon's "
                     f"({format_list(cpus_ok)}): CPUs not set")
    elif usable_cpus != cpus:
        notes.append(f"CPUs {format_list(cpus - cpus_ok)} are outside this daemon's and left out")
    mem_nodes = tuple(n for n in nodes if mems_ok is None or n in mems_ok)
    if len(mem_nodes) != len(nodes):
        left = format_list(set(nodes) - set(mem_nodes))
        notes.append(f"memory of node {left} is not allowed to this daemon (Mems_allowed_list "
                     f"{format_list(mems_ok or ())})" + ("" if mem_nodes else ": memory policy not set"))
    memory = 0 if not mem_nodes else (MPOL_PREFERRED if len(mem_nodes) == 1 else MPOL_PREFERRED_MANY)
    return Placement(nodes, tuple(sorted(usable_cpus)), memory, mem_nodes, source, "; ".join(notes))


def status(spec: Unit) -> dict | None:
    """The unit's placement for `status --json` and /units (`Placement.to_json`), or None when
    it has none to have (numa = "off", or "auto" without gpus)."""
    if spec.numa is NumaMode.OFF or (spec.numa is NumaMode.AUTO and not spec.gpus):
        return None
    return placement_for(spec).to_json()


def kernel_placement(pid: int) -> str | None:
    """What the kernel says about a process's placement: its allowed CPUs and memory nodes
    (/proc/PID/status) and its memory policy (/proc/PID/numa_maps shows it on every mapping
    without one of its own), or None when the process is gone."""
    cpus = mems = ""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    cpus = line.split(":", 1)[1].strip()
                elif line.startswith("Mems_allowed_list:"):
                    mems = line.split(":", 1)[1].strip()
    except OSError:
        return None
    policy = _numa_policy_bounded(pid)
    return f"CPUs {cpus or '?'}, memory policy {policy} (nodes allowed {mems or '?'})"


NUMA_MAPS_WAIT_S = 0.5


def _numa_policy_bounded(pid: int) -> str:
    """The memory policy from /proc/PID/numa_maps, read on a daemon thread and waited for at most
    NUMA_MAPS_WAIT_S: the read takes the process's mm lock, which it can keep for good (a fault
    on a hung mount with a thread waiting in mmap; measured on Linux 6.18, numa_maps then never
    returns, while status does). "?" without NUMA support, "not read" past the wait."""
    import threading

    out: list[str] = []

    def read() -> None:
        try:
            with open(f"/proc/{pid}/numa_maps") as f:
                out.append(memory_policy_of(f.read(65536)))
        except OSError:
            out.append("?")  # a kernel without NUMA support has no numa_maps

    t = threading.Thread(target=read, name=f"numa_maps {pid}", daemon=True)
    t.start()
    t.join(NUMA_MAPS_WAIT_S)
    return out[0] if out else f"not read within {NUMA_MAPS_WAIT_S:g} s (its memory lock is held?)"


def memory_policy_of(numa_maps: str) -> str:
    """The task memory policy as numa_maps writes it ("default", "prefer:1", "bind:0-1"): the most
    common policy over the mappings (a mapping with a policy of its own shows that one)."""
    seen: dict[str, int] = {}
    for line in numa_maps.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            # "prefer (many):0-1" is written with a space
            policy = f"{parts[1]} {parts[2]}" if parts[2:3] and parts[2].startswith("(many)") else parts[1]
            seen[policy] = seen.get(policy, 0) + 1
    return max(seen, key=seen.__getitem__) if seen else "?"


def unit_notes(spec: Unit, this_host: bool) -> list[tuple[str, str, bool]]:
    """(key, note, fails) for `omnid check`: what an operator should know about this unit's
    placement. Always: the unit's own numactl or taskset, env that pins threads, an env
    CUDA_VISIBLE_DEVICES that differs from gpus. With `this_host`: GPUs whose node cannot be
    read here, and `numa = N` this host cannot honour (`fails`: the spawn would fail)."""
    out: list[tuple[str, str, bool]] = []
    if spec.numa is NumaMode.OFF or (spec.numa is NumaMode.AUTO and not spec.gpus):
        return out
    where = "the GPUs' node" if spec.numa is NumaMode.AUTO else f"node {spec.numa}"
    own = own_placement(spec)
    if own and spec.numa is NumaMode.AUTO:
        out.append(("exec", f'numa = "auto" leaves the placement to the unit ({own}); '
                            'omnid sets no CPUs or memory policy for it', False))
    elif own:
        out.append(("exec", f"{own}: it runs after omnid placed the unit on {where} and its own "
                            "placement is what applies", False))
    pinned = [k for k in AFFINITY_ENV if k in spec.env]
    if pinned and not own:
        out.append(("env", f"{', '.join(pinned)} pin threads to CPU lists of their own: omnid still limits the "
                           f"unit to {where}'s CPUs, and those lists must lie within them", False))
    cvd = spec.env.get("CUDA_VISIBLE_DEVICES")
    if spec.gpus and cvd is not None and cvd != ",".join(map(str, spec.gpus)) and spec.numa is NumaMode.AUTO:
        out.append(("env", f"CUDA_VISIBLE_DEVICES = {cvd!r} overrides gpus for CUDA; the NUMA placement "
                           f"follows gpus = {list(spec.gpus)}", False))
    if this_host and not own:
        p = placement_for(spec)
        if p.error:
            out.append(("numa", p.error, True))
        elif p.note and not p.note.startswith("one NUMA node"):
            out.append(("gpus" if spec.numa is NumaMode.AUTO else "numa", f"NUMA placement: {p.note}", False))
    return out
