from dataclasses import replace

import numpy as np
import pytest

from kvtier.blocks import (
    F_KEEP_DRAM,
    F_MANUAL_PIN,
    F_NEVER_SWAP,
    F_NOT_PRESENT,
    F_PREFILL_DONE,
    F_UNMOVABLE,
    STUCK_DECLARED,
    STUCK_FAILING,
    STUCK_LOCKED,
    STUCK_NONE,
    STUCK_PINNED,
    STUCK_TEXT,
    TIER_MIXED,
    TIER_UNKNOWN,
    BlockTable,
)
from kvtier.errors import ConfigError
from kvtier.hotness import Temperature, apply_phase
from kvtier.policy import (
    BACKLOG_ROOM_MAX,
    MIB,
    R_COLD,
    R_EVICT,
    R_KEEP_DRAM,
    R_NEVER_SWAP,
    R_OVERFLOW,
    R_PIN,
    R_PROMOTE,
    R_QUOTA,
    REASON_NAMES,
    S_UNMOVABLE,
    STAY_NAMES,
    PolicyConfig,
    PolicyState,
    TierState,
    explain,
    plan,
    record_results,
    refund,
)

BS = 2 * MIB


def make_table(n, tier=0, temp=0.0, tenants=None, priority=0):
    t = BlockTable()
    t.add_region(1, 1000, 1 << 40, n * BS, BS)
    t.flags[:] &= ~np.uint8(F_NOT_PRESENT)
    t.prior[:] = 0  # allocated while the daemon watched, as in the simulator
    t.tier[:] = tier
    t.temp[:] = temp
    t.priority[:] = priority
    if tenants is not None:
        t.tenant[:] = tenants
    return t


def tiers(dram_blocks, cxl_blocks=1000, swap_blocks=None):
    ts = [TierState(0, "dram", "dram", dram_blocks * BS), TierState(1, "cxl0", "cxl", cxl_blocks * BS)]
    if swap_blocks is not None:
        ts.append(TierState(2, "swap", "swap", swap_blocks * BS))
    return ts


def cfg(**kw):
    base = dict(high_wm=1.0, low_wm=0.8, promote_temp=2.0, demote_temp=0.5, min_residence_s=0.0, margin_sigma=0.0)
    base.update(kw)
    return PolicyConfig(**base)


def apply(t, p, now, c):
    record_results(t, p.rows, np.ones(len(p), bool), np.zeros(len(p), bool), now, c, dst=p.dst)


def used(t, tier):
    return int(t.nbytes[t.tier == tier].sum())


def test_overflow_demotes_coldest_back_under_the_high_watermark_and_no_further():
    # Warm blocks demoted early only come back: above the high watermark the
    # coldest go until it is met (plus room for the measured allocations,
    # none here), not down to the low watermark.
    t = make_table(20)
    t.temp[:] = np.arange(20, dtype=np.float32) + 1  # row 0 coldest
    c = cfg(high_wm=0.9)
    p, _ = plan(t.snapshot(), tiers(10), c, PolicyState(), 100.0)
    assert np.all(p.reason == R_OVERFLOW) and np.all(p.dst == 1)
    assert sorted(p.rows.tolist()) == list(range(11))  # 20 -> 9 blocks = 0.9 * 10
    apply(t, p, 100.0, c)
    assert used(t, 0) == 9 * BS
    assert p.bytes_by_direction == {(0, 1): 11 * BS}


def test_overflow_makes_room_for_the_measured_allocation_rate():
    t = make_table(20)
    t.temp[:] = np.arange(20, dtype=np.float32) + 1
    c = cfg(high_wm=0.9, low_wm=0.5)
    st = PolicyState(promote_tokens=1e12, demote_tokens=1e12, last_now=99.0, last_total=20 * BS, inflow_bps=2 * BS)
    p, _ = plan(t.snapshot(), tiers(10), c, st, 100.0)
    # about 2 blocks/s of allocations (1.8 after a second without growth),
    # burst_s 1: DRAM to 10 - 1.8 blocks, one more than the watermark asks
    assert sorted(p.rows.tolist()) == list(range(12))
    # while allocations outrun the migrator, plus two standard deviations
    # of the rate (the second without growth gave it one)
    p, _ = plan(t.snapshot(), tiers(10), c, replace(st, backlog_peak=BS), 100.0)
    assert sorted(p.rows.tolist()) == list(range(13))


def test_promotes_hottest_first_into_room_and_stops_at_high_watermark():
    t = make_table(10, tier=1)
    t.temp[:] = [5, 1, 9, 3, 7, 8, 0, 2, 6, 4]
    c = cfg()
    p, _ = plan(t.snapshot(), tiers(4), c, PolicyState(), 100.0)
    assert np.all(p.reason == R_PROMOTE)
    assert p.rows.tolist() == [2, 5, 4, 8]  # temps 9, 8, 7, 6
    apply(t, p, 100.0, c)
    assert used(t, 0) == 4 * BS


def test_exchange_needs_margin_over_coldest_resident():
    t = make_table(4)
    t.tier[:] = [0, 0, 1, 1]
    t.temp[:] = [10, 4, 5.5, 6.5]  # coldest resident 4: needs > 4*1.25+1 = 6
    c = cfg(margin_ratio=0.25, margin_abs=1.0, low_wm=0.5)
    p, _ = plan(t.snapshot(), tiers(2), c, PolicyState(), 100.0)
    assert p.rows.tolist() == [1, 3]  # demotion first, then the promotion
    assert p.reason.tolist() == [R_EVICT, R_PROMOTE]
    assert p.src.tolist() == [0, 1] and p.dst.tolist() == [1, 0]


def test_no_exchange_within_margin():
    t = make_table(3)
    t.tier[:] = [0, 0, 1]
    t.temp[:] = [10, 4, 5.9]
    p, _ = plan(t.snapshot(), tiers(2), cfg(low_wm=0.5), PolicyState(), 100.0)
    assert len(p) == 0


def test_cold_blocks_demoted_between_watermarks_warm_ones_stay():
    t = make_table(9)
    t.temp[:] = [0.1, 0.2, 3, 3, 3, 3, 3, 3, 3]
    p, _ = plan(t.snapshot(), tiers(10), cfg(low_wm=0.5), PolicyState(), 100.0)
    assert sorted(p.rows.tolist()) == [0, 1] and np.all(p.reason == R_COLD)
    p2, _ = plan(t.snapshot(), tiers(10), cfg(low_wm=0.5, cold_demote=False), PolicyState(), 100.0)
    assert len(p2) == 0


def test_cascade_dram_to_cxl_to_swap():
    t = make_table(12)
    t.tier[:] = [0] * 6 + [1] * 6
    t.temp[:] = [5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 0.5, 0.6]
    ts = tiers(4, cxl_blocks=6, swap_blocks=100)
    p, _ = plan(t.snapshot(), ts, cfg(low_wm=0.5), PolicyState(), 100.0)
    d = {(int(r), int(s), int(x)) for r, s, x in zip(p.rows, p.src, p.dst)}
    # DRAM 6 > 4: back to 4 -> rows 0, 1 go to CXL; CXL then 8 > 6: its two
    # coldest (10, 11) go to swap
    assert {(r, 0, 1) for r in range(2)} <= d
    assert {r for r, s, x in d if s == 1 and x == 2} == {10, 11}
    # slowest source first: executed in order, no move lands in a full CXL
    occ = {0: 6, 1: 6, 2: 0}
    for s_, d_ in zip(p.src.tolist(), p.dst.tolist()):
        occ[s_] -= 1
        occ[d_] += 1
        assert occ[1] <= 6
    assert p.src[0] == 1


