"""The engine between ticks: a region just registered is looked at, and hot
blocks hinted in a lower tier are promoted into free DRAM room, in the event
loop's next turns, without waiting for a tick (the guest comparison's first
hot set: vm_tiering_compare.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvtier import policy as pol

from test_engine import BASE, BLOCK, DRAM, PID, PPB, SWAP, SWAP_TIER, Rig, cfg


@pytest.fixture
def wired():
    rigs = []

    def make(blocks: int = 8, **kw) -> Rig:
        r = Rig(blocks, cfg(**kw))
        # as daemon.build wires them (the Rig registered its region before: look again)
        r.registry.on_added, r.registry.on_hinted = r.engine.registered, r.engine.hinted
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        r.close()


def turns(r: Rig, done, limit: float = 5.0) -> None:
    """Run the event loop (no tick) until ``done()``, failing after ``limit`` s."""
    async def go():
        loop = asyncio.get_running_loop()
        end = loop.time() + limit
        while not done():
            assert loop.time() < end, "not done without a tick"
            await asyncio.sleep(0.002)

    r.loop.run_until_complete(go())


def idle(r: Rig, seconds: float = 0.2) -> None:
    r.loop.run_until_complete(asyncio.sleep(seconds))


def test_a_registered_region_is_looked_at_before_any_tick(wired):
    r = wired(8)
    r.settle()
    reg = r.registry.add(4242, 0x7F0000000000 + 8 * BLOCK, 4 * BLOCK, BLOCK, name="late").id
    turns(r, lambda: (r.table.tier[r.rows(reg)] == DRAM).all())


def place(r: Rig, in_dram: int) -> None:
    """The first ``in_dram`` blocks in DRAM, the rest in swap, and the table
    knows it."""
    r.settle()
    r.kernel.loc[: in_dram * PPB] = DRAM
    r.kernel.loc[in_dram * PPB :] = SWAP
    r.engine.request_measure()
    r.tick()
    n = r.kernel.loc.size // PPB // 3
    assert r.tiers() == [DRAM] * in_dram + [SWAP_TIER] * (n - in_dram)


def test_hinted_blocks_in_a_lower_tier_go_to_free_dram_without_a_tick(wired):
    r = wired(8)
    place(r, 0)
    calls = len(r.kernel.calls)
    r.hint([2, 5], count=1)  # one hint is enough: a new run's rate is what the policy ranks by
    turns(r, lambda: r.tiers()[2] == DRAM and r.tiers()[5] == DRAM)
    assert (r.kernel.where(2) == 0).all() and (r.kernel.where(5) == 0).all()
    assert r.stats.hot_promotions_total == 2
    assert [op for op, _ in r.kernel.calls[calls:]] == ["pagein"]
    assert r.tiers().count(DRAM) == 2  # only the hinted ones


def test_hinted_blocks_wait_for_the_plan_when_dram_has_no_room(wired):
    """DRAM at what the policy fills it to: no promotion between ticks (an
    exchange with a colder resident is the plan's decision)."""
    r = wired(16, cold_demote=False)  # DRAM target 8 blocks: filled to 0.98 * 8 = 7.84
    place(r, 7)
    r.hint([1, 2, 3, 4, 5, 6, 8], count=1)
    idle(r)
    assert r.stats.hot_promotions_total == 0
    assert r.tiers()[8] == SWAP_TIER


def test_room_counts_what_is_already_on_its_way(wired):
    """Room for 3 blocks, 6 hinted hot in swap: 3 promoted between ticks,
    hottest first, not all 6 (DRAM is not overfilled by promotions queued
    turn after turn)."""
    # filled to 7.84 blocks of 8 (low_wm = high_wm: whatever room the policy
    # keeps for allocations, it does not go below that)
    r = wired(16, cold_demote=False, low_wm=0.98)
    place(r, 4)
    r.hint([10, 11, 12], count=5)
    r.hint([13, 14, 15], count=1)
    idle(r, 0.3)
    r.hint([13, 14, 15], count=1)  # asked again, with the first three on their way or there
    idle(r, 0.3)
    assert r.stats.hot_promotions_total == 3
    assert sorted(np.flatnonzero(np.array(r.tiers()) == DRAM).tolist()) == [0, 1, 2, 3, 10, 11, 12]


def test_hints_of_blocks_already_in_dram_do_not_replan(wired, monkeypatch):
    """A hint of a DRAM resident makes it hotter, which moves nothing: the
    tick does not plan again for it (a plan per tick under a steady stream
    of hints was most of the daemon's tick in the guest); a hint of a block
    in a lower tier does."""
    from kvtier import engine as engine_mod

    r = wired(16, cold_demote=False, low_wm=0.98)  # DRAM full: no promotion between ticks
    place(r, 7)
    r.tick(12, dt=1.0)  # the replans after placing are done
    monkeypatch.setattr(engine_mod, "IDLE_REPLAN_S", 1e9)  # and no periodic one falls in the ticks below
    plans = []
    real = engine_mod.pol.plan
    monkeypatch.setattr(engine_mod.pol, "plan", lambda *a, **k: plans.append(1) or real(*a, **k))
    for _ in range(3):
        r.hint([0, 1, 2, 3], count=1)
        r.tick(dt=1.0)
    assert plans == []
    r.hint([9], count=1)
    r.tick(dt=1.0)
    assert plans == [1]


def test_a_refill_between_plans_counts_no_allocations():
    """The engine refills the token buckets for its scheduled moves between
    plans, without counting the tiers: that must not read as the table
    vanishing and coming back (a 256 MiB 'backlog' of allocations kept
    every later promotion out of DRAM in the guest comparison's phase 2)."""
    c = pol.PolicyConfig()
    mb = float(BLOCK)
    total = 256.0 * (1 << 20)
    s = pol.PolicyState().refill(c, 100.0, mb, total)
    s = s.refill(c, 100.02, mb)  # a prefetch between plans
    s = s.refill(c, 100.05, mb, total)  # the next plan: nothing was allocated
    assert s.backlog_peak == 0.0 and s.inflow_bps == 0.0
    s = s.refill(c, 101.05, mb, total + 64 * mb)  # 128 MiB of new blocks in a second are counted
    assert s.inflow_bps > 0


def test_a_hint_with_the_mover_idle_reaches_it_within_the_hint(wired):
    """A client's hint of blocks in a lower tier, the mover idle: the move
    is handed to the mover while the hint is applied, not in a later turn
    of the loop (whose other callbacks came first: 0.09-0.31 s in the
    guest)."""
    r = wired(8)
    place(r, 0)
    r.hint([2, 5], count=1)  # no loop turn after it
    assert r.engine.mover.busy and r.stats.hot_promotions_total == 2
    turns(r, lambda: r.tiers()[2] == DRAM and r.tiers()[5] == DRAM)


def test_blocks_on_their_way_are_not_queued_again_by_each_hint(wired):
    """Hints that keep coming while the mover brings the blocks up queue
    nothing more: queued again they counted twice against DRAM's room and
    shut out a block that was not moving at all."""
    import threading

    # DRAM target 8 blocks, filled to 7.84: room for 7 (below, 2 + 2 x 2 would not fit)
    r = wired(16, cold_demote=False, low_wm=0.98)
    place(r, 0)
    r.kernel.hold["pagein"] = threading.Event()  # the mover stays in its job
    r.hint([1, 2], count=1)
    assert r.engine.mover.busy
    for _ in range(3):
        r.hint([1, 2], count=1)
        idle(r, 0.05)
    r.hint([9], count=1)  # a block not on its way: DRAM still has room for it
    idle(r, 0.05)
    assert r.stats.hot_promotions_total == 3
    r.kernel.hold["pagein"].set()
    turns(r, lambda: sorted(np.flatnonzero(np.array(r.tiers()) == DRAM).tolist()) == [1, 2, 9])


def test_a_pool_resident_when_registered_is_no_allocation_burst(wired):
    """An engine registers its pool once it has written it: the blocks the
    first look and the rotating sample find are not new allocations. Fails
    without ``BlockTable.inflow_offset``: the pool found read as a burst
    of allocations (inflow_bps 5.8 MB/s here; the rotating sample finds up
    to 4,096 blocks a second at the defaults) and the policy emptied DRAM of its idle
    blocks for them (a host test's memfd pool, DRAM four times its size,
    paged out to swap two seconds after registration). Pages that appear
    where a measurement found none are allocations, and count."""
    r = wired(12, capacity={DRAM: 36 * BLOCK})  # the fake process has 36 blocks of pages
    big = r.registry.add(PID, BASE + 12 * BLOCK, 16 * BLOCK, BLOCK, name="pool").id  # resident: loc 0
    r.tick(6, dt=0.1)
    assert (r.table.tier[r.rows(big)] == DRAM).all() and (r.table.tier[r.rows()] == DRAM).all()
    assert r.engine.pstate.inflow_bps == 0.0 and r.engine.pstate.backlog_peak == 0.0
    assert not [c for c in r.kernel.calls if c[0] == "pageout"]
    # a region registered before it is written: what appears later was allocated
    r.kernel.loc[28 * PPB : 36 * PPB] = -1  # ABSENT: never touched
    lazy = r.registry.add(PID, BASE + 28 * BLOCK, 8 * BLOCK, BLOCK, name="lazy").id
    r.tick(3, dt=0.1)
    assert (r.table.tier[r.rows(lazy)] < 0).all()
    r.kernel.loc[28 * PPB : 36 * PPB] = DRAM  # the engine writes it
    r.engine.request_measure(np.arange(r.rows(lazy).start, r.rows(lazy).stop))
    r.tick(2, dt=0.1)
    assert (r.table.tier[r.rows(lazy)] >= 0).all()
    assert r.engine.pstate.inflow_bps > 0.0  # (and a burst: the idle blocks make room for more)


def test_a_release_takes_blocks_not_measured_since_they_were_written(wired):
    """An engine pauses a session right after its last decode step: the
    blocks it wrote since the last measurement have no known tier yet.
    Fails without taking them: `release` answered them `skipped` and they
    stayed in DRAM (KvtierCache.release() straight after generate():
    queued 4, skipped 28). Never-written blocks of the release go to the
    mover too, which reports them untouched: they stay unplaced."""
    r = wired(8, capacity={DRAM: 24 * BLOCK})
    r.settle()
    r.kernel.loc[8 * PPB : 16 * PPB] = -1  # ABSENT: a second region, not written yet
    late = r.registry.add(PID, BASE + 8 * BLOCK, 8 * BLOCK, BLOCK, name="session").id
    r.tick(2)
    rows = np.arange(r.rows(late).start, r.rows(late).stop)
    assert (r.table.tier[rows] < 0).all()
    r.kernel.loc[8 * PPB : 14 * PPB] = DRAM  # the session writes 6 of its 8 blocks; no measurement since
    ans = r.engine.schedule(rows, "release")
    assert (ans["queued"], ans["already"], ans["skipped"]) == (8, 0, 0), ans
    turns(r, lambda: not r.engine.mover.busy and not r.engine.scheduled and
          (r.table.tier[rows[:6]] == SWAP_TIER).all())
    assert (r.kernel.loc[8 * PPB : 14 * PPB] == SWAP).all()  # the kernel has them in swap
    assert (r.table.tier[rows[6:]] < 0).all() and (r.kernel.loc[14 * PPB : 16 * PPB] == -1).all()


def test_a_block_demoted_a_moment_ago_comes_back_between_ticks_when_read(wired):
    """min_residence_s bars demotions only: a block moved out of DRAM a
    moment ago and read again is promoted in the next turns, as the plan
    would (the conversation turn that comes back soon after its blocks'
    demotion)."""
    r = wired(8, min_residence_s=5.0)
    place(r, 0)
    r.table.last_move[2] = r.engine.clock()  # just moved
    r.hint([2], count=1)
    turns(r, lambda: r.tiers()[2] == DRAM)
