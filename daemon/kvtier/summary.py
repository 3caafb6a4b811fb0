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
    """The sums of rows [lo, hi)."""
    return _fold_many(table, np.array([lo]), np.array([hi]), now, lay)[0]


def _fold_many(table: BlockTable, lo: np.ndarray, hi: np.ndarray, now: float, lay: _Layout) -> np.ndarray:
    """The sums of each row range [lo[i], hi[i]), one vector per range: a
    few bincounts over all of the ranges' rows at once (the range's number
    times each key's width added to the key), no per-block loop and no
    per-range one (about 40 ns per row; a call per region cost 130 us each
    at 1,000 regions)."""
    s = lay.slots
    lo = np.asarray(lo, dtype=np.int64)
    lens = np.asarray(hi, dtype=np.int64) - lo
    nseg = lens.size
    total = int(lens.sum())
    rows: slice | np.ndarray
    if nseg == 1 or (lo[1:] == lo[:-1] + lens[:-1]).all():
        rows = slice(int(lo[0]), int(lo[0]) + total)  # one run of rows (regions visited in table order)
    else:
        rows = np.arange(total, dtype=np.int64) + np.repeat(lo - (np.cumsum(lens) - lens), lens)
    seg = np.repeat(np.arange(nseg, dtype=np.intp), lens) if nseg > 1 else None

    def keyed(k: np.ndarray, width: int) -> np.ndarray:
        """``k`` made distinct per range: the range's number times ``width`` added."""
        if seg is not None:
            k += seg * width
        return k
    slot = table.tier[rows].astype(np.intp)
    slot -= TIER_MIXED
    if slot.size and int(slot.max()) >= s:
        raise _TooManyTiers
    nbytes = table.nbytes[rows].astype(np.float64)
    temp = table.temp[rows]
    # Age bucket = how many edges the age reaches (age >= edge: the older
    # bucket, as ages.age_bytes), as last_access <= now - edge.
    last = table.last_access[rows]
    key = slot * NAGES
    for edge in ages.AGE_EDGES:
        key += last <= now - edge
    v = np.empty((nseg, lay.size))
    per = s * NAGES
    age = np.bincount(keyed(key, per), weights=nbytes, minlength=nseg * per).reshape(nseg, per)
    v[:, lay.age] = age
    v[:, lay.bytes] = age.reshape(nseg, s, NAGES).sum(axis=2)
    tk = keyed(slot, s)
    v[:, lay.blocks] = np.bincount(tk, minlength=nseg * s).reshape(nseg, s)
    v[:, lay.temp] = np.bincount(tk, weights=temp, minlength=nseg * s).reshape(nseg, s)
    # Temperature bucket = how many edges lie below it (Prometheus' le).
    tb = np.zeros(total, dtype=np.intp)
    for edge in TEMP_BUCKETS:
        tb += temp > edge
    v[:, lay.hist] = np.bincount(keyed(tb, NTEMPS), minlength=nseg * NTEMPS).reshape(nseg, NTEMPS)
    flags = table.flags[rows]
    unmovable = (flags & F_UNMOVABLE) != 0
    pinned = (flags & F_MANUAL_PIN) != 0
    nst = len(STUCK_NAMES)
    stuck = table.stuck[rows][unmovable].astype(np.intp)
    known = stuck < nst
    if seg is None:
        v[0, lay.unmovable] = np.count_nonzero(unmovable)
        v[0, lay.pinned] = np.count_nonzero(pinned)
        v[0, lay.stuck] = np.bincount(stuck[known], minlength=nst)
    else:
        v[:, lay.unmovable] = np.bincount(seg, weights=unmovable, minlength=nseg)
        v[:, lay.pinned] = np.bincount(seg, weights=pinned, minlength=nseg)
        v[:, lay.stuck] = np.bincount(seg[unmovable][known] * nst + stuck[known],
                                      minlength=nseg * nst).reshape(nseg, nst)
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
        # Their sums, total and per tenant (with the tenant's region count),
        # kept as regions are replaced or leave: a publish costs what
        # changed, not a sum over every region (1,000 regions: 0.7 ms a
        # tick). Recomputed from _done at the end of each pass, so float
        # rounding in the temperature sums does not accumulate.
        self._total = np.zeros(self.lay.size)
        self._tenant_sum: dict[int, list] = {}  # tenant -> [sums, regions]
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
            self._set_done(rid, None)
            changed = True
        # The row ranges to fold this call, in visiting order: (region,
        # first row, end row, whether that ends the region's visit).
        segs: list[tuple[int, int, int, bool]] = []
        carried = self._cur is not None  # the first range goes on with self._acc
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
                        self._resum()
                    self._queue.extend(sorted(slices))
                    started_pass = True
                    if not self._queue:
                        break
                rid = self._queue.popleft()
                if rid not in slices:
                    continue
                self._cur, self._off = rid, 0
            s = slices.get(self._cur)
            if s is None:  # unregistered while under way
                self._cur = None
                carried = False  # (only the first visit can find it gone: no range taken yet)
                continue
            take = min(s.count - self._off, budget - rows)
            lo = s.start + self._off
            self._off += take
            rows += take
            ends = self._off >= s.count
            segs.append((self._cur, lo, lo + take, ends))
            if ends:
                self._cur = None
        if segs:
            sums = _fold_many(table, np.array([g[1] for g in segs]), np.array([g[2] for g in segs]), now, self.lay)
            for i, (rid, lo, _, ends) in enumerate(segs):
                acc = self._acc + sums[i] if i == 0 and carried else sums[i]
                if ends:
                    s = slices[rid]
                    self._set_done(rid, (int(table.tenant[s.start]) if s.count else 0, acc))
                    changed = True
                else:
                    self._acc = acc
        self.rows_visited_total += rows
        if changed:
            self._publish(now)
        return rows

    def _set_done(self, rid: int, entry: tuple[int, np.ndarray] | None) -> None:
        """Replace (or with None drop) a region's finished sums, and the
        totals with them."""
        old = self._done.pop(rid, None)
        if old is not None:
            self._total -= old[1]
            ts = self._tenant_sum[old[0]]
            ts[0] = ts[0] - old[1]
            ts[1] -= 1
            if not ts[1]:
                del self._tenant_sum[old[0]]
        if entry is not None:
            self._done[rid] = entry
            self._total += entry[1]
            ts = self._tenant_sum.get(entry[0])
            if ts is None:
                self._tenant_sum[entry[0]] = [entry[1].copy(), 1]
            else:
                ts[0] = ts[0] + entry[1]
                ts[1] += 1

    def _resum(self) -> None:
        """The totals summed again from every region's sums."""
        self._total = np.zeros(self.lay.size)
        self._tenant_sum = {}
        for tenant, v in self._done.values():
            self._total += v
            ts = self._tenant_sum.get(tenant)
            if ts is None:
                self._tenant_sum[tenant] = [v.copy(), 1]
            else:
                ts[0] += v
                ts[1] += 1

    def _publish(self, now: float) -> None:
        # Copies: readers on other threads keep this Summary while the
        # totals change under the next visits.
        self.current = Summary(self.lay.slots, self._total.copy(), {t: v[0].copy() for t, v in self._tenant_sum.items()},
                               {r: v for r, (_, v) in self._done.items()}, now,
                               {r: t for r, (t, _) in self._done.items()})
