"""Per-tier, per-tenant and per-region sums of the block table, kept up to
date a bounded number of rows per tick, so reading them costs nothing per
block.

The metrics exporter publishes what the block table holds summed up (bytes
and blocks per tier, tenant and region, the temperature histogram, bytes by
time since last access). Computing those at scrape time costs time
proportional to the table (0.6-2.8 s at 1-2 TiB registered on the
development host, run on the exporter's thread while the event loop
competes for the GIL). ``BlockSummarizer.advance`` instead folds at most
``budget`` rows per call into per-region sums (one vector of numbers per
region, regions visited in turn, a large region over several calls), and
publishes a new immutable ``Summary`` whenever a region's sums are complete.
A scrape reads the current ``Summary``: its cost depends on the number of
tiers, tenants and regions, not blocks.

What that costs in freshness: a region's numbers are as of the last time its
rows were visited, at most one pass (``pass_seconds``) old; time since last
access is measured at that visit too. ``kvtierctl ages`` computes ages from
the table on demand.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import numpy as np

from kvtier import ages
from kvtier.blocks import F_MANUAL_PIN, F_UNMOVABLE, STUCK_NAMES, TIER_MIXED, BlockTable

# Temperature is a decayed access count: a block read r times a second
# settles at r * tau (hotness.py), so decades span idle to every-decode-step.
TEMP_BUCKETS = (0.0, 0.01, 0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0)

NAGES = len(ages.AGE_LABELS)
NTEMPS = len(TEMP_BUCKETS) + 1
# Tier slots: slot = tier - TIER_MIXED, so mixed (-2) and unknown (-1) come first.
DEFAULT_SLOTS = 8 - TIER_MIXED


class _Layout:
    """Where each sum sits in a region's vector (float64), for ``slots`` tiers."""

    def __init__(self, slots: int):
        s = self.slots = slots
        self.bytes = slice(0, s)
        self.blocks = slice(s, 2 * s)
        self.temp = slice(2 * s, 3 * s)
        self.age = slice(3 * s, (3 + NAGES) * s)  # tier-major: slot * NAGES + bucket
        self.hist = slice((3 + NAGES) * s, (3 + NAGES) * s + NTEMPS)
        self.unmovable = self.hist.stop
        self.pinned = self.hist.stop + 1
        self.stuck = slice(self.hist.stop + 2, self.hist.stop + 2 + len(STUCK_NAMES))  # unmovable, by reason
        self.size = self.stuck.stop


class _TooManyTiers(Exception):
    pass


def _fold(table: BlockTable, lo: int, hi: int, now: float, lay: _Layout) -> np.ndarray:
    """The sums of rows [lo, hi): a few bincounts and comparisons, no
    per-block loop (about 40 ns per row; searchsorted instead cost 120)."""
    s = lay.slots
    slot = table.tier[lo:hi].astype(np.intp)
    slot -= TIER_MIXED
    if slot.size and int(slot.max()) >= s:
        raise _TooManyTiers
    nbytes = table.nbytes[lo:hi].astype(np.float64)
    temp = table.temp[lo:hi]
    # Age bucket = how many edges the age reaches (age >= edge: the older
    # bucket, as ages.age_bytes), as last_access <= now - edge.
    last = table.last_access[lo:hi]
    key = slot * NAGES
    for edge in ages.AGE_EDGES:
        key += last <= now - edge
    v = np.empty(lay.size)
    age = np.bincount(key, weights=nbytes, minlength=s * NAGES)
    v[lay.age] = age
    v[lay.bytes] = age.reshape(s, NAGES).sum(axis=1)
    v[lay.blocks] = np.bincount(slot, minlength=s)
    v[lay.temp] = np.bincount(slot, weights=temp, minlength=s)
    # Temperature bucket = how many edges lie below it (Prometheus' le).
    tb = np.zeros(slot.size, dtype=np.intp)
    for edge in TEMP_BUCKETS:
        tb += temp > edge
    v[lay.hist] = np.bincount(tb, minlength=NTEMPS)
    flags = table.flags[lo:hi]
    unmovable = (flags & F_UNMOVABLE) != 0
    v[lay.unmovable] = np.count_nonzero(unmovable)
    v[lay.pinned] = np.count_nonzero(flags & F_MANUAL_PIN)
    v[lay.stuck] = np.bincount(table.stuck[lo:hi][unmovable], minlength=len(STUCK_NAMES))[: len(STUCK_NAMES)]
    return v


