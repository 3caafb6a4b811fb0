"""The access-bit source on a kernel with idle page tracking (issue 13, item 10).

No Debian kernel sets CONFIG_IDLE_PAGE_TRACKING, so these tests run in the
guest booted on the kernel scripts/vm/build-kernel.sh builds from Debian's
own 6.12 source with it (``vmidle``: run.py --kernel idle); where that kernel
is not built they skip, saying so.

The ground truth is the kernel's own idle bits, read here straight from
/sys/kernel/mm/page_idle/bitmap (one bit per page frame; a set bit: not
accessed since marked idle), never through the source's code:

- the kernel: pages marked idle and then read come back not idle, the rest
  stay idle; the source's probe picks page_idle;
- kvtierd with the access-bit source as its only source (DAMON, perf and
  hints off) and a pool all on the far node, read by a decoder in one part:
  the daemon ranks exactly the blocks the kernel's bits say were accessed
  above the rest, and promotes them to DRAM (placement read from the
  kernel), while the blocks the kernel reports idle stay on the far node.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from vmhelpers import DRAM_NODE, FAR_NODE, GuestKvtierd, KVChild, MiB, block_ranges, scaled, scaled_count

from kvtier.ctl import decode_blocks
from kvtier.kernel import topology
from kvtier.kernel.migrator import Migrator
from kvtier.kernel.native import PAGE_SIZE
from kvtier.kernel.procfs import PM_PFN_MASK, PM_PRESENT, Pagemap
from kvtier.kernel.sources.accessbits import AccessBitSource

pytestmark = pytest.mark.vmidle

BITMAP = Path("/sys/kernel/mm/page_idle/bitmap")
SHARE = Path("/mnt/kvtier")  # run.py's share: the figures go back to the host

POOL = 64 * MiB
BLOCK = 2 * MiB
NBLOCKS = POOL // BLOCK
HOT = np.arange(8, 16)  # the decoder reads these 8 blocks (16 MiB) in a loop
DRAM_TARGET = 32 * MiB  # room for the hot set, not for the pool
TICK_S = 0.5
# Ticks until the hot set is on node 0. Each collect adds 0.5 x the fraction
# of a block's pages accessed, promote_temp is 2: ~4 collects after the first
# (which only arms), then one move; 2-3x that, times the guest's slowness.
PROMOTE_TICKS = 40


def pfns(pid: int, addr: int, length: int) -> np.ndarray:
    """Page frame of every page of [addr, addr+length) of ``pid`` (all present)."""
    with Pagemap(pid) as pm:
        e = pm.read(addr, length // PAGE_SIZE, PAGE_SIZE)
    assert ((e & PM_PRESENT) != 0).all(), "pool pages not present"
    pfn = (e & PM_PFN_MASK).astype(np.int64)
    assert pfn.all(), "PFNs read as 0 (needs CAP_SYS_ADMIN)"
    return pfn


def kernel_idle(pfn: np.ndarray) -> np.ndarray:
    """The kernel's idle bit of each frame (True: not accessed since marked)."""
    fd = os.open(BITMAP, os.O_RDONLY)
    try:
        words = {}
        for w in np.unique(pfn >> 6).tolist():
            words[w] = int.from_bytes(os.pread(fd, 8, w * 8), "little")
    finally:
        os.close(fd)
    return np.array([(words[p >> 6] >> (p & 63)) & 1 for p in pfn.tolist()], dtype=bool)


def mark_idle(pfn: np.ndarray) -> None:
    fd = os.open(BITMAP, os.O_WRONLY)
    try:
        for w in np.unique(pfn >> 6).tolist():
            bits = 0
            for p in pfn[(pfn >> 6) == w].tolist():
                bits |= 1 << (p & 63)
            os.pwrite(fd, bits.to_bytes(8, "little"), w * 8)
    finally:
        os.close(fd)


