"""perf sources against this host's kernel (root, swap file, no hardware PMU).

A child's pool is paged out with process_madvise(MADV_PAGEOUT); the child
then reads some blocks back, and the major-fault source must report exactly
those blocks (and suggest the next ones for prefetch). Swap readahead is
switched off for these tests (vm.page-cluster=0): with it, a fault brings the
following pages in and their later reads are minor faults, which is the
documented blind spot of fault sampling, not what is being tested here.
"""

from __future__ import annotations

import os

import pytest

from kvchild import KVChild, page_out
from kvtier.kernel import native
from kvtier.blocks import BlockTable
from kvtier.kernel.sources.perf import LoadSampleSource, MajorFaultSource

pytestmark = pytest.mark.root

P = native.PAGE_SIZE
PAGE_CLUSTER = "/proc/sys/vm/page-cluster"


@pytest.fixture
def no_swap_readahead():
    with open(PAGE_CLUSTER) as f:
        old = f.read().strip()
    with open(PAGE_CLUSTER, "w") as f:
        f.write("0")
    yield
    with open(PAGE_CLUSTER, "w") as f:
        f.write(old)


def majflt(pid: int) -> int:
    """The kernel's own count of the process's major faults (/proc/PID/stat field 12)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[9])


def test_major_faults_report_exactly_the_touched_blocks(swapfile, no_swap_readahead):
    block = 64 * P
    n = 16
    with KVChild(n * block) as c:
        t = BlockTable()
        t.add_region(7, c.pid, c.addr, n * block, block)
        src = MajorFaultSource(prefetch_blocks=2)
        av = src.probe()
        assert av.ok, av.reason
        src.set_targets(t)
        try:
            page_out(c)
            assert len(src.collect(0.0)) == 0  # paging out is not a fault
            touched = [1, 5, 6, 13, 15]
            before = majflt(c.pid)
            for b in touched:
                assert c.ask(f"touch {b * block} {block}").startswith("ok")
            faults = majflt(c.pid) - before
            obs = src.collect(1.0)
        finally:
            src.close()
    assert obs.source == "perf_fault"
    assert obs.rows.tolist() == touched  # region 7 is rows 0..15 in block order
    # One sample per major fault. Nearly always 64 per block; a few pages
    # may still sit in the swap cache (see page_out) and fault minor.
    assert obs.counts.sum() == faults
    assert (obs.counts > 32).all()
    # The next two blocks of each, inside the region, not already faulting.
    assert obs.prefetch.tolist() == [2, 3, 7, 8, 14]


def test_ring_wraps_around_on_the_real_kernel(swapfile, no_swap_readahead):
    # One data page holds 128 samples of 32 bytes; three rounds of 100 faults
    # make the kernel's head wrap past the end of the ring between reads.
    n = 300
    with KVChild(n * P) as c:
        t = BlockTable()
        t.add_region(1, c.pid, c.addr, n * P, P)  # one page per block
        src = MajorFaultSource(ring_pages=1, prefetch_blocks=0)
        assert src.probe().ok
        src.set_targets(t)
        try:
            page_out(c)
            seen = 0
            for k in range(3):
                before = majflt(c.pid)
                assert c.ask(f"touch {k * 100 * P} {100 * P}").startswith("ok")
                faults = majflt(c.pid) - before
                obs = src.collect(float(k))
                # Exactly the pages that faulted: in this round's range, each once.
                assert len(obs) == faults and (obs.counts == 1).all()
                assert set(obs.rows.tolist()) <= set(range(k * 100, (k + 1) * 100))
                seen += faults
            assert seen * 32 > 4096 + 2048  # the kernel's head did wrap
            assert src.lost == 0
        finally:
            src.close()


def test_new_threads_are_followed(swapfile, no_swap_readahead):
    # Faults of a thread that did not exist at set_targets still count: each
    # collect opens events for new threads first. Here the child's only
    # thread exists already, so check the bookkeeping against /proc.
    with KVChild(16 * P) as c:
        t = BlockTable()
        t.add_region(1, c.pid, c.addr, 16 * P, P)
        src = MajorFaultSource()
        src.set_targets(t)
        try:
            tids = sorted(int(x) for x in os.listdir(f"/proc/{c.pid}/task"))
            assert sorted(tid for _, tid in src.rings) == tids
        finally:
            src.close()


def test_load_sampling_reports_missing_pmu():
    # This host has no hardware PMU (only software/tracepoint/breakpoint...).
    av = LoadSampleSource().probe()
    assert not av.ok
    assert av.reason.startswith("no PEBS/IBS: PMU absent (/sys/bus/event_source/devices has: ")
    assert "software" in av.reason
