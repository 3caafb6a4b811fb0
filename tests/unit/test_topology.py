"""Topology discovery against captured and synthetic sysfs/procfs trees.

Every tree under tests/fixtures with a NUMA node directory is checked for the
invariants; the synthetic CXL tree (and copies of it edited per test) pins the
classification, ordering, override and swap rules.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.kernel import sysfs
from kvtier.kernel import topology as topo
from kvtier.errors import ConfigError, InvalidArgument

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TREES = sorted(d for d in FIXTURES.iterdir() if (d / "sys" / sysfs.NODE_DIR).is_dir())
SYNTH = FIXTURES / "synthetic-cxl"
CAPTURE = Path(__file__).resolve().parent.parent.parent / "scripts" / "capture_fixtures.py"
HOST = FIXTURES / "host-1node"
GIB = 1 << 30


def discover(tree: Path, overrides=None) -> topo.Topology:
    return topo.discover(str(tree / "sys"), str(tree / "proc"), overrides)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A private, editable copy of the synthetic CXL tree."""
    dst = tmp_path / "tree"
    shutil.copytree(SYNTH, dst, symlinks=True)
    return dst


def node_dir(tree: Path, n: int) -> Path:
    return tree / "sys" / sysfs.NODE_DIR / f"node{n}"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def set_swaps(tree: Path, *rows: str) -> None:
    write(tree / "proc" / sysfs.PROC_SWAPS, "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n" + "\n".join(rows))


def set_memtiers(tree: Path, tiers: dict[int, str] | None) -> None:
    base = tree / "sys" / sysfs.MEMTIER_DIR
    shutil.rmtree(base)
    for tid, nodes in (tiers or {}).items():
        write(base / f"{sysfs.MEMTIER_PREFIX}{tid}" / sysfs.MEMTIER_NODELIST, nodes)


def drop_hmat(tree: Path) -> None:
    for n in range(3):
        for access in sysfs.HMAT_ACCESS_CLASSES:
            shutil.rmtree(node_dir(tree, n) / access)


def summary(t: topo.Topology) -> list[tuple[str, str, tuple[int, ...], str]]:
    return [(x.name, x.kind, x.nodes, x.order_source) for x in t.tiers]


# ---------------------------------------------------------------------------
# invariants on every fixture tree (host capture, synthetic, qemu-cxl when captured)


def test_fixture_trees_found():
    names = {d.name for d in TREES}
    assert {"host-1node", "synthetic-cxl"} <= names


@pytest.mark.parametrize("tree_dir", TREES, ids=lambda d: d.name)
def test_invariants(tree_dir: Path):
    t = discover(tree_dir)
    base = tree_dir / "sys" / sysfs.NODE_DIR
    # Read the node lists here independently of the code under test.
    has_cpu = set(sysfs.parse_list((base / "has_cpu").read_text()))
    has_mem = set(sysfs.parse_list((base / "has_memory").read_text()))

    assert t.tiers[0].kind == "dram" and t.tiers[0].name == "dram"
    assert set(t.tiers[0].nodes) == has_cpu & has_mem
    assert [x.index for x in t.tiers] == list(range(len(t.tiers)))
    # every memory node in exactly one tier, node_to_tier agreeing
    placed = [n for x in t.tiers for n in x.nodes]
    assert sorted(placed) == sorted(has_mem)
    assert t.node_to_tier == {n: x.index for x in t.tiers for n in x.nodes}
    for n in has_mem:
        assert n in t.tier_for_node(n).nodes
    for x in t.tiers[1:]:
        assert x.kind in ("far", "cxl", "swap")
        assert not set(x.nodes) & has_cpu
    # far tiers never go against the kernel's memory tiers
    mt = [max(t.nodes[n].memory_tier for n in x.nodes) for x in t.tiers if x.kind in ("far", "cxl")]
    if all(v is not None for v in mt):
        assert mt == sorted(mt)
    # capacities are the nodes' MemTotal/MemFree sums
    for x in t.tiers:
        if x.kind != "swap":
            assert x.total == sum(t.nodes[n].total for n in x.nodes) > 0
            assert 0 <= x.free <= x.total and x.capacity == x.total
    swaps = sysfs.parse_swaps((tree_dir / "proc" / "swaps").read_text())
    if swaps:
        assert t.tiers[-1].kind == "swap" and t.tiers[-1].nodes == ()
        assert t.tiers[-1].total == sum(r[2] for r in swaps)
        assert [x.kind for x in t.tiers].count("swap") == 1
    else:
        assert all(x.kind != "swap" for x in t.tiers)