def accessed_per_block(child: KVChild) -> np.ndarray:
    """Fraction of each block's pages the kernel reports accessed (not idle)."""
    idle = kernel_idle(pfns(child.pid, child.addr, child.size))
    return 1.0 - idle.reshape(-1, BLOCK // PAGE_SIZE).mean(axis=1)


def test_kernel_idle_bits_follow_reads_and_the_probe_picks_them():
    assert BITMAP.exists(), f"{BITMAP} absent: not the idle kernel ({os.uname().release})"
    with KVChild(8 * BLOCK) as c:
        pfn = pfns(c.pid, c.addr, c.size)
        mark_idle(pfn)
        assert kernel_idle(pfn).all(), "pages marked idle do not read back idle"
        assert c.ask(f"touch 0 {4 * BLOCK}").startswith("ok")
        idle = kernel_idle(pfn).reshape(8, -1)
        assert not idle[:4].any() and idle[4:].all(), idle.mean(axis=1)
    src = AccessBitSource()
    av = src.probe()
    src.close()
    assert av.ok and av.reason == f"access bits via {BITMAP}", av.reason


class Daemon(GuestKvtierd):
    """kvtierd tiering DRAM (node 0) over far (node 1), the access-bit
    source its only source of hotness."""

    def __init__(self, tmp: Path):
        mem = [t for t in topology.discover().tiers if t.kind not in (topology.KIND_SWAP, topology.KIND_CXL)]
        assert [list(t.nodes) for t in mem] == [[DRAM_NODE], [FAR_NODE]], mem
        tiers = ", ".join(f'{{ name = "{t.name}", nodes = {list(t.nodes)}, kind = "{t.kind}" }}' for t in mem)
        super().__init__(tmp, textwrap.dedent(f"""\
            [policy]
            capacity = {{ "0" = {DRAM_TARGET} }}
            [topology]
            tiers = [{tiers}]
            swap = false
            [hotness.access_bits]
            enabled = true
            mode = "page_idle"
            [hotness.damon]
            enabled = false
            [hotness.perf_fault]
            enabled = false
            [hotness.perf]
            enabled = false
            """), daemon={"tick_interval": TICK_S}, name="test_accessbits_vm")


def test_kvtierd_on_access_bits_alone_finds_and_promotes_the_hot_set(tmp_path):
    cold = np.setdiff1d(np.arange(NBLOCKS), HOT)
    with KVChild(POOL) as child:
        starts, lengths = block_ranges(child, BLOCK)
        mig = Migrator()
        mig.move(child.pid, starts, lengths, FAR_NODE)
        assert (mig.residency(child.pid, starts, lengths).node_pages[:, FAR_NODE] > 0).all()
        d = Daemon(tmp_path)
        try:
            sources = d.client.request("status")["engine"]["sources"]
            assert sources["access_bits"]["active"], sources
            assert sources["access_bits"]["reason"] == f"access bits via {BITMAP}", sources
            assert not any(v["active"] for k, v in sources.items() if k != "access_bits"), sources
            region = d.client.register(addr=child.addr, length=POOL, block_size=BLOCK, pid=child.pid, name="pool")
            assert child.ask(f"read {HOT[0] * BLOCK} {HOT.size * BLOCK}").startswith("ok")
            t0, limit = d.ticks(), scaled_count(PROMOTE_TICKS)
            while True:
                r = mig.residency(child.pid, starts, lengths)
                dram = r.node_pages[:, DRAM_NODE] / r.pages
                n = d.ticks() - t0
                if (dram[HOT] > 0.99).all() or n > limit:
                    break
                time.sleep(TICK_S)
            # The kernel's view, taken while the decoder still reads: the
            # daemon marks every pool page idle at each collect, so what is
            # not idle now was accessed since its last one.
            truth = accessed_per_block(child)
            temps = np.array(decode_blocks(d.client.request("blocks", region=region.id))["temps"])
            passes = child.ask("stop")
            stats = d.stats()
        finally:
            d.stop()
    report = {
        "ticks_to_hot_set_in_dram": n, "limit_ticks": limit,
        "hot_on_node0": dram[HOT].round(3).tolist(), "cold_on_node0": dram[cold].round(3).tolist(),
        "temp_hot": temps[HOT].round(2).tolist(), "temp_cold_max": float(temps[cold].max()),
        "kernel_accessed_hot": truth[HOT].round(3).tolist(), "kernel_accessed_cold_max": float(truth[cold].max()),
        "decoder": passes, "migrated_bytes": stats.get("migrated_bytes"),
    }
    if SHARE.is_dir():
        with open(SHARE / "accessbits_vm.jsonl", "a") as f:
            f.write(json.dumps(report) + "\n")
    # The kernel's ground truth: the decoder's blocks accessed, the rest idle.
    assert (truth[HOT] > 0.9).all() and (truth[cold] < 0.05).all(), report
    # The daemon found that set: every accessed block hotter than every idle one...
    assert temps[HOT].min() > temps[cold].max(), report
    # ...and the policy acted on it: the hot set in DRAM, the idle blocks left on the far node.
    assert (dram[HOT] > 0.99).all(), f"hot set not in DRAM after {n} ticks: {report}\n{d.log_tail()}"
    assert (dram[cold] < 0.01).all(), report
