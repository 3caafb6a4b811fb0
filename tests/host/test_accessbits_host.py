"""Access-bit source against this host's kernel (root).

The source decides by experiment whether this kernel can tell accessed
pages apart (page_idle bitmap, or kpageflags REFERENCED after clear_refs).
Where it can, a child that touches half its blocks after a reset must see
that half reported hotter. Where it cannot (this host: no page_idle, and
REFERENCED stays clear for touched anonymous pages), the probe must say
which mechanisms it tried and what it saw, and the PFN readers are still
checked against the real /proc/kpageflags.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvchild import KVChild
from kvtier.blocks import BlockTable
from kvtier.kernel.native import PAGE_SIZE
from kvtier.kernel.procfs import PM_PFN_MASK, PM_PRESENT, Pagemap
from kvtier.kernel.sources import accessbits as ab

pytestmark = pytest.mark.root

P = PAGE_SIZE
BLOCK = 16 * P
NBLOCKS = 8


def test_probe_names_every_mechanism_it_tried():
    src = ab.AccessBitSource()
    av = src.probe()
    src.close()
    if av.ok:
        assert av.reason.startswith("access bits via ")
        return
    idle_path = "/sys/kernel/mm/page_idle/bitmap"
    if os.path.exists(idle_path):
        assert f"{idle_path} does not follow page-table accessed bits" in av.reason
    else:
        assert f"{idle_path} absent (CONFIG_IDLE_PAGE_TRACKING)" in av.reason
    assert "/proc/kpageflags REFERENCED + clear_refs" in av.reason
    assert "self-test: " in av.reason


def test_touched_half_is_reported_hotter():
    src = ab.AccessBitSource()
    av = src.probe()
    if not av.ok:
        src.close()
        pytest.skip(f"no access-bit mechanism on this kernel: {av.reason}")
    with KVChild(NBLOCKS * BLOCK) as c:
        t = BlockTable()
        t.add_region(1, c.pid, c.addr, NBLOCKS * BLOCK, BLOCK)
        src.set_targets(t)
        try:
            assert len(src.collect(0.0)) == 0  # arms: resets every page
            assert c.ask(f"touch 0 {NBLOCKS * BLOCK // 2}").startswith("ok")
            obs = src.collect(1.0)
        finally:
            src.close()
    got = np.zeros(NBLOCKS)
    got[obs.rows] = obs.counts
    assert (got[: NBLOCKS // 2] > 0.9).all() and (got[NBLOCKS // 2 :] < 0.1).all(), got


def test_kpageflags_runs_agree_with_per_page_reads():
    with KVChild(NBLOCKS * BLOCK) as c:
        with Pagemap(c.pid) as pm:
            e = pm.read(c.addr, NBLOCKS * BLOCK // P, P)
        assert ((e & PM_PRESENT) != 0).all()
        pfn = (e & PM_PFN_MASK).astype(np.int64)
        assert pfn.all(), "PFNs hidden: needs CAP_SYS_ADMIN"
        f = ab.PfnFile("/proc/kpageflags")
        try:
            runs = f.read(pfn)
            calls = f.syscalls
            single = np.array([int.from_bytes(os.pread(f.fd, 8, int(p) * 8), "little") for p in pfn], dtype=np.uint64)
        finally:
            f.close()
    # LRU/ACTIVE/REFERENCED may change between the two reads; ANON and MMAP
    # (bit 11) of a mapped anonymous page may not.
    stable = np.uint64((1 << ab.KPF_ANON) | (1 << 11))
    assert ((single & stable) == stable).all()
    assert ((runs & stable) == (single & stable)).all()
    assert calls <= len(np.unique(pfn))