@pytest.mark.parametrize("tree_dir", TREES, ids=lambda d: d.name)
def test_to_dict_and_table(tree_dir: Path):
    t = discover(tree_dir)
    d = json.loads(json.dumps(t.to_dict()))
    assert [x["name"] for x in d["tiers"]] == [x.name for x in t.tiers]
    assert {int(n): i for n, i in d["node_to_tier"].items()} == t.node_to_tier
    table = topo.format_table(t).splitlines()
    header, rows = table[0], table[1 : 1 + len(t.tiers)]
    assert header.split()[:3] == ["TIER", "NAME", "KIND"]
    # columns are aligned: every row's NAME and NOTES start under the header's
    for col in ("NAME", "TOTAL", "NOTES"):
        at = header.index(col)
        for r, x in zip(rows, t.tiers):
            assert r[at - 2 : at] == "  " and r[at] != " ", (col, r)
    for r, x in zip(rows, t.tiers):
        assert r.split()[:3] == [str(x.index), x.name, x.kind]
    assert table[1 + len(t.tiers) :] == [f"warning: {w}" for w in t.warnings]


@pytest.mark.parametrize("tree_dir", TREES, ids=lambda d: d.name)
def test_node_tier_lut(tree_dir: Path):
    t = discover(tree_dir)
    lut = t.node_tier_lut()
    for n, i in t.node_to_tier.items():
        assert lut[n] == i
    with pytest.raises(InvalidArgument):
        t.tier_for_node(len(lut) + 5)


@pytest.mark.skipif(not (FIXTURES / "qemu-cxl" / "sys").is_dir(), reason="qemu-cxl not captured yet")
def test_qemu_guest_capture_matches_design():
    # DESIGN.md's guest: DRAM, a CPU-less far RAM node, CXL through dax
    # kmem, swap on NVMe. A capture missing one means the VM is misbuilt.
    t = discover(FIXTURES / "qemu-cxl")
    kinds = [x.kind for x in t.tiers]
    assert kinds[0] == "dram" and {"far", "cxl", "swap"} <= set(kinds), kinds
    assert t.swap_tier.nvme


# ---------------------------------------------------------------------------
# the synthetic CXL guest


def test_synthetic_order_and_classification():
    t = discover(SYNTH)
    assert summary(t) == [
        ("dram", "dram", (0,), "cpus"),
        ("far0", "far", (1,), "memory_tier"),
        ("cxl0", "cxl", (2,), "memory_tier"),
        ("swap", "swap", (), "swap"),
    ]
    assert t.nodes[2].cxl == "dax0.0 in region0"
    assert t.nodes[1].cxl is None
    assert [t.nodes[n].memory_tier for n in range(3)] == [4, 18, 22]
    assert [t.nodes[n].slit_from_cpu for n in range(3)] == [10, 20, 30]
    far, cxl = t.tiers[1], t.tiers[2]
    assert (far.read_latency_ns, far.write_latency_ns, far.read_bandwidth_mbps) == (200, 200, 10000)
    assert (cxl.read_latency_ns, cxl.write_latency_ns, cxl.write_bandwidth_mbps) == (350, 400, 4000)
    assert t.nodes[2].perf.access_class == "access1"
    assert (t.tiers[0].total, t.tiers[0].free) == (2 * GIB, 1536 << 20)
    assert "memory_tier 22 > 18" in cxl.notes[0]
    assert t.warnings == []


def test_synthetic_swap_is_nvme_whole_disk():
    t = discover(SYNTH)
    swap = t.swap_tier
    assert swap is not None and swap.nvme
    (dev,) = swap.swap_devices
    assert (dev.path, dev.type, dev.block, dev.disk, dev.transport) == (
        "/dev/nvme0n1", "partition", "nvme0n1", "nvme0n1", "nvme")
    assert dev.nvme and dev.rotational is False
    assert (dev.size, dev.used, dev.priority) == (4194300 * 1024, 1024 * 1024, -2)
    assert swap.free == swap.total - dev.used


