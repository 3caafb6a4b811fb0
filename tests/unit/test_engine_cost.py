"""The engine's per-tick work follows what changed, not the registered size.

Real pieces throughout: this process's own memory (sparse anonymous
mappings), the real Migrator (move_pages queries and pagemap on our own pid
need no privilege), the real Registry and the fixture topology of a
one-node host. What is counted is blocks and pages measured per tick, never
time.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from kvtier import policy as pol
from kvtier.blocks import F_NOT_PRESENT, F_STALE, BlockTable
from kvtier.engine import Engine
from kvtier.hotness import Temperature
from kvtier.kernel import topology as topo_mod
from kvtier.kernel.migrator import Migrator
from kvtier.kernel.procmap import ProcProcesses
from kvtier.registry import Limits, Registry
from kvtier.stats import DaemonStats

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "host-1node"
BLOCK = 2 << 20
MAP_NORESERVE = 0x4000
BUDGET = 4096  # pages per second
SAMPLE = 16  # pages per block in the rotating sample


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def rig():
    clock = Clock()
    table = BlockTable()
    stats = DaemonStats()
    temp = Temperature(30.0)
    registry = Registry(table, Limits(), stats, temp, ProcProcesses("/proc"), clock=clock)
    topo = topo_mod.discover(str(FIXTURE / "sys"), str(FIXTURE / "proc"))
    topo.refresh_free = lambda: None  # the fixture tree's meminfo does not change
    loop = asyncio.new_event_loop()
    engine = Engine(table, registry, topo, Migrator(), temp, pol.PolicyConfig(), stats, loop,
                    residency_interval=10.0, residency_pages_per_s=BUDGET, residency_sample_pages=SAMPLE,
                    clock=clock, seed=1)
    maps = []

    def region(nbytes: int, touch: list[int] = ()) -> int:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        view = np.frombuffer(m, dtype=np.uint8)
        for b in touch:
            view[b * BLOCK : (b + 1) * BLOCK : 4096] = 1  # every page of the block
        del view
        maps.append(m)
        addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
        return registry.add(os.getpid(), addr, nbytes, BLOCK).id

    def ticks(n: int) -> list[tuple[int, int, int]]:
        """(blocks, whole blocks, pages) measured in each of n ticks."""
        out = []

        async def go():
            for _ in range(n):
                b0, f0, p0 = stats.residency_blocks_total, stats.residency_full_blocks_total, stats.residency_pages_total
                clock.now += 1.0
                engine.tick()
                while engine.future is not None:
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0)
                out.append((stats.residency_blocks_total - b0, stats.residency_full_blocks_total - f0,
                            stats.residency_pages_total - p0))

        loop.run_until_complete(go())
        return out

    yield engine, registry, table, region, ticks
    engine.shutdown()
    loop.close()
    for m in maps:
        m.close()


def test_untouched_blocks_cost_the_same_at_any_size(rig):
    engine, registry, table, region, ticks = rig
    region(4 << 30)  # 2,048 never-touched blocks
    small = ticks(4)
    region(16 << 30)  # 8,192 more
    large = ticks(4)
    # The budget bounds the pages asked per tick; never-touched blocks are
    # only sampled (no whole-block measurement), at any table size.
    for blocks, whole, pages in small + large:
        assert pages <= BUDGET
        assert blocks <= BUDGET // SAMPLE
        assert whole == 0
    assert max(b for b, _, _ in large) <= max(b for b, _, _ in small)
    assert (table.flags & F_NOT_PRESENT).all()


def test_hinted_and_sampled_blocks_get_placed(rig):
    engine, registry, table, region, ticks = rig
    rid = region(64 << 20, touch=[3, 20])  # 32 blocks, two of them touched
    registry.hint(rid, np.array([3], dtype=np.uint32), None)
    ticks(1)
    s = table.slices[rid]
    tier = table.tier[s.start : s.stop]
    flags = table.flags[s.start : s.stop]
    # the hinted block, and the touched one the sample found, are in DRAM (tier 0)
    assert tier[3] == 0 and tier[20] == 0
    assert not flags[3] & F_NOT_PRESENT and not flags[20] & F_NOT_PRESENT
    assert (tier[[b for b in range(32) if b not in (3, 20)]] < 0).all()
    ticks(1)  # the sampled block is then measured whole and stops being stale
    assert not (table.flags[s.start : s.stop] & F_STALE).any()


def test_full_remeasure_on_demand_ignores_the_budget(rig):
    engine, registry, table, region, ticks = rig
    region(256 << 20)  # 128 blocks of 512 pages: 16 budgets' worth
    engine.request_measure()
    done = ticks(1)
    assert done[0][1] == 128 and done[0][2] == 128 * 512
    assert not (table.flags & F_STALE).any()


def test_rows_of_follows_shifted_regions():
    t = BlockTable()
    t.add_region(7, 1, 1 << 30, 4 * BLOCK, BLOCK)
    t.add_region(1 << 30, 1, 2 << 30, 3 * BLOCK, BLOCK)  # a large id from a state file
    t.add_region(9, 1, 3 << 30, 2 * BLOCK, BLOCK)
    keys = (np.array([9, 1 << 30, 7, 5]), np.array([1, 2, 3, 0]))
    assert t.rows_of(*keys).tolist() == [8, 6, 3, -1]
    t.remove_region(7)
    assert t.rows_of(*keys).tolist() == [4, 2, -1, -1]


def test_a_hint_stream_over_never_touched_blocks_is_one_measuring_job(rig):
    """50 hint messages for the same 32 never-touched blocks between two
    ticks, the loop turning between them (as the daemon's socket does): one
    measuring job, within the budget, and a block found empty is not marked
    stale again until the next tick. A job per message, and every message
    marking the blocks just found empty again, was most of the daemon's CPU
    with 1 M hinted blocks/s (scripts/bench/scale.py)."""
    engine, registry, table, region, ticks = rig
    registry.on_hinted = engine.hinted  # as daemon.build wires it
    rid = region(64 << 20)  # 32 blocks of 512 pages, none touched
    ticks(1)
    stats = engine.stats
    jobs, whole = stats.residency_scans_total, stats.residency_full_blocks_total
    registry.clock.now += 0.9  # budget for 0.9 s: 0.75 * 0.9 * 4096 = 2764 pages, 5 whole blocks
    blocks = np.arange(32, dtype=np.uint32)

    async def stream():
        for _ in range(50):
            registry.hint(rid, blocks, None)
            await asyncio.sleep(0.002)
        while engine.measurer.busy:
            await asyncio.sleep(0.001)

    engine.loop.run_until_complete(stream())
    assert stats.residency_scans_total - jobs == 1
    measured = stats.residency_full_blocks_total - whole
    assert measured == 5
    s = table.slices[rid]
    flags = table.flags[s.start : s.stop]
    assert np.count_nonzero(flags & F_STALE) == 32 - measured  # the rest wait for budget
    assert (flags & F_NOT_PRESENT).all()
    # the next tick measures the waiting ones first, before its rotating sample
    ticks(1)
    assert stats.residency_full_blocks_total - whole == 5 + 6  # 3072 pages of budget: 6 blocks


@pytest.mark.parametrize("with_counts", [False, True])
def test_a_message_of_many_hints_of_few_blocks_counts_as_its_listings(rig, with_counts):
    """One message listing 32 blocks 3,000 times (summed per block first)
    leaves the blocks and the counters as the same listings sent 50 at a
    time (each listing applied as it comes)."""
    engine, registry, table, region, ticks = rig
    a, b = region(64 << 20), region(64 << 20)
    for rid in (a, b):
        s = table.slices[rid]
        table.tier[s.start : s.start + 10] = 0
        table.tier[s.start + 10 : s.start + 20] = 1
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 32, 3000).astype(np.uint32)
    counts = rng.integers(1, 4, 3000).astype(np.uint32) if with_counts else None
    stats = registry.stats

    def sent(rid, chunk):
        hits0, off0 = dict(stats.hint_tier_blocks), registry.hints_off_top
        for lo in range(0, blocks.size, chunk):
            registry.hint(rid, blocks[lo : lo + chunk], None if counts is None else counts[lo : lo + chunk])
        s = table.slices[rid]
        cols = {c: getattr(table, c)[s.start : s.stop].copy() for c in ("temp", "fresh", "runs", "last_access", "flags")}
        hits = {k: v - hits0.get(k, 0) for k, v in stats.hint_tier_blocks.items()}
        return cols, hits, registry.hints_off_top - off0, registry.regions[rid].block_hints

    whole, parts = sent(a, blocks.size), sent(b, 50)
    np.testing.assert_allclose(whole[0]["temp"], parts[0]["temp"], rtol=1e-6)
    for c in ("fresh", "runs", "last_access", "flags"):
        np.testing.assert_array_equal(whole[0][c], parts[0][c], err_msg=c)
    assert whole[1:] == parts[1:]
    assert whole[3] == 3000


def test_a_small_table_is_sampled_once_per_residency_interval(rig):
    # 128 blocks (the guest comparison's pool), all touched: after the
    # first look the rotating sample visits each block once per
    # residency_interval (10 s) in whole-table jobs, not every tick (a
    # job's fixed cost, paid every tick, was most of what measuring cost in
    # the guest). Every page of every window was in DRAM, so no block is
    # measured whole after its first look (in the guest that second pass
    # was 1 s of the measuring thread beside the first hot set's move).
    engine, registry, table, region, ticks = rig
    engine.residency_idle_slowdown = 1  # no back-off (the next test has it)
    region(128 * BLOCK, touch=list(range(128)))
    out = ticks(50)
    assert out[0] == (128, 0, 128 * SAMPLE)  # the first look
    assert sum(whole for _, whole, _ in out) == 0
    jobs = [i for i, (blocks, _, _) in enumerate(out) if blocks]
    assert jobs == [0, 10, 20, 30, 40]
    assert all(out[i] == (128, 0, 128 * SAMPLE) for i in jobs)
    assert (table.tier == 0).all()
    assert (table.flags & np.uint8(F_STALE | F_NOT_PRESENT) == 0).all()


def test_the_sample_backs_off_while_it_finds_nothing_and_not_after_a_change(rig):
    """Kills: a sample that never slows down on a quiet table (an idle
    daemon then pays the full budget for nothing), one that slows past
    residency_idle_slowdown, one that stays slow after a window found a
    block away from where the table had it, and one that counts a block
    seen for the first time as such a change (a sparse pool would then
    never back off)."""
    engine, registry, table, region, ticks = rig
    engine.residency_idle_slowdown = 4
    rid = region(128 * BLOCK, touch=[b for b in range(128) if b != 77])
    out = ticks(80)
    jobs = [i for i, (blocks, _, _) in enumerate(out) if blocks]
    # Each whole pass that found no block away from its known tier (the
    # first look included) doubles the interval: 10 s -> 20 s -> 40 s, and
    # no further (4x).
    assert jobs == [0, 20, 60]
    assert engine.stats.residency_sample_slowdown == 4
    row = table.slices[rid].start + 77
    assert table.tier[row] < 0  # never written: nowhere yet
    ctypes.memset(int(table.addr[row]), 1, BLOCK)  # the owner writes it, unhinted
    out = ticks(45)
    jobs = [i for i, (blocks, _, _) in enumerate(out) if blocks]
    assert jobs == [20]  # the 4x pass finds it: news, not drift
    assert table.tier[row] == 0
    assert engine.stats.residency_sample_slowdown == 4
    # The table believes block 5 is in the lower tier (as after a pageout
    # its reader faulted straight back in, unseen): the next pass finds it
    # in DRAM, and the sample is back at full rate.
    moved = table.slices[rid].start + 5
    table.tier[moved] = 1
    out = ticks(40)
    sampled = [i for i, (blocks, whole, _) in enumerate(out) if blocks > whole]
    # the 4x pass that finds it (40 s after the last; the block is measured
    # whole at the next tick), the next pass at full rate (10 s), which
    # agrees again: the back-off starts over (2x)
    assert sampled == [15, 25]
    assert [i for i, (_, whole, _) in enumerate(out) if whole] == [16]
    assert table.tier[moved] == 0
    assert engine.stats.residency_sample_slowdown == 2


def test_a_first_look_that_finds_part_of_a_window_is_followed_by_a_whole_measurement(rig):
    """Kills: taking a window's tier as the block's when some of its pages
    were elsewhere (here: not there at all, every other page of the block
    never written), so a block only partly where the window said is never
    measured page by page."""
    engine, registry, table, region, ticks = rig
    rid = region(8 * BLOCK, touch=[0, 1, 2, 3])
    m = mmap.mmap(-1, 4 * BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    view = np.frombuffer(m, dtype=np.uint8)
    view[::8192] = 1  # every other page
    del view
    half = registry.add(os.getpid(), np.frombuffer(m, dtype=np.uint8).ctypes.data, 4 * BLOCK, BLOCK).id
    try:
        out = ticks(12)
        assert out[0][0] == 12  # the first look at both regions
        assert sum(whole for _, whole, _ in out) == 4  # the half-written blocks only
        s, h = table.slices[rid], table.slices[half]
        assert (table.tier[s.start : s.start + 4] == 0).all() and (table.tier[h.start : h.stop] == 0).all()
    finally:
        registry.remove(half)
        m.close()


@pytest.mark.parametrize("chunk", [16, 96, 3000])
def test_hints_count_where_their_blocks_were(rig, chunk):
    """hint_tier_blocks and hints_off_top count every listing by the tier
    its block was in, whether a message's blocks sit in one tier (counted
    without a bincount), several, or none known; short messages and those
    summed per block first alike."""
    engine, registry, table, region, ticks = rig
    rid = region(64 << 20)  # 32 blocks: 0-9 in DRAM, 10-19 in tier 1, the rest unknown
    s = table.slices[rid]
    table.tier[s.start : s.start + 10] = 0
    table.tier[s.start + 10 : s.start + 20] = 1
    table.tier[s.start + 20 : s.stop] = -1
    tier_of = table.tier[s.start : s.stop].copy()
    rng = np.random.default_rng(5)
    stats = registry.stats
    for lo, hi in ((0, 10), (10, 20), (20, 32), (0, 32), (5, 15)):
        blocks = rng.integers(lo, hi, 3000).astype(np.uint32)
        hits0, off0 = dict(stats.hint_tier_blocks), registry.hints_off_top
        for k in range(0, blocks.size, chunk):
            registry.hint(rid, blocks[k : k + chunk], None)
        want = {int(t): int((tier_of[blocks] == t).sum()) for t in np.unique(tier_of[blocks])}
        hits = {k: v - hits0.get(k, 0) for k, v in stats.hint_tier_blocks.items() if v != hits0.get(k, 0)}
        assert hits == want, (lo, hi)
        assert registry.hints_off_top - off0 == int((tier_of[blocks] != 0).sum()), (lo, hi)


def test_the_rotating_sample_waits_while_the_mover_brings_blocks_up(rig):
    """A tick while the mover promotes measures only what is queued: the
    rotating sample would compete with the move for the CPUs and measure
    pages the move is changing. It runs again, with what accrued, once the
    mover demotes or is idle."""
    from concurrent.futures import Future

    from kvtier.engine import MoveJob

    engine, registry, table, region, ticks = rig
    engine.residency_idle_slowdown = 1  # the sample at its full rate: what it skips is then plain
    region(64 << 20)  # 32 never-touched blocks: the sample looks at them
    ticks(2)
    stats, clock = engine.stats, engine.clock
    up = np.array([1], dtype=np.int8), np.array([0], dtype=np.int8)
    engine.mover.job = MoveJob.of_rows(table, np.array([0]), *up, clock.now)
    engine.mover.future = Future()  # busy until the test says otherwise

    def tick_measured() -> int:
        b0 = stats.residency_blocks_total
        clock.now += 1.0
        engine.tick()
        while engine.measurer.busy:
            engine.loop.run_until_complete(asyncio.sleep(0.001))
        return stats.residency_blocks_total - b0

    # longer than residency_interval (10 s): the sample came due in there
    assert [tick_measured() for _ in range(12)] == [0] * 12
    engine.mover.job = MoveJob.of_rows(table, np.array([0]), up[1], up[0], clock.now)  # a demotion
    assert tick_measured() == 32  # all that accrued, at once
    engine.mover.future = engine.mover.job = None
    assert sum(tick_measured() for _ in range(12)) > 0


def test_work_queued_on_the_loop_starts_no_job_after_shutdown(rig):
    """Kills: a first look (or any measure_soon/kick) queued on the loop
    before the daemon stopped, run after Engine.shutdown: submitting to a
    shut-down executor raised RuntimeError and put a traceback in the log
    at every such stop (a host test's teardown caught one)."""
    engine, registry, table, region, ticks = rig
    errors = []
    engine.loop.set_exception_handler(lambda loop, ctx: errors.append(ctx))
    engine.registered(region(8 * BLOCK, touch=[0]))  # queues the first look: measure_soon next turn
    engine.shutdown()
    engine.loop.run_until_complete(asyncio.sleep(0.01))
    assert errors == []
    assert engine.measurer.future is None