@dataclass(frozen=True)
class Summary:
    """Sums over the table as of ``at`` (the oldest region visit in them is
    at most one pass older). Vectors as laid out by ``_Layout``."""

    slots: int
    total: np.ndarray
    tenants: dict[int, np.ndarray]
    regions: dict[int, np.ndarray]
    at: float = 0.0
    region_tenant: dict[int, int] = field(default_factory=dict)
    lay: _Layout = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "lay", _Layout(self.slots))

    def without(self, gone: list[int]) -> "Summary":
        """These sums less regions unregistered since (a scrape between the
        unregistration and the next tick must not show their bytes)."""
        if not gone:
            return self
        total = self.total.copy()
        tenants = dict(self.tenants)
        for rid in gone:
            v = self.regions[rid]
            total -= v
            t = self.region_tenant[rid]
            tenants[t] = tenants[t] - v
            if not tenants[t][self.lay.blocks].any():
                del tenants[t]
        regions = {r: v for r, v in self.regions.items() if r not in set(gone)}
        return Summary(self.slots, total, tenants, regions, self.at, self.region_tenant)

    @staticmethod
    def empty(slots: int = DEFAULT_SLOTS) -> "Summary":
        return Summary(slots, np.zeros(_Layout(slots).size), {}, {})

    def _per_tier(self, v: np.ndarray, part: slice) -> dict[int, float]:
        """Tier -> value of ``part`` for the tiers that hold blocks in ``v``."""
        blocks = v[self.lay.blocks]
        vals = v[part]
        return {int(i) + TIER_MIXED: _num(vals[i]) for i in np.flatnonzero(blocks)}

    def tier_bytes(self, v: np.ndarray | None = None) -> dict[int, float]:
        return self._per_tier(self.total if v is None else v, self.lay.bytes)

    def tier_blocks(self, v: np.ndarray | None = None) -> dict[int, float]:
        return self._per_tier(self.total if v is None else v, self.lay.blocks)

    def tier_temp(self) -> dict[int, float]:
        return self._per_tier(self.total, self.lay.temp)

    def age_bytes(self, v: np.ndarray) -> dict[int, list[int]]:
        """Tier -> bytes per ages.AGE_LABELS bucket, tiers holding blocks in ``v``."""
        per = v[self.lay.age].reshape(self.slots, NAGES)
        return {int(i) + TIER_MIXED: [int(x) for x in per[i]] for i in np.flatnonzero(v[self.lay.blocks])}

    @property
    def temp_hist(self) -> np.ndarray:
        return self.total[self.lay.hist]

    @property
    def temp_sum(self) -> float:
        return float(self.total[self.lay.temp].sum())

    @property
    def unmovable(self) -> int:
        return int(self.total[self.lay.unmovable])

    @property
    def pinned(self) -> int:
        return int(self.total[self.lay.pinned])

    @property
    def unmovable_by_reason(self) -> np.ndarray:
        """Unmovable blocks per STUCK_NAMES code."""
        return self.total[self.lay.stuck]


def _num(v: float) -> float:
    # Byte sums are integral; keep them ints so the exposition has no ".0".
    return int(v) if float(v).is_integer() else float(v)


class BlockSummarizer:
    """Keeps ``current`` (a Summary) within one pass of the table.

    ``advance(table, now, budget)`` visits up to ``budget`` rows, continuing
    where the last call stopped; ``refresh`` visits every row now. Runs on
    the event loop thread (the table's writer); readers on other threads
    only ever take ``current``, which is replaced, never modified.
    """

    def __init__(self, slots: int = DEFAULT_SLOTS, clock=time.monotonic):
        self.clock = clock
        self._reset(slots)
        self.rows_visited_total = 0
        self.passes_total = 0
        self.pass_seconds = 0.0  # how long the last complete pass took (clock time)

    def _reset(self, slots: int) -> None:
        self.lay = _Layout(slots)
        self._done: dict[int, tuple[int, np.ndarray]] = {}  # region -> (tenant, sums)
        self._queue: collections.deque[int] = collections.deque()
        self._cur: int | None = None  # region being visited
        self._off = 0  # its rows visited so far
        self._acc = np.zeros(self.lay.size)
        self._pass_start = self.clock()
        self.current = Summary.empty(slots)

    def refresh(self, table: BlockTable, now: float) -> Summary:
        """Visit every row now (a standalone collector; the first scrape)."""
        self._queue.clear()
        self._cur = None
        self.advance(table, now, len(table) + 1)
        return self.current

    def advance(self, table: BlockTable, now: float, budget: int) -> int:
        """Fold at most ``budget`` rows, going on where the last call
        stopped, and at most one pass over the table; returns rows visited."""
        try:
            return self._advance(table, now, budget)
        except _TooManyTiers:  # a tier index beyond the layout: start over, wider
            self._reset(self.lay.slots * 2)
            return self._advance(table, now, budget)

    def _advance(self, table: BlockTable, now: float, budget: int) -> int:
        slices = table.slices
        changed = False
        for rid in [r for r in self._done if r not in slices]:  # unregistered: its blocks are gone
            del self._done[rid]
            changed = True
        rows = 0
        started_pass = False
        while rows < budget:
            if self._cur is None:
                if not self._queue:
                    if started_pass:
                        break  # one pass per call at most: every region was just visited
                    if self._done or rows:
                        self.passes_total += 1
                        t = self.clock()
                        self.pass_seconds = t - self._pass_start
                        self._pass_start = t
                    self._queue.extend(sorted(slices))
                    started_pass = True
                    if not self._queue:
                        break
                rid = self._queue.popleft()
                if rid not in slices:
                    continue
                self._cur, self._off = rid, 0
                self._acc = np.zeros(self.lay.size)
            s = slices.get(self._cur)
            if s is None:  # unregistered while under way
                self._cur = None
                continue
            take = min(s.count - self._off, budget - rows)
            lo = s.start + self._off
            if take:
                self._acc += _fold(table, lo, lo + take, now, self.lay)
            self._off += take
            rows += take
            if self._off >= s.count:
                tenant = int(table.tenant[s.start]) if s.count else 0
                self._done[self._cur] = (tenant, self._acc)
                self._cur = None
                changed = True
        self.rows_visited_total += rows
        if changed:
            self._publish(now)
        return rows

    def _publish(self, now: float) -> None:
        total = np.zeros(self.lay.size)
        tenants: dict[int, np.ndarray] = {}
        for tenant, v in self._done.values():
            total += v
            if tenant in tenants:
                tenants[tenant] = tenants[tenant] + v
            else:
                tenants[tenant] = v.copy()
        self.current = Summary(self.lay.slots, total, tenants, {r: v for r, (_, v) in self._done.items()}, now,
                               {r: t for r, (t, _) in self._done.items()})