def test_missing_memory_tiering_falls_back_to_hmat(tree: Path):
    set_memtiers(tree, None)
    t = discover(tree)
    assert summary(t)[1:3] == [("far0", "far", (1,), "hmat"), ("cxl0", "cxl", (2,), "hmat")]
    assert all(n.memory_tier is None for n in t.nodes.values())
    assert any("memory tiers absent" in w for w in t.warnings)


def test_memory_tier_outranks_hmat(tree: Path):
    # The kernel put the CXL node in the faster tier; HMAT says otherwise.
    # kvtier follows the kernel's tiers, which is also what demotion uses.
    set_memtiers(tree, {4: "0", 18: "2", 22: "1"})
    t = discover(tree)
    assert summary(t)[1:3] == [("cxl0", "cxl", (2,), "memory_tier"), ("far0", "far", (1,), "memory_tier")]


def test_slit_orders_without_tiers_or_hmat(tree: Path):
    set_memtiers(tree, None)
    drop_hmat(tree)
    # make the CXL node nearer than the far node by SLIT
    write(node_dir(tree, 0) / "distance", "10 40 20")
    t = discover(tree)
    assert summary(t)[1:3] == [("cxl0", "cxl", (2,), "slit"), ("far0", "far", (1,), "slit")]
    assert t.tiers[1].read_latency_ns is None
    assert any("no HMAT" in w for w in t.warnings)


def test_kind_breaks_a_tie_and_equal_nodes_share_a_tier(tree: Path):
    set_memtiers(tree, {4: "0", 18: "1-2"})
    drop_hmat(tree)
    write(node_dir(tree, 0) / "distance", "10 20 20")
    t = discover(tree)
    assert summary(t)[1:3] == [("far0", "far", (1,), "memory_tier"), ("cxl0", "cxl", (2,), "kind")]
    # without the CXL evidence both nodes are plain far memory with equal keys
    shutil.rmtree(tree / "sys" / "bus")
    t = discover(tree)
    assert summary(t)[1] == ("far0", "far", (1, 2), "memory_tier")
    assert t.tiers[1].total == 2 * GIB and len(t.tiers) == 3


def test_guest_without_hmat_all_in_dram_tier(tree: Path):
    # A QEMU guest without HMAT puts every node in the default memory tier;
    # only SLIT tells the far nodes apart, and equal SLIT falls back to kind.
    set_memtiers(tree, {4: "0-2"})
    drop_hmat(tree)
    assert summary(discover(tree))[1:3] == [("far0", "far", (1,), "slit"), ("cxl0", "cxl", (2,), "slit")]
    write(node_dir(tree, 0) / "distance", "10 10 10")
    t = discover(tree)
    assert summary(t)[1:3] == [("far0", "far", (1,), "kind"), ("cxl0", "cxl", (2,), "kind")]
    assert t.tiers[1].notes[0].startswith("CPU-less memory after DRAM")
    assert t.tiers[2].notes[0].startswith("CXL after plain far memory")


def test_cxl_by_region_range_without_dax(tree: Path):
    # Firmware-onlined CXL memory: no dax device, but node2's memory blocks
    # (memory82.. at 128 MiB each = 0x290000000) lie inside region0.
    shutil.rmtree(tree / "sys" / sysfs.DAX_DEVICES)
    t = discover(tree)
    assert t.nodes[2].kind == "cxl" and t.nodes[2].cxl == "memory82 in region0"
    assert t.nodes[1].kind == "far"


def test_region_without_range_or_dax_is_far(tree: Path):
    shutil.rmtree(tree / "sys" / sysfs.DAX_DEVICES)
    region = tree / "sys/devices/platform/ACPI0017:00/root0/decoder0.0/region0"
    write(region / sysfs.CXL_REGION_SIZE, "0x0")  # region not yet committed
    t = discover(tree)
    assert [x.name for x in t.tiers] == ["dram", "far0", "far1", "swap"]
    assert t.nodes[2].cxl is None