def test_capacity_and_fraction_targets():
    t = make_table(10)
    c = cfg(capacity={0: 0.5}, low_wm=1.0)
    p, _ = plan(t.snapshot(), tiers(10), c, PolicyState(), 100.0)
    assert len(p) == 5
    c2 = cfg(capacity={0: 3 * BS}, low_wm=1.0)
    p2, _ = plan(t.snapshot(), tiers(10), c2, PolicyState(), 100.0)
    assert len(p2) == 7


def test_free_bytes_limits_promotion():
    t = make_table(6, tier=1, temp=10.0)
    ts = [TierState(0, "dram", "dram", 10 * BS, free_bytes=2 * BS), TierState(1, "cxl", "cxl", 100 * BS)]
    p, _ = plan(t.snapshot(), ts, cfg(), PolicyState(), 100.0)
    assert len(p) == 2


def test_rate_limit_honoured_across_ticks():
    t = make_table(400, tier=1, temp=10.0)
    c = cfg(promote_mbps=10.0, burst_s=1.0)
    st = PolicyState()
    moved = 0
    for k in range(20):
        now = 100.0 + 0.5 * k
        p, st = plan(t.snapshot(), tiers(400), c, st, now)
        assert p.promote_bytes <= 10 * MIB * 1.0 + 1
        moved += p.promote_bytes
        apply(t, p, now, c)
    # burst (10 MiB) + 9.5 s * 10 MiB/s, in whole 2 MiB blocks
    assert moved <= 10 * MIB + 9.5 * 10 * MIB
    assert moved >= 9.5 * 10 * MIB - BS


def test_refund_gives_back_failed_bytes():
    t = make_table(10, tier=1, temp=10.0)
    c = cfg(promote_mbps=4.0)
    p, st = plan(t.snapshot(), tiers(100), c, PolicyState(), 0.0)
    assert len(p) == 2 and st.promote_tokens == 0
    st2 = refund(st, p, np.array([True, False]), c)
    assert st2.promote_tokens == BS


def test_unmovable_pinned_unknown_and_not_present_are_skipped():
    t = make_table(7, tier=1, temp=50.0)
    t.flags[0] |= F_UNMOVABLE
    t.flags[1] |= F_MANUAL_PIN  # pin_tier unknown: pinned where it is
    t.tier[2] = TIER_UNKNOWN
    t.tier[3] = TIER_MIXED
    t.flags[4] |= F_NOT_PRESENT
    p, _ = plan(t.snapshot(), tiers(100), cfg(), PolicyState(), 100.0)
    assert sorted(p.rows.tolist()) == [5, 6]


def test_manual_pin_moves_to_pin_tier_even_when_hot():
    t = make_table(3, tier=0, temp=50.0)
    t.flags[0] |= F_MANUAL_PIN
    t.pin_tier[0] = 1
    t.last_move[0] = 99.0  # residence time does not hold back an operator's pin
    p, _ = plan(t.snapshot(), tiers(100), cfg(min_residence_s=10.0), PolicyState(), 100.0)
    assert p.rows.tolist() == [0] and p.reason.tolist() == [R_PIN] and p.dst.tolist() == [1]


def test_keep_dram_promoted_and_never_demoted():
    t = make_table(6, tier=0, temp=0.0)
    t.flags[:3] |= F_KEEP_DRAM
    t.tier[5] = 1
    t.flags[5] |= F_KEEP_DRAM
    p, _ = plan(t.snapshot(), tiers(3), cfg(low_wm=0.5), PolicyState(), 100.0)
    got = dict(zip(p.rows.tolist(), p.reason.tolist()))
    assert got[5] == R_KEEP_DRAM
    assert not {0, 1, 2} & set(got)
    assert got[3] == R_OVERFLOW and got[4] == R_OVERFLOW


def test_never_swap_blocks_stay_out_of_swap():
    t = make_table(6, tier=1, temp=0.0)
    t.flags[:3] |= F_NEVER_SWAP
    t.tier[5] = 2
    t.flags[5] |= F_NEVER_SWAP
    ts = tiers(10, cxl_blocks=2, swap_blocks=100)
    p, _ = plan(t.snapshot(), ts, cfg(low_wm=0.5), PolicyState(), 100.0)
    got = dict(zip(p.rows.tolist(), zip(p.dst.tolist(), p.reason.tolist())))
    assert got[5] == (1, R_NEVER_SWAP)
    for r in (0, 1, 2):
        assert r not in got or got[r][0] != 2
    assert got[3][0] == 2 and got[4][0] == 2


def test_tenant_quota_caps_promotion_and_demotes_excess():
    t = make_table(12, tier=1, temp=10.0, tenants=[1] * 6 + [2] * 6)
    t.tier[:2] = 0  # tenant 1 already has 2 blocks in DRAM
    c = cfg(tenant_dram_quota={1: 3 * BS})
    p, _ = plan(t.snapshot(), tiers(100), c, PolicyState(), 100.0)
    apply(t, p, 100.0, c)
    assert int(t.nbytes[(t.tier == 0) & (t.tenant == 1)].sum()) == 3 * BS
    assert int(t.nbytes[(t.tier == 0) & (t.tenant == 2)].sum()) == 6 * BS
    t.tier[t.tenant == 1] = 0  # over quota now
    p2, _ = plan(t.snapshot(), tiers(100), c, PolicyState(), 200.0)
    assert np.all(p2.reason == R_QUOTA) and len(p2) == 3


def test_quota_counts_blocks_the_same_plan_brings_in():
    t = make_table(3, tier=0, temp=10.0, tenants=[1, 1, 1])
    t.temp[0] = 5.0
    t.tier[2] = 1
    t.flags[2] |= F_KEEP_DRAM
    p, _ = plan(t.snapshot(), tiers(100), cfg(tenant_dram_quota={1: 2 * BS}), PolicyState(), 100.0)
    got = dict(zip(p.rows.tolist(), p.reason.tolist()))
    assert got == {2: R_KEEP_DRAM, 0: R_QUOTA}


def test_priority_wins_dram_under_contention():
    t = make_table(4, tier=0, temp=50.0)
    t.tier[2:] = 1
    t.temp[2:] = 3.0
    t.priority[3] = 5
    p, _ = plan(t.snapshot(), tiers(2), cfg(low_wm=1.0), PolicyState(), 100.0)
    assert 3 in p.rows[p.reason == R_PROMOTE] and 2 not in p.rows
    assert len(p.rows[p.reason == R_EVICT]) == 1


def test_prefill_done_blocks_are_demoted_first():
    t = make_table(4, tier=0, temp=3.0)
    t.temp[0] = 1.5
    t.flags[3] |= F_PREFILL_DONE  # effective 0.75
    p, _ = plan(t.snapshot(), tiers(3), cfg(low_wm=1.0), PolicyState(), 100.0)
    assert p.rows.tolist() == [3]


