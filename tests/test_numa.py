"""NUMA placement at birth (omnid.process.numa, unit key `numa`): decided from the GPUs' topology and set
by the spawner between fork and exec. This machine has one NUMA node and no GPU, so the GPU
topology is a fake sysfs tree (OMNID_SYSFS_ROOT) and the tests say so in their names; what the
unit process gets is read from the kernel (/proc/PID/status, /proc/PID/numa_maps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnid.process import numa
from omnid.model.units import NumaMode, load_stack
from tests.harness import REPO, make_stack, wait_for

GPU0 = "GPU-7f57f032-34ab-a064-c37c-7a4f75601cc5"
GPU1 = "GPU-8c7c9c30-f12f-20bf-e14e-d3c4c965af32"
HOST_CPUS = sorted(os.sched_getaffinity(0))
ONE_CPU = str(HOST_CPUS[-1])  # a CPU this machine has, so the affinity can really be set
needs_two_cpus = pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs to tell a placement from none")


def fake_gpu_tree(root: Path, gpus: list[dict], nodes: dict[int, str], driver: bool = True) -> Path:
    """A sysfs + /proc tree: each GPU {"bus", "uuid", "node" (text, or None: no numa_node file),
    "cpus" (local_cpulist)}; nodes {node: cpulist}. Without `driver`, no /proc/driver/nvidia and
    the GPUs are found as NVIDIA 3D controllers in /sys/bus/pci/devices."""
    for g in gpus:
        dev = root / "sys/bus/pci/devices" / g["bus"]
        dev.mkdir(parents=True)
        (dev / "vendor").write_text("0x10de\n")
        (dev / "class").write_text("0x030200\n")
        if g.get("node") is not None:
            (dev / "numa_node").write_text(f"{g['node']}\n")
        (dev / "local_cpulist").write_text(f"{g.get('cpus', '')}\n")
        if driver:
            info = root / "proc/driver/nvidia/gpus" / g["bus"]
            info.mkdir(parents=True)
            (info / "information").write_text(f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: \t\t 18\n"
                                              f"GPU UUID: \t {g['uuid']}\nBus Location: \t {g['bus']}\n")
    # A non-GPU PCI device: never counted.
    other = root / "sys/bus/pci/devices/0000:00:1f.0"
    other.mkdir(parents=True)
    (other / "vendor").write_text("0x8086\n")
    (other / "class").write_text("0x060100\n")
    for n, cpus in nodes.items():
        d = root / f"sys/devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    (root / "sys/devices/system/node").mkdir(parents=True, exist_ok=True)
    (root / "sys/devices/system/node/online").write_text(",".join(map(str, sorted(nodes))) + "\n")
    return root


def two_gpus(root: Path, **kw) -> Path:
    # GPU 0 on node 0 (this machine's node) with one CPU; GPU 1 on node 1, which this host lacks.
    return fake_gpu_tree(root, [
        {"bus": "0000:3b:00.0", "uuid": GPU0, "node": "0", "cpus": ONE_CPU},
        {"bus": "0000:86:00.0", "uuid": GPU1, "node": "1", "cpus": str(HOST_CPUS[0])},
    ], {0: ONE_CPU, 1: str(HOST_CPUS[0])}, **kw)


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    root = two_gpus(tmp_path / "fake")
    monkeypatch.setenv(numa.SYSFS_ROOT_ENV, str(root))
    numa.topology.cache_clear()
    numa._placement.cache_clear()
    yield root
    numa.topology.cache_clear()
    numa._placement.cache_clear()


def unit(tmp_path: Path, body: str):
    d = tmp_path / "stack"
    d.mkdir(exist_ok=True)
    (d / "w.toml").write_text('exec = ["sleep", "1000"]\n' + body)
    return load_stack(d)["w"]


# ------------------------------------------------------------------ reading the topology


@pytest.mark.fast
def test_kernel_lists_read_and_written():
    assert numa.parse_list("0-3,8,10-11\n", "x") == (0, 1, 2, 3, 8, 10, 11)
    assert numa.parse_list("", "x") == ()
    assert numa.format_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    for bad in ("0-", "a", "3-1", "0-99999"):
        with pytest.raises(numa.TopologyError, match="expected a list"):
            numa.parse_list(bad, "x")


@pytest.mark.parametrize("driver", [True, False], ids=["driver_proc", "pci_scan"])
@pytest.mark.fast
def test_fake_gpu_topology_gpus_in_pci_bus_order(tmp_path, driver):
    root = fake_gpu_tree(tmp_path, [
        {"bus": "0000:86:00.0", "uuid": GPU1, "node": "1", "cpus": "8-15"},
        {"bus": "0000:3b:00.0", "uuid": GPU0, "node": "0", "cpus": "0-7"},
    ], {0: "0-7", 1: "8-15"}, driver=driver)
    topo = numa.topology(str(root))
    assert [(g.index, g.bus_id, g.node, g.cpus) for g in topo.gpus] == [
        (0, "0000:3b:00.0", 0, tuple(range(8))), (1, "0000:86:00.0", 1, tuple(range(8, 16)))]
    assert [g.uuid for g in topo.gpus] == ([GPU0, GPU1] if driver else [None, None])
    assert topo.nodes == {0: tuple(range(8)), 1: tuple(range(8, 16))}


@pytest.mark.fast
def test_fake_gpu_topology_unreadable_node_is_a_problem_not_a_guess(tmp_path):
    root = fake_gpu_tree(tmp_path, [{"bus": "0000:3b:00.0", "uuid": GPU0, "node": None, "cpus": "0"},
                                    {"bus": "0000:86:00.0", "uuid": GPU1, "node": "x", "cpus": "0"}], {0: "0"})
    g0, g1 = numa.topology(str(root)).gpus
    assert g0.node is None and "numa_node does not exist" in g0.problem
    assert g1.node is None and "expected a node number or -1, got 'x'" in g1.problem


# ------------------------------------------------------------------ deciding


@pytest.mark.fast
def test_fake_gpu_topology_auto_places_on_the_gpus_node(fake_root, tmp_path):
    p = numa.placement_for(unit(tmp_path, "gpus = [0]\n"))
    assert p.nodes == (0,) and p.cpus == (int(ONE_CPU),)
    assert p.memory == numa.MPOL_PREFERRED and p.mem_nodes == (0,)
    assert p.source == "gpus [0]" and not p.error
    assert p.to_wire() == {"cpus": [int(ONE_CPU)], "mempolicy": numa.MPOL_PREFERRED, "nodes": [0]}


@pytest.mark.fast
def test_fake_gpu_topology_gpu_named_by_uuid_or_legacy_mig_uuid(fake_root, tmp_path):
    assert numa.placement_for(unit(tmp_path, f'gpus = ["{GPU0}"]\n')).nodes == (0,)
    assert numa.placement_for(unit(tmp_path, f'gpus = ["MIG-{GPU0}/1/0"]\n')).nodes == (0,)


@pytest.mark.fast
def test_fake_nvml_mig_uuid_is_placed_on_its_gpus_node(fake_root, tmp_path, monkeypatch):
    # No NVML here: a fake resolver stands in for nvmlDeviceGetDeviceHandleFromMigDeviceHandle.
    mig = "MIG-377e0049-554c-540b-93c6-d0976f8426cb"
    monkeypatch.setattr(numa, "_nvml_mig_parent", lambda uuid: GPU0 if uuid == mig else None)
    assert numa.placement_for(unit(tmp_path, f'gpus = ["{mig}"]\n')).nodes == (0,)


@pytest.mark.fast
def test_fake_gpu_topology_mig_uuid_without_nvml_is_said_not_guessed(fake_root, tmp_path, monkeypatch):
    monkeypatch.setattr(numa, "_nvml_mig_parent", lambda uuid: None)
    p = numa.placement_for(unit(tmp_path, 'gpus = ["MIG-377e0049-554c-540b-93c6-d0976f8426cb"]\n'))
    assert not p.active and "cannot be found without NVML" in p.note


@pytest.mark.fast
def test_fake_gpu_topology_node_this_host_lacks_keeps_cpus_drops_memory_policy(fake_root, tmp_path):
    p = numa.placement_for(unit(tmp_path, "gpus = [1]\n"))
    assert p.nodes == (1,) and p.cpus == (HOST_CPUS[0],)
    assert p.memory == 0 and "memory of node 1 is not allowed" in p.note


@pytest.mark.fast
def test_fake_gpu_topology_gpus_on_two_nodes_prefer_both(tmp_path, monkeypatch):
    root = two_gpus(tmp_path / "fake")
    monkeypatch.setenv(numa.SYSFS_ROOT_ENV, str(root))
    monkeypatch.setattr(numa, "usable", lambda: (frozenset(HOST_CPUS), frozenset({0, 1})))
    numa._placement.cache_clear()
    p = numa.placement_for(unit(tmp_path, "gpus = [0, 1]\n"))
    assert p.nodes == (0, 1) and p.memory == numa.MPOL_PREFERRED_MANY and p.mem_nodes == (0, 1)
    numa._placement.cache_clear()


@pytest.mark.fast
def test_fake_gpu_topology_problems_leave_the_unit_unplaced_and_say_why(fake_root, tmp_path):
    p = numa.placement_for(unit(tmp_path, "gpus = [7]\n"))
    assert not p.active and "GPU 7: this host has 2 GPUs" in p.note and not p.error
    p = numa.placement_for(unit(tmp_path, 'gpus = ["GPU-00000000-0000-0000-0000-000000000000"]\n'))
    assert not p.active and "no GPU with UUID" in p.note


@pytest.mark.fast
def test_fake_gpu_topology_explicit_node_is_honoured_or_refused(fake_root, tmp_path):
    p = numa.placement_for(unit(tmp_path, "numa = 0\n"))
    assert p.nodes == (0,) and p.cpus == (int(ONE_CPU),) and p.memory == numa.MPOL_PREFERRED
    p = numa.placement_for(unit(tmp_path, "numa = 5\n"))
    assert p.error == "numa = 5: no NUMA node 5 on this host (online: 0-1)"
    assert p.to_wire() == {"error": p.error}


@pytest.mark.fast
def test_numa_off_and_auto_without_gpus_place_nothing(fake_root, tmp_path):
    assert numa.placement_for(unit(tmp_path, 'gpus = [0]\nnuma = "off"\n')) is numa.NO_PLACEMENT
    assert numa.placement_for(unit(tmp_path, "")) is numa.NO_PLACEMENT
    assert numa.status(unit(tmp_path, "")) is None


@pytest.mark.fast
def test_fake_gpu_topology_units_own_numactl_wins_and_is_said(fake_root, tmp_path):
    d = tmp_path / "own"
    d.mkdir()
    (d / "w.toml").write_text('exec = ["numactl", "--cpunodebind=1", "vllm"]\ngpus = [0]\n')
    (d / "v.toml").write_text('exec = ["vllm", "serve", "--numa-bind"]\ngpus = [0]\n')
    (d / "e.toml").write_text('exec = ["w"]\ngpus = [0]\nenv = { GOMP_CPU_AFFINITY = "0-3" }\n')
    stack = load_stack(d)
    for name, how in (("w", "its exec runs numactl"), ("v", "its exec passes --numa-bind")):
        p = numa.placement_for(stack[name])
        assert not p.active and how in p.note
        notes = numa.unit_notes(stack[name], this_host=False)
        assert notes and notes[0][0] == "exec" and "leaves the placement to the unit" in notes[0][1]
    assert numa.placement_for(stack["e"]).active
    (key, note, fails), = numa.unit_notes(stack["e"], this_host=False)
    assert key == "env" and "GOMP_CPU_AFFINITY" in note and not fails


@pytest.mark.fast
def test_memory_policy_read_from_numa_maps():
    maps = ("55d0 prefer:1 file=/bin/x mapped=2 N0=2\n55d1 prefer:1 anon=3 N0=3\n"
            "7f00 bind:0 anon=1 N0=1\n")
    assert numa.memory_policy_of(maps) == "prefer:1"
    assert numa.memory_policy_of("55d0 prefer (many):0-1 anon=1 N0=1\n") == "prefer (many):0-1"


# ------------------------------------------------------------------ the real process


def proc_status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def policy(pid: int) -> str:
    return numa.memory_policy_of(Path(f"/proc/{pid}/numa_maps").read_text())


@needs_two_cpus
def test_fake_gpu_topology_unit_process_is_born_on_its_gpus_cpus_and_node(tmp_path, daemon_factory):
    root = two_gpus(tmp_path / "fake")
    stack = make_stack({
        "placed": 'exec = ["sleep", "1000"]\ngpus = [0]\n',
        "remote": 'exec = ["sleep", "1000"]\ngpus = [1]\n',
        "off": 'exec = ["sleep", "1000"]\ngpus = [0]\nnuma = "off"\n',
        "node": 'exec = ["sleep", "1000"]\nnuma = 0\n',
    })
    d = daemon_factory(stack, env={numa.SYSFS_ROOT_ENV: str(root)})
    units = d.wait_all_active()
    everything = proc_status(units["off"]["pid"], "Cpus_allowed_list")
    # Kernel truth of the real processes: affinity and memory policy were set before exec.
    placed = units["placed"]["pid"]
    assert proc_status(placed, "Cpus_allowed_list") == ONE_CPU, d.log()[-2000:]
    assert policy(placed) == "prefer:0"
    assert proc_status(units["node"]["pid"], "Cpus_allowed_list") == ONE_CPU
    assert policy(units["node"]["pid"]) == "prefer:0"
    # GPU 1's node 1 does not exist on this host: its CPUs are set, no memory policy.
    assert proc_status(units["remote"]["pid"], "Cpus_allowed_list") == str(HOST_CPUS[0])
    assert policy(units["remote"]["pid"]) == "default"
    assert everything == f"{HOST_CPUS[0]}-{HOST_CPUS[-1]}" and policy(units["off"]["pid"]) == "default"
    # What status says (the decision, and for `omnid status UNIT` also the kernel's view).
    assert units["placed"]["placement"]["cpus"] == ONE_CPU
    assert units["placed"]["placement"]["memory"] == "preferred"
    assert "memory of node 1 is not allowed" in units["remote"]["placement"]["note"]
    assert units["off"]["placement"] is None
    r = subprocess.run([sys.executable, "-m", "omnid", "--control", d.control, "status", "placed"],
                       capture_output=True, text=True, timeout=30, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    assert f"NUMA: node 0 (from gpus [0]): CPUs {ONE_CPU}, memory preferred on 0" in r.stdout, r.stdout
    assert f"kernel: CPUs {ONE_CPU}, memory policy prefer:0" in r.stdout, r.stdout


def test_fake_gpu_topology_numa_node_the_host_lacks_fails_the_spawn_with_the_reason(tmp_path, daemon_factory):
    root = two_gpus(tmp_path / "fake")
    d = daemon_factory(make_stack({"w": 'exec = ["sleep", "1000"]\nnuma = 5\n'}),
                       env={numa.SYSFS_ROOT_ENV: str(root)})
    u = d.wait_state("w", "failed")
    assert "no NUMA node 5 on this host" in u["reason"], u


def test_fake_gpu_topology_restart_keeps_the_placement(tmp_path, daemon_factory):
    root = two_gpus(tmp_path / "fake")
    d = daemon_factory(make_stack({"w": 'exec = ["sleep", "1000"]\ngpus = [0]\nrestart = "always"\n'
                                        "restart_sec = 0\n"}), env={numa.SYSFS_ROOT_ENV: str(root)})
    first = d.wait_state("w", "active")["pid"]
    os.kill(first, 9)
    again = wait_for(lambda: (u := d.unit("w"))["state"] == "active" and u["pid"] != first and u["pid"], 10,
                     "a replacement")
    assert proc_status(again, "Cpus_allowed_list") == ONE_CPU and policy(again) == "prefer:0"


# ------------------------------------------------------------------ omnid check


def run_check(stack: Path, root: Path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{numa.SYSFS_ROOT_ENV: str(root)})
    return subprocess.run([sys.executable, "-m", "omnid", "check", "-u", str(stack), *flags], capture_output=True,
                          text=True, timeout=60, env=env, cwd=str(REPO))


def test_fake_gpu_topology_check_this_host_reports_gpus_whose_node_cannot_be_read(tmp_path):
    root = fake_gpu_tree(tmp_path / "fake", [{"bus": "0000:3b:00.0", "uuid": GPU0, "node": None, "cpus": "0"}],
                         {0: "0"})
    stack = make_stack({"w": 'exec = ["sleep", "1"]\ngpus = [0]\n'})
    r = run_check(stack, root, "--this-host")
    assert r.returncode == 0, r.stderr  # the unit starts, unplaced: a warning
    assert "warning:" in r.stderr and "w.toml: gpus: NUMA placement: GPU 0:" in r.stderr, r.stderr
    assert "numa_node does not exist" in r.stderr
    # Without --this-host the stack may be meant for another host: nothing about this one.
    assert "numa_node" not in run_check(stack, root).stderr


def test_fake_gpu_topology_check_this_host_refuses_a_node_the_host_lacks(tmp_path):
    root = two_gpus(tmp_path / "fake")
    r = run_check(make_stack({"w": 'exec = ["sleep", "1"]\nnuma = 5\n'}), root, "--this-host")
    assert r.returncode == 2 and "numa: numa = 5: no NUMA node 5 on this host" in r.stderr, r.stderr


def test_check_says_when_the_units_own_numactl_takes_over(tmp_path):
    root = two_gpus(tmp_path / "fake")
    r = run_check(make_stack({"w": 'exec = ["numactl", "-N", "1", "sleep", "1"]\ngpus = [0]\n'}), root)
    assert r.returncode == 0
    assert 'exec: numa = "auto" leaves the placement to the unit (its exec runs numactl)' in r.stderr, r.stderr


def test_status_json_placement_is_null_without_gpus(daemon_factory):
    d = daemon_factory(make_stack({"w": 'exec = ["sleep", "1000"]\n'}))
    assert d.wait_state("w", "active")["placement"] is None
    assert json.loads(json.dumps(d.unit("w")))["placement"] is None
    assert load_stack(d.units_dir)["w"].numa is NumaMode.AUTO