def test_dax_outside_cxl_is_not_cxl(tree: Path):
    # An hmem dax device (EFI "specific purpose" memory) also has a
    # target_node, but no CXL region above it.
    dax = tree / "sys" / sysfs.DAX_DEVICES / "dax0.0"
    dax.unlink()
    dax.symlink_to("../../../devices/platform/hmem.0/dax0.0")
    write(tree / "sys/devices/platform/hmem.0/dax0.0" / sysfs.DAX_TARGET_NODE, "1")
    t = discover(tree)
    assert t.nodes[1].kind == "far"
    assert t.nodes[2].cxl == "memory82 in region0"  # still CXL by its physical range


# ---------------------------------------------------------------------------
# swap devices


def test_swap_partition_on_nvme(tree: Path):
    set_swaps(tree, "/dev/nvme0n1p1                          partition\t1048572\t0\t-2")
    (dev,) = discover(tree).swap_devices
    assert (dev.type, dev.block, dev.disk, dev.nvme, dev.rotational) == ("partition", "nvme0n1p1", "nvme0n1", True, False)


def test_swap_file_resolved_through_recorded_st_dev(tree: Path):
    meta = json.loads((tree / sysfs.FIXTURE_META).read_text())
    meta["swap_files"] = {"/srv/swap file": "259:1", "/var/tmp/other": "254:0", "/tmpfs/swap": "0:42"}
    (tree / sysfs.FIXTURE_META).write_text(json.dumps(meta))
    set_swaps(
        tree,
        "/srv/swap\\040file                       file\t1024\t0\t-3",
        "/var/tmp/other                          file\t2048\t512\t5",
        "/tmpfs/swap                             file\t4096\t0\t-4",
        "/unrecorded                             file\t4096\t0\t-5",
    )
    t = discover(tree)
    devs = {d.path: d for d in t.swap_devices}
    assert (devs["/srv/swap file"].block, devs["/srv/swap file"].disk, devs["/srv/swap file"].nvme) == (
        "nvme0n1p1", "nvme0n1", True)
    other = devs["/var/tmp/other"]
    assert (other.block, other.transport, other.nvme, other.rotational) == ("vda", "virtio", False, True)
    assert other.used == 512 * 1024
    for unknown in ("/tmpfs/swap", "/unrecorded"):
        assert devs[unknown].disk is None and not devs[unknown].nvme
    # NVMe first, whatever the kernel's priorities; the inversion is reported
    assert t.swap_devices[0].path == "/srv/swap file"
    assert any("/var/tmp/other has a higher priority than the NVMe swap" in w for w in t.warnings)
    assert t.swap_tier.total == (1024 + 2048 + 4096 + 4096) * 1024


def test_swap_on_device_mapper_over_nvme(tree: Path):
    dm = tree / "sys/devices/virtual/block/dm-0"
    write(dm / sysfs.BLOCK_ROTATIONAL, "0")
    (dm / sysfs.BLOCK_SLAVES).mkdir()
    (dm / sysfs.BLOCK_SLAVES / "nvme0n1p1").symlink_to("../../../../pci0000:00/0000:00:04.0/nvme/nvme0/nvme0n1/nvme0n1p1")
    (tree / "sys/block/dm-0").symlink_to("../devices/virtual/block/dm-0")
    set_swaps(tree, "/dev/dm-0                               partition\t1024\t0\t-2")
    (dev,) = discover(tree).swap_devices
    assert (dev.disk, dev.transport, dev.nvme) == ("dm-0", "dm", True)


def test_no_swap(tree: Path):
    set_swaps(tree)
    t = discover(tree)
    assert t.swap_tier is None and [x.kind for x in t.tiers] == ["dram", "far", "cxl"]
    assert any("no active swap" in w for w in t.warnings)


# ---------------------------------------------------------------------------
# refresh


def test_refresh_free_rereads_nodes_and_swap(tree: Path):
    t = discover(tree)
    write(node_dir(tree, 1) / "meminfo", "Node 1 MemTotal: 1048576 kB\nNode 1 MemFree: 4096 kB")
    set_swaps(tree, "/dev/nvme0n1                            partition\t4194300\t2097152\t-2")
    free = t.refresh_free()
    assert free[1] == 4096 * 1024 == t.tiers[1].free == t.nodes[1].free
    assert free[3] == (4194300 - 2097152) * 1024
    assert free == [x.free for x in t.tiers]
    set_swaps(tree)  # swapped off: the tier holds nothing now
    assert t.refresh_free()[3] == 0 and t.swap_tier.total == 0