def test_a_refused_demotion_backs_off_demotions_only():
    """A block the kernel would not page out (its pages in use, or not on
    an LRU list yet just after a move) stays where it is; if it is read
    next, it is promoted at once. Fails without ``fail_dir``: the failed
    pageout barred the block from every move for its backoff, and a TCG
    guest's next hot set sat on CXL for 30 s (13 of 16 blocks in DRAM
    after 54 ticks). A refused promotion still backs off promotions."""
    c = cfg(backoff_base_s=30.0, unmovable_after=3)
    t = make_table(4, tier=1, temp=0.0)
    ts = tiers(2, cxl_blocks=2, swap_blocks=100)  # CXL over its target: the coldest go to swap
    p, _ = plan(t.snapshot(), ts, c, PolicyState(), 10.0)
    assert len(p) >= 2 and (p.dst == 2).all()
    ok = np.ones(len(p), dtype=bool)
    ok[0] = False
    record_results(t, p.rows, ok, np.zeros(len(p), bool), 10.0, c, dst=p.dst)
    held, gone = int(p.rows[0]), int(p.rows[1])
    assert t.fail_dir[held] == 1 and t.fail_dir[gone] == 0 and t.retry_at[held] == 40.0
    # still cold: not paged out again within the backoff
    p, _ = plan(t.snapshot(), ts, c, PolicyState(), 11.0)
    assert held not in p.rows.tolist()
    # read now: promoted into DRAM's free room, backoff or not
    t.temp[held] = 10.0
    p, _ = plan(t.snapshot(), ts, c, PolicyState(), 12.0)
    assert held in p.rows[p.dst == 0].tolist()
    # a promotion that fails backs off promotions
    record_results(t, np.array([held]), [False], [False], 12.0, c, dst=np.array([0], dtype=np.int8))
    assert t.fail_dir[held] == -1
    p, _ = plan(t.snapshot(), ts, c, PolicyState(), 13.0)
    assert held not in p.rows.tolist()
    # a move that succeeds clears it
    record_results(t, np.array([held]), [True], [False], 80.0, c, dst=np.array([0], dtype=np.int8))
    assert t.fail_dir[held] == 0


def test_failed_moves_backoff_and_are_not_retried_before_retry_at():
    t = make_table(3, tier=1, temp=10.0)
    c = cfg(backoff_base_s=1.0, unmovable_after=3)
    p, _ = plan(t.snapshot(), tiers(100), c, PolicyState(), 10.0)
    assert sorted(p.rows.tolist()) == [0, 1, 2]
    record_results(t, p.rows, p.rows != 0, np.zeros(3, bool), 10.0, c, dst=p.dst)
    assert t.tier.tolist() == [1, 0, 0] and t.retry_at[0] == 11.0 and t.fail_count[0] == 1
    assert plan(t.snapshot(), tiers(100), c, PolicyState(), 10.5)[0].rows.tolist() == []
    p, _ = plan(t.snapshot(), tiers(100), c, PolicyState(), 11.0)
    assert p.rows.tolist() == [0]
    record_results(t, p.rows, [False], [False], 11.0, c, dst=p.dst)
    assert t.retry_at[0] == 13.0  # 2 s: doubled
    record_results(t, p.rows, [False], [False], 13.0, c, dst=p.dst)
    assert t.flags[0] & F_UNMOVABLE and t.stuck[0] == STUCK_FAILING  # third failure in a row
    # Not planned again until the re-probe, far beyond the backoff.
    assert len(plan(t.snapshot(), tiers(100), c, PolicyState(), 13.0 + c.unmovable_reprobe_s - 1)[0]) == 0
    assert plan(t.snapshot(), tiers(100), c, PolicyState(), 13.0 + c.unmovable_reprobe_s)[0].rows.tolist() == [0]


def test_kernel_reported_unmovable_is_marked_at_once():
    t = make_table(2, tier=1, temp=10.0)
    c = cfg()
    record_results(t, np.array([0, 1]), [False, True], [True, False], 5.0, c, dst=np.array([0, 0]))
    assert t.flags[0] & F_UNMOVABLE and not t.flags[1] & F_UNMOVABLE
    assert t.stuck[0] == STUCK_PINNED and t.stuck[1] == STUCK_NONE
    assert t.last_move[1] == 5.0 and t.tier[1] == 0


def test_unmovable_reason_from_the_migrator_and_reprobe():
    """Kills: record_results ignoring the migrator's reason (every block
    "pinned"), F_UNMOVABLE kept after a successful re-probe, a declared pin
    re-probed, evidence alone (no kernel refusal) marking a block at once."""
    t = make_table(4, tier=1, temp=10.0)
    t.stuck[3] = STUCK_DECLARED
    t.flags[3] |= F_UNMOVABLE
    c = cfg(unmovable_after=2, unmovable_reprobe_s=100.0)
    rows = np.arange(3)
    reason = np.array([STUCK_LOCKED, STUCK_PINNED, STUCK_NONE], dtype=np.uint8)
    record_results(t, rows, [False] * 3, [True, False, False], 0.0, c, dst=np.zeros(3), reason=reason)
    assert t.stuck.tolist() == [STUCK_LOCKED, STUCK_NONE, STUCK_NONE, STUCK_DECLARED]
    assert (t.flags[:3] & F_UNMOVABLE).tolist() == [F_UNMOVABLE, 0, 0]
    record_results(t, rows[1:], [False] * 2, [False] * 2, 1.0, c, dst=np.zeros(2), reason=reason[1:])
    assert t.stuck.tolist() == [STUCK_LOCKED, STUCK_PINNED, STUCK_FAILING, STUCK_DECLARED]
    assert t.retry_at[0] == 100.0 and t.retry_at[1] == 101.0
    p, _ = plan(t.snapshot(), tiers(100), c, PolicyState(), 101.0)
    assert p.rows.tolist() == [0, 1, 2]  # the declared pin never comes back
    assert p.stay[3] == S_UNMOVABLE
    record_results(t, p.rows, [True] * 3, [False] * 3, 101.0, c, dst=p.dst)
    assert not (t.flags[:3] & F_UNMOVABLE).any() and not t.stuck[:3].any()
    assert t.flags[3] & F_UNMOVABLE and t.stuck[3] == STUCK_DECLARED
    assert "long-term pinned" in STUCK_TEXT[STUCK_PINNED]


def test_min_residence_time_bars_demotions_not_promotions():
    # two cold blocks in a full DRAM: the one promoted 5 s ago stays
    t = make_table(4, tier=0, temp=0.0)
    t.last_move[0] = 95.0
    p, _ = plan(t.snapshot(), tiers(4), cfg(min_residence_s=10.0, high_wm=0.5, low_wm=0.25), PolicyState(), 100.0)
    assert 0 not in p.rows.tolist() and len(p) > 0
    # a hot block demoted 5 s ago comes back as soon as it is read again
    # (held back, every later turn of a conversation that came within the
    # residence read its blocks from CXL: kvtier-sim presets chat and rag)
    t = make_table(2, tier=1, temp=10.0)
    t.last_move[0] = 95.0
    p, _ = plan(t.snapshot(), tiers(100), cfg(min_residence_s=10.0), PolicyState(), 100.0)
    assert sorted(p.rows.tolist()) == [0, 1] and set(p.dst.tolist()) == {0}


