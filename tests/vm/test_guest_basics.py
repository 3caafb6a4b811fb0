"""The guest is the machine kvtier is built for: DRAM, a far node, CXL, NVMe swap.

These check the test-bed itself (scripts/vm), so a broken guest shows up as
one clear failure here instead of as confusing failures in kvtier's tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.kernel import native
from vmhelpers import (
    CXL_DEVICES, CXL_NODE, DAX_DEVICES, DRAM_NODE, FAR_NODE, MEMORY_TIERS, MiB, NODE_DIR, SWAP_DISK,
    SYS, node_mem_total, parse_list, read,
)

pytestmark = pytest.mark.vm


def test_three_memory_nodes_with_cpus_only_on_node0():
    assert parse_list(read(NODE_DIR / "online")) == [0, 1, 2]
    assert parse_list(read(NODE_DIR / "has_memory")) == [0, 1, 2]
    assert parse_list(read(NODE_DIR / f"node{DRAM_NODE}/cpulist")) == list(range(os.cpu_count()))
    assert read(NODE_DIR / f"node{FAR_NODE}/cpulist") == ""
    assert read(NODE_DIR / f"node{CXL_NODE}/cpulist") == ""
    # Sizes from run.py, less what the kernel keeps for itself on each node.
    assert 900 * MiB < node_mem_total(DRAM_NODE) <= 1024 * MiB
    assert 900 * MiB < node_mem_total(FAR_NODE) <= 1024 * MiB
    assert node_mem_total(CXL_NODE) == 256 * MiB


def _cxl_regions() -> list[Path]:
    return sorted(p for p in CXL_DEVICES.iterdir() if p.name.startswith("region"))


def test_node2_memory_is_the_cxl_region():
    regions = _cxl_regions()
    assert len(regions) == 1, f"expected one CXL region, found {[r.name for r in regions]}"
    region = regions[0]
    assert read(region / "mode") == "ram"
    assert read(region / "commit") == "1"
    assert (region / "driver").resolve().name == "cxl_region"
    start, size = int(read(region / "resource"), 16), int(read(region / "size"), 16)
    assert size == 256 * MiB

    # The region's dax device is bound to kmem and targets node 2...
    daxes = sorted(region.glob("dax_region*/dax*.*"))
    assert [d.name for d in daxes] == ["dax0.0"]
    dax = DAX_DEVICES / daxes[0].name
    assert int(read(dax / "target_node")) == CXL_NODE
    assert (dax / "driver").resolve().name == "kmem"

    # ...and every memory block of node 2 lies inside the region's window.
    block = int(read(SYS / "devices/system/memory/block_size_bytes"), 16)
    blocks = sorted(int(p.name[len("memory"):]) for p in (NODE_DIR / f"node{CXL_NODE}").glob("memory[0-9]*"))
    assert len(blocks) * block == size
    for b in blocks:
        assert start <= b * block < start + size
        assert read(SYS / f"devices/system/memory/memory{b}/online") == "1"
        # Movable: kernel allocations never land there, so it can be emptied.
        assert read(SYS / f"devices/system/memory/memory{b}/valid_zones") == "Movable"


def test_each_node_in_its_own_memory_tier_dram_fastest():
    tiers = {}
    for t in MEMORY_TIERS.glob("memory_tier*"):
        for node in parse_list(read(t / "nodelist")):
            tiers[node] = int(t.name[len("memory_tier"):])
    assert set(tiers) == {DRAM_NODE, FAR_NODE, CXL_NODE}
    assert len(set(tiers.values())) == 3, tiers
    # Lower tier id = faster: DRAM first, the CPU-less nodes after it.
    assert tiers[DRAM_NODE] < min(tiers[FAR_NODE], tiers[CXL_NODE])


def test_swap_is_active_on_the_nvme_namespace():
    lines = read("/proc/swaps").splitlines()[1:]
    devices = [l.split()[0] for l in lines]
    assert f"/dev/{SWAP_DISK}" in devices, lines
    size_kib = int(next(l.split()[2] for l in lines if l.split()[0] == f"/dev/{SWAP_DISK}"))
    assert size_kib > 1000 * 1024
    # The namespace belongs to a PCIe NVMe controller, not a virtio disk.
    assert read(SYS / "class/nvme/nvme0/transport") == "pcie"
    assert read(SYS / "block" / SWAP_DISK / "queue/rotational") == "0"


def test_numa_balancing_is_off_for_a_stable_baseline():
    assert read("/proc/sys/kernel/numa_balancing") == "0"


def test_damon_sysfs_takes_vaddr_operations(kdamond):
    ctx = kdamond / "contexts/0"
    avail = read(ctx / "avail_operations").split()
    assert "vaddr" in avail and "paddr" in avail
    (ctx / "operations").write_text("vaddr")
    assert read(ctx / "operations") == "vaddr"


def test_debugfs_and_tracefs_are_mounted():
    mounts = {line.split()[1]: line.split()[2] for line in read("/proc/mounts").splitlines()}
    assert mounts.get("/sys/kernel/debug") == "debugfs"
    assert mounts.get("/sys/kernel/tracing") == "tracefs"


def test_move_pages_reaches_every_node(child_factory):
    """The raw syscall the migrator stands on, without the migrator: pages of
    another process go to node 1, to the CXL node and back to node 0."""
    # 1 MiB: the emulated CXL device moves ~1 MiB/s under TCG.
    child = child_factory(1 * MiB)
    before = child.checksum()
    addrs = np.uint64(child.addr) + np.arange(MiB // native.PAGE_SIZE, dtype=np.uint64) * np.uint64(native.PAGE_SIZE)
    assert (native.move_pages(child.pid, addrs, None) == DRAM_NODE).all()
    for node in (FAR_NODE, CXL_NODE, DRAM_NODE):
        status = native.move_pages(child.pid, addrs, node)
        assert (status == node).all(), np.unique(status, return_counts=True)
        assert (native.move_pages(child.pid, addrs, None) == node).all()
    assert child.checksum() == before
