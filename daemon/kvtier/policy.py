"""The tiering policy: a pure function from block state to a migration plan.

``plan(snap, tiers, cfg, state, now)`` reads a ``BlockTable.snapshot()`` (or
any dict of the same arrays), the tier capacities and the config, and returns
the moves to make plus the new ``PolicyState``. It does no I/O and imports no
adapter: the daemon and the simulator (``kvtier.sim``) run this same code.

Control law (one call = one tick)
---------------------------------
Temperatures come from ``kvtier.hotness`` (exponentially decayed access
counts that drop to 0 when a block's run of reads ends: a client's phase
``free``, or a silence its read rate makes improbable); the policy ranks by
``hotness.rate_temp``, which corrects a block that has only just started
being read (a new prompt's, a new decode block) to the rate it is read at.
The policy ranks blocks by (region priority, effective temperature, then
recency: equal temperatures go oldest-read first); a block whose prefill is
done (``F_PREFILL_DONE``) counts only ``prefill_done_factor`` of its
temperature. Each step is one function (``_step_*``) and records, for the
blocks it looked at and left alone, the rule that decided (``Plan.stay``,
``STAY_NAMES``): ``explain`` prints that record.

1. ``_step_constraints``: blocks that must be elsewhere (``F_KEEP_DRAM``
   outside tier 0, ``F_MANUAL_PIN`` with a ``pin_tier`` they are not in,
   ``F_NEVER_SWAP`` in a swap tier) move there regardless of temperature.
2. ``_step_quotas``: a tenant above its DRAM quota has its coldest tier-0
   blocks demoted until it is back within quota.
3. For each tier t, fastest first:
   a. ``_step_overflow``: above what the tier may be filled to (``fill``:
      the high watermark; for DRAM, where new blocks land, at most the
      target less the room the next ``burst_s`` of allocations needs,
      ``PolicyState.headroom``) the coldest residents are demoted one tier
      down until usage is back under it (never below the low watermark; the
      cold ones below that go in step c). What lands on t+1 may push t+1
      over its own high watermark; it is handled in t+1's turn (the cascade).
   b. ``_step_promote``: blocks in slower tiers at least ``promote_temp`` hot
      and hotter than anything step a just demoted from t (that room was made
      for new allocations, not for colder blocks), hottest first. They fill
      the free room below ``fill`` (and within the node's
      ``free_bytes``); beyond that a candidate may only displace the coldest
      resident of t if it is hotter by the margin (``temp > coldest *
      (1+margin_ratio) + margin_abs + margin_sigma*sqrt(temp+coldest)``, see
      ``exchange_bar``) or has higher priority; the displaced resident goes
      to t+1. Tier 0 admits a tenant's blocks only within its quota. Hottest
      candidates meet the coldest residents first, so the exchange stops at
      the first pair that fails the margin test. While DRAM is still
      filling at a rate, net of discarded blocks, that the migrator cannot
      match and that fills its free room within BACKLOG_TAU_S, that room
      is the new blocks' (``promote_limit``): promotions come in by
      exchange only.
   c. ``_step_cold``: between the watermarks, blocks colder than
      ``demote_temp`` are demoted down to the low watermark: headroom for new
      allocations without evicting anything in use. Every cold block goes,
      not just down to the watermark, only when DRAM would otherwise be full
      while the migrator has no time to make room (``_dram_fills``): a burst
      faster than ``demote_mbps`` that DRAM's free room would not hold, or a
      load that has outrun the migrator on the whole for minutes at an
      excess that fills that room within ``FILL_HORIZON_S``.
4. ``_step_ended`` (DRAM, last in the plan): when allocations have come
   faster than the migrator could make room for them as they came
   (``PolicyState.backlog_peak``, a queue of the inflow drained at
   ``demote_mbps`` or the mean inflow), DRAM keeps that much room free (at
   most ``BACKLOG_ROOM_MAX`` of it), made from blocks whose run of reads is over, least likely to be reused
   first, below the low watermark if need be; promotions do not fill that
   room. A new block that
   finds DRAM full is read from CXL by every decode step of its request
   while the migrator is too busy to promote it; a finished block demoted
   in a quiet second costs one move the migrator had to spare.

New blocks land in DRAM (first touch) at the serving engine's allocation
rate, so the demotion side must keep up with it: ``PolicyState`` measures the
inflow (growth of the bytes in measured tiers, which moves do not change) and
the demote bucket refills at ``max(demote_mbps, 1.5 x inflow)``; the promote
bucket at ``max(promote_mbps, inflow)``. A fixed rate below the write rate
would let DRAM fill and every new block land on CXL.

No ping-pong: ``promote_temp > demote_temp`` (hysteresis), the exchange margin,
no demotion within ``min_residence_s`` of a block's last move (promotions
are not held back by it: a block read again is worth its move), no demotion of a block whose
run of reads has only just started (``STARTING_FRESH``: a block just written,
whose rate its one write cannot tell), and at most one move per block per
plan. Migration bandwidth is a token bucket per direction (promote/demote)
held in ``PolicyState``; each plan spends tokens and stops when they run out
(``refund`` gives back what failed or was not done).
Blocks the kernel could not move are skipped until ``retry_at``
(``record_results`` sets it with exponential backoff) or forever once marked
``F_UNMOVABLE``, so failures neither eat the budget every tick nor spin.
Blocks whose tier is not measured (``TIER_UNKNOWN``) or straddles tiers
(``TIER_MIXED``) are never planned; the migrator measures them first.

Plan order: demotions first (slowest source tier first, so each one lands in
room the one before made), then promotions (fastest destination first), then
the proactive cold demotions of step c: a migrator short of time drops those
first.
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
    STUCK_DECLARED,
    STUCK_NAMES,
    STUCK_NONE,
    STUCK_FAILING,
    STUCK_PINNED,
    STUCK_TEXT,
    TIER_UNKNOWN,
)
from .errors import ConfigError
from .hotness import rate_temp, reuse_score

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

# Why a block stays where it is; Plan.stay[row] holds the code of the rule
# that decided it, STAY_NAMES[code] its label, STAY_TEXT[code] a sentence.
S_PLACED = 0  # nothing asks it to move (hot where it is, or cold and below)
S_THRESHOLD = 1  # in a slower tier, colder than promote_temp
S_WATERMARK = 2  # demotion stopped at the low watermark / room kept for allocations
S_MARGIN = 3  # not hotter than the coldest resident by the exchange margin
S_RESIDENCE = 4  # moved less than min_residence_s ago
S_RATE_LIMIT = 5  # a candidate, but the token bucket ran out first
S_BACKOFF = 6  # a move failed; waiting for retry_at
S_PIN = 7  # manually pinned where it is
S_UNMOVABLE = 8  # the kernel cannot move its pages
S_QUOTA = 9  # its tenant is at its DRAM quota
S_KEEP_DRAM = 10  # keep_dram constraint holds it in DRAM
S_NOT_PRESENT = 11  # no page touched yet
S_UNMEASURED = 12  # placement not measured (or straddles tiers)
S_STARTING = 13  # its run of reads has only just started: no rate to rank it by yet
STAY_NAMES = ("placed", "threshold", "watermark", "margin", "residence", "rate_limit", "backoff", "pin",
              "unmovable", "quota", "keep_dram", "not_present", "unmeasured", "starting")
STAY_TEXT = (
    "nothing asks it to move",
    "colder than promote_temp",
    "watermark: the tier is at or below its low watermark, or this room was made for new allocations",
    "margin: not hotter than the block it would displace by the exchange margin",
    "residence: moved less than min_residence_s ago",
    "rate limit: the migration token bucket ran out",
    "backoff: its last move failed, waiting to retry",
    "pin: manually pinned",
    "unmovable: the kernel cannot move its pages",
    "quota: its tenant is at its DRAM quota",
    "keep_dram: the region's constraint holds it in DRAM",
    "no page touched yet: nothing to move",
    "placement not measured yet (or pages straddle tiers): never planned until measured",
    "starting: its run of reads has only just started (a block just written), too few reads to rank it; "
    "not demoted until they count",
)

TIER_KINDS = ("dram", "far", "cxl", "swap")

# Composite sort key = priority * _PRIO_SCALE + effective temperature; the
# exact comparisons use the two parts separately, this only orders.
_PRIO_SCALE = 1e12
_TEMP_CAP = 1e11
_AGE_SPAN_S = 86400.0
_AGE_TIE = 1e-12
_REUSE_TIE = 1e-6
# A run of reads younger than half a tau (hotness: ``fresh`` = exp(-age/tau),
# a run counted as one interval old at its first read) is not demoted: its
# rate estimate stands on a read or two. What starts a run is mostly a block
# just written (a new prompt's blocks, the block decode just opened), which
# every following decode step reads; ranked by its one write it looked
# colder than a block read once a second, and was the one demoted. In the
# demo guest (a plan log, 60 s, 1 s ticks, tau 5 s) 21 of 100 demotions
# were blocks written 0.03-0.3 s before; every decode step then read them
# from the far node, and 9 came back within 10 s (after min_residence_s).
# Half a tau is the plan after the write (fresh 0.82 at the first read,
# 0.67 at the tick after it; 0.55, demotable, a tick later).
STARTING_FRESH = math.exp(-0.5)


@dataclass(frozen=True)
class TierState:
    """One tier as the policy sees it.

    ``capacity_bytes`` is what kvtier may use in the tier (its target before
    the config's fraction); ``free_bytes`` is the memory actually free on the
    tier's nodes (None = unknown): promotions never plan more than that.
    ``arriving_bytes``: moves into the tier sent and not yet answered (an
    engine-mode region's owner executes them), whose blocks the table still
    counts in their source tier; the plan counts them here already.
    """

    index: int
    name: str
    kind: str
    capacity_bytes: int
    used_bytes: int = 0
    free_bytes: int | None = None
    arriving_bytes: int = 0


@dataclass(frozen=True)
class PolicyConfig:
    # tier index -> capacity target: a fraction (<= 1.0) of TierState.capacity_bytes
    # or a byte count (> 1). Missing tiers use their whole capacity_bytes.
    capacity: Mapping[int, float] = field(default_factory=dict)
    high_wm: float = 0.98  # fraction of the target above which we demote (DRAM: less the allocations' room)
    low_wm: float = 0.85  # ... down to this fraction
    promote_temp: float = 2.0
    demote_temp: float = 0.5
    margin_ratio: float = 0.25
    margin_abs: float = 1.0
    margin_sigma: float = 3.0  # counting-noise margin, in sqrt(temperature) units
    min_residence_s: float = 2.0
    promote_mbps: float = 4096.0  # MiB/s
    demote_mbps: float = 4096.0
    burst_s: float = 1.0  # token bucket depth in seconds of rate
    tenant_dram_quota: Mapping[int, int] = field(default_factory=dict)  # tenant -> bytes
    prefill_done_factor: float = 0.25
    cold_demote: bool = True
    backoff_base_s: float = 1.0
    backoff_max_s: float = 300.0
    unmovable_after: int = 8  # consecutive failures before F_UNMOVABLE
    unmovable_reprobe_s: float = 600.0  # an unmovable block is tried again after this long
    # A block found back in memory this soon after its pageout came straight
    # back (its reader faulted it in): it is not paged out again for
    # return_backoff_s, doubling per return in a row (up to backoff_max_s).
    return_window_s: float = 5.0
    return_backoff_s: float = 30.0

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


# Time constant of the allocation-rate estimate: long enough to ride over a
# burst of arrivals, short enough to follow the load within a minute.
INFLOW_TAU_S = 10.0
_DEMOTE_FACTOR = 1.5
# Room kept in DRAM for allocations: mean + this many standard deviations of
# the allocation rate (about 98 % of ticks, were it normal).
HEADROOM_SIGMAS = 2.0
_PROMOTE_FACTOR = 1.0
# How long the policy remembers a backlog of allocations (PolicyState.backlog_peak).
# (kvtier-sim: 60 s to 1200 s within 0.4 point on every slice tried.)
BACKLOG_TAU_S = 300.0
# At most this share of DRAM is kept free for a backlog of allocations
# (PolicyState.backlog_room). The room is a bet that the next burst's new
# blocks, each read by every decode step of its request, are worth more
# than what could sit there until then; when the backlog is DRAM's size
# or more, the bet is all of DRAM, held empty or emptied, against blocks
# of the running requests that are just as hot. kvtier-sim, Mooncake
# synthetic with 16-token blocks of 2 MiB (llama-3-8b, 1,000 requests,
# DRAM 21 GiB at 25 %): backlog peaks of 9-31 GiB kept promotions out and
# DRAM 7-16 GiB full, 0.6770 against LRU's 0.7579; capped at a tenth,
# 0.7585. The 15-cell grid did not move in the 4th digit (its backlogs
# are 2-14 % of DRAM); 0.25 recovered only part (0.7401). Not capped where
# DRAM fills for good (backlog_room).
BACKLOG_ROOM_MAX = 0.1
# How far ahead _step_cold looks for DRAM filling up at the sustained excess
# of allocations over the migrator (_dram_fills): the time over which a
# serving load's mean rate is taken to hold (traffic moves over hours).
FILL_HORIZON_S = 3600.0


def _bursts(cfg: PolicyConfig, max_block: float, inflow_bps: float = 0.0) -> tuple[float, float]:
    # Depth is burst_s of rate but at least one block, so a rate below one
    # block per tick still moves a block every few ticks.
    return (
        max(_promote_rate(cfg, inflow_bps) * cfg.burst_s, max_block),
        max(_demote_rate(cfg, inflow_bps) * cfg.burst_s, max_block),
    )


def _promote_rate(cfg: PolicyConfig, inflow_bps: float) -> float:
    return max(cfg.promote_mbps * MIB, _PROMOTE_FACTOR * inflow_bps)


def _demote_rate(cfg: PolicyConfig, inflow_bps: float) -> float:
    """Bytes/s the demote bucket refills at: the configured rate, or twice the
    allocation rate if that is more, so room lost to a burst of allocations
    comes back as fast as it went."""
    return max(cfg.demote_mbps * MIB, _DEMOTE_FACTOR * inflow_bps)


@dataclass(frozen=True)
class PolicyState:
    """What the policy carries between ticks: the two token buckets (bytes),
    and the rate at which new bytes appear in the fastest tier.

    New blocks land in DRAM (first touch) at the serving engine's allocation
    rate; to keep room for them the demotion side must move at least that
    fast, so the demote bucket refills at ``max(demote_mbps, 1.5 * inflow)``.
    The inflow is what the measured tiers together gained since the last plan
    (moves do not change the total; new blocks do, wherever they landed: a
    full DRAM sends them to CXL, and they must still count), the blocks
    discarded meanwhile added back (``plan``'s ``dropped``), averaged over
    ``INFLOW_TAU_S``.
    """

    promote_tokens: float | None = None
    demote_tokens: float | None = None
    last_now: float | None = None
    last_total: float | None = None  # bytes in measured tiers at the last plan
    inflow_bps: float = 0.0
    inflow_var: float = 0.0  # variance of the per-plan inflow rate (same average)
    # Allocations the migrator could not have made room for as they came: a
    # queue fed by the inflow and drained at demote_mbps, or at the mean
    # inflow if that is more (Lindley's recursion), and its recent peak
    # (decays over BACKLOG_TAU_S). Where allocations outrun the migrator for
    # good (kvtier-sim, 70B-class KV: 7-8 GiB/s against 4) a queue drained
    # at demote_mbps only grows, until it claimed all of DRAM and no
    # promotion had room (synthetic 70B 10 %: 0.509 -> 0.475); there DRAM
    # is full whatever one does, and only the bursts above the mean find it
    # so a tick early.
    backlog: float = 0.0
    backlog_peak: float = 0.0
    total_at: float | None = None  # when last_total was counted (refills between plans count none)
    # The allocation rate averaged over BACKLOG_TAU_S, and the weight that
    # average has gathered (so it is the mean from the first plans on, not
    # biased to 0): the sustained rate, where inflow_bps follows bursts.
    inflow_slow: float = 0.0
    inflow_slow_w: float = 0.0
    # The same mean of the net rate, new bytes less those discarded (bytes in
    # the measured tiers, ``net``), and the net total at the last count: how
    # fast DRAM fills for good, where decode blocks freed at a request's end
    # never need a move (_fills_for_good).
    net_slow: float = 0.0
    last_net: float | None = None

    def refill(self, cfg: PolicyConfig, now: float, max_block: float, total: float | None = None,
               net: float | None = None) -> "PolicyState":
        """Tokens for the time since the last refill; with ``total`` (bytes
        in the measured tiers, what the plan counts) also the allocation
        rate and backlog since the last counted total. A refill between
        plans (the engine's scheduled moves) passes no total: taken as 0,
        it made every prefetch look like a whole table of new allocations
        (a 256 MiB backlog that kept promotions out of DRAM for minutes)."""
        if self.last_now is None or self.promote_tokens is None or self.demote_tokens is None:
            bp, bd = _bursts(cfg, max_block)
            return PolicyState(bp, bd, now, total, 0.0, total_at=None if total is None else now,
                               last_net=net if total is not None else None)
        dt = max(0.0, now - self.last_now)
        inflow, var = self.inflow_bps, self.inflow_var
        backlog, peak = self.backlog, self.backlog_peak
        slow, slow_w = self.inflow_slow, self.inflow_slow_w
        net_slow, last_net = self.net_slow, self.last_net
        last_total, total_at = self.last_total, self.total_at
        if total is not None and last_total is None:
            last_total, total_at = total, now  # the first count: a rate from the next one on
            last_net = net
        elif total is not None:
            # seconds since that count (older state files have none: since the last refill)
            dtt = max(0.0, now - (total_at if total_at is not None else self.last_now))
            if dtt > 0:
                grown = max(0.0, total - last_total)
                inflow, var, backlog, peak = self._inflow(cfg, grown, dtt)
                a = 1.0 - math.exp(-dtt / BACKLOG_TAU_S)
                slow, slow_w = slow + a * (grown / dtt - slow), slow_w + a * (1.0 - slow_w)
                if net is not None and last_net is not None:
                    net_slow += a * ((net - last_net) / dtt - net_slow)
                last_total, total_at, last_net = total, now, net
        bp, bd = _bursts(cfg, max_block, inflow)
        p = min(bp, self.promote_tokens + _promote_rate(cfg, inflow) * dt)
        d = min(bd, self.demote_tokens + _demote_rate(cfg, inflow) * dt)
        return PolicyState(p, d, max(now, self.last_now), last_total, inflow, var, backlog, peak, total_at,
                           slow, slow_w, net_slow, last_net)

    @property
    def sustained_net_inflow(self) -> float:
        """The net allocation rate's mean over about BACKLOG_TAU_S (bytes/s):
        new bytes less discarded ones, negative while more are freed."""
        return self.net_slow / self.inflow_slow_w if self.inflow_slow_w > 0 else 0.0

    @property
    def sustained_inflow(self) -> float:
        """The allocation rate's mean over about BACKLOG_TAU_S (bytes/s)."""
        return self.inflow_slow / self.inflow_slow_w if self.inflow_slow_w > 0 else 0.0

    def _inflow(self, cfg: PolicyConfig, grown: float, dt: float) -> tuple[float, float, float, float]:
        """The allocation rate's average and variance, the backlog and its
        peak after ``grown`` new bytes in ``dt`` seconds."""
        inflow, var = self.inflow_bps, self.inflow_var
        seen = grown / dt
        a = 1.0 - math.exp(-dt / INFLOW_TAU_S)
        d0 = seen - inflow
        inflow += a * d0
        var = (1.0 - a) * (var + a * d0 * d0)
        backlog = max(0.0, self.backlog + grown - max(cfg.demote_mbps * MIB, inflow) * dt)
        peak = max(backlog, self.backlog_peak * math.exp(-dt / BACKLOG_TAU_S))
        if peak < MIB:  # forgotten
            peak = 0.0
        return inflow, var, backlog, peak

    def backlog_room(self, target: float, cfg: "PolicyConfig") -> float:
        """Room DRAM (``target`` bytes) keeps free for the backlog of
        allocations: its recent peak, at most BACKLOG_ROOM_MAX of DRAM. Not
        capped where allocations net of discards outrun ``demote_mbps``
        (DRAM fills for good): there a block let into that room is demoted
        again when every demotion is room for a new block, and the cap only
        moved the loss (kvtier-sim cell 11 of docs/benchmarks.md, DRAM 5 %:
        0.8264 capped, 0.8370 not; the cap is for bursts of blocks freed
        as fast as written, cell 73)."""
        if self.sustained_net_inflow > cfg.demote_mbps * MIB:
            return min(self.backlog_peak, target)
        return min(self.backlog_peak, BACKLOG_ROOM_MAX * target)

    def headroom(self, cfg: "PolicyConfig") -> float:
        """Bytes of room the fastest tier needs for the next ``burst_s`` of
        allocations: the measured rate, plus HEADROOM_SIGMAS standard
        deviations of it while there is a backlog (arrivals come in bursts; a
        block that finds DRAM full lands on CXL and is read from there until
        promoted)."""
        # The margin above the mean only while allocations outrun the
        # migrator (a backlog): then a block that finds DRAM full stays on
        # CXL. When the migrator keeps up, it is promoted at the next tick,
        # the same one tick of CXL reads the margin would cost an idle block
        # demoted for it and read again (chat preset: 0.961 -> 0.964).
        hs = HEADROOM_SIGMAS if self.backlog_peak > 0 else 0.0
        return (self.inflow_bps + hs * math.sqrt(max(self.inflow_var, 0.0))) * cfg.burst_s


@dataclass(frozen=True)
class Plan:
    rows: np.ndarray  # int64 BlockTable rows
    src: np.ndarray  # int8 tier now
    dst: np.ndarray  # int8 tier wanted
    reason: np.ndarray  # uint8 code, see REASON_NAMES
    nbytes: np.ndarray  # int64 bytes per move
    bytes_by_direction: dict[tuple[int, int], int]
    names: tuple[str, ...] = REASON_NAMES
    stay: np.ndarray | None = None  # uint8 per snapshot row: S_* code of why it is not moved

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
    """What the policy ranks by: the read rate estimate (``hotness.rate_temp``,
    so a block just written ranks by the rate it is read at, not by how
    little it has been read so far), scaled by ``prefill_done_factor`` once
    its prefill is done."""
    eff = rate_temp(snap["temp"], snap["fresh"]) if "fresh" in snap else snap["temp"].astype(np.float64)
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
        self.parts: list[tuple[np.ndarray, np.ndarray, int, bool]] = []
        known = (self.tier >= 0) & (self.tier < ntiers)
        self.used = np.bincount(self.tier[known], weights=self.nb[known], minlength=ntiers)[:ntiers]
        self.tokens = {"promote": float(state.promote_tokens), "demote": float(state.demote_tokens)}
        self.inflow = np.zeros(ntiers)
        self.late_out = np.zeros(ntiers)

    def take(self, rows: np.ndarray, dst, reason: int, limit_bytes: float = math.inf, late: bool = False) -> np.ndarray:
        """Plan ``rows`` (in priority order) as far as budget and ``limit_bytes`` allow.
        ``late`` moves are executed after the promotions (proactive work a
        migrator short of time should drop first)."""
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
        self.parts.append((rows, dst, reason, late))
        if late:  # not there yet when the promotions run: their room must not count it
            self.late_out += np.bincount(src, weights=nb, minlength=n)
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
        late = np.concatenate([np.full(p[0].size, p[3]) for p in self.parts])
        src = self.tier[rows].astype(np.int8)
        nb = self.nb[rows]
        demote = dst > src
        # Demotions first, slowest source first (each lands in room the one
        # before made); then promotions, fastest destination first; proactive
        # cold demotions last, so a migrator short of time drops them first.
        group = np.where(late, 2, np.where(demote, 0, 1))
        order = np.lexsort((np.where(demote, 0, dst), np.where(demote, -src.astype(np.int16), 0), group))
        rows, src, dst, reason, nb = rows[order], src[order], dst[order], reason[order], nb[order]
        by_dir: dict[tuple[int, int], int] = {}
        pair = src.astype(np.int64) * 256 + dst.astype(np.int64)
        for p in np.unique(pair):
            by_dir[(int(p // 256), int(p % 256))] = int(nb[pair == p].sum())
        return Plan(rows, src, dst, reason, nb, by_dir)


def _ordered(idx: np.ndarray, key: np.ndarray, k: int, hottest_first: bool) -> np.ndarray:
    """The ``k`` best of ``idx`` by ``key`` in order, without sorting them all.

    Equal keys (blocks nothing tells apart: present, never read) go by row:
    a demotion takes the highest rows first, a promotion the lowest. A
    pool's allocator hands its blocks out from the start (vLLM's free block
    queue, SGLang's free slots), so the blocks at a region's end are the
    last it writes; the first plan after a registration, made before any
    hint, paged out the lowest (argpartition's pick among ties), the very
    blocks the first requests then wrote and read back."""
    if idx.size == 0 or k <= 0:
        return idx[:0]
    kk = key[idx] if not hottest_first else -key[idx]
    if k < idx.size:
        thr = kk[np.argpartition(kk, k)[:k]].max()
        below = np.flatnonzero(kk < thr)
        tied = np.flatnonzero(kk == thr)
        need = k - below.size  # >= 1: thr is one of the k
        if need < tied.size:  # the lowest rows (promotion) or the highest (demotion), without a sort
            rows_t = idx[tied] if hottest_first else -idx[tied]
            tied = tied[np.argpartition(rows_t, need - 1)[:need]]
        sel = np.concatenate([below, tied])
        idx, kk = idx[sel], kk[sel]
    return idx[np.lexsort((idx if hottest_first else -idx, kk))]


def _beats(prio_c, eff_c, prio_r, eff_r, cfg: PolicyConfig) -> np.ndarray:
    """Candidate wins the resident's slot: higher priority, or hotter by the margin."""
    return (prio_c > prio_r) | ((prio_c == prio_r) & (eff_c > exchange_bar(eff_r, cfg, eff_c)))


def exchange_bar(eff_r, cfg: PolicyConfig, eff_c=None):
    """Temperature a candidate must exceed to displace a resident at ``eff_r``.

    Temperatures are decayed counts, so they carry counting noise: for a
    steady rate the spread is about sqrt(temp). Comparing the hottest outsider
    with the coldest insider picks the extremes of that noise, so without the
    sigma term two blocks of equal rate would swap places every few ticks.
    The noise of a difference of two such counts is about sqrt(2 x temp) at
    equal rates, the case the margin exists for. It is the resident's: a
    resident at 0 (a finished request's block, after phase ``free``) has no
    count to be noisy about, and any block read more than ``margin_abs``
    times displaces it. (``eff_c`` is accepted for callers and ignored.)
    """
    return eff_r * (1.0 + cfg.margin_ratio) + cfg.margin_abs + cfg.margin_sigma * np.sqrt(np.maximum(2.0 * eff_r, 0.0))


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


def fill_bytes(tier: TierState, cfg: PolicyConfig, state: PolicyState) -> float:
    """What a tier may be filled to by promotions: its high watermark, and
    for DRAM (index 0), where new blocks land, less the room the next
    burst_s of them needs (never below the low watermark)."""
    target = cfg.target_bytes(tier)
    high = target * cfg.high_wm
    if tier.index != 0:
        return high
    return max(target * cfg.low_wm, min(high, target - state.headroom(cfg)))


def promote_limit(tier: TierState, cfg: PolicyConfig, state: PolicyState, used: float | None = None) -> float:
    """What promotions may fill a tier to: ``fill_bytes``, and in DRAM not
    into the room kept for a backlog of allocations (theirs: _step_ended),
    nor into the free room of a DRAM that allocations fill faster than the
    migrator can empty it (``used``: bytes in the tier, by default its
    ``used_bytes``). The plan and the engine's promotions between ticks
    both stop here."""
    limit = fill_bytes(tier, cfg, state)
    if tier.index == 0:
        target = cfg.target_bytes(tier)
        room = state.backlog_room(target, cfg)
        limit = min(limit, target - room)
        # While DRAM is still filling (free room beyond what the next
        # burst_s of allocations and the backlog need, twice over, so a
        # full DRAM's swings do not flip it) at a net rate the migrator
        # cannot match, that room is the new blocks' (_fills_for_good):
        # promotions come in by exchange only. Once DRAM is full they take
        # the room the overflow step makes, as before.
        used = tier.used_bytes if used is None else used
        free = target - used
        if free > 2.0 * (state.headroom(cfg) + room) and _fills_for_good(state, cfg, free):
            limit = min(limit, used)
    return limit


def _fills_for_good(state: PolicyState, cfg: PolicyConfig, free: float) -> bool:
    """Whether DRAM's ``free`` room fills within BACKLOG_TAU_S at the rate by
    which allocations net of discards (``sustained_net_inflow``: decode blocks
    freed at a request's end never need a move) outrun the migrator's
    ``demote_mbps``. A block promoted into that room now is in the way once
    DRAM is full, when each demotion is room for a new block (read by every
    decode step of its request) and the migrator has none to spare."""
    return _fills_within(state.sustained_net_inflow, cfg, free, BACKLOG_TAU_S)


def _fills_within(inflow: float, cfg: PolicyConfig, free: float, horizon: float) -> bool:
    """Whether allocations at ``inflow`` bytes/s, less what the migrator
    demotes (``demote_mbps``), fill ``free`` bytes within ``horizon`` s."""
    excess = inflow - cfg.demote_mbps * MIB
    return excess > 0 and excess * horizon >= free


def _swap_tiers(tiers: Sequence[TierState]) -> np.ndarray:
    return np.array([t.kind == "swap" for t in tiers], dtype=bool)


class _Tick:
    """One plan's inputs, derived once: masks, keys, watermarks, and the
    ``_Builder`` collecting moves. Each numbered step of the control law is
    one function over it; each records why the blocks it looked at stay."""

    def __init__(self, snap, tiers: Sequence[TierState], cfg: PolicyConfig, state: PolicyState, now: float):
        self.tiers, self.cfg, self.now = tiers, cfg, now
        T = self.T = len(tiers)
        tier = self.tier = snap["tier"]  # int8: compared and indexed, never widened
        flags = snap["flags"]
        self.prio = snap["priority"]
        self.tenant = snap["tenant"]
        self.eff = effective_temp(snap, cfg)
        # Equal temperatures (every block of a finished request is at 0 after
        # phase "free") rank by recency: the one read longest ago goes first,
        # as a later turn of a conversation comes back to what it read last.
        # The term is below any temperature a read leaves: it only breaks ties.
        age = np.minimum((now - snap["last_access"]) * (_AGE_TIE / _AGE_SPAN_S), _AGE_TIE)
        key = np.minimum(self.eff, _TEMP_CAP)
        key -= age
        if "runs" in snap:
            # Among blocks whose run of reads is over, the ones likeliest to
            # come back (hotness.reuse_score) go last; still below any read
            # block (the term is below _REUSE_TIE).
            ended = self.eff <= 0.0
            if ended.any():
                lam = reuse_score(snap["runs"][ended], snap["last_access"][ended], now)
                key[ended] += _REUSE_TIE * lam / (lam + 1.0)
        if self.prio.any():
            key += self.prio * _PRIO_SCALE
        self.key = key
        self.is_swap = _swap_tiers(tiers)
        nonswap = np.flatnonzero(~self.is_swap)
        self.slowest_mem = int(nonswap[-1]) if nonswap.size else T - 1
        self.known = (tier >= 0) & (tier < T)
        absent = (flags & F_NOT_PRESENT) != 0
        backoff = snap["retry_at"] > now
        # A block its reader faulted straight back in after a pageout (the
        # engine's pageout returns) is barred from swap until retry_at, not
        # from every move: it is being read, so promoting it is exactly right.
        returned = backoff & (snap["returns"] > 0) if "returns" in snap else np.zeros_like(backoff)
        backoff &= ~returned
        unmovable = (flags & F_UNMOVABLE) != 0
        if "stuck" in snap:
            # The kernel's refusal is re-probed once retry_at has passed
            # (record_results sets it unmovable_reprobe_s ahead); a block its
            # engine pins (declared) or marked without a reason never is.
            why = snap["stuck"]
            unmovable &= backoff | (why == STUCK_NONE) | (why == STUCK_DECLARED)
        # A failed demotion backs off demotions only (``fail_dir``): the
        # kernel that would not page a block out (pages in use, or not yet
        # on an LRU list just after a move) says nothing about moving it
        # up. Barred from every move, blocks of the next hot set whose
        # pageout a TCG guest skipped waited out 30 s of backoff on CXL
        # (tests/vm/test_tiering_e2e_vm.py: 13 of 16 in DRAM after 54 ticks).
        down = snap["fail_dir"] > 0 if "fail_dir" in snap else np.zeros_like(backoff)
        self.no_demote = backoff & ~unmovable & down
        backoff &= ~self.no_demote
        self.actionable = self.known & ~unmovable & ~absent & ~backoff
        self.pinned = (flags & F_MANUAL_PIN) != 0
        recent = now - snap["last_move"] < cfg.min_residence_s
        # min_residence_s bars demotions only: a block read again soon
        # after it was demoted comes back as soon as it is hot enough (the
        # promotion threshold and the exchange margin still apply). Barred
        # both ways, every later turn of a conversation and every request
        # of a popular document that came within the residence of their
        # blocks' demotion read them from CXL for it (kvtier-sim presets
        # chat and rag: kvtier below LRU in 4 of 18 cells, none after).
        self.promotable = self.actionable & ~self.pinned
        self.settled = self.promotable & ~recent
        # runs just started (STARTING_FRESH): promotable, not demotable
        fresh = snap["fresh"] if "fresh" in snap else None
        self.starting = (np.zeros(tier.size, dtype=bool) if fresh is None else
                         (fresh > STARTING_FRESH) & (fresh < 1.0) & (snap["temp"] > 0))
        self.keep = (flags & F_KEEP_DRAM) != 0
        self.never_swap = ((flags & F_NEVER_SWAP) != 0) | returned
        self.pin_tier = snap["pin_tier"].astype(np.int64)
        target = self.target = np.array([cfg.target_bytes(t) for t in tiers])
        self.high, self.low = target * cfg.high_wm, target * cfg.low_wm
        self.fill = np.array([fill_bytes(t, cfg, state) for t in tiers])
        self.state = state
        self.b = _Builder(snap, T, state)
        arriving = [t.arriving_bytes for t in tiers]
        if any(arriving):
            self.b.used = self.b.used + np.array(arriving, dtype=np.float64)
        # Why each block stays, most specific last (a later rule overrides).
        stay = np.full(tier.size, S_PLACED, dtype=np.uint8)
        stay[recent] = S_RESIDENCE
        stay[self.starting & ~recent] = S_STARTING
        stay[self.pinned] = S_PIN
        stay[backoff | self.no_demote] = S_BACKOFF
        stay[absent] = S_NOT_PRESENT
        stay[unmovable] = S_UNMOVABLE
        # a block measured never touched is not "unmeasured" for lack of a tier
        stay[~self.known & ~absent] = S_UNMEASURED
        self.stay = stay

    def demotable(self, t: int) -> np.ndarray:
        m = self.settled & (self.tier == t) & ~self.b.moved & ~self.starting & ~self.no_demote
        if t == 0:
            m &= ~self.keep
        if self.is_swap[t + 1]:
            m &= ~self.never_swap
        return m

    def mark(self, rows: np.ndarray, reason: int) -> None:
        """Record ``reason`` for the rows that were considered and not moved."""
        if rows.size:
            self.stay[rows[~self.b.moved[rows]]] = reason


def _step_constraints(x: _Tick) -> None:
    """1. Blocks that must be elsewhere go there (residence does not apply: the operator asked)."""
    b, tier, T = x.b, x.tier, x.T
    want_pin = x.actionable & x.pinned & (x.pin_tier >= 0) & (x.pin_tier < T) & (x.pin_tier != tier)
    want_pin &= ~(x.no_demote & (x.pin_tier > tier))  # down: that backoff holds
    rows = np.flatnonzero(want_pin)
    x.mark(b.take(rows, x.pin_tier[rows], R_PIN), S_PLACED)
    x.mark(rows, S_RATE_LIMIT)
    want_keep = x.actionable & ~x.pinned & x.keep & (tier > 0) & ~b.moved
    rows = np.flatnonzero(want_keep)
    b.take(rows, 0, R_KEEP_DRAM)
    x.mark(rows, S_RATE_LIMIT)
    x.stay[x.keep & (tier == 0) & ~x.pinned & x.actionable] = S_KEEP_DRAM
    if x.is_swap.any():
        in_swap = x.is_swap[np.clip(tier, 0, T - 1)] & x.known
        rows = np.flatnonzero(x.actionable & ~x.pinned & x.never_swap & in_swap & ~b.moved)
        b.take(rows, x.slowest_mem, R_NEVER_SWAP)
        x.mark(rows, S_RATE_LIMIT)


def _step_quotas(x: _Tick) -> None:
    """2. A tenant above its DRAM quota has its coldest DRAM blocks demoted."""
    cfg, b = x.cfg, x.b
    if x.T < 2 or not cfg.tenant_dram_quota:
        return
    in0 = b.in_tier(0)  # after the constraint moves
    for ten, quota in cfg.tenant_dram_quota.items():
        over = float(b.nb[in0 & (x.tenant == ten)].sum()) - float(quota)
        if over > 0:
            cand = np.flatnonzero(x.demotable(0) & (x.tenant == ten))
            k = min(b.budget_rows("demote", 1 if cand.size == 0 else int(b.nb[cand].min())), cand.size)
            b.take(_ordered(cand, x.key, k, hottest_first=False), 1, R_QUOTA, over)
            x.mark(cand, S_RATE_LIMIT)


def _step_overflow(x: _Tick, t: int) -> float:
    """3a. Above the high watermark, demote the coldest residents of ``t``
    until it is back under it with room for the coming allocations. Returns the hottest key demoted (the
    floor promotion candidates must beat), -inf if none."""
    b = x.b
    if b.used[t] <= x.fill[t]:
        return -np.inf
    cand = np.flatnonzero(x.demotable(t))
    if cand.size == 0:
        return -np.inf
    k = min(b.budget_rows("demote", int(b.nb[cand].min())), cand.size)
    order = _ordered(cand, x.key, k, hottest_first=False)
    # Back under fill: the high watermark, for DRAM less the room for the
    # next burst_s of allocations (DRAM must not spill new blocks to CXL);
    # never below the low watermark. Not further: what is still warm stays
    # until it is needed, since demoting it early only brings it back (cold
    # blocks go in step c).
    gone = b.take(order, t + 1, R_OVERFLOW, b.used[t] - x.fill[t])
    return float(x.key[gone].max()) if gone.size else -np.inf


def _step_promote(x: _Tick, t: int, floor: float) -> None:
    """3b. Promote into ``t`` the hottest blocks of slower tiers: into free
    room below the high watermark, or in exchange for a colder resident when
    hotter by the margin (``exchange_bar``) or of higher priority."""
    b, cfg, key, eff, prio = x.b, x.cfg, x.key, x.eff, x.prio
    slower = x.promotable & ~b.moved & x.known & (x.tier > t)
    if x.never_swap.any() and x.is_swap[t]:
        slower &= ~x.never_swap
    hot = slower & (eff >= cfg.promote_temp)
    x.stay[slower & ~hot] = S_THRESHOLD
    # Only blocks that rank above everything just demoted from t: that room
    # was made for new allocations, not for colder blocks.
    x.stay[hot & (key <= floor)] = S_WATERMARK
    cand = np.flatnonzero(hot & (key > floor))
    if cand.size == 0:
        return
    k = min(b.budget_rows("promote", int(b.nb[cand].min())), cand.size)
    top = _ordered(cand, key, k, hottest_first=True)
    x.mark(cand, S_RATE_LIMIT)  # until admitted below
    cand = top
    if t == 0 and cfg.tenant_dram_quota:
        allowed = _within_quota(cand, b, x.tenant, cfg.tenant_dram_quota)
        x.stay[np.setdiff1d(cand, allowed)] = S_QUOTA
        cand = allowed
        if cand.size == 0:
            return
    room = max(0.0, promote_limit(x.tiers[t], cfg, x.state, b.used[t]) - b.used[t] - b.late_out[t])
    free = x.tiers[t].free_bytes
    if free is not None:
        # what the node has free, minus what this plan already sends there
        room = min(room, max(0.0, float(free) - b.inflow[t]))
    res = np.flatnonzero(x.demotable(t))
    kr = min(b.budget_rows("demote", int(b.nb[res].min())) if res.size else 0, res.size)
    res = _ordered(res, key, kr, hottest_first=False)
    cum_c = np.cumsum(b.nb[cand])
    ok = cum_c <= room
    if res.size and not ok.all():
        cum_r = np.cumsum(b.nb[res])
        j = np.searchsorted(cum_r, cum_c - room, side="left")
        jj = np.minimum(j, res.size - 1)
        ok |= (j < res.size) & _beats(prio[cand], eff[cand], prio[res[jj]], eff[res[jj]], cfg)
    k = cand.size if ok.all() else int(np.argmin(ok))
    # Hottest candidates meet the coldest residents first, so the first pair
    # that fails the margin ends the exchange: the rest fail it too.
    x.mark(cand[k:], S_MARGIN)
    x.mark(res, S_MARGIN)  # residents that no candidate beat
    if k == 0:
        return
    cand = cand[:k]
    # evict exactly the residents the admitted candidates need, then promote
    over = float(cum_c[k - 1]) - room
    if over > 0 and res.size:
        cum_r = np.cumsum(b.nb[res])
        nev = int(np.searchsorted(cum_r, over, side="left")) + 1
        ev = b.take(res[:nev], t + 1, R_EVICT)
        freed = float(b.nb[ev].sum())
        if ev.size < nev:  # demote budget ran out: admit only what fits
            x.mark(cand[cum_c[:k] > room + freed], S_RATE_LIMIT)
            cand = cand[cum_c[:k] <= room + freed]
    x.mark(cand, S_RATE_LIMIT)
    b.take(cand, t, R_PROMOTE, math.inf)


def _step_ended(x: _Tick) -> None:
    """3d. Room for the allocations to come, from finished blocks: when new
    blocks have come faster than the migrator can make room for them
    (``PolicyState.backlog_room``), DRAM keeps that much free, made by
    demoting blocks whose run of reads is over (temperature 0), least likely
    to be reused first, even below the low watermark. Each such demotion,
    made while the migrator has time, is a new block that lands in DRAM in
    the next burst instead of on CXL, where every decode step of its request
    would read it. Last in the plan: it only takes time nothing else wants."""
    b = x.b
    goal = x.target[0] - x.state.backlog_room(x.target[0], x.cfg)
    if goal >= b.used[0]:
        return
    cand = np.flatnonzero(x.demotable(0) & (x.eff <= 0.0))
    if cand.size == 0:
        return
    k = min(b.budget_rows("demote", int(b.nb[cand].min())), cand.size)
    b.take(_ordered(cand, x.key, k, hottest_first=False), 1, R_COLD, b.used[0] - goal, late=True)


def _step_cold(x: _Tick, t: int) -> None:
    """3c. Between the watermarks, demote blocks colder than ``demote_temp``
    down to the low watermark: headroom for new allocations without evicting
    anything in use. Planned after the promotions and executed after them, so
    a migrator short of time drops this proactive work first."""
    b, cfg = x.b, x.cfg
    if not cfg.cold_demote or b.used[t] > x.high[t]:
        return
    cand = np.flatnonzero(x.demotable(t) & (x.eff < cfg.demote_temp))
    low = x.low[t]
    if t == 0 and _dram_fills(x.state, cfg, x.target[0] - b.used[0], x.target[0]):
        low = 0.0  # every cold block, last in the plan: migrator time nothing else wants
    if cand.size == 0 or b.used[t] <= low:
        x.mark(cand, S_WATERMARK)
        return
    k = min(b.budget_rows("demote", int(b.nb[cand].min())), cand.size)
    b.take(_ordered(cand, x.key, k, hottest_first=False), t + 1, R_COLD, b.used[t] - low, late=True)
    x.mark(cand, S_WATERMARK)  # the rest: the tier is at its low watermark now (or tokens ran out)


def _dram_fills(state: PolicyState, cfg: PolicyConfig, free: float, target: float) -> bool:
    """Whether DRAM, ``free`` bytes short of its target, fills with new
    blocks faster than the migrator can make room: then every cold block
    goes early (``_step_cold``), in the migrator's spare time, each one out a
    new block that lands in DRAM later instead of on CXL, where every decode
    step of its request would read it.

    Emptying DRAM of cold blocks is not free where it is not needed: most of
    them are finished requests' blocks kept as a prefix cache, and the next
    turn that takes one reads it from CXL and promotes it back. So it is
    done only where the room is short:

    - a burst: allocations now faster than the migrator (``demote_mbps``)
      while the free room is less than what the recent bursts needed beyond
      it (``backlog_room``: ``backlog_peak``, at most BACKLOG_ROOM_MAX of
      DRAM) and the next ``burst_s`` of them (``headroom``).
      With more room than that the burst fits in it. (Fired on every burst
      above the migrator, the rule emptied DRAM of cached prefixes that
      later turns took back where DRAM had room for dozens of such bursts:
      kvtier-sim, Mooncake conversation, 8B, DRAM 50 %: 800-1,100 GiB free
      in most ticks against backlogs of 18-48 GiB; 0.9989, below the
      kernel-like policy's 0.9996; 0.9997 with this test.)
    - a load that outruns the migrator: its mean over BACKLOG_TAU_S above
      ``demote_mbps`` at an excess that fills the free room within
      FILL_HORIZON_S. DRAM then fills however fast we demote, and migrator
      time not spent now is lost for good: the room made early is what the
      new blocks find once DRAM would be full. The horizon is how long the
      load's mean is taken to hold, not how soon DRAM must be full: with
      900 s and no burst test, conversation 70B 50 % (8 GiB/s of new blocks
      against 4) kept its cold blocks until DRAM was within 15 minutes of
      full and lost 0.938 -> 0.839; an excess of a few minutes (a fleet's
      start with DRAM empty: conversation 8B, about 4.6 GiB/s over its
      first minutes) fills nothing within an hour.
    """
    rate = cfg.demote_mbps * MIB
    if state.inflow_bps > rate and free < state.backlog_room(target, cfg) + state.headroom(cfg):
        return True
    return _fills_within(state.sustained_inflow, cfg, free, FILL_HORIZON_S)


def plan(
    snap: Mapping[str, np.ndarray],
    tiers: Sequence[TierState],
    cfg: PolicyConfig,
    state: PolicyState,
    now: float,
    dropped: float = 0.0,
    discarded: float | None = None,
) -> tuple[Plan, PolicyState]:
    """Decide this tick's moves. Pure: ``snap`` and ``state`` are not modified.

    ``dropped``: ``BlockTable.inflow_offset()``, the bytes discarded out of
    the measured tiers so far, less the bytes found resident at
    registration (no allocation). Counted with what is measured, the
    allocation rate is the new blocks' rate: net of discards it was 0 at a steady state
    where new blocks fill DRAM as fast as blocks demoted earlier are
    discarded from CXL (the demo guest: about 70 % of the new blocks' rate).

    ``discarded``: ``BlockTable.dropped_bytes`` alone (None: ``dropped``,
    as where no pool was resident at registration). The net allocation
    rate (``PolicyState.sustained_net_inflow``) is the growth of the
    measured bytes less those resident at registration: ``dropped`` less
    ``discarded`` added to them."""
    tiers = sorted(tiers, key=lambda t: t.index)
    n = int(snap["tier"].size)
    max_block = float(snap["nbytes"].max()) if n else 0.0
    total = float(snap["nbytes"][(snap["tier"] >= 0) & (snap["tier"] < len(tiers))].sum()) if n else 0.0
    total += dropped
    net = total - (dropped if discarded is None else discarded)
    state = state.refill(cfg, now, max_block, total, net)
    if n == 0 or not tiers:
        return empty_plan(), state
    x = _Tick(snap, tiers, cfg, state, now)
    _step_constraints(x)
    _step_quotas(x)
    for t in range(x.T - 1):  # fastest tier first; what lands in t+1 is handled in its turn
        floor = _step_overflow(x, t)
        _step_promote(x, t, floor)
        _step_cold(x, t)
    if x.T > 1:
        _step_ended(x)
    b = x.b
    out = replace(b.plan(), stay=x.stay)
    return out, replace(
        state, promote_tokens=max(0.0, b.tokens["promote"]), demote_tokens=max(0.0, b.tokens["demote"]),
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
    bp, bd = _bursts(cfg, float(plan_.nbytes.max()), state.inflow_bps)
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
    reason: np.ndarray | None = None,
) -> None:
    """Write the migrator's outcome back into a BlockTable (or snapshot dict).

    Moved rows get ``tier=dst`` (when given), ``last_move=now`` and their
    failure count cleared. Failed rows are retried after
    ``backoff_base_s * 2**(fail_count-1)`` (capped at ``backoff_max_s``); rows
    the kernel reported unmovable, or that failed ``unmovable_after`` times in
    a row, get ``F_UNMOVABLE`` with the reason in ``stuck`` (``reason`` per row,
    a STUCK_* code from the migrator's evidence; else pinned when the kernel
    said unmovable, failing otherwise) and are not planned again for
    ``unmovable_reprobe_s``. A row that moves loses F_UNMOVABLE.
    """
    rows = np.asarray(rows, dtype=np.int64)
    ok = np.asarray(ok_mask, dtype=bool)
    unmov = np.asarray(unmovable_mask, dtype=bool)
    tier, last_move = _field(table, "tier"), _field(table, "last_move")
    retry_at, fail_count, flags = _field(table, "retry_at"), _field(table, "fail_count"), _field(table, "flags")
    why = _field(table, "stuck")
    good = rows[ok]
    fail_dir = None if isinstance(table, Mapping) and "fail_dir" not in table else _field(table, "fail_dir")
    bad = rows[~ok]
    if fail_dir is not None and bad.size:
        # which way the failed move went (before the tier below changes)
        fail_dir[bad] = 0 if dst is None else np.sign(
            np.asarray(dst, dtype=np.int64)[~ok] - tier[bad].astype(np.int64)).astype(np.int8)
    if dst is not None:
        tier[good] = np.asarray(dst, dtype=np.int8)[ok]
    last_move[good] = now
    fail_count[good] = 0
    retry_at[good] = -np.inf
    if fail_dir is not None:
        fail_dir[good] = 0
    moved = good[why[good] != STUCK_DECLARED]
    flags[moved] &= np.uint8(~F_UNMOVABLE & 0xFF)
    why[moved] = STUCK_NONE
    if bad.size:
        _field(table, "returns")[bad] = 0  # a failed move backs off every move, not only pageout
        fc = np.minimum(fail_count[bad].astype(np.int64) + 1, np.iinfo(np.uint16).max)
        fail_count[bad] = fc
        delay = np.minimum(cfg.backoff_max_s, cfg.backoff_base_s * np.exp2(np.minimum(fc - 1, 62)))
        retry_at[bad] = now + delay
        stuck = unmov[~ok] | (fc >= cfg.unmovable_after)
        code = np.where(unmov[~ok], np.uint8(STUCK_PINNED), np.uint8(STUCK_FAILING))
        if reason is not None:
            r = np.asarray(reason, dtype=np.uint8)[~ok]
            code = np.where(r != STUCK_NONE, r, code)
        code = np.where(why[bad] == STUCK_DECLARED, np.uint8(STUCK_DECLARED), code)
        hit = bad[stuck]
        flags[hit] |= np.uint8(F_UNMOVABLE)
        why[hit] = code[stuck]
        retry_at[hit] = np.maximum(retry_at[hit], now + cfg.unmovable_reprobe_s)


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
    dropped: float = 0.0,
    discarded: float | None = None,
) -> str:
    """Human-readable account of where block ``row`` is and what the policy
    would do (``dropped`` and ``discarded`` as for ``plan``)."""
    tiers = sorted(tiers, key=lambda t: t.index)
    T = len(tiers)
    n = int(snap["tier"].size)
    if not 0 <= row < n:
        return f"row {row}: no such block (table has {n})"
    t = int(snap["tier"][row])
    f = int(snap["flags"][row])
    eff = float(effective_temp({k: snap[k][row : row + 1] for k in ("temp", "flags", "fresh") if k in snap}, cfg)[0])
    tname = tiers[t].name if 0 <= t < T else ("unknown" if t == TIER_UNKNOWN else "mixed")
    out = [
        f"block row {row}: region {int(snap['region'][row])} index {int(snap['index'][row])}, "
        f"{int(snap['nbytes'][row])} bytes, tenant {int(snap['tenant'][row])}, priority {int(snap['priority'][row])}",
        f"tier: {t} ({tname})",
        f"temperature {float(snap['temp'][row]):.3g}, effective {eff:.3g}"
        + (f" (prefill done: x{cfg.prefill_done_factor})" if f & F_PREFILL_DONE else "")
        + f"; promote at >= {cfg.promote_temp}, cold below {cfg.demote_temp}",
        "flags: " + (", ".join(_flag_names(f)) or "none")
        + (f" (unmovable: {STUCK_NAMES[int(snap['stuck'][row])]})"
           if f & F_UNMOVABLE and "stuck" in snap and int(snap["stuck"][row]) != STUCK_NONE else ""),
    ]
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
                e = effective_temp({k: snap[k][faster] for k in ("temp", "flags", "fresh") if k in snap}, cfg)
                cold = float(e.min())
                out.append(
                    f"coldest block in tier {t - 1}: {cold:.3g}; displacing it needs > "
                    f"{float(exchange_bar(cold, cfg, eff)):.3g}"
                )
    # The verdict is the plan's own: the rule that moved the block, or the
    # rule that kept it where it is, as plan() recorded it.
    p, _ = plan(snap, tiers, cfg, state, now, dropped, discarded)
    hit = np.flatnonzero(p.rows == row)
    if hit.size:
        i = int(hit[0])
        out.append(f"plan: move tier {int(p.src[i])} -> {int(p.dst[i])} ({REASON_NAMES[int(p.reason[i])]})")
        return "\n".join(out)
    code = int(p.stay[row]) if p.stay is not None else S_PLACED
    detail = STAY_TEXT[code]
    if code == S_RESIDENCE:
        detail += f" ({now - float(snap['last_move'][row]):.1f}s of {cfg.min_residence_s}s)"
    elif code == S_BACKOFF:
        detail += (f" (failed {int(snap['fail_count'][row])} time(s), "
                   f"retry in {float(snap['retry_at'][row]) - now:.1f}s)")
    elif code == S_UNMOVABLE:
        why = int(snap["stuck"][row]) if "stuck" in snap else STUCK_NONE
        if why != STUCK_NONE:
            detail += f": {STUCK_NAMES[why]}, {STUCK_TEXT[why]}"
            if why != STUCK_DECLARED:
                detail += f"; tried again in {max(0.0, float(snap['retry_at'][row]) - now):.0f}s"
    elif code == S_PIN:
        pt = int(snap["pin_tier"][row])
        detail += f" to tier {pt if pt >= 0 else t}"
    elif code == S_THRESHOLD:
        detail += f" ({eff:.3g} < {cfg.promote_temp})"
    out.append(f"plan: stay ({STAY_NAMES[code]}) - {detail}")
    return "\n".join(out)