def test_plan_is_pure():
    t = make_table(20, tier=0)
    t.temp[:] = np.arange(20)
    snap = t.snapshot()
    before = {k: v.copy() for k, v in snap.items()}
    st = PolicyState()
    plan(snap, tiers(10), cfg(), st, 100.0)
    for k in snap:
        np.testing.assert_array_equal(snap[k], before[k])
    assert st == PolicyState()


def test_no_ping_pong_under_steady_workload():
    # 200 blocks, DRAM fits 60; fixed per-block access rates (Zipf-like with
    # noise). After convergence the plan must be empty tick after tick.
    rng = np.random.default_rng(7)
    n = 200
    t = make_table(n, tier=1)
    rates = (50.0 / np.arange(1, n + 1) ** 0.9)[rng.permutation(n)]
    h = Temperature(tau_s=5.0)
    c = cfg(high_wm=0.95, low_wm=0.85, min_residence_s=2.0, promote_temp=1.0, demote_temp=0.3, margin_sigma=3.0)
    st = PolicyState()
    ts = tiers(60)
    moves_per_row = np.zeros(n, int)
    late_moves = 0
    for k in range(400):
        now = k * 0.5
        h.decay(t, now)
        counts = rng.poisson(rates * 0.5).astype(np.float32)
        h.add(t, np.arange(n), counts, now)
        p, st = plan(t.snapshot(), ts, c, st, now)
        assert used(t, 0) <= 0.95 * 60 * BS
        moves_per_row[p.rows] += 1
        if k >= 200:
            late_moves += len(p)
        apply(t, p, now, c)
    # without the noise margin (margin_sigma=0) this is ~290 moves
    assert late_moves <= 10, late_moves
    assert moves_per_row.max() <= 3
    # and the hottest blocks ended up in DRAM
    hot = np.argsort(-rates)[:40]
    assert np.all(t.tier[hot] == 0)


def test_explain_says_why():
    t = make_table(3, tier=1, temp=10.0)
    t.retry_at[0] = 150.0
    t.fail_count[0] = 2
    s = explain(t.snapshot(), 0, tiers(100), cfg(), PolicyState(), 100.0)
    assert "retry in 50.0s" in s and "plan: stay" in s
    s1 = explain(t.snapshot(), 1, tiers(100), cfg(), PolicyState(), 100.0)
    assert "plan: move tier 1 -> 0 (promote)" in s1
    assert "no such block" in explain(t.snapshot(), 9, tiers(100), cfg(), PolicyState(), 100.0)


def test_reason_names_cover_codes():
    assert len(REASON_NAMES) == 8 and REASON_NAMES[R_PROMOTE] == "promote"


@pytest.mark.parametrize(
    "kw", [dict(low_wm=0.9, high_wm=0.8), dict(promote_temp=1, demote_temp=2), dict(promote_mbps=0)]
)
def test_config_validated(kw):
    with pytest.raises(ConfigError):
        PolicyConfig(**kw)


# -- invariants over random block states --------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 300),
    ntiers=st.integers(2, 3),
    dram=st.integers(1, 200),
    mbps=st.sampled_from([2.0, 8.0, 64.0, 4096.0]),
    quota=st.one_of(st.none(), st.integers(0, 100)),
)
def test_plan_invariants(seed, n, ntiers, dram, mbps, quota):
    rng = np.random.default_rng(seed)
    t = make_table(n)
    t.tier[:] = rng.choice([TIER_UNKNOWN, TIER_MIXED, 0, 1, ntiers - 1], n, p=[0.05, 0.05, 0.4, 0.3, 0.2])
    t.temp[:] = rng.exponential(3.0, n).astype(np.float32)
    t.flags[:] = rng.choice([0, F_UNMOVABLE, F_KEEP_DRAM, F_NEVER_SWAP, F_PREFILL_DONE, F_MANUAL_PIN], n,
                            p=[0.6, 0.08, 0.08, 0.08, 0.08, 0.08])
    t.pin_tier[:] = rng.integers(-1, ntiers, n)
    t.tenant[:] = rng.integers(0, 3, n)
    t.priority[:] = rng.integers(-1, 2, n)
    t.retry_at[:] = np.where(rng.random(n) < 0.1, 150.0, -np.inf)
    t.last_move[:] = np.where(rng.random(n) < 0.1, 99.0, -np.inf)
    ts = tiers(dram, cxl_blocks=150, swap_blocks=1000 if ntiers == 3 else None)
    c = cfg(min_residence_s=5.0, promote_mbps=mbps, demote_mbps=mbps,
            tenant_dram_quota={} if quota is None else {1: quota * BS})
    snap = t.snapshot()
    p, st2 = plan(snap, ts, c, PolicyState(), 100.0)

    assert np.unique(p.rows).size == len(p)  # one move per block
    assert np.all(p.src == snap["tier"][p.rows]) and np.all(p.src != p.dst)
    assert np.all((p.src >= 0) & (p.dst >= 0) & (p.dst < ntiers))
    f = snap["flags"][p.rows]
    assert not np.any(f & F_UNMOVABLE)
    assert np.all(snap["retry_at"][p.rows] <= 100.0)
    # pinned blocks only ever go to their pin tier
    pinned = (f & F_MANUAL_PIN) != 0
    assert np.all(p.dst[pinned] == snap["pin_tier"][p.rows][pinned])
    assert np.all(p.reason[pinned] == R_PIN)
    # KEEP_DRAM never leaves DRAM, NEVER_SWAP never enters swap
    assert not np.any((f & F_KEEP_DRAM != 0) & ~pinned & (p.dst > p.src) & (p.src == 0))
    if ntiers == 3:
        assert not np.any((f & F_NEVER_SWAP != 0) & ~pinned & (p.dst == 2))
    # the residence time holds for every demotion the operator did not
    # order (promotions do not wait for it)
    free_will = np.isin(p.reason, [R_OVERFLOW, R_COLD, R_EVICT, R_QUOTA])
    assert np.all(snap["last_move"][p.rows][free_will] <= 95.0)
    # rate limit: each direction within its bucket (burst = 1 s of rate, >= one block)
    burst = max(mbps * MIB, BS)
    assert p.promote_bytes <= burst and p.demote_bytes <= burst
    assert st2.promote_tokens == pytest.approx(burst - p.promote_bytes)
    # the demotions promotions need (evictions, constraints) come before them,
    # proactive cold demotions after them
    up = p.dst < p.src
    cold = p.reason == R_COLD
    needed = ~up & np.isin(p.reason, [R_EVICT, R_QUOTA, R_PIN, R_KEEP_DRAM, R_NEVER_SWAP])
    if up.any() and needed.any():
        assert np.flatnonzero(needed).max() < np.flatnonzero(up).min()
    if up.any() and cold.any():
        assert np.flatnonzero(up).max() < np.flatnonzero(cold).min()
    # every block not moved has the rule that kept it recorded
    assert p.stay is not None and p.stay.size == n and int(p.stay.max()) < len(STAY_NAMES)
    measured = (snap["tier"] >= 0) & (snap["tier"] < ntiers)
    assert np.all(p.stay[((snap["flags"] & F_UNMOVABLE) != 0) & measured] == S_UNMOVABLE)
    # promotions (not operator moves) never push a tier past its high watermark
    after = snap["tier"].copy()
    after[p.rows] = p.dst
    before0 = int(snap["nbytes"][snap["tier"] == 0].sum())
    after0 = int(snap["nbytes"][after == 0].sum())
    forced = int(p.nbytes[(p.dst == 0) & np.isin(p.reason, [R_PIN, R_KEEP_DRAM])].sum())
    assert after0 <= max(before0, dram * BS) + forced
    # a tenant is never promoted into DRAM past its quota
    if quota is not None:
        ten = snap["tenant"]
        prom1 = (p.reason == R_PROMOTE) & (p.dst == 0) & (ten[p.rows] == 1)
        if prom1.any():
            forced1 = int(p.nbytes[(p.dst == 0) & (ten[p.rows] == 1) & np.isin(p.reason, [R_PIN, R_KEEP_DRAM])].sum())
            assert int(snap["nbytes"][(after == 0) & (ten == 1)].sum()) <= quota * BS + forced1


