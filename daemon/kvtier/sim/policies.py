"""Placement policies the simulator compares, all behind one small interface.

Each policy sees the engine (``eng``: tier/alive arrays, capacities) and is
called once per tick:

    place(rows)               tiers for newly allocated blocks (first touch by default)
    observe(rows, counts, times, now)   accesses of the tick just served
    lifecycle(acquired, released, now)  what the serving engine's client reports
                              with ``phase`` (request traces only): cached
                              blocks taken by a request / no longer used by any
    freed(rows)               blocks freed (at the end of the tick, or evicted at its start)
    decide(now) -> (rows, dst)          moves to make, in execution order
    moved(rows, dst, ok, now)           what the migrator managed

A policy with ``prefetches`` (kvtier's client prefetch) is also told, inside
the tick, what each arriving request finds cached, and the engine's
migrator asks it for the moves its tokens pay for:

    schedule(rows, now)                 a request arriving at ``now`` will read these cached blocks
    has_scheduled() / scheduled_job(now) -> rows   asked moves to DRAM waiting / one job of them
    scheduled_moved(rows, ok, now)      that job's outcome (ok False: DRAM had no room)

``kvtier`` runs the real ``kvtier.policy.plan`` on the real ``kvtier.hotness``
temperatures, with the daemon's shipped settings, fed what a client sends the
daemon (hints for reads, ``phase`` for lifecycle); the page-cache policies see
only the reads. The others are models of the usual alternatives (see
docs/simulator.md for how close each is to its original), and the two
references of ``kvtier.sim.oracles``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..blocks import F_NOT_PRESENT, F_UNMOVABLE, FIELDS, BlockTable
from ..engine import dram_room, fit_room, fit_scheduled, last_requests, mark_prefetched, movable_now, oldest_in_room
from ..hotness import DEFAULT_TAU_S, END_OF_RUN, SOURCE_WEIGHTS, Temperature, apply_phase
from ..policy import PolicyConfig, PolicyState, plan, record_results, refund


class SimPolicy:
    name = "base"
    needs_future = False  # reads eng.future (the offline oracle only)
    prefetches = False  # told each request's cached blocks at its arrival (kvtier's client prefetch)

    def attach(self, eng) -> None:
        self.eng = eng

    def place(self, rows: np.ndarray) -> np.ndarray:
        return self.eng.first_touch(rows)

    def observe(self, rows, counts, times, now) -> None:
        pass

    def clock(self, decayed: float, step: float) -> None:
        """A recording's replay: the daemon's temperatures last decayed at
        ``decayed``, a step of ``step`` seconds (before a tick whose previous
        tick was not recorded)."""

    def lifecycle(self, acquired, released, now) -> None:
        pass

    def freed(self, rows) -> None:
        pass

    def decide(self, now):
        return np.zeros(0, np.int64), np.zeros(0, np.int8)

    def moved(self, rows, dst, ok, now) -> None:
        pass


def _keep_top(eng, cand: np.ndarray, key: np.ndarray):
    """Fast tier = the C best of (residents U cand) by ``key``: promote the
    candidates that make it, demote the residents that do not."""
    res = np.flatnonzero(eng.tier == 0)
    cand = cand[eng.tier[cand] > 0]
    if cand.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int8)
    pool = np.concatenate([res, cand])
    c = eng.cap_blocks[0]
    if pool.size <= c:
        return cand, np.zeros(cand.size, np.int8)
    kk = key[pool]
    keep = np.zeros(pool.size, bool)
    keep[np.argpartition(-kk, c - 1)[:c]] = True
    up = pool[res.size :][keep[res.size :]]
    down = pool[: res.size][~keep[: res.size]]
    # the C best can include fewer candidates than free slots... only evict what is needed
    need = max(0, int(eng.occ[0]) + up.size - c)
    if need < down.size:
        down = down[np.argsort(key[down], kind="stable")[:need]]
    return np.concatenate([down, up]), np.concatenate(
        [eng.demote_target(down), np.zeros(up.size, np.int8)]
    )


class _Recency(SimPolicy):
    """Keeps each block's last access time and the set touched in the last tick."""

    def attach(self, eng):
        super().attach(eng)
        self.last = np.full(eng.n, -np.inf)
        self.touched = np.zeros(0, np.int64)

    def observe(self, rows, counts, times, now):
        np.maximum.at(self.last, rows, times)
        self.touched = np.unique(rows)

    def freed(self, rows):
        self.last[rows] = -np.inf


class LRU(_Recency):
    """Fast tier as an LRU cache: every block touched in a slower tier is
    promoted at the end of the tick, the least recently used residents leave."""

    name = "lru"

    def decide(self, now):
        return _keep_top(self.eng, self.touched, self.last)