def test_refresh_free_follows_hotplug_total(tree: Path):
    t = discover(tree, {"tiers": [{"name": "dram", "nodes": [0]}, {"name": "cxl", "nodes": [2], "capacity": 3 * GIB}]})
    assert t.tiers[1].capacity == GIB  # a cap above the node's size changes nothing
    write(node_dir(tree, 2) / "meminfo", "Node 2 MemTotal: 4194304 kB\nNode 2 MemFree: 4194304 kB")
    t.refresh_free()
    assert (t.tiers[1].total, t.tiers[1].capacity) == (4 * GIB, 3 * GIB)


# ---------------------------------------------------------------------------
# overrides


def test_override_order_names_capacity():
    ov = {
        "tiers": [
            {"name": "local", "nodes": [0]},
            {"name": "cxl", "nodes": [2], "capacity": GIB // 2},
            {"name": "slow", "nodes": [1], "kind": "cxl"},
        ],
        "swap": {"name": "nvme-swap", "capacity": GIB},
    }
    t = discover(SYNTH, ov)
    assert summary(t) == [
        ("local", "dram", (0,), "config"),
        ("cxl", "cxl", (2,), "config"),
        ("slow", "cxl", (1,), "config"),
        ("nvme-swap", "swap", (), "swap"),
    ]
    assert t.tiers[1].capacity == GIB // 2 and t.tiers[1].total == GIB
    assert t.tiers[3].capacity == GIB
    assert t.node_to_tier == {0: 0, 2: 1, 1: 2}


def test_override_swap_off_and_unassigned_node():
    t = discover(SYNTH, {"tiers": [{"name": "dram", "nodes": [0]}, {"name": "cxl", "nodes": [2]}], "swap": False})
    assert [x.name for x in t.tiers] == ["dram", "cxl"]
    assert t.unassigned_nodes == (1,)
    assert 1 not in t.node_to_tier and t.node_tier_lut()[1] == -1
    with pytest.raises(InvalidArgument, match="node 1"):
        t.tier_for_node(1)
    assert len(t.swap_devices) == 1  # still known, just not a tier


def test_override_mixed_kinds_with_explicit_kind():
    t = discover(SYNTH, {"tiers": [{"name": "dram", "nodes": [0]}, {"name": "far", "nodes": [1, 2], "kind": "far"}]})
    assert summary(t)[1] == ("far", "far", (1, 2), "config")
    assert t.tiers[1].read_latency_ns == 350  # the slower node sets the tier's latency
    assert t.tiers[1].read_bandwidth_mbps == 5000


D = {"name": "dram", "nodes": [0]}


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"bogus": 1}, "topology.bogus"),
        ([1, 2], "topology"),
        ({"tiers": []}, "tiers"),
        ({"tiers": {"dram": [0]}}, "tiers"),
        ({"tiers": ["dram"]}, "tiers[0]"),
        ({"tiers": [{"nodes": [0]}]}, "tiers[0].name"),
        ({"tiers": [{"name": "dram"}]}, "tiers[0].nodes"),
        ({"tiers": [{"name": "dram", "nodes": [0], "colour": "red"}]}, "tiers[0].colour"),
        ({"tiers": [{"name": "", "nodes": [0]}]}, "tiers[0].name"),
        ({"tiers": [{"name": "a b", "nodes": [0]}]}, "tiers[0].name"),
        ({"tiers": [D, {"name": "dram", "nodes": [1]}]}, "tiers[1].name"),
        ({"tiers": [D, {"name": "swap", "nodes": [1]}]}, "tiers[1].name"),
        ({"tiers": [{"name": "dram", "nodes": []}]}, "tiers[0].nodes"),
        ({"tiers": [{"name": "dram", "nodes": [True]}]}, "tiers[0].nodes"),
        ({"tiers": [{"name": "dram", "nodes": ["0"]}]}, "tiers[0].nodes"),
        ({"tiers": [{"name": "dram", "nodes": [-1]}]}, "tiers[0].nodes"),
        ({"tiers": [D, {"name": "x", "nodes": [1, 0]}]}, "tiers[1].nodes"),
        ({"tiers": [D, {"name": "x", "nodes": [1], "kind": "swap"}]}, "tiers[1].kind"),
        ({"tiers": [{"name": "dram", "nodes": [0], "kind": "cxl"}]}, "tiers[0].kind"),
        ({"tiers": [D, {"name": "x", "nodes": [1], "capacity": -1}]}, "tiers[1].capacity"),
        ({"tiers": [D, {"name": "x", "nodes": [1], "capacity": "64G"}]}, "tiers[1].capacity"),
        ({"tiers": [D, {"name": "x", "nodes": [1], "capacity": True}]}, "tiers[1].capacity"),
        ({"swap": "yes"}, "swap"),
        ({"swap": {"enable": True}}, "swap.enable"),
        ({"swap": {"enabled": 1}}, "swap.enabled"),
        ({"swap": {"name": "x y"}}, "swap.name"),
        ({"swap": {"capacity": 1.5}}, "swap.capacity"),
        ({"tiers": [D], "swap": {"name": "dram"}}, "swap.name"),
    ],
)
def test_override_shape_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        topo.validate_overrides(overrides)
    assert str(e.value).startswith(f"{key}:"), str(e.value)
    # discover() validates the same way before reading anything
    with pytest.raises(ConfigError):
        discover(SYNTH, overrides)


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        ({"tiers": [D, {"name": "x", "nodes": [7]}]}, "tiers[1].nodes", "node 7"),
        ({"tiers": [{"name": "x", "nodes": [1]}]}, "tiers[0].kind", "must be dram"),
        ({"tiers": [D, {"name": "x", "nodes": [1, 2]}]}, "tiers[1].kind", "cxl, far"),
        ({"swap": {"name": "cxl0"}}, "swap.name", "already a memory tier"),
    ],
)
def test_override_errors_against_discovered_nodes(overrides, key, words):
    topo.validate_overrides(overrides)  # well-formed...
    with pytest.raises(ConfigError) as e:  # ...but wrong for this machine
        discover(SYNTH, overrides)
    assert str(e.value).startswith(f"{key}:") and words in str(e.value), str(e.value)