def _full_dram(temp_res=5.0, temp_out=300.0, **kw):
    """DRAM of 4 blocks full of rows 0-3 at temp_res; row 4 in CXL at temp_out."""
    t = make_table(5, tier=0, temp=temp_res)
    t.tier[4] = 1
    t.temp[4] = temp_out
    return t


@pytest.mark.parametrize("rule", ["quota", "margin", "residence", "rate_limit", "backoff", "pin", "unmovable",
                                  "threshold", "watermark", "placed"])
def test_explain_names_the_rule_that_kept_the_block(rule):
    """Every 'stay' names the rule from the plan's own record (issue 13 item 11)."""
    t = _full_dram()
    kw = {}
    row = 4
    if rule == "quota":
        t.tenant[:] = 1
        kw = dict(tenant_dram_quota={1: 4 * BS})
    elif rule == "margin":
        t.temp[4] = 5.5  # hotter than the residents, but not by the margin
    elif rule == "residence":
        row = 0  # residents promoted 1 s ago are not demoted for the hotter row 4
        t.last_move[:4] = 99.0
        kw = dict(min_residence_s=5.0)
    elif rule == "rate_limit":
        t.nbytes[:] = BS
        kw = dict(promote_mbps=1.0, burst_s=1.0)  # 1 MiB of tokens, a block is 2 MiB
        st = PolicyState(promote_tokens=0.0, demote_tokens=0.0, last_now=100.0)
    elif rule == "backoff":
        t.retry_at[4] = 130.0
    elif rule == "pin":
        t.flags[4] |= F_MANUAL_PIN
    elif rule == "unmovable":
        t.flags[4] |= F_UNMOVABLE
    elif rule == "threshold":
        t.temp[4] = 1.0
    elif rule == "watermark":
        row = 0
        t.temp[:4] = 0.0  # cold residents, DRAM at low watermark 1.0 after nothing to do
        kw = dict(low_wm=1.0, high_wm=1.0)
        t.temp[4] = 0.0
    elif rule == "placed":
        row = 0
        t.temp[4] = 1.0
    state = st if rule == "rate_limit" else PolicyState()
    c = cfg(**kw)
    p, _ = plan(t.snapshot(), tiers(4), c, state, 100.0)
    assert row not in p.rows.tolist()
    s = explain(t.snapshot(), row, tiers(4), c, state, 100.0)
    assert f"plan: stay ({rule})" in s, s


def test_explain_of_a_move_names_its_rule():
    t = _full_dram(temp_res=0.0)
    s = explain(t.snapshot(), 4, tiers(4), cfg(), PolicyState(), 100.0)
    assert "plan: move tier 1 -> 0 (promote)" in s
    p, _ = plan(t.snapshot(), tiers(4), cfg(), PolicyState(), 100.0)
    out = p.rows[p.dst == 1]
    assert out.size  # room for the promoted one (rows 0-3 tie: the last go first, see the tie test)
    s = explain(t.snapshot(), int(out[0]), tiers(4), cfg(), PolicyState(), 100.0)
    assert "plan: move tier 0 -> 1 (evict)" in s or "(cold)" in s


def test_blocks_nothing_tells_apart_leave_dram_from_the_regions_end_and_enter_from_its_start():
    """Present, never read, all alike: a pool's allocator writes its first
    blocks first, so the plan demotes from the highest rows and promotes
    from the lowest. Kills: argpartition's arbitrary pick among ties (for
    small tables the lowest rows: the first blind plan after a
    registration paged out the blocks the first requests were about to
    write)."""
    for n, room in ((12, 8), (1000, 700)):
        t = make_table(n, tier=0, temp=0.0)  # DRAM over its size: n - room must go
        p, _ = plan(t.snapshot(), tiers(room), cfg(cold_demote=False), PolicyState(), 100.0)
        assert sorted(p.rows[p.dst == 1].tolist()) == list(range(room, n))
        t = make_table(n, tier=1, temp=5.0)  # all equally hot in CXL, DRAM empty
        p, _ = plan(t.snapshot(), tiers(n - room), cfg(), PolicyState(), 100.0)
        assert sorted(p.rows[p.dst == 0].tolist()) == list(range(n - room))


def test_demote_bucket_follows_the_allocation_rate():
    # DRAM of 100 blocks; 20 new blocks (40 MiB) appear every second, above a
    # 8 MiB/s demote rate. The inflow estimate must raise the demote bucket.
    c = cfg(demote_mbps=8.0, promote_mbps=8.0, low_wm=0.5, high_wm=0.9)
    t = make_table(400, tier=1, temp=0.0)
    t.flags[:] |= np.uint8(F_NOT_PRESENT)
    t.tier[:] = TIER_UNKNOWN
    st = PolicyState()
    demoted, inflow = [], []
    for sec in range(30):
        new = slice(20 * sec, 20 * sec + 20) if sec < 20 else slice(0, 0)
        t.tier[new] = 0
        t.flags[new] &= ~np.uint8(F_NOT_PRESENT)
        p, st = plan(t.snapshot(), tiers(100), c, st, float(sec))
        apply(t, p, float(sec), c)
        demoted.append(p.demote_bytes)
        inflow.append(st.inflow_bps)
    assert max(inflow) > 8.0 * MIB
    # more than the 8 MiB/s bucket alone could give in some second
    assert max(demoted) > 8 * MIB


def test_cold_demotions_run_after_promotions():
    # DRAM half full of cold blocks between the watermarks, a hot block in CXL:
    # the promotion is planned before the proactive cold demotions.
    t = make_table(12, tier=0, temp=0.0)
    t.tier[10:] = 1
    t.temp[10:] = 50.0
    c = cfg(low_wm=0.5, high_wm=0.95)
    p, _ = plan(t.snapshot(), tiers(11), c, PolicyState(), 100.0)
    up = np.flatnonzero(p.dst < p.src)
    cold = np.flatnonzero(p.reason == R_COLD)
    assert up.size and cold.size and up.max() < cold.min()