class LFU(_Recency):
    """Frequency since allocation (no ageing); recency breaks ties."""

    name = "lfu"

    def attach(self, eng):
        super().attach(eng)
        self.freq = np.zeros(eng.n)

    def observe(self, rows, counts, times, now):
        super().observe(rows, counts, times, now)
        np.add.at(self.freq, rows, counts)

    def freed(self, rows):
        super().freed(rows)
        self.freq[rows] = 0

    def decide(self, now):
        # frequency first, then recency (scaled below one access)
        t = self.last - now
        return _keep_top(self.eng, self.touched, self.freq + 1e-3 / (1.0 - np.maximum(t, -1e9)))


class KernelNumaBalancing(_Recency):
    """numa_balancing=2 (memory tiering) in outline.

    The scanner unmaps ``scan_mb_per_s`` of slow-tier memory per second
    (kernel default numa_balancing_scan_size_mb=256 per scan period, period
    >= 1 s); a scanned block touched within ``hot_threshold_s`` takes a hint
    fault and is promoted if the fast tier has free pages above the promotion
    watermark. kswapd demotes the least recently used fast-tier blocks to keep
    ``free_frac`` free. Promotion is capped by ``promote_rate_mbps``
    (numa_balancing_promote_rate_limit_MBps, default 65536).
    """

    name = "kernel"

    def __init__(self, scan_mb_per_s=256.0, hot_threshold_s=1.0, free_frac=0.02, promote_rate_mbps=65536.0):
        self.scan_mb_per_s = scan_mb_per_s
        self.hot_threshold_s = hot_threshold_s
        self.free_frac = free_frac
        self.promote_rate_mbps = promote_rate_mbps

    def attach(self, eng):
        super().attach(eng)
        self.scanned_at = np.full(eng.n, -np.inf)
        self.cursor = 0

    def freed(self, rows):
        super().freed(rows)
        self.scanned_at[rows] = -np.inf

    def decide(self, now):
        eng = self.eng
        # hint faults: touched slow-tier blocks scanned shortly before the touch
        t = self.touched
        sc = self.scanned_at[t]
        lat = np.full(t.size, np.inf)  # hint-fault latency; never scanned -> no fault
        seen = np.isfinite(sc)
        lat[seen] = self.last[t][seen] - sc[seen]
        hot = t[(eng.tier[t] > 0) & (lat >= 0) & (lat <= self.hot_threshold_s)]
        # scanner advances over slow-tier blocks (address order, wraps)
        k = int(self.scan_mb_per_s * eng.tick_s * (1 << 20) // eng.block_bytes)
        slow = np.flatnonzero(eng.alive & (eng.tier > 0))
        if slow.size and k:
            start = int(np.searchsorted(slow, self.cursor))
            pick = np.take(slow, np.arange(start, start + min(k, slow.size)), mode="wrap")
            self.scanned_at[pick] = now
            self.cursor = int(pick[-1]) + 1
        c = eng.cap_blocks[0]
        limit = int(self.promote_rate_mbps * eng.tick_s * (1 << 20) // eng.block_bytes)
        hot = hot[np.argsort(-self.last[hot], kind="stable")][:limit]
        # kswapd: keep free_frac of the fast tier free; promotion only into that
        # headroom's complement (the kernel wakes kswapd to make room)
        floor = int(c * (1 - self.free_frac))
        need = max(0, int(eng.occ[0]) + hot.size - floor)
        res = np.flatnonzero(eng.tier == 0)
        down = res[np.argsort(self.last[res], kind="stable")[:need]]
        up = hot[: max(0, floor - int(eng.occ[0]) + down.size)]
        return np.concatenate([down, up]), np.concatenate([eng.demote_target(down), np.zeros(up.size, np.int8)])


class Damos(SimPolicy):
    """DAMON + DAMOS migrate_hot / migrate_cold in outline.

    Regions are fixed runs of ``region_blocks`` adjacent blocks (real DAMON
    adapts 10..1000 regions over the whole space, usually coarser). A
    region's access frequency is the fraction of its live blocks touched in
    the tick; regions at or above ``hot_frac`` are promoted hottest first,
    regions untouched for ``cold_age_s`` are demoted, each within a quota of
    ``quota_mbps``; promotion stops at ``high_wm`` of the fast tier.
    """

    name = "damos"

    def __init__(self, region_blocks=8, hot_frac=0.5, cold_age_s=5.0, quota_mbps=4096.0, high_wm=0.95):
        self.region_blocks = region_blocks
        self.hot_frac = hot_frac
        self.cold_age_s = cold_age_s
        self.quota_mbps = quota_mbps
        self.high_wm = high_wm

    def attach(self, eng):
        super().attach(eng)
        self.nreg = (eng.n + self.region_blocks - 1) // self.region_blocks
        self.freq = np.zeros(self.nreg)
        self.last_hit = np.full(self.nreg, -np.inf)

    def observe(self, rows, counts, times, now):
        eng = self.eng
        reg = np.unique(rows) // self.region_blocks
        hits = np.bincount(reg, minlength=self.nreg)
        live = np.bincount(np.flatnonzero(eng.alive) // self.region_blocks, minlength=self.nreg)
        self.freq = hits / np.maximum(live, 1)
        self.last_hit[hits > 0] = now

    def decide(self, now):
        eng = self.eng
        quota = int(self.quota_mbps * eng.tick_s * (1 << 20) // eng.block_bytes)
        blk_reg = np.arange(eng.n) // self.region_blocks
        # migrate_cold
        cold_reg = (now - self.last_hit) >= self.cold_age_s
        down = np.flatnonzero((eng.tier == 0) & cold_reg[blk_reg])[:quota]
        # migrate_hot, hottest regions first
        cand = np.flatnonzero((eng.tier > 0) & eng.alive & (self.freq[blk_reg] >= self.hot_frac))
        cand = cand[np.argsort(-self.freq[blk_reg[cand]], kind="stable")][:quota]
        room = max(0, int(eng.cap_blocks[0] * self.high_wm) - int(eng.occ[0]) + down.size)
        up = cand[:room]
        return np.concatenate([down, up]), np.concatenate([eng.demote_target(down), np.zeros(up.size, np.int8)])


# kvtier's client prefetch at each request's arrival, off by default: with
# the daemon's prefetch limited to DRAM's room (engine.dram_room) it still
# costs hit ratio in 8 of the 12 Mooncake cells (up to 0.05), where the
# migrator is the bottleneck (docs/benchmarks.md, sixth round). The one
# default kvtier-sim's CLI and the policy benches read.
DEFAULT_PREFETCH = False


class Kvtier(SimPolicy):
    """The daemon's own policy: kvtier.hotness temperatures + kvtier.policy.plan,
    with the daemon's shipped defaults unless ``cfg`` / ``tau_s`` / ``end_of_run`` are given.

    It learns what the daemon learns from a client: every read as a hint
    (``Temperature.add``, weight of the ``hint`` source) and, for request
    traces, the lifecycle as ``phase`` messages (``hotness.apply_phase``,
    the code the daemon's registry runs): ``active`` when a request takes a
    cached block, ``free`` when no request uses it any more.

    With ``prefetch`` (off by default: ``DEFAULT_PREFETCH``) the client also sends ``prefetch`` for
    the cached blocks a request finds at its arrival (its prefix-cache hits),
    as docs/integrations.md has an engine do when it schedules a request:
    the daemon's ``Engine.schedule`` and ``_build_scheduled`` on this table
    (``engine.mark_prefetched``, ``engine.fit_scheduled``: the same hotness
    and the same token buckets the plan spends)."""

    name = "kvtier"

    def __init__(self, cfg: PolicyConfig | None = None, tau_s: float | None = None, end_of_run: float | None = None,
                 prefetch: bool = DEFAULT_PREFETCH):
        self.cfg = cfg if cfg is not None else PolicyConfig()
        self.tau_s = DEFAULT_TAU_S if tau_s is None else tau_s
        self.end_of_run = END_OF_RUN if end_of_run is None else end_of_run
        self.prefetches = prefetch

    def attach(self, eng):
        super().attach(eng)
        self.table = BlockTable(eng.n)
        self.table.add_region(0, 0, 0, eng.n * eng.block_bytes, eng.block_bytes)
        self.table.flags[:] = F_NOT_PRESENT
        self.table.prior[:] = 0  # every block of a trace is allocated while it runs
        self.temp = Temperature(self.tau_s, self.end_of_run)
        self.state = PolicyState()
        self.tiers = [t.state(i) for i, t in enumerate(eng.cfg.tiers)]
        self.view = {name: getattr(self.table, name) for name in FIELDS}  # live, no copy: plan() is pure
        self.scheduled: list[tuple[np.ndarray, np.ndarray]] = []  # prefetches asked for: rows, when each

    def place(self, rows):
        dst = super().place(rows)
        tb = self.table
        tb.tier[rows] = dst
        tb.flags[rows] = 0
        tb.temp[rows] = 0
        tb.fresh[rows] = 0
        tb.runs[rows] = 0
        tb.last_access[rows] = -np.inf
        tb.last_move[rows] = -np.inf
        tb.retry_at[rows] = -np.inf
        tb.fail_count[rows] = 0
        return dst

    def observe(self, rows, counts, times, now):
        # The daemon's order: the hints of a tick add up as they arrive, and
        # the tick then decays them all, the latest too, before it plans.
        self.temp.add(self.table, rows, counts, now, SOURCE_WEIGHTS["hint"])
        if len(rows):
            # A block's last access is its last read of the tick, as the
            # daemon's is its last hint's arrival: when its run ends depends
            # on it. Its silence is tested again with the decay.
            self.table.last_access[rows] = np.where(np.isfinite(times), times, now)
            self.temp.recheck(self.table, rows)
        self.temp.decay(self.table, now)
        self.table.tier[:] = self.eng.tier  # implicit moves (swap-in) are the engine's

    def clock(self, decayed, step):
        self.temp.resume(self.table, decayed, step)

    def lifecycle(self, acquired, released, now):
        apply_phase(self.table, acquired, "active")
        apply_phase(self.table, released, "free")

    def freed(self, rows):
        # A trace's free is a slot whose pages are gone (the engine model
        # reuses it by first touch): what a client's discard with the drop
        # tells the daemon, through the same code.
        apply_phase(self.table, rows, "discard")

    def decide(self, now):
        p, self.state = plan(self.view, self.tiers, self.cfg, self.state, now, self.table.dropped_bytes)
        self.last_plan = p
        return p.rows, p.dst

    def schedule(self, rows, now):
        """The daemon's ``Engine.schedule(rows, "prefetch")``: hot for the
        policy, and queued for DRAM unless there already or not movable, as
        far as DRAM's room goes (``engine.dram_room``, less what is queued);
        the rest is left to the next plan (deferred)."""
        t = self.table
        tier = t.tier[rows]
        movable = movable_now(tier, t.flags[rows])
        mark_prefetched(t, self.temp, rows, self.cfg)
        go = movable & (tier != 0)
        if go.any():
            queued = float(sum(t.nbytes[r].astype(np.float64).sum() for r, _ in self.scheduled))
            want = rows[go]
            want = want[fit_room(t.nbytes[want], self._dram_room(queued))]
            if want.size:
                self.scheduled.append((want, np.full(want.size, float(now))))

    def _dram_room(self, on_way: float) -> float:
        # DRAM's use as the daemon knows it: its table plus the mover's job
        # (the engine's occupancy counts a prefetch job's blocks from its start)
        dram = replace(self.tiers[0], used_bytes=int(self.eng.occ[0]) * self.eng.block_bytes)
        return dram_room(dram, self.cfg, self.state, on_way)

    def has_scheduled(self) -> bool:
        return bool(self.scheduled)

    def scheduled_job(self, now) -> np.ndarray:
        """The daemon's ``Engine._build_scheduled``: one request per block
        (the latest), those not in DRAM now, as far as the promote bucket pays
        (oldest first); the rest wait for the migrator's next turn."""
        t = self.table
        rows = np.concatenate([r for r, _ in self.scheduled])
        asked = np.concatenate([at for _, at in self.scheduled])
        self.scheduled = []
        keep = last_requests(rows)
        rows, asked = rows[keep], asked[keep]
        go = t.tier[rows] > 0
        rows, asked = rows[go], asked[go]
        order = np.argsort(asked, kind="stable")  # oldest request first
        rows, asked = rows[order], asked[order]
        room = oldest_in_room(t.nbytes[rows], asked, self._dram_room(0.0))  # shrunk since queued: the rest to the plan
        rows, asked = rows[room], asked[room]
        if rows.size == 0:
            return rows
        fits, self.state = fit_scheduled(self.state, self.cfg, now, t.nbytes[rows], np.ones(rows.size, bool), asked)
        if not fits.all():
            self.scheduled.append((rows[~fits], asked[~fits]))
        return rows[fits]

    def scheduled_moved(self, rows, ok, now):
        # as the daemon's _finish_move for a scheduled job: no plan, so no refund
        record_results(self.table, rows, ok, np.zeros(rows.size, bool), now, self.cfg,
                       dst=np.zeros(rows.size, np.int8))

    def moved(self, rows, dst, ok, now):
        # moves the migrator did not get to are neither successes nor failures:
        # the next plan simply asks again (and gets its tokens back, as the
        # daemon's engine refunds moves that did not happen)
        if len(self.last_plan) and not ok.all():
            pos = np.full(self.eng.n, -1, np.int64)
            pos[self.last_plan.rows] = np.arange(len(self.last_plan))
            done = np.zeros(len(self.last_plan), bool)
            p = pos[rows[ok]]
            done[p[p >= 0]] = True
            self.state = refund(self.state, self.last_plan, done, self.cfg)
        record_results(self.table, rows[ok], np.ones(int(ok.sum()), bool), np.zeros(int(ok.sum()), bool),
                       now, self.cfg, dst=dst[ok])


POLICIES = {
    "kvtier": Kvtier,
    "lru": LRU,
    "lfu": LFU,
    "kernel": KernelNumaBalancing,
    "damos": Damos,
}