def test_cpu_only_node_is_not_a_memory_node(tree: Path):
    base = tree / "sys" / sysfs.NODE_DIR
    write(base / "online", "0-3")
    write(base / "has_cpu", "0,3")
    nd = base / "node3"
    write(nd / "cpulist", "2")
    write(nd / "meminfo", "Node 3 MemTotal: 0 kB\nNode 3 MemFree: 0 kB")
    for n in range(3):
        write(node_dir(tree, n) / "distance", (node_dir(tree, n) / "distance").read_text().strip() + " 20")
    write(nd / "distance", "20 30 40 10")
    t = discover(tree)
    assert t.nodes[3].kind == "cpu-only" and 3 not in t.node_to_tier
    assert [x.name for x in t.tiers] == ["dram", "far0", "cxl0", "swap"]
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.nodes: node 3"):
        discover(tree, {"tiers": [{"name": "dram", "nodes": [0, 3]}]})


# ---------------------------------------------------------------------------
# host capture and odd kernels


def test_host_capture_swap_file_on_virtio():
    t = discover(HOST)
    assert [(x.name, x.kind, x.nodes) for x in t.tiers] == [("dram", "dram", (0,)), ("swap", "swap", ())]
    assert t.nodes[0].memory_tier == 4 and t.nodes[0].cpus == (0, 1)
    (dev,) = t.swap_devices
    assert (dev.path, dev.type, dev.block, dev.disk, dev.transport) == (
        "/var/tmp/kvt-swap", "file", "vda", "vda", "virtio")
    assert not dev.nvme and dev.rotational is True and not t.swap_tier.nvme


def test_kernel_without_numa_sysfs(tmp_path: Path):
    write(tmp_path / "proc" / "meminfo", "MemTotal:  2048 kB\nMemFree:  1024 kB\nSwapTotal: 0 kB")
    write(tmp_path / "proc" / "swaps", "Filename\tType\tSize\tUsed\tPriority")
    write(tmp_path / "sys" / "devices/system/cpu/online", "0-3")
    t = discover(tmp_path)
    assert [(x.name, x.nodes, x.total, x.free) for x in t.tiers] == [("dram", (0,), 2 << 20, 1 << 20)]
    assert t.nodes[0].cpus == (0, 1, 2, 3)
    assert any("without NUMA" in w for w in t.warnings)
    (tmp_path / "proc" / "meminfo").write_text("MemTotal:  2048 kB\nMemFree:  512 kB\n")
    assert t.refresh_free() == [512 << 10]