def test_a_finished_requests_block_is_displaced_by_any_read_block():
    # a resident at 0 (phase free) has no counting noise: a block read a few
    # times displaces it, even with the sigma margin on
    c = cfg(margin_sigma=3.0, margin_ratio=0.25, margin_abs=1.0)
    t = make_table(3, tier=0, temp=0.0)
    t.tier[2] = 1
    t.temp[2] = 4.0
    p, _ = plan(t.snapshot(), tiers(2), c, PolicyState(), 100.0)
    assert 2 in p.rows[p.dst == 0].tolist()


def test_among_finished_blocks_the_ones_that_keep_coming_back_stay():
    # Four DRAM residents whose runs of reads are over (temperature 0), one
    # slot needed: the block read in a single run goes, not the shared prefix
    # that came back five times, even though that one was read longer ago.
    h = Temperature(5.0)
    t = make_table(5, tier=0)
    t.tier[4] = 1
    for k in range(5):  # row 0: five runs, 20 s apart
        h.decay(t, 20.0 * k)
        h.add(t, np.array([0]), 10.0, 20.0 * k)
        if k < 4:
            apply_phase(t, np.array([0]), "free")
    h.add(t, np.array([1, 2, 3]), 10.0, 85.0)  # one run each, later
    apply_phase(t, np.array([0, 1, 2, 3]), "free")
    t.temp[4] = 50.0
    c = cfg(high_wm=1.0, low_wm=1.0)
    p, _ = plan(t.snapshot(), tiers(4), c, PolicyState(), 100.0)
    out = p.rows[p.dst == 1].tolist()
    assert out and 0 not in out and 4 in p.rows[p.dst == 0].tolist()


def test_a_prefix_popular_long_ago_goes_before_a_turn_that_just_ended():
    # Runs alone would keep yesterday's shared prefix forever: row 0 came
    # back three times an hour ago, row 1's only turn ended a second ago.
    h = Temperature(5.0)
    t = make_table(3, tier=0)
    t.tier[2] = 1
    for k in range(3):
        h.decay(t, 10.0 * k)
        h.add(t, np.array([0]), 10.0, 10.0 * k)
        apply_phase(t, np.array([0]), "free")
    h.decay(t, 3599.0)
    h.add(t, np.array([1]), 10.0, 3599.0)
    apply_phase(t, np.array([1]), "free")
    t.temp[2] = 50.0
    p, _ = plan(t.snapshot(), tiers(2), cfg(high_wm=1.0, low_wm=1.0), PolicyState(), 3600.0)
    assert p.rows[p.dst == 1].tolist() == [0] and p.rows[p.dst == 0].tolist() == [2]


def test_promotions_leave_dram_the_room_measured_allocations_need():
    # 2 blocks/s of new blocks land in DRAM by first touch: filling it to
    # the high watermark with promotions would send them to CXL.
    t = make_table(12, tier=1)
    t.temp[:] = 50.0
    st = PolicyState(promote_tokens=1e12, demote_tokens=1e12, last_now=99.0, last_total=12 * BS, inflow_bps=2 * BS)
    p, st2 = plan(t.snapshot(), tiers(10), cfg(high_wm=1.0, low_wm=0.5), st, 100.0)
    room = st2.headroom(cfg(high_wm=1.0, low_wm=0.5))
    assert 0 < room < 3 * BS
    assert int((p.dst == 0).sum()) == 10 - int(np.ceil(room / BS))
    # no allocations measured: DRAM fills to the watermark
    p0, _ = plan(t.snapshot(), tiers(10), cfg(high_wm=1.0, low_wm=0.5), PolicyState(), 100.0)
    assert int((p0.dst == 0).sum()) == 10


def test_a_block_faulted_back_after_a_pageout_is_barred_from_swap_only():
    """The engine's pageout-return backoff (returns > 0, retry_at ahead): the
    block is being read, so it is promoted like any hot block, and only a move
    to swap waits for retry_at (a bar on every move held a hot set on CXL)."""
    t = make_table(2, tier=1, temp=10.0)
    t.returns[0], t.retry_at[0] = 1, 40.0
    p, _ = plan(t.snapshot(), tiers(100), cfg(), PolicyState(), 10.0)
    assert sorted(p.rows.tolist()) == [0, 1] and p.dst.tolist() == [0, 0]
    # Cold and over a full DRAM and CXL: the returned block is not paged out.
    t = make_table(2, tier=1, temp=0.0)
    t.returns[0], t.retry_at[0] = 1, 40.0
    p, _ = plan(t.snapshot(), tiers(0, cxl_blocks=0, swap_blocks=100), cfg(), PolicyState(), 10.0)
    assert p.rows[p.dst == 2].tolist() == [1]


def test_allocations_beside_discards_still_get_their_room_in_dram():
    # A serving engine at steady state: 2 new blocks/s land in DRAM by first
    # touch while finished sessions' blocks, demoted to CXL earlier, are
    # discarded (pages dropped) at the same rate. The measured bytes do not
    # grow, yet DRAM fills at 2 blocks/s: the rate must count the new blocks,
    # not the growth net of the discarded ones, or promotions fill the room.
    c = cfg(high_wm=1.0, low_wm=0.5)
    t = make_table(200, tier=1, temp=0.0)
    # The pool was resident when registered (``prior``: its blocks are not
    # counted as allocations, nor their discards) but for its free slots,
    # which a measurement found without pages: what appears there is new.
    t.prior[100:] = 1
    t.tier[:100] = TIER_UNKNOWN  # free slots
    t.flags[:100] |= np.uint8(F_NOT_PRESENT)
    st = PolicyState()
    for sec in range(30):
        new = np.arange(2 * sec, 2 * sec + 2)
        t.tier[new] = 0
        t.temp[new] = 10.0  # read by their sessions
        t.flags[new] &= ~np.uint8(F_NOT_PRESENT)
        apply_phase(t, np.arange(100 + 2 * sec, 102 + 2 * sec), "discard")
        _, st = plan(t.snapshot(), tiers(100), c, st, float(sec), dropped=t.inflow_offset())
    assert st.inflow_bps > 1.8 * BS
    # warm blocks waiting in CXL (not enough hotter to displace the new
    # ones): promotions fill DRAM but for the next second's new blocks
    t.temp[160:] = 5.0
    p, st = plan(t.snapshot(), tiers(100), c, st, 30.0, dropped=t.inflow_offset())
    apply(t, p, 30.0, c)
    assert used(t, 0) == 98 * BS


