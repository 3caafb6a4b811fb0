"""kvtier on the machine it is built for: topology discovery and the migrator
against real DRAM, far, CXL and NVMe-swap tiers in the QEMU guest.

Transfers to the emulated CXL device are slow under TCG (~1 MiB/s), so only a
few MiB go there; bulk moves use node 1 (~100 MiB/s).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.kernel import native
from kvtier.kernel.migrator import Migrator
from kvtier.kernel.procfs import PM_PRESENT, PM_SWAP, Pagemap
from kvtier.kernel.topology import KIND_CXL, KIND_DRAM, KIND_FAR, KIND_SWAP, discover
from vmhelpers import (
    CXL_NODE, DRAM_NODE, FAR_NODE, MEMORY_TIERS, MiB, SWAP_DISK, block_ranges, numa_maps_nodes,
    parse_list, read,
)

pytestmark = pytest.mark.vm

PAGE = native.PAGE_SIZE
BLOCK = 2 * MiB


def kernel_memory_tiers() -> dict[int, int]:
    out = {}
    for t in MEMORY_TIERS.glob("memory_tier*"):
        for node in parse_list(read(t / "nodelist")):
            out[node] = int(t.name[len("memory_tier"):])
    return out


def test_discover_classifies_dram_far_cxl_and_nvme_swap():
    topo = discover()
    assert topo.nodes[DRAM_NODE].kind == KIND_DRAM
    assert topo.nodes[FAR_NODE].kind == KIND_FAR
    assert topo.nodes[CXL_NODE].kind == KIND_CXL
    assert "region0" in topo.nodes[CXL_NODE].cxl
    assert topo.nodes[FAR_NODE].cxl is None

    # Tier 0 is DRAM; each CPU-less node is its own tier, ordered as the
    # kernel's memory tiers order them; swap comes last and is NVMe.
    assert topo.tiers[0].kind == KIND_DRAM and topo.tiers[0].nodes == (DRAM_NODE,)
    memtier = kernel_memory_tiers()
    far_tiers = sorted((FAR_NODE, CXL_NODE), key=memtier.__getitem__)
    assert [t.nodes for t in topo.tiers[1:3]] == [(n,) for n in far_tiers]
    assert topo.tiers[-1].kind == KIND_SWAP and len(topo.tiers) == 4
    swap = topo.tiers[-1]
    assert swap.nvme
    (dev,) = swap.swap_devices
    assert dev.path == f"/dev/{SWAP_DISK}" and dev.disk == SWAP_DISK and dev.transport == "nvme"
    assert dev.size >= 1000 * MiB

    # Node 1's HMAT figures from run.py reach the tier.
    assert topo.nodes[FAR_NODE].perf is not None
    assert topo.nodes[FAR_NODE].perf.read_latency_ns == 200
    assert topo.tier_for_node(CXL_NODE).total == 256 * MiB


def pagemap_bits(pid: int, addr: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    with Pagemap(pid) as pm:
        e = pm.read(addr, size // PAGE, PAGE)
    return (e & PM_PRESENT) != 0, (e & PM_SWAP) != 0


def page_addrs(addr: int, size: int) -> np.ndarray:
    return np.uint64(addr) + np.arange(size // PAGE, dtype=np.uint64) * np.uint64(PAGE)


def node_of_pages(child, addrs: np.ndarray):
    """A function giving the node (or -errno) of every page, per 2 MiB block."""
    return lambda: native.move_pages(child.pid, addrs, None).reshape(-1, BLOCK // PAGE)


def test_migrator_walks_a_region_through_every_tier(child_factory):
    """16 MiB in 8 blocks: all to node 1, 1 block on to CXL, 2 others out to
    swap, those back in to node 0, then everything home. After each step the
    kernel's own views (move_pages status, numa_maps, pagemap) agree with the
    migrator, and the bytes never change."""
    child = child_factory(16 * MiB)
    before = child.checksum()
    mig = Migrator()
    starts, lengths = block_ranges(child, BLOCK)
    addrs, per_block = page_addrs(child.addr, child.size), BLOCK // PAGE
    where = node_of_pages(child, addrs)

    assert (where() == DRAM_NODE).all()

    # Everything to the far node.
    r = mig.move(child.pid, starts, lengths, FAR_NODE)
    assert r.done == r.pages == len(addrs) and r.block_ok.all() and r.errors == {}, r.to_dict()
    assert (where() == FAR_NODE).all()
    assert numa_maps_nodes(child.pid, child.addr).get(FAR_NODE, 0) >= len(addrs)
    res = mig.residency(child.pid, starts, lengths)
    assert (res.dominant_node() == FAR_NODE).all()
    assert (res.node_pages[:, FAR_NODE] == per_block).all()

    # Block 0 (2 MiB) on to CXL.
    r = mig.move(child.pid, starts[:1], lengths[:1], CXL_NODE)
    assert r.done == per_block and r.block_ok.all(), r.to_dict()
    w = where()
    assert (w[:1] == CXL_NODE).all() and (w[1:] == FAR_NODE).all()
    nm = numa_maps_nodes(child.pid, child.addr)
    assert nm.get(CXL_NODE, 0) >= per_block
    res = mig.residency(child.pid, starts, lengths)
    assert list(res.dominant_node()) == [CXL_NODE] + [FAR_NODE] * 7

    # Blocks 4-5 out to NVMe swap.
    out_s, out_l = starts[4:6], lengths[4:6]
    r = mig.pageout(child.pid, out_s, out_l)
    assert r.done == 2 * per_block and r.block_ok.all(), r.to_dict()
    present, swapped = pagemap_bits(child.pid, child.addr, child.size)
    lo, hi = 4 * per_block, 6 * per_block
    assert swapped[lo:hi].all() and not present[lo:hi].any()
    assert present[:lo].all() and present[hi:].all() and not swapped[:lo].any()
    res = mig.residency(child.pid, starts, lengths)
    assert (res.swapped == np.array([0, 0, 0, 0, per_block, per_block, 0, 0])).all()
    assert (res.dominant_node()[4:6] == -1).all()
    used_kib = int(read("/proc/swaps").splitlines()[1].split()[3])
    assert used_kib * 1024 >= 2 * BLOCK

    # Back in, straight to DRAM.
    r = mig.pagein(child.pid, out_s, out_l, DRAM_NODE)
    assert r.done == 2 * per_block and r.block_ok.all(), r.to_dict()
    w = where()
    assert (w[4:6] == DRAM_NODE).all()
    assert not pagemap_bits(child.pid, child.addr, child.size)[1].any()

    # And everything home.
    r = mig.move(child.pid, starts, lengths, DRAM_NODE)
    assert r.block_ok.all(), r.to_dict()
    assert (where() == DRAM_NODE).all()
    nm = numa_maps_nodes(child.pid, child.addr)
    assert nm.get(FAR_NODE, 0) == 0 and nm.get(CXL_NODE, 0) == 0
    assert child.checksum() == before


@pytest.mark.parametrize("kind", ["--shared", "--memfd"])
def test_shared_memory_walks_node0_node1_swap_and_home(child_factory, kind):
    """Shared memory (mmap.mmap(-1, n): MAP_SHARED anonymous, and memfd) on
    the 6.12 guest: to node 1, half out to NVMe swap (no swap PTE: the
    migrator asks the object, cachestat here), back straight to node 0.
    The kernel's own smaps and move_pages agree at each step; bytes equal."""
    child = child_factory(8 * MiB, kind)
    before = child.checksum()
    mig = Migrator()
    starts, lengths = block_ranges(child, BLOCK)
    addrs, per_block = page_addrs(child.addr, child.size), BLOCK // PAGE
    where = node_of_pages(child, addrs)

    r = mig.move(child.pid, starts, lengths, FAR_NODE)
    assert r.done == r.pages and r.block_ok.all() and r.errors == {}, r.to_dict()
    assert (where() == FAR_NODE).all()

    r = mig.pageout(child.pid, starts[2:], lengths[2:])
    assert r.done == 2 * per_block and r.block_ok.all() and r.errors == {}, r.to_dict()
    assert child.smaps_kib() == {"Rss": 4 * 1024, "Swap": 4 * 1024}
    res = mig.residency(child.pid, starts, lengths)
    assert res.swapped.tolist() == [0, 0, per_block, per_block], res.to_dict()
    assert list(res.dominant_node()) == [FAR_NODE, FAR_NODE, -1, -1]
    assert res.absent.sum() == 0 and res.errors == {}

    r = mig.pagein(child.pid, starts[2:], lengths[2:], DRAM_NODE)
    assert r.done == 2 * per_block and r.block_ok.all() and r.errors == {}, r.to_dict()
    assert child.smaps_kib() == {"Rss": 8 * 1024, "Swap": 0}
    w = where()
    assert (w[:2] == FAR_NODE).all() and (w[2:] == DRAM_NODE).all()
    res = mig.residency(child.pid, starts, lengths)
    assert list(res.dominant_node()) == [FAR_NODE, FAR_NODE, DRAM_NODE, DRAM_NODE] and res.swapped.sum() == 0

    r = mig.move(child.pid, starts, lengths, DRAM_NODE)
    assert r.block_ok.all() and (where() == DRAM_NODE).all(), r.to_dict()
    assert child.checksum() == before


def test_migrator_moves_transparent_huge_pages_whole(child_factory):
    """THP-backed blocks go to node 1 and back as huge pages (the -EBUSY per
    THP that move_pages reports is resolved, not reported as pinned)."""
    enabled = read("/sys/kernel/mm/transparent_hugepage/enabled")
    assert "[never]" not in enabled
    child = child_factory(16 * MiB, "--thp")
    before = child.checksum()
    mig = Migrator()
    starts, lengths = block_ranges(child, BLOCK)
    thp_before = _anon_huge_kib(child.pid)
    assert thp_before >= 8 * 1024, "the child's pool is not THP-backed"
    for node in (FAR_NODE, DRAM_NODE):
        r = mig.move(child.pid, starts, lengths, node)
        assert r.block_ok.all() and not r.block_unmovable.any(), r.to_dict()
        assert (native.move_pages(child.pid, page_addrs(child.addr, child.size), None) == node).all()
    # Migration kept (most of) the huge pages huge.
    assert _anon_huge_kib(child.pid) >= thp_before // 2
    assert child.checksum() == before


def _anon_huge_kib(pid: int) -> int:
    for line in read(f"/proc/{pid}/smaps_rollup").splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0