# ---------------------------------------------------------------------------
# readers


@pytest.mark.parametrize(
    "text, expect",
    [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0-1,4,6-7\n", [0, 1, 4, 6, 7]), ("", []), ("\n", []), ("3,1", [1, 3])],
)
def test_parse_list(text, expect):
    assert sysfs.parse_list(text) == expect


def test_read_meminfo_units_and_node_prefix(tmp_path: Path):
    p = tmp_path / "meminfo"
    p.write_text("Node 2 MemTotal:  100 kB\nNode 2 HugePages_Total:     3\nMemFree: 5 kB\ngarbage\n")
    assert sysfs.read_meminfo(str(p)) == {"MemTotal": 102400, "HugePages_Total": 3, "MemFree": 5120}
    assert sysfs.read_meminfo(str(tmp_path / "absent")) == {}
    # names: parsed up to the last of them, in any order, and no further
    assert sysfs.read_meminfo(str(p), ("MemFree", "MemTotal")) == {"MemTotal": 102400, "HugePages_Total": 3,
                                                                   "MemFree": 5120}
    assert sysfs.read_meminfo(str(p), ("MemTotal",)) == {"MemTotal": 102400}


def test_read_int_hex_and_errors(tmp_path: Path):
    p = tmp_path / "v"
    p.write_text("0x290000000\n")
    assert sysfs.read_int(str(p), 16) == 0x290000000
    p.write_text("8000000\n")
    assert sysfs.read_int(str(p), 16) == 128 << 20
    assert sysfs.read_int(str(tmp_path / "absent")) is None
    p.write_text("[always] never\n")
    with pytest.raises(OSError) as e:
        sysfs.read_int(str(p))
    assert e.value.errno == 22
    d = tmp_path / "dir"
    d.mkdir()
    with pytest.raises(OSError) as e:  # EISDIR is a real error, not "absent"
        sysfs.read_text(str(d))
    assert e.value.errno == 21


def test_parse_swaps_escapes():
    text = "Filename\tType\tSize\tUsed\tPriority\n/a\\040b\\134c  file  8  4  -2\n/dev/zram0 partition 16 0 100\n"
    assert sysfs.parse_swaps(text) == [("/a b\\c", "file", 8192, 4096, -2), ("/dev/zram0", "partition", 16384, 0, 100)]


# ---------------------------------------------------------------------------
# the capture script


@pytest.mark.parametrize("tree_dir", TREES, ids=lambda d: d.name)
def test_capture_round_trip(tree_dir: Path, tmp_path: Path):
    """Capturing a fixture tree as if it were a machine reproduces what
    discovery sees (swap-file st_dev aside: a fixture's swap files cannot
    be stat()ed, so the metadata is carried over by hand)."""
    dest = tmp_path / "copy"
    subprocess.run(
        [sys.executable, str(CAPTURE), str(dest), "--sys-root", str(tree_dir / "sys"),
         "--proc-root", str(tree_dir / "proc")],
        check=True, capture_output=True,
    )
    meta = json.loads((dest / sysfs.FIXTURE_META).read_text())
    assert meta["synthetic"] is False and meta["kernel"] is None
    meta["swap_files"] = json.loads((tree_dir / sysfs.FIXTURE_META).read_text())["swap_files"]
    (dest / sysfs.FIXTURE_META).write_text(json.dumps(meta))
    a, b = discover(tree_dir).to_dict(), discover(dest).to_dict()
    for d in (a, b):
        del d["sys_root"], d["proc_root"]
    assert a == b


def test_capture_refuses_to_clobber_a_non_fixture_dir(tmp_path: Path):
    (tmp_path / "precious").write_text("keep me")
    r = subprocess.run([sys.executable, str(CAPTURE), str(tmp_path), "--sys-root", str(SYNTH / "sys"),
                        "--proc-root", str(SYNTH / "proc")], capture_output=True, text=True)
    assert r.returncode != 0 and "not a fixture tree" in r.stderr
    assert (tmp_path / "precious").read_text() == "keep me"