def test_allocations_beyond_the_migrator_build_a_backlog_that_decays():
    # A burst of 20 blocks/s for 3 s against demote_mbps of 4 blocks/s, after
    # a minute at 2 blocks/s: 16 blocks a second the migrator could not have
    # made room for as they came (a little less once the burst lifts the mean
    # inflow above the migrator's rate: then the queue drains at the mean).
    c = cfg(demote_mbps=4 * BS / MIB)
    st = PolicyState().refill(c, 0.0, BS, 0.0)
    total = 0.0
    for s in range(1, 61):
        total += 2 * BS
        st = st.refill(c, float(s), BS, total)
    assert st.backlog == 0.0
    for s in range(61, 64):
        total += 20 * BS
        st = st.refill(c, float(s), BS, total)
    assert 40 * BS < st.backlog < 48 * BS
    peak = st.backlog
    # the rate falls below the migrator's: the queue drains, its peak is remembered
    for s in range(64, 84):
        total += 2 * BS
        st = st.refill(c, float(s), BS, total)
    assert st.backlog == 0.0
    assert 0.8 * peak < st.backlog_peak < peak


def test_a_backlog_is_the_burst_above_the_mean_when_allocations_outrun_the_migrator_for_good():
    # 8 blocks/s for good against 4: DRAM is full whatever the policy does;
    # a queue drained at 4 would grow without end and claim all of DRAM.
    c = cfg(demote_mbps=4 * BS / MIB)
    st = PolicyState().refill(c, 0.0, BS, 0.0)
    for s in range(1, 301):
        st = st.refill(c, float(s), BS, s * 8.0 * BS)
    assert st.backlog_peak < 100 * BS  # not 4 x 300


def test_a_backlog_of_allocations_is_made_room_for_from_finished_blocks_only():
    # DRAM of 100 at 99: 20 finished blocks (temperature 0, one of them a
    # prefix with many runs) and 79 read ones. A backlog of 6 blocks asks
    # for DRAM at 94: finished ones go, least likely to be reused first,
    # below the low watermark (0.98); the read ones stay.
    t = make_table(99)
    t.temp[:20] = 0.0
    t.temp[20:] = 1.0  # warm, but below demote_temp: the cold step stops at the low watermark
    t.fresh[:20] = 1.0
    t.last_access[:] = 90.0
    t.runs[:20] = 1
    t.runs[2] = 9
    c = cfg(high_wm=1.0, low_wm=0.98, demote_temp=2.0, promote_temp=3.0)

    def demoted(backlog_blocks):
        st = PolicyState(promote_tokens=1e12, demote_tokens=1e12, last_now=99.0, last_total=99 * BS,
                         backlog_peak=backlog_blocks * BS)
        p, _ = plan(t.snapshot(), tiers(100), c, st, 100.0)
        assert np.all(p.dst == 1) and np.all(p.rows < 20), p.rows  # finished blocks only
        return p.rows.tolist()

    rows = demoted(6)
    assert len(rows) == 5 and 2 not in rows  # 99 - 5 = 94 meets the goal; the prefix stays
    # A backlog of DRAM's size would empty it of all 20 (and keep promotions
    # out): the room is at most BACKLOG_ROOM_MAX of DRAM, 10 blocks here.
    assert BACKLOG_ROOM_MAX == 0.1
    rows = demoted(60)
    assert len(rows) == 9 and 2 not in rows
    # no backlog: down to the low watermark (98 blocks) only, one block
    assert len(demoted(0)) == 1


def test_the_headroom_margin_above_the_mean_only_while_allocations_outrun_the_migrator():
    # When the migrator keeps up, a block that finds DRAM full is promoted at
    # the next tick; the 2-sigma margin would only demote idle blocks early.
    c = cfg()
    calm = PolicyState(inflow_bps=10 * BS, inflow_var=(4 * BS) ** 2)
    assert calm.headroom(c) == pytest.approx(10 * BS)
    assert replace(calm, backlog_peak=BS).headroom(c) == pytest.approx(18 * BS)


def test_all_cold_blocks_go_early_only_where_dram_would_fill_while_the_migrator_is_short():
    # DRAM holds 9 blocks: 3 cold (finished, a prefix cache) and 6 warm; the
    # migrator makes room for 4 blocks/s. Every cold block goes early (each
    # one out is a new block landing in DRAM later) where DRAM's free room
    # is short: a burst faster than the migrator that the room would not
    # hold (less than the recent bursts' backlog and the next second of
    # allocations), or a load whose mean outruns the migrator at an excess
    # that fills the room within the horizon, in its lulls too. A burst the
    # room holds, a calm mean, or room for more than the horizon's excess
    # leave the cached blocks in DRAM (down to the low watermark only: none
    # here): the next turn that takes them would read them from CXL.
    t = make_table(9)
    t.temp[:3] = 0.1
    t.temp[3:] = 3.0
    c = cfg(demote_mbps=4 * BS / MIB)

    def cold_moves(dram_blocks, now_blocks_s, mean_blocks_s, backlog_blocks=0.0):
        st = PolicyState(promote_tokens=1e12, demote_tokens=1e12, last_now=99.0, last_total=9 * BS,
                         total_at=99.0, inflow_bps=now_blocks_s * BS, inflow_slow=mean_blocks_s * BS,
                         inflow_slow_w=1.0, backlog_peak=backlog_blocks * BS)
        p, _ = plan(t.snapshot(), tiers(dram_blocks), c, st, 100.0)
        return sorted(p.rows[p.reason == R_COLD].tolist())

    assert cold_moves(12, 8.0, 3.0) == [0, 1, 2]  # a burst of 8/s above the migrator, 3 blocks free
    assert cold_moves(1000, 8.0, 3.0) == []  # the same burst, 991 free: it fits
    assert cold_moves(18, 8.0, 3.0) == []  # 9 free hold the next second's 8
    assert cold_moves(18, 8.0, 3.0, backlog_blocks=2.0) == [0, 1, 2]  # bursts needed 1.8 (a tenth of DRAM) + 8
    # a backlog of DRAM's size counts a tenth of it (BACKLOG_ROOM_MAX): 100 + 8 fit in 991
    assert cold_moves(1000, 8.0, 3.0, backlog_blocks=990.0) == []
    assert cold_moves(1000, 1.0, 8.0) == [0, 1, 2]  # a lull: (8 - 4) x 3600 s > 991 blocks free
    assert cold_moves(1000, 1.0, 3.0) == []  # a lull on a calm mean
    assert cold_moves(100000, 1.0, 8.0) == []  # 99,991 free: more than the horizon's excess


def _read_steadily(t, temp, rows, until):
    """Rows read once a second up to ``until``, decayed each tick as the daemon does."""
    for sec in range(until):
        temp.add(t, rows, 1.0, float(sec))
        temp.decay(t, float(sec + 1))


def _dram_over_by_a_block_just_written():
    """DRAM one block over its target: ten blocks read once a second for
    half a minute, and a block written at 29.9 s (a decode step just opened
    it; every following step reads it), decayed to the 30 s tick."""
    t = make_table(11, tier=0)
    temp = Temperature(5.0)
    _read_steadily(t, temp, np.arange(10), 29)
    temp.add(t, np.array([10]), 1.0, 29.9)
    temp.decay(t, 30.0)
    return cfg(high_wm=1.0, low_wm=0.8), t, temp


def test_a_block_just_written_is_not_the_one_demoted():
    # Ranked by its one write (rate estimate 2.5 per tau) the new block is
    # the coldest; its run has only just started, so a steady block goes.
    c, t, _ = _dram_over_by_a_block_just_written()
    p, _ = plan(t.snapshot(), tiers(10), c, PolicyState(), 30.0)
    assert p.demote_bytes == BS
    assert 10 not in p.rows.tolist()
    assert "plan: stay (starting)" in explain(t.snapshot(), 10, tiers(10), c, PolicyState(), 30.0)


