"""The interface every hotness source implements, and the address-to-block index.

A source measures accesses; it does not keep temperatures. The engine owns
the loop and, for each source that probed available:

    source.probe()              once at start -> Availability(ok, reason)
    source.set_targets(table)   whenever regions were added or removed
    obs = source.collect(now)   once per tick -> Observation
    temperature.add(table, obs.rows, obs.counts, now, obs.weight)
    source.close()              at shutdown (releases kdamonds, perf fds)

Contract:
- ``collect`` returns rows of the table as it was at the last
  ``set_targets``: the engine must call ``set_targets`` before the next
  ``collect`` whenever rows shifted (a region was removed or added).
- Rows in an observation have a positive count (hotness.add bumps
  ``last_access`` of every row it is given). A row may appear once only.
- A source never raises for one process going away mid-collect: that
  process is skipped (the registry drops its regions via its pidfd). Typed
  errors (kvtier.errors) escape only for failures of the source itself.
- ``probe`` never raises: a missing kernel feature, a permission, an
  occupied kdamond all come back as ``Availability(False, reason)`` with the
  reason a human needs (which file, which sysctl, which config option).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np

from kvtier.blocks import BlockTable

_EMPTY_ROWS = np.zeros(0, dtype=np.int64)
_EMPTY_COUNTS = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""  # why not (or, when ok, which mechanism was chosen)

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Observation:
    """What one source saw since its previous collect.

    ``counts`` are in the source's own unit (DAMON: accessed samples per
    aggregation interval; access bits: fraction of the block's pages
    referenced; perf: samples), ``weight`` converts them to the common
    temperature scale (hotness.SOURCE_WEIGHTS). ``prefetch`` lists rows the
    source expects to be touched soon without having seen it (perf: the
    blocks after a faulting one); the engine pages those in swap in at once
    (Engine._prefetch_swapped).
    """

    source: str
    rows: np.ndarray = field(default_factory=lambda: _EMPTY_ROWS)  # int64 BlockTable rows
    counts: np.ndarray = field(default_factory=lambda: _EMPTY_COUNTS)  # float32, > 0
    weight: float = 1.0
    prefetch: np.ndarray = field(default_factory=lambda: _EMPTY_ROWS)  # int64 rows
    # rows seen read that the source does not credit yet (DAMON: the next
    # dump must agree): collecting again soon would tell (Engine._follow_up)
    pending: np.ndarray = field(default_factory=lambda: _EMPTY_ROWS)  # int64 rows

    def __len__(self) -> int:
        return int(self.rows.size)


class Source(abc.ABC):
    """One hotness source. Constructors do no I/O; ``probe`` does."""

    name: str = ""
    weight: float = 1.0

    @abc.abstractmethod
    def probe(self) -> Availability: ...

    @abc.abstractmethod
    def set_targets(self, table: BlockTable) -> None: ...

    @abc.abstractmethod
    def collect(self, now: float) -> Observation: ...

    def close(self) -> None:  # noqa: B027 - most sources hold nothing
        pass

    def empty(self) -> Observation:
        return Observation(self.name, weight=self.weight)

    def events(self) -> dict[str, int]:
        """Running totals of what the source ran into (exported as
        kvtier_source_events_total); read from the metrics thread."""
        return {}

    def observation(self, rows: np.ndarray, counts: np.ndarray, prefetch: np.ndarray | None = None,
                    pending: np.ndarray | None = None) -> Observation:
        """Drop zero counts (they would still bump last_access) and package."""
        rows = np.asarray(rows, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.float32)
        keep = counts > 0
        pf = _EMPTY_ROWS if prefetch is None else np.asarray(prefetch, dtype=np.int64)
        pend = _EMPTY_ROWS if pending is None else np.asarray(pending, dtype=np.int64)
        return Observation(self.name, rows[keep], counts[keep], self.weight, pf, pend)


class BlockIndex:
    """The table's blocks grouped by pid and sorted by address.

    Held as runs of consecutive rows of one region (its blocks are evenly
    spaced, only the region's last may be short), so it costs memory per
    region, not per block: per-block arrays of rows, starts and ends for
    the whole table were 28 bytes a block, a quarter of the daemon's memory
    at 1 M blocks. Built once per ``set_targets``; answers "which block
    holds this address" and "how much of each block does this address range
    cover" for a whole array of addresses at once, and gives a pid's blocks
    as arrays (``blocks``) when a caller wants them.
    """

    def __init__(self, table: BlockTable, rows: np.ndarray | None = None):
        """Index all blocks, or only ``rows`` (the blocks a source is to watch)."""
        if rows is None:
            sl = sorted(table.slices.values(), key=lambda v: v.start)
            first = np.array([v.start for v in sl if v.count], dtype=np.int64)
            count = np.array([v.count for v in sl if v.count], dtype=np.int64)
        else:
            r = np.unique(np.asarray(rows, dtype=np.int64))
            region = table.region[r]
            cut = np.ones(r.size, dtype=bool)
            cut[1:] = (np.diff(r) != 1) | (region[1:] != region[:-1])
            at = np.flatnonzero(cut)
            first = r[at]
            count = np.diff(np.append(at, r.size)).astype(np.int64)
        last = first + count - 1
        pid = table.pid[first].astype(np.int64)
        start = table.addr[first].astype(np.uint64)
        # spacing of the run's blocks (a one-block run never needs it)
        step = np.where(count > 1, table.addr[np.minimum(first + 1, last)] - start, table.nbytes[first])
        end = table.addr[last] + table.nbytes[last]
        order = np.lexsort((start, pid))
        self.first, self.count, self.pid = first[order], count[order], pid[order]
        self.start, self.step, self.end = start[order], np.maximum(step[order], 1).astype(np.uint64), end[order]
        self.region = table.region[self.first].astype(np.int64)
        # index position of each run's first block
        self.pos = np.concatenate(([0], np.cumsum(self.count)[:-1])).astype(np.int64)
        self.n = int(self.count.sum())
        cuts = np.flatnonzero(np.diff(self.pid)) + 1
        bounds = np.concatenate(([0], cuts, [self.pid.size])).astype(np.int64)
        self._span: dict[int, tuple[int, int]] = {
            int(self.pid[bounds[i]]): (int(bounds[i]), int(bounds[i + 1])) for i in range(len(bounds) - 1)
        } if self.pid.size else {}

    def __len__(self) -> int:
        return self.n

    @property
    def pids(self) -> list[int]:
        return sorted(self._span)

    def blocks(self, pid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, starts, ends) of one pid's blocks, ascending by address."""
        lo, hi = self._span.get(pid, (0, 0))
        cnt = self.count[lo:hi]
        runs = np.repeat(np.arange(lo, hi, dtype=np.int64), cnt)
        off = np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(self.pos[lo:hi] - self.pos[lo], cnt)
        starts = self.start[runs] + off.astype(np.uint64) * self.step[runs]
        ends = starts + self.step[runs]
        last = np.cumsum(cnt) - 1
        ends[last] = self.end[lo:hi]
        return self.first[runs] + off, starts, ends

    def ranges(self, pid: int, align: int = 1) -> np.ndarray:
        """One pid's blocks merged into disjoint [start, end) ranges (uint64, shape (k, 2)).

        Adjacent blocks (and adjacent regions) merge; ``align`` widens each
        range outward to that alignment (DAMON wants page-aligned regions).
        """
        lo, hi = self._span.get(pid, (0, 0))
        s, e = self.start[lo:hi], self.end[lo:hi]  # a run's blocks are contiguous
        if s.size == 0:
            return np.zeros((0, 2), dtype=np.uint64)
        a = np.uint64(align)
        s = (s // a) * a
        e = ((e + a - np.uint64(1)) // a) * a
        # A new range starts where a run begins after everything before it ended.
        reach = np.maximum.accumulate(e)
        new = np.ones(s.size, dtype=bool)
        new[1:] = s[1:] > reach[:-1]
        first = np.flatnonzero(new)
        last = np.append(first[1:], s.size) - 1
        return np.stack([s[first], reach[last]], axis=1)

    def lookup(self, pid: int, addrs: np.ndarray) -> np.ndarray:
        """Row of the block holding each address of ``pid``, -1 where none does."""
        lo, hi = self._span.get(pid, (0, 0))
        a = np.asarray(addrs, dtype=np.uint64)
        if hi == lo or a.size == 0:
            return np.full(a.shape, -1, dtype=np.int64)
        k = np.searchsorted(self.start[lo:hi], a, side="right").astype(np.int64) - 1
        kc = np.clip(k, 0, hi - lo - 1) + lo
        inside = (k >= 0) & (a < self.end[kc])
        off = np.where(inside, a - self.start[kc], np.uint64(0)) // self.step[kc]
        return np.where(inside, self.first[kc] + off.astype(np.int64), -1)

    def neighbours(self, rows: np.ndarray, k: int) -> np.ndarray:
        """The up-to-``k`` blocks after each given row in the same region (a
        sequential reader's next blocks), excluding the given rows themselves."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0 or k <= 0 or self.n == 0:
            return _EMPTY_ROWS
        # the run holding each row (runs ordered by first row), -1: not indexed
        by_row = np.argsort(self.first, kind="stable")
        j = np.searchsorted(self.first[by_row], rows, side="right") - 1
        run = by_row[np.clip(j, 0, None)]
        indexed = (j >= 0) & (rows < self.first[run] + self.count[run])
        rows, run = rows[indexed], run[indexed]
        pos = self.pos[run] + (rows - self.first[run])  # position in address order
        p = (pos[:, None] + np.arange(1, k + 1)[None, :]).ravel()
        base = np.repeat(run, k)
        ok = p < self.n
        p, base = p[ok], base[ok]
        at = np.searchsorted(self.pos, p, side="right") - 1  # run of each position
        ok = self.region[at] == self.region[base]  # same region as the given row's
        out = np.unique(self.first[at[ok]] + (p[ok] - self.pos[at[ok]]))
        return np.setdiff1d(out, rows, assume_unique=False)

    def mean_over_blocks(
        self, pid: int, seg_start: np.ndarray, seg_end: np.ndarray, value: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Byte-weighted mean of a piecewise-constant value over each block.

        The segments (DAMON regions) are sorted and disjoint; a block covered
        by several segments gets their overlap-weighted mean, uncovered bytes
        count as zero. Vectorised through the running integral F(x) of the
        value over addresses: a block's mean is (F(end) - F(start)) / size,
        and F at any address is one searchsorted away.
        Returns (rows, means) for all of the pid's blocks.
        """
        rows, bs, be = self.blocks(pid)
        if rows.size == 0:
            return rows, np.zeros(0, dtype=np.float64)
        s = np.asarray(seg_start, dtype=np.uint64)
        e = np.asarray(seg_end, dtype=np.uint64)
        v = np.asarray(value, dtype=np.float64)
        if s.size == 0:
            return rows, np.zeros(rows.size, dtype=np.float64)
        length = (e - s).astype(np.float64)
        cum = np.concatenate(([0.0], np.cumsum(v * length)))

        def integral(x: np.ndarray) -> np.ndarray:
            k = np.searchsorted(s, x, side="right").astype(np.int64) - 1
            kc = np.clip(k, 0, s.size - 1)
            # Offsets are taken relative to the segment start before the
            # float conversion, so 47-bit addresses lose no precision.
            off = np.where(x > s[kc], x - s[kc], np.uint64(0)).astype(np.float64)
            part = np.minimum(off, length[kc]) * v[kc]
            return np.where(k >= 0, cum[kc] + part, 0.0)

        size = (be - bs).astype(np.float64)
        return rows, (integral(be) - integral(bs)) / np.maximum(size, 1.0)
