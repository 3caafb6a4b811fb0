"""The tiering policy: a pure function from block state to a migration plan.

``plan(snap, tiers, cfg, state, now)`` reads a ``BlockTable.snapshot()`` (or
any dict of the same arrays), the tier capacities and the config, and returns
the moves to make plus the new ``PolicyState``. It does no I/O and imports no
adapter: the daemon and the simulator (``kvtier.sim``) run this same code.

Control law (one call = one tick)
---------------------------------
Temperatures come from ``kvtier.hotness`` (exponentially decayed access
counts). The policy ranks blocks by (region priority, effective temperature);
a block whose prefill is done (``F_PREFILL_DONE``) counts only
``prefill_done_factor`` of its temperature, so finished prompts go first.

1. Constraints: blocks that must be elsewhere (``F_KEEP_DRAM`` outside tier 0,
   ``F_MANUAL_PIN`` with a ``pin_tier`` they are not in, ``F_NEVER_SWAP`` in a
   swap tier) move there regardless of temperature.
2. Tenant quotas: a tenant above its DRAM quota has its coldest tier-0 blocks
   demoted until it is back within quota.
3. For each tier t, fastest first:
   a. Watermarks. Above the high watermark the coldest residents are demoted
      one tier down until usage reaches the low watermark (like kswapd). Between
      the watermarks only blocks colder than ``demote_temp`` are demoted, down
      to the low watermark: this keeps headroom for new allocations without
      evicting anything that is in use. What lands on t+1 may push t+1 over its
      own high watermark; it is handled in t+1's turn (the cascade).
   b. Promotion into t: blocks in slower tiers at least ``promote_temp`` hot
      and hotter than anything step a just demoted from t (that room was made
      for new allocations, not for colder blocks), hottest first. They fill
      the free room below the high watermark (and within the node's
      ``free_bytes``); beyond that a candidate may only displace the coldest
      resident of t if it is hotter by the margin (``temp > coldest *
      (1+margin_ratio) + margin_abs + margin_sigma*sqrt(temp+coldest)``, see
      ``exchange_bar``) or has higher priority; the displaced resident goes
      to t+1. With free room the threshold alone admits a block: nothing has
      to leave for it. Tier 0 admits a tenant's blocks only within its quota.
   Hottest candidates meet the coldest residents first, so the exchange stops
   at the first pair that fails the margin test.

No ping-pong: ``promote_temp > demote_temp`` (hysteresis), the exchange margin,
``min_residence_s`` since a block's last move, and at most one move per block
per plan. Migration bandwidth is a token bucket per direction (promote/demote)
held in ``PolicyState``; each plan spends tokens and stops when they run out
(``refund`` gives back what failed).
Blocks the kernel could not move are skipped until ``retry_at``
(``record_results`` sets it with exponential backoff) or forever once marked
``F_UNMOVABLE``, so failures neither eat the budget every tick nor spin.
Blocks whose tier is not measured (``TIER_UNKNOWN``) or straddles tiers
(``TIER_MIXED``) are never planned; the migrator measures them first.

Plan order: demotions first (slowest source tier first, so each one lands in
room the one before made), then promotions (fastest destination first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from .blocks import (
    F_KEEP_DRAM,
    F_MANUAL_PIN,
    F_NEVER_SWAP,
    F_NOT_PRESENT,
    F_PREFILL_DONE,
    F_UNMOVABLE,
    TIER_UNKNOWN,
)
from .errors import ConfigError

MIB = 1 << 20

# Reason codes carried in Plan.reason; REASON_NAMES[code] is the label.
R_OVERFLOW = 0  # tier above its high watermark
R_COLD = 1  # proactive demotion of a cold block between the watermarks
R_EVICT = 2  # displaced by a hotter block promoted into its tier
R_QUOTA = 3  # tenant above its DRAM quota
R_PROMOTE = 4  # hot block in a slower tier
R_KEEP_DRAM = 5  # F_KEEP_DRAM block outside DRAM
R_PIN = 6  # F_MANUAL_PIN block not in its pin_tier
R_NEVER_SWAP = 7  # F_NEVER_SWAP block found in swap
REASON_NAMES = ("overflow", "cold", "evict", "quota", "promote", "keep_dram", "pin", "never_swap")

TIER_KINDS = ("dram", "far", "cxl", "swap")

# Composite sort key = priority * _PRIO_SCALE + effective temperature; the
# exact comparisons use the two parts separately, this only orders.
_PRIO_SCALE = 1e12
_TEMP_CAP = 1e11


@dataclass(frozen=True)
class TierState:
    """One tier as the policy sees it.

    ``capacity_bytes`` is what kvtier may use in the tier (its target before
    the config's fraction); ``free_bytes`` is the memory actually free on the
    tier's nodes (None = unknown): promotions never plan more than that.
    """

    index: int
    name: str
    kind: str
    capacity_bytes: int
    used_bytes: int = 0
    free_bytes: int | None = None


@dataclass(frozen=True)
class PolicyConfig:
    # tier index -> capacity target: a fraction (<= 1.0) of TierState.capacity_bytes
    # or a byte count (> 1). Missing tiers use their whole capacity_bytes.
    capacity: Mapping[int, float] = field(default_factory=dict)
    high_wm: float = 0.95  # fraction of the target above which we demote
    low_wm: float = 0.85  # ... down to this fraction
    promote_temp: float = 2.0
    demote_temp: float = 0.5
    margin_ratio: float = 0.25
    margin_abs: float = 1.0
    margin_sigma: float = 3.0  # counting-noise margin, in sqrt(temperature) units
    min_residence_s: float = 5.0
    promote_mbps: float = 2048.0  # MiB/s
    demote_mbps: float = 2048.0
    burst_s: float = 1.0  # token bucket depth in seconds of rate
    tenant_dram_quota: Mapping[int, int] = field(default_factory=dict)  # tenant -> bytes
    prefill_done_factor: float = 0.25
    cold_demote: bool = True
    backoff_base_s: float = 1.0
    backoff_max_s: float = 300.0
    unmovable_after: int = 8  # consecutive failures before F_UNMOVABLE

    def __post_init__(self) -> None:
        if not 0.0 < self.low_wm <= self.high_wm:
            raise ConfigError(f"policy: need 0 < low_wm <= high_wm, got {self.low_wm}, {self.high_wm}")
        if self.demote_temp > self.promote_temp:
            raise ConfigError("policy: demote_temp must not exceed promote_temp (hysteresis)")
        if self.promote_mbps <= 0 or self.demote_mbps <= 0:
            raise ConfigError("policy: promote_mbps and demote_mbps must be > 0")
        if min(self.margin_ratio, self.margin_abs, self.margin_sigma, self.min_residence_s) < 0:
            raise ConfigError("policy: margins and min_residence_s must be >= 0")
        if not 0.0 <= self.prefill_done_factor <= 1.0:
            raise ConfigError("policy: prefill_done_factor must be in [0, 1]")
        for t, v in self.capacity.items():
            if v <= 0:
                raise ConfigError(f"policy: capacity of tier {t} must be > 0")

    def target_bytes(self, tier: TierState) -> float:
        v = self.capacity.get(tier.index)
        if v is None:
            return float(tier.capacity_bytes)
        return float(v) * tier.capacity_bytes if v <= 1.0 else float(v)


def _bursts(cfg: PolicyConfig, max_block: float) -> tuple[float, float]:
    # Depth is burst_s of rate but at least one block, so a rate below one
    # block per tick still moves a block every few ticks.
    return (
        max(cfg.promote_mbps * MIB * cfg.burst_s, max_block),
        max(cfg.demote_mbps * MIB * cfg.burst_s, max_block),
    )


@dataclass(frozen=True)
class PolicyState:
    """What the policy carries between ticks: the two token buckets (bytes)."""

    promote_tokens: float | None = None
    demote_tokens: float | None = None
    last_now: float | None = None

    def refill(self, cfg: PolicyConfig, now: float, max_block: float) -> "PolicyState":
        bp, bd = _bursts(cfg, max_block)
        if self.last_now is None or self.promote_tokens is None or self.demote_tokens is None:
            return PolicyState(bp, bd, now)
        dt = max(0.0, now - self.last_now)
        p = min(bp, self.promote_tokens + cfg.promote_mbps * MIB * dt)
        d = min(bd, self.demote_tokens + cfg.demote_mbps * MIB * dt)
        return PolicyState(p, d, max(now, self.last_now))


@dataclass(frozen=True)
class Plan:
    rows: np.ndarray  # int64 BlockTable rows
    src: np.ndarray  # int8 tier now
    dst: np.ndarray  # int8 tier wanted
    reason: np.ndarray  # uint8 code, see REASON_NAMES
    nbytes: np.ndarray  # int64 bytes per move
    bytes_by_direction: dict[tuple[int, int], int]
    names: tuple[str, ...] = REASON_NAMES

    def __len__(self) -> int:
        return int(self.rows.size)

    @property
    def promote_bytes(self) -> int:
        return int(self.nbytes[self.dst < self.src].sum())

    @property
    def demote_bytes(self) -> int:
        return int(self.nbytes[self.dst > self.src].sum())


def empty_plan() -> Plan:
    z = np.zeros(0, dtype=np.int64)
    i8 = np.zeros(0, dtype=np.int8)
    return Plan(z, i8, i8.copy(), np.zeros(0, dtype=np.uint8), z.copy(), {})


def effective_temp(snap: Mapping[str, np.ndarray], cfg: PolicyConfig) -> np.ndarray:
    eff = snap["temp"].astype(np.float64)
    done = (snap["flags"] & F_PREFILL_DONE) != 0
    eff[done] *= cfg.prefill_done_factor
    return eff


class _Builder:
    """Accumulates moves while keeping per-tier usage and tokens current."""

    def __init__(self, snap, ntiers: int, state: PolicyState):
        self.tier = snap["tier"]
        self.nb = snap["nbytes"].astype(np.int64)
        self.moved = np.zeros(self.tier.size, dtype=bool)
        self.dest = np.full(self.tier.size, -1, dtype=np.int64)
        self.parts: list[tuple[np.ndarray, np.ndarray, int]] = []
        known = (self.tier >= 0) & (self.tier < ntiers)
        self.used = np.bincount(self.tier[known], weights=self.nb[known], minlength=ntiers)[:ntiers]
        self.tokens = {"promote": float(state.promote_tokens), "demote": float(state.demote_tokens)}
        self.inflow = np.zeros(ntiers)

    def take(self, rows: np.ndarray, dst, reason: int, limit_bytes: float = math.inf) -> np.ndarray:
        """Plan ``rows`` (in priority order) as far as budget and ``limit_bytes`` allow."""
        if rows.size == 0:
            return rows
        dst = np.broadcast_to(np.asarray(dst, dtype=np.int64), rows.shape)
        src = self.tier[rows].astype(np.int64)
        nb = self.nb[rows]
        cum = np.cumsum(nb)
        up = dst < src
        # Spend each direction's tokens in order; stop at the first row that
        # does not fit so the plan stays a prefix of the priority order.
        ok = np.ones(rows.size, dtype=bool)
        for direction, mask in (("promote", up), ("demote", ~up)):
            if mask.any():
                c = np.cumsum(np.where(mask, nb, 0))
                ok &= ~mask | (c <= self.tokens[direction] + 0.5)
        ok &= cum - nb < limit_bytes  # the row that crosses the limit is included
        k = rows.size if ok.all() else int(np.argmin(ok))
        rows, src, dst, nb = rows[:k], src[:k], dst[:k], nb[:k]
        if k == 0:
            return rows
        self.tokens["promote"] -= float(nb[dst < src].sum())
        self.tokens["demote"] -= float(nb[dst > src].sum())
        n = self.used.size
        self.used -= np.bincount(src, weights=nb, minlength=n)
        arrive = np.bincount(dst, weights=nb, minlength=n)
        self.used += arrive
        self.inflow += arrive
        self.moved[rows] = True
        self.dest[rows] = dst
        self.parts.append((rows, dst, reason))
        return rows

    def in_tier(self, t: int) -> np.ndarray:
        """Rows in tier ``t`` once the moves planned so far are done."""
        return np.where(self.moved, self.dest == t, self.tier == t)

    def budget_rows(self, direction: str, min_nb: int) -> int:
        return int(self.tokens[direction] // max(1, min_nb)) + 1

    def plan(self) -> Plan:
        if not self.parts:
            return empty_plan()
        rows = np.concatenate([p[0] for p in self.parts]).astype(np.int64)
        dst = np.concatenate([p[1] for p in self.parts]).astype(np.int8)
        reason = np.concatenate([np.full(p[0].size, p[2], dtype=np.uint8) for p in self.parts])
        src = self.tier[rows].astype(np.int8)
        nb = self.nb[rows]
        demote = dst > src
        # demotions first, slowest source first; then promotions, fastest dst first
        order = np.lexsort((np.where(demote, 0, dst), np.where(demote, -src.astype(np.int16), 0), ~demote))
        rows, src, dst, reason, nb = rows[order], src[order], dst[order], reason[order], nb[order]
        by_dir: dict[tuple[int, int], int] = {}
        pair = src.astype(np.int64) * 256 + dst.astype(np.int64)
        for p in np.unique(pair):
            by_dir[(int(p // 256), int(p % 256))] = int(nb[pair == p].sum())
        return Plan(rows, src, dst, reason, nb, by_dir)


def _ordered(idx: np.ndarray, key: np.ndarray, k: int, hottest_first: bool) -> np.ndarray:
    """The ``k`` best of ``idx`` by ``key`` in order, without sorting them all."""
    if idx.size == 0:
        return idx
    kk = key[idx] if not hottest_first else -key[idx]
    if k < idx.size:
        part = np.argpartition(kk, k)[:k]
        idx, kk = idx[part], kk[part]
    return idx[np.argsort(kk, kind="stable")]


def _beats(prio_c, eff_c, prio_r, eff_r, cfg: PolicyConfig) -> np.ndarray:
    """Candidate wins the resident's slot: higher priority, or hotter by the margin."""
    return (prio_c > prio_r) | ((prio_c == prio_r) & (eff_c > exchange_bar(eff_r, cfg, eff_c)))


def exchange_bar(eff_r, cfg: PolicyConfig, eff_c=None):
    """Temperature a candidate must exceed to displace a resident at ``eff_r``.

    Temperatures are decayed counts, so they carry counting noise: for a
    steady rate the spread is about sqrt(temp). Comparing the hottest outsider
    with the coldest insider picks the extremes of that noise, so without the
    sigma term two blocks of equal rate would swap places every few ticks.
    """
    c = eff_r if eff_c is None else eff_c
    return eff_r * (1.0 + cfg.margin_ratio) + cfg.margin_abs + cfg.margin_sigma * np.sqrt(np.maximum(eff_r + c, 0.0))


def _group_cumsum(groups: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """Running sum of ``vals`` within each group, in the given order."""
    order = np.argsort(groups, kind="stable")
    g, v = groups[order], vals[order]
    c = np.cumsum(v)
    starts = np.r_[0, np.flatnonzero(np.diff(g)) + 1]
    base = np.repeat(c[starts] - v[starts], np.diff(np.r_[starts, g.size]))
    out = np.empty_like(c)
    out[order] = c - base
    return out


def _swap_tiers(tiers: Sequence[TierState]) -> np.ndarray:
    return np.array([t.kind == "swap" for t in tiers], dtype=bool)


def plan(
    snap: Mapping[str, np.ndarray],
    tiers: Sequence[TierState],
    cfg: PolicyConfig,
    state: PolicyState,
    now: float,
) -> tuple[Plan, PolicyState]:
    """Decide this tick's moves. Pure: ``snap`` and ``state`` are not modified."""
    tiers = sorted(tiers, key=lambda t: t.index)
    T = len(tiers)
    n = int(snap["tier"].size)
    max_block = float(snap["nbytes"].max()) if n else 0.0
    state = state.refill(cfg, now, max_block)
    if n == 0 or T == 0:
        return empty_plan(), state

    tier = snap["tier"].astype(np.int64)
    flags = snap["flags"]
    prio = snap["priority"].astype(np.int64)
    tenant = snap["tenant"]
    eff = effective_temp(snap, cfg)
    key = prio * _PRIO_SCALE + np.minimum(eff, _TEMP_CAP)
    is_swap = _swap_tiers(tiers)
    nonswap = np.flatnonzero(~is_swap)
    slowest_mem = int(nonswap[-1]) if nonswap.size else T - 1

    known = (tier >= 0) & (tier < T)
    actionable = known & ((flags & (F_UNMOVABLE | F_NOT_PRESENT)) == 0) & (snap["retry_at"] <= now)
    pinned = (flags & F_MANUAL_PIN) != 0
    settled = actionable & ~pinned & (now - snap["last_move"] >= cfg.min_residence_s)
    keep = (flags & F_KEEP_DRAM) != 0
    never_swap = (flags & F_NEVER_SWAP) != 0

    b = _Builder(snap, T, state)
    target = np.array([cfg.target_bytes(t) for t in tiers])
    high, low = target * cfg.high_wm, target * cfg.low_wm

    # 1. constraints (residence time does not apply: the operator asked)
    pin_tier = snap["pin_tier"].astype(np.int64)
    want_pin = actionable & pinned & (pin_tier >= 0) & (pin_tier < T) & (pin_tier != tier)
    rows = np.flatnonzero(want_pin)
    b.take(rows, pin_tier[rows], R_PIN)
    want_keep = actionable & ~pinned & keep & (tier > 0) & ~b.moved
    b.take(np.flatnonzero(want_keep), 0, R_KEEP_DRAM)
    if is_swap.any():
        want_ns = actionable & ~pinned & never_swap & is_swap[np.clip(tier, 0, T - 1)] & known & ~b.moved
        b.take(np.flatnonzero(want_ns), slowest_mem, R_NEVER_SWAP)

    def demotable(t: int) -> np.ndarray:
        m = settled & (tier == t) & ~b.moved
        if t == 0:
            m &= ~keep
        if is_swap[t + 1]:
            m &= ~never_swap
        return m

    # 2. tenant DRAM quotas
    if T > 1 and cfg.tenant_dram_quota:
        in0 = b.in_tier(0)  # after the constraint moves
        for ten, quota in cfg.tenant_dram_quota.items():
            over = float(b.nb[in0 & (tenant == ten)].sum()) - float(quota)
            if over > 0:
                cand = np.flatnonzero(demotable(0) & (tenant == ten))
                k = min(b.budget_rows("demote", 1 if cand.size == 0 else int(b.nb[cand].min())), cand.size)
                b.take(_ordered(cand, key, k, hottest_first=False), 1, R_QUOTA, over)

    # 3. per tier, fastest first
    for t in range(T - 1):
        # a. watermarks
        if b.used[t] > low[t]:
            need = b.used[t] - low[t]
            m = demotable(t)
            if b.used[t] <= high[t]:
                if not cfg.cold_demote:
                    m[:] = False
                m &= eff < cfg.demote_temp
                reason = R_COLD
            else:
                reason = R_OVERFLOW
            cand = np.flatnonzero(m)
            floor = -np.inf
            if cand.size:
                k = min(b.budget_rows("demote", int(b.nb[cand].min())), cand.size)
                gone = b.take(_ordered(cand, key, k, hottest_first=False), t + 1, reason, need)
                if gone.size:
                    floor = float(key[gone].max())
        else:
            floor = -np.inf

        # b. promotion into t from every slower tier
        # Only blocks that rank above everything just demoted from t: the
        # demotion made room for new allocations, not for colder blocks.
        cand_m = settled & ~b.moved & known & (tier > t) & (eff >= cfg.promote_temp) & (key > floor)
        if never_swap.any() and is_swap[t]:
            cand_m &= ~never_swap
        cand = np.flatnonzero(cand_m)
        if cand.size == 0:
            continue
        k = min(b.budget_rows("promote", int(b.nb[cand].min())), cand.size)
        cand = _ordered(cand, key, k, hottest_first=True)
        if t == 0 and cfg.tenant_dram_quota:
            cand = _within_quota(cand, b, tenant, cfg.tenant_dram_quota)
        room = max(0.0, high[t] - b.used[t])
        free = tiers[t].free_bytes
        if free is not None:
            # what the node has free, minus what this plan already sends there
            room = min(room, max(0.0, float(free) - b.inflow[t]))
        res = np.flatnonzero(demotable(t))
        kr = min(b.budget_rows("demote", int(b.nb[res].min())) if res.size else 0, res.size)
        res = _ordered(res, key, kr, hottest_first=False)
        cum_c = np.cumsum(b.nb[cand])
        fits = cum_c <= room
        ok = fits.copy()
        if res.size and not fits.all():
            cum_r = np.cumsum(b.nb[res])
            j = np.searchsorted(cum_r, cum_c - room, side="left")
            jj = np.minimum(j, res.size - 1)
            ok |= (j < res.size) & _beats(prio[cand], eff[cand], prio[res[jj]], eff[res[jj]], cfg)
        k = cand.size if ok.all() else int(np.argmin(ok))
        if k == 0:
            continue
        cand = cand[:k]
        # evict exactly the residents the admitted candidates need, then promote
        over = float(cum_c[k - 1]) - room
        if over > 0 and res.size:
            cum_r = np.cumsum(b.nb[res])
            nev = int(np.searchsorted(cum_r, over, side="left")) + 1
            ev = b.take(res[:nev], t + 1, R_EVICT)
            freed = float(b.nb[ev].sum())
            if ev.size < nev:  # demote budget ran out: admit only what fits
                cand = cand[cum_c[:k] <= room + freed]
        b.take(cand, t, R_PROMOTE, math.inf)

    return b.plan(), replace(
        state, promote_tokens=max(0.0, b.tokens["promote"]), demote_tokens=max(0.0, b.tokens["demote"])
    )


def _within_quota(cand, b: _Builder, tenant, quotas: Mapping[int, int]) -> np.ndarray:
    """Drop candidates that would take their tenant past its DRAM quota."""
    ten = tenant[cand].astype(np.int64)
    q = np.array([quotas.get(int(x), np.inf) for x in np.unique(ten)])
    uniq = np.unique(ten)
    in0 = b.in_tier(0)
    used0 = np.array([float(b.nb[in0 & (tenant == x)].sum()) for x in uniq])
    pos = np.searchsorted(uniq, ten)
    ok = used0[pos] + _group_cumsum(ten, b.nb[cand].astype(np.float64)) <= q[pos]
    return cand[ok]


def refund(state: PolicyState, plan_: Plan, ok_mask: np.ndarray, cfg: PolicyConfig) -> PolicyState:
    """Give back the tokens of moves that failed, so failures do not eat the budget."""
    if state.promote_tokens is None or state.demote_tokens is None or len(plan_) == 0:
        return state
    bad = ~np.asarray(ok_mask, dtype=bool)
    up = plan_.dst < plan_.src
    bp, bd = _bursts(cfg, float(plan_.nbytes.max()))
    return replace(
        state,
        promote_tokens=min(bp, state.promote_tokens + float(plan_.nbytes[bad & up].sum())),
        demote_tokens=min(bd, state.demote_tokens + float(plan_.nbytes[bad & ~up].sum())),
    )


def _field(table, name: str) -> np.ndarray:
    return table[name] if isinstance(table, Mapping) else getattr(table, name)


def record_results(
    table,
    rows: np.ndarray,
    ok_mask: np.ndarray,
    unmovable_mask: np.ndarray,
    now: float,
    cfg: PolicyConfig,
    dst: np.ndarray | None = None,
) -> None:
    """Write the migrator's outcome back into a BlockTable (or snapshot dict).

    Moved rows get ``tier=dst`` (when given), ``last_move=now`` and their
    failure count cleared. Failed rows are retried after
    ``backoff_base_s * 2**(fail_count-1)`` (capped at ``backoff_max_s``); rows
    the kernel reported pinned, or that failed ``unmovable_after`` times in a
    row, get ``F_UNMOVABLE`` and are never planned again.
    """
    rows = np.asarray(rows, dtype=np.int64)
    ok = np.asarray(ok_mask, dtype=bool)
    unmov = np.asarray(unmovable_mask, dtype=bool)
    tier, last_move = _field(table, "tier"), _field(table, "last_move")
    retry_at, fail_count, flags = _field(table, "retry_at"), _field(table, "fail_count"), _field(table, "flags")
    good = rows[ok]
    if dst is not None:
        tier[good] = np.asarray(dst, dtype=np.int8)[ok]
    last_move[good] = now
    fail_count[good] = 0
    retry_at[good] = -np.inf
    bad = rows[~ok]
    if bad.size:
        fc = np.minimum(fail_count[bad].astype(np.int64) + 1, np.iinfo(np.uint16).max)
        fail_count[bad] = fc
        delay = np.minimum(cfg.backoff_max_s, cfg.backoff_base_s * np.exp2(np.minimum(fc - 1, 62)))
        retry_at[bad] = now + delay
        stuck = unmov[~ok] | (fc >= cfg.unmovable_after)
        flags[bad[stuck]] |= np.uint8(F_UNMOVABLE)


def _flag_names(f: int) -> list[str]:
    names = [
        (F_UNMOVABLE, "UNMOVABLE"),
        (F_KEEP_DRAM, "KEEP_DRAM"),
        (F_NEVER_SWAP, "NEVER_SWAP"),
        (F_PREFILL_DONE, "PREFILL_DONE"),
        (F_MANUAL_PIN, "MANUAL_PIN"),
        (F_NOT_PRESENT, "NOT_PRESENT"),
    ]
    return [s for bit, s in names if f & bit]


def explain(
    snap: Mapping[str, np.ndarray],
    row: int,
    tiers: Sequence[TierState],
    cfg: PolicyConfig,
    state: PolicyState,
    now: float,
) -> str:
    """Human-readable account of where block ``row`` is and what the policy would do."""
    tiers = sorted(tiers, key=lambda t: t.index)
    T = len(tiers)
    n = int(snap["tier"].size)
    if not 0 <= row < n:
        return f"row {row}: no such block (table has {n})"
    t = int(snap["tier"][row])
    f = int(snap["flags"][row])
    eff = float(effective_temp({k: snap[k][row : row + 1] for k in ("temp", "flags")}, cfg)[0])
    tname = tiers[t].name if 0 <= t < T else ("unknown" if t == TIER_UNKNOWN else "mixed")
    out = [
        f"block row {row}: region {int(snap['region'][row])} index {int(snap['index'][row])}, "
        f"{int(snap['nbytes'][row])} bytes, tenant {int(snap['tenant'][row])}, priority {int(snap['priority'][row])}",
        f"tier: {t} ({tname})",
        f"temperature {float(snap['temp'][row]):.3g}, effective {eff:.3g}"
        + (f" (prefill done: x{cfg.prefill_done_factor})" if f & F_PREFILL_DONE else "")
        + f"; promote at >= {cfg.promote_temp}, cold below {cfg.demote_temp}",
        "flags: " + (", ".join(_flag_names(f)) or "none"),
    ]
    reasons = []
    if not 0 <= t < T:
        reasons.append("placement not measured yet (or pages straddle tiers): never planned until measured")
    if f & F_UNMOVABLE:
        reasons.append("kernel cannot move its pages (pinned): skipped for good")
    if f & F_NOT_PRESENT:
        reasons.append("no page touched yet: nothing to move")
    ra = float(snap["retry_at"][row])
    if ra > now:
        reasons.append(f"last move failed {int(snap['fail_count'][row])} time(s): retry in {ra - now:.1f}s")
    if f & F_MANUAL_PIN:
        pt = int(snap["pin_tier"][row])
        reasons.append(f"manually pinned to tier {pt if pt >= 0 else t}")
    since = now - float(snap["last_move"][row])
    if since < cfg.min_residence_s:
        reasons.append(f"moved {since:.1f}s ago: stays at least {cfg.min_residence_s}s")
    if 0 <= t < T:
        tgt = cfg.target_bytes(tiers[t])
        known = snap["tier"] == t
        used = float(snap["nbytes"][known].sum())
        out.append(
            f"tier {t} usage {used / MIB:.0f} MiB of target {tgt / MIB:.0f} MiB "
            f"(low {cfg.low_wm * tgt / MIB:.0f}, high {cfg.high_wm * tgt / MIB:.0f})"
        )
        if t > 0:
            faster = (snap["tier"] == t - 1) & ((snap["flags"] & (F_UNMOVABLE | F_MANUAL_PIN)) == 0)
            if faster.any():
                e = effective_temp({k: snap[k][faster] for k in ("temp", "flags")}, cfg)
                cold = float(e.min())
                out.append(
                    f"coldest block in tier {t - 1}: {cold:.3g}; displacing it needs > "
                    f"{float(exchange_bar(cold, cfg, eff)):.3g}"
                )
    p, _ = plan(snap, tiers, cfg, state, now)
    hit = np.flatnonzero(p.rows == row)
    if hit.size:
        i = int(hit[0])
        out.append(f"plan: move tier {int(p.src[i])} -> {int(p.dst[i])} ({REASON_NAMES[int(p.reason[i])]})")
    else:
        out.append("plan: stay" + (" — " + "; ".join(reasons) if reasons else ""))
    return "\n".join(out)