def test_a_block_written_and_not_read_again_goes_once_its_run_has_counted():
    # The same block with no read after its write: a tick later its run is
    # over half a tau old and its estimate (one read) is its rate: the coldest.
    c, t, temp = _dram_over_by_a_block_just_written()
    temp.add(t, np.arange(10), 1.0, 30.5)
    temp.decay(t, 31.0)
    p, _ = plan(t.snapshot(), tiers(10), c, PolicyState(), 31.0)
    assert p.rows.tolist() == [10] and p.reason.tolist() == [R_OVERFLOW]


def test_a_block_just_written_in_a_slower_tier_is_still_promoted():
    # The protection is against demotion only: a new block that landed on
    # CXL (DRAM was full at its first touch) goes up as soon as it is hot.
    c = cfg(high_wm=1.0, low_wm=0.8)
    t = make_table(10, tier=0)
    temp = Temperature(5.0)
    t.tier[9] = 1
    _read_steadily(t, temp, np.arange(9), 29)
    temp.add(t, np.array([9]), 3.0, 29.9)
    temp.decay(t, 30.0)
    p, _ = plan(t.snapshot(), tiers(10), c, PolicyState(), 30.0)
    assert p.rows.tolist() == [9] and p.dst.tolist() == [0]


def test_promotions_leave_dram_free_room_to_new_blocks_while_allocations_outrun_the_migrator():
    # DRAM of 100 blocks holds 50 warm ones; 10 hot blocks wait in CXL; the
    # migrator demotes 4 blocks/s. Where new blocks, net of the discarded
    # ones, come faster than that by enough to fill the 50 free within
    # BACKLOG_TAU_S, that room is theirs: a block promoted into it now must
    # be demoted again when every demotion is room for a new block, read by
    # every decode step of its request. The hot blocks then come in only in
    # exchange for colder residents (as many as the demote bucket's 4), DRAM
    # stays at 50. Where the discards match the new blocks (decode blocks
    # freed at a request's end) or the excess fills the room only after the
    # horizon, all 10 fill the room.
    c = cfg(demote_mbps=4 * BS / MIB)

    def promoted_and_dram(dram_blocks, gross_blocks_s, net_blocks_s):
        t = make_table(60, tier=0, temp=1.0)
        t.tier[50:] = 1
        t.temp[50:] = 5.0
        st = PolicyState(promote_tokens=1e12, demote_tokens=1e12, last_now=99.0, last_total=60 * BS,
                         total_at=99.0, inflow_slow=gross_blocks_s * BS, net_slow=net_blocks_s * BS,
                         inflow_slow_w=1.0, last_net=60 * BS)
        p, _ = plan(t.snapshot(), tiers(dram_blocks), c, st, 100.0)
        apply(t, p, 100.0, c)
        return int((t.tier[50:] == 0).sum()), used(t, 0) // BS

    assert promoted_and_dram(100, 8.0, 8.0) == (4, 50)  # (8 - 4) x 300 s >= 50 free: exchanges only
    assert promoted_and_dram(100, 8.0, 0.0) == (10, 60)  # as many discarded as written: DRAM does not fill
    assert promoted_and_dram(100, 2.0, 2.0) == (10, 60)  # the migrator keeps up
    assert promoted_and_dram(2000, 8.0, 8.0) == (10, 60)  # 1,950 free: more than the horizon's excess (1,200)


def test_the_net_allocation_rate_counts_new_blocks_less_discarded_ones():
    # 8 blocks/s written and as many discarded: the gross rate the bursts
    # are sized by is 8, the net rate DRAM fills at for good is 0.
    c = cfg(demote_mbps=4 * BS / MIB)
    st = PolicyState().refill(c, 0.0, BS, 0.0, 0.0)
    for s in range(1, 601):
        st = st.refill(c, float(s), BS, s * 8.0 * BS, 0.0)
    assert st.sustained_inflow == pytest.approx(8 * BS, rel=0.01)
    assert abs(st.sustained_net_inflow) < 0.01 * BS
    for s in range(601, 1201):  # now every block written stays
        st = st.refill(c, float(s), BS, s * 8.0 * BS, (s - 600) * 8.0 * BS)
    assert st.sustained_net_inflow > 6 * BS


def test_the_backlogs_room_is_not_capped_where_dram_fills_for_good():
    # The tenth of DRAM is for bursts of blocks freed about as fast as they
    # are written. Where allocations net of discards outrun the migrator,
    # DRAM fills for good and the backlog's whole peak is kept: 60 of 100
    # blocks here, made from the 20 finished ones (all of them go). The
    # migrator: demote_mbps 4 GiB/s (2,048 blocks/s), new blocks 3,000/s.
    t = make_table(99)
    t.temp[:20] = 0.0
    t.temp[20:] = 1.0
    t.fresh[:20] = 1.0
    t.last_access[:] = 90.0
    t.runs[:20] = 1
    c = cfg(high_wm=1.0, low_wm=0.98, demote_temp=0.5, promote_temp=3.0, demote_mbps=4096.0,
            cold_demote=False)  # the backlog's room (_step_ended) alone

    def demoted(net_blocks_s):
        st = PolicyState(promote_tokens=1e12, demote_tokens=1e12, last_now=99.0, last_total=99 * BS,
                         backlog_peak=60 * BS, inflow_slow=3000 * BS, net_slow=net_blocks_s * BS,
                         inflow_slow_w=1.0)
        assert st.backlog_room(100 * BS, c) == (60 if net_blocks_s > 2048 else 10) * BS
        p, _ = plan(t.snapshot(), tiers(100), c, st, 100.0)
        assert np.all(p.rows < 20), p.rows  # finished blocks only
        return len(p)

    assert demoted(0.0) == 9  # as many discarded as written: down to 90
    assert demoted(3000.0) == 20  # every new block stays: all finished blocks go


def test_a_pool_resident_at_registration_is_no_net_allocation_either():
    # 100 blocks of a pool written before the daemon looked (prior), found
    # in DRAM at once by the first look: neither the gross nor the net
    # allocation rate counts them (a net rate that did would read as DRAM
    # filling for good and keep promotions out of its free room).
    c = cfg(demote_mbps=1.0)

    def rates_after_the_first_look(prior):
        t = make_table(100, tier=TIER_UNKNOWN)
        t.prior[:] = prior
        st = PolicyState()
        for sec in range(0, 3):
            if sec == 1:
                t.tier[:] = 0  # the first look
            _, st = plan(t.snapshot(), tiers(1000), c, st, float(sec), dropped=t.inflow_offset(),
                         discarded=t.dropped_bytes)
        return st

    st = rates_after_the_first_look(1)
    assert st.inflow_bps == 0.0 and st.sustained_inflow == 0.0
    assert st.sustained_net_inflow == 0.0
    # blocks allocated since (no prior) count in both
    st = rates_after_the_first_look(0)
    assert st.sustained_inflow > 0 and st.sustained_net_inflow == pytest.approx(st.sustained_inflow)
