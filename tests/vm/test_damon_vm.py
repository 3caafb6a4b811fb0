"""The DAMON source on a kernel with vaddr operations (the 6.12 guest), as root.

A child maps a pool, one thread keeps reading a hot part of it, and the
source (real sysfs writes through SysfsIO) must rank the hot blocks above the
cold ones, keep its monitoring inside the registered range, follow a second
process added by commit, and leave no kdamond behind.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.blocks import BlockTable
from kvtier.kernel.sources import damon as dm
from kvtier.kernel.sysfs_io import SysfsIO
from vmhelpers import MiB, scaled

pytestmark = pytest.mark.vm

BLOCK = 2 * MiB
POOL = 64 * MiB
HOT = 8  # blocks 0..7 are read continuously


class Toucher:
    """Reads [off, off+len) of a child's pool, one byte per page, until stopped."""

    def __init__(self, child, off, length):
        self.stop = threading.Event()
        self.rounds = 0

        def run():
            while not self.stop.is_set():
                child.ask(f"touch {off} {length}")
                self.rounds += 1

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.thread.join(timeout=scaled(30))


@pytest.fixture
def damon():
    io = SysfsIO("/sys")
    # Fast enough for TCG: 10 samples per 50 ms aggregation.
    src = dm.DamonSource(io, dm.DamonParams(sample_us=5_000, aggr_us=50_000, min_nr_regions=10, max_nr_regions=200))
    av = src.probe()
    assert av.ok, av.reason
    yield src
    src.close()
    assert io.read(dm.NR_KDAMONDS) == "0"


def collect_sum(src, table, n):
    total = np.zeros(len(table))
    for i in range(n):
        obs = src.collect(float(i))
        np.add.at(total, obs.rows, obs.counts)
    return total


def test_hot_blocks_rank_above_cold_and_monitoring_stays_in_range(damon, child_factory):
    c = child_factory(POOL)
    t = BlockTable()
    t.add_region(1, c.pid, c.addr, POOL, BLOCK)
    damon.set_targets(t)
    assert damon.io.read(dm.STATE) == "on"
    toucher = Toucher(c, 0, HOT * BLOCK)
    try:
        total = collect_sum(damon, t, 30)
    finally:
        toucher.close()
    assert toucher.rounds > 0
    hot, cold = total[:HOT], total[HOT:]
    assert hot.sum() > 5 * cold.sum(), (hot, cold)
    assert (hot > 0).sum() >= HOT - 1, hot
    # Cold blocks next to the hot set share a region with it until DAMON
    # splits it; far from it they stay at a small fraction of the hot score.
    assert np.median(cold[4:]) < 0.1 * np.median(hot), (hot, cold)
    regs = damon.last_regions[c.pid]
    assert regs, "no tried regions"
    assert min(r.start for r in regs) >= c.addr
    assert max(r.end for r in regs) <= c.addr + POOL


def test_second_process_joins_by_commit(damon, child_factory):
    a = child_factory(16 * MiB)
    b = child_factory(16 * MiB)
    t = BlockTable()
    t.add_region(1, a.pid, a.addr, 16 * MiB, BLOCK)
    damon.set_targets(t)
    kd_pid = damon.io.read(dm.KDAMOND_PID)
    t.add_region(2, b.pid, b.addr, 16 * MiB, BLOCK)
    damon.io.clear_log()
    damon.set_targets(t)
    assert list(damon.io.writes)[-1] == (dm.STATE, "commit")
    assert damon.io.read(dm.KDAMOND_PID) == kd_pid  # same kdamond, not restarted
    toucher = Toucher(b, 0, 4 * MiB)  # b's first two blocks
    try:
        total = collect_sum(damon, t, 20)
    finally:
        toucher.close()
    assert set(damon.last_regions) == {a.pid, b.pid}
    assert all(damon.last_regions[p] for p in (a.pid, b.pid))
    b_rows = np.arange(t.slices[2].start, t.slices[2].stop)
    assert total[b_rows[:2]].sum() > 0
    assert total[b_rows[:2]].sum() > 5 * total[b_rows[2:]].sum()


def test_kdamond_stopping_by_itself_when_targets_exit(damon, child_factory):
    c = child_factory(8 * MiB)
    t = BlockTable()
    t.add_region(1, c.pid, c.addr, 8 * MiB, BLOCK)
    damon.set_targets(t)
    c.close()
    # vaddr kdamonds stop once no target is alive; collect must notice and
    # report nothing instead of raising, and a later set_targets restarts.
    for i in range(50):
        obs = damon.collect(float(i))
        if not damon.running:
            break
    assert not damon.running and len(obs) == 0
    d = child_factory(8 * MiB)
    t2 = BlockTable()
    t2.add_region(2, d.pid, d.addr, 8 * MiB, BLOCK)
    damon.set_targets(t2)
    assert damon.io.read(dm.STATE) == "on"
