"""Per-block state for every registered KV block, as numpy arrays.

One ``BlockTable`` holds all blocks of all regions as a struct of arrays (no
Python object per block). Each region owns one contiguous slice; the registry
adds and removes regions, hotness sources write ``temp``/``last_access``, the
policy reads a snapshot and the migrator's results write ``tier``,
``last_move``, ``retry_at`` and ``flags``.

Tier numbers are indices into the topology's ordered tier list (0 = fastest,
DRAM); ``TIER_UNKNOWN`` marks a block whose placement has not been measured
and ``TIER_MIXED`` one whose pages straddle tiers.
"""

from __future__ import annotations

import mmap
import platform
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

TIER_UNKNOWN = -1
TIER_MIXED = -2

# flags bits
F_UNMOVABLE = 1 << 0  # the kernel will not move its pages: why in ``stuck``
F_KEEP_DRAM = 1 << 1  # region constraint: never demote out of tier 0
F_NEVER_SWAP = 1 << 2  # region constraint: never page out to swap
F_PREFILL_DONE = 1 << 3  # phase hint: block is read-only now, demotion candidate
F_MANUAL_PIN = 1 << 4  # operator pinned the block to its current tier
F_NOT_PRESENT = 1 << 5  # no page of the block has been touched yet
F_STALE = 1 << 6  # placement may have changed (hinted while not present, a move failed,
                  # the sample disagreed): measure the whole block soon
F_ENGINE = 1 << 7  # the engine owns and moves it (mode "engine"): no pages to measure or migrate

# Why a block is F_UNMOVABLE (field ``stuck``). Every reason but "declared"
# is the kernel's answer to a move and is re-probed after
# PolicyConfig.unmovable_reprobe_s (a pin can be dropped, a lock undone).
STUCK_NONE = 0
STUCK_LOCKED = 1  # pages in an mlock'ed mapping (VM_LOCKED): MADV_PAGEOUT refuses them (EINVAL)
STUCK_PINNED = 2  # pages the kernel keeps refusing to migrate or page out while mapped by this
                  # process alone and not locked: a long-term pin (CUDA host memory, RDMA, io_uring)
STUCK_DECLARED = 3  # registered pinned=True: its engine pins it; never probed
STUCK_FAILING = 4  # failed PolicyConfig.unmovable_after times in a row for other reasons
STUCK_NAMES = ("none", "locked", "pinned", "declared", "failing")
STUCK_TEXT = (
    "",
    "mlock'ed (VM_LOCKED): the kernel will not page it out",
    "long-term pinned (the kernel keeps refusing to migrate or page out pages only this process maps)",
    "its engine pins it (registered pinned=True)",
    "its moves failed repeatedly",
)

FIELDS: dict[str, np.dtype] = {
    "region": np.dtype(np.int32),
    "index": np.dtype(np.int32),
    "addr": np.dtype(np.uint64),
    "nbytes": np.dtype(np.uint64),
    "pid": np.dtype(np.int32),
    "tier": np.dtype(np.int8),
    "pin_tier": np.dtype(np.int8),
    "temp": np.dtype(np.float32),
    "fresh": np.dtype(np.float32),  # exp(-age/tau) of the block's current run of reads (kvtier.hotness)
    "runs": np.dtype(np.float32),  # runs of reads it has had (kvtier.hotness)
    "last_access": np.dtype(np.float64),
    # earliest time (float32 s since hotness.Temperature.epoch) its run of
    # reads could end on silence: only rows past it are tested each tick
    "check_at": np.dtype(np.float32),
    "last_move": np.dtype(np.float64),
    "retry_at": np.dtype(np.float64),
    "fail_count": np.dtype(np.uint16),
    "returns": np.dtype(np.uint8),  # pageouts in a row its reader undid at once (engine: pageout returns)
    # the direction of its last failed move: 1 toward a slower tier, -1
    # toward a faster one, 0 none or not known; a backoff bars that
    # direction only (policy._Tick), so a demotion the kernel refused
    # does not keep the block out of DRAM once it is read
    "fail_dir": np.dtype(np.int8),
    "flags": np.dtype(np.uint8),
    "stuck": np.dtype(np.uint8),
    "priority": np.dtype(np.int8),
    "tenant": np.dtype(np.int16),
    # 1 from registration until a measurement finds no page of the block: a
    # page seen there first was written before the daemon looked (an engine's
    # pool, resident when registered), not allocated since; such bytes are
    # not counted in the policy's allocation rate (``inflow_offset``)
    "prior": np.dtype(np.uint8),
}

_DEFAULTS = {
    "tier": TIER_UNKNOWN,
    "pin_tier": TIER_UNKNOWN,
    "last_access": -np.inf,
    "last_move": -np.inf,
    "retry_at": -np.inf,
    "check_at": np.inf,
    "prior": 1,
}


@dataclass(frozen=True)
class Slice:
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


def _zeros(count: int, dtype: np.dtype) -> np.ndarray:
    """An array of zeros in its own anonymous mapping: pages cost memory
    only once written, whatever malloc's mmap threshold has grown to (a
    calloc served from the heap would zero, and so touch, all of it), and
    without reserving swap for the untouched part where the kernel lets us."""
    nbytes = count * dtype.itemsize
    if nbytes < (1 << 20):
        return np.zeros(count, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE),
                         dtype=dtype)


# Linux's MAP_NORESERVE where the mmap module does not name it (0x4000 on
# x86, arm and the generic ABI; other values elsewhere, so only there).
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if platform.machine() in ("x86_64", "aarch64") else 0)


@dataclass
class Staged:
    """A region's rows being written in steps past the table's used part,
    where no reader looks (``BlockTable.stage``/``fill``/``publish``)."""

    pid: int
    start: int
    length: int
    block_size: int
    flags: int
    priority: int
    tenant: int
    count: int
    at: int = -1  # first row written to; -1: not begun
    done: int = 0  # rows written from ``at``
    version: int = -1  # the table's layout when the rows were written
    restarts: int = 0

    @property
    def complete(self) -> bool:
        return self.done == self.count


def inflow_offset(table, dropped: float, known: np.ndarray | None = None) -> float:
    """What the policy adds to the bytes in the measured tiers to count
    allocations (``policy.plan``'s ``dropped``): the bytes discarded
    (``BlockTable.dropped_bytes``), less the placed bytes of blocks whose
    pages were there before the daemon ever looked (``prior``). Registering
    a resident pool is not an allocation burst: counted as one (the first
    look and the rotating sample find up to 4,096 blocks a second at the
    defaults, 8 GiB/s of 2 MiB blocks) it made the policy demote the idle
    pool to make room for allocations that never came. ``table``: the
    BlockTable or a ``snapshot()`` of it."""
    tier, prior, nbytes = (table[k] if isinstance(table, dict) else getattr(table, k)
                           for k in ("tier", "prior", "nbytes"))
    if known is None:
        known = np.flatnonzero(tier >= 0)
    was = known[prior[known] != 0]
    return dropped - float(nbytes[was].sum()) if was.size else dropped


class BlockTable:
    """Growable struct-of-arrays; region ``r`` lives in ``self.slices[r]``."""

    def __init__(self, capacity: int = 1024):
        self._cap = max(16, capacity)
        self.n = 0
        self.slices: dict[int, Slice] = {}
        # Zero pages are mapped lazily: capacity not yet used costs no
        # memory, so the daemon reserves room for limits.max_blocks_total
        # up front and never copies the table to grow it (a grow copied
        # every row and first-touched the new arrays: 10-45 ms of the loop
        # thread at 256 Ki blocks, hundreds of ms on a busy host). Nothing
        # may read rows past ``n``; add_region and fill set every field.
        try:
            self._a: dict[str, np.ndarray] = {name: _zeros(self._cap, dt) for name, dt in FIELDS.items()}
        except (OSError, MemoryError):  # no address space or commit charge for it: grow as needed
            self._cap = 1024
            self._a = {name: _zeros(self._cap, dt) for name, dt in FIELDS.items()}
        # Bumped whenever rows past ``n`` may have been overwritten or the
        # arrays replaced: a Staged region written before must start again.
        self.version = 0
        self._staging: Staged | None = None
        # Bytes that left the measured tiers because their owner dropped the
        # pages (phase ``discard``), since the table was made: the policy adds
        # them to the measured total, so its allocation rate counts every new
        # block and not the growth net of the discarded ones.
        self.dropped_bytes = 0.0

    def inflow_offset(self, known: np.ndarray | None = None) -> float:
        """``inflow_offset`` of the live table (``known``: the rows with a
        known tier, if the caller has them)."""
        return inflow_offset(self, self.dropped_bytes, known)

    def __len__(self) -> int:
        return self.n

    def __getattr__(self, name: str) -> np.ndarray:
        # Live views of the used part of each array: table.temp, table.tier...
        a = self.__dict__.get("_a")
        if a is not None and name in a:
            return a[name][: self.n]
        raise AttributeError(name)

    def _grow(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = self._cap
        while cap < need:
            cap *= 2
        for name, arr in self._a.items():
            new = _zeros(cap, arr.dtype)
            new[: self.n] = arr[: self.n]
            self._a[name] = new
        self._cap = cap
        self.version += 1

    def add_region(
        self,
        region: int,
        pid: int,
        start: int,
        length: int,
        block_size: int,
        *,
        flags: int = 0,
        priority: int = 0,
        tenant: int = 0,
    ) -> Slice:
        """Append the blocks of one region; the last block may be short."""
        st = self.stage(pid, start, length, block_size, flags=flags, priority=priority, tenant=tenant)
        return self.publish(st, region)

    def stage(self, pid: int, start: int, length: int, block_size: int, *, flags: int = 0,
              priority: int = 0, tenant: int = 0) -> Staged:
        """A region to add in steps: ``fill`` writes its rows a slice at a
        time past the used part (no reader sees them), ``publish`` makes it
        part of the table at once. Between steps the table may change
        (another region added or removed): the rows then start again."""
        count = (length + block_size - 1) // block_size
        return Staged(pid, start, length, block_size, flags, priority, tenant, count)

    def fill(self, st: Staged, rows: int) -> bool:
        """Write up to ``rows`` more of ``st``'s rows; True once all are written."""
        if st.at != self.n or st.version != self.version or self._staging is not st:
            if st.at >= 0:
                st.restarts += 1
            self._grow(self.n + st.count)
            st.at, st.done, st.version = self.n, 0, self.version
            self._staging = st
        k = min(rows, st.count - st.done)
        if k <= 0:
            return st.complete
        lo, hi = st.at + st.done, st.at + st.done + k
        sl = slice(lo, hi)
        a = self._a
        idx = np.arange(st.done, st.done + k, dtype=np.uint64)
        a["index"][sl] = idx.astype(np.int32)
        a["addr"][sl] = np.uint64(st.start) + idx * np.uint64(st.block_size)
        a["nbytes"][sl] = st.block_size
        if hi == st.at + st.count:
            a["nbytes"][hi - 1] = st.length - (st.count - 1) * st.block_size
        a["pid"][sl] = st.pid
        a["flags"][sl] = st.flags | F_NOT_PRESENT
        a["priority"][sl] = st.priority
        a["tenant"][sl] = st.tenant
        for name, dflt in _DEFAULTS.items():
            a[name][sl] = dflt
        a["temp"][sl] = 0
        a["fresh"][sl] = 0
        a["runs"][sl] = 0
        a["fail_count"][sl] = 0
        a["stuck"][sl] = STUCK_NONE
        a["returns"][sl] = 0
        a["fail_dir"][sl] = 0
        st.done += k
        return st.complete

    def publish(self, st: Staged, region: int) -> Slice:
        """Make ``st`` region ``region``'s slice (writing what is left first)."""
        if region in self.slices:
            raise KeyError(f"region {region} already in the block table")
        self.fill(st, st.count)
        s = Slice(self.n, st.count)
        self._a["region"][s.start : s.stop] = region
        self.n += st.count
        self.slices[region] = s
        self._staging = None
        self.version += 1
        return s

    def remove_region(self, region: int) -> None:
        """Drop a region's blocks, shifting later regions down (one copy per array)."""
        self.remove_regions([region])

    def remove_regions(self, regions: Iterable[int]) -> None:
        """Drop the blocks of several regions in one pass: the rows kept are
        compacted once per array, and every later region's slice moves down
        by the rows dropped before it. A process with 1,000 regions exiting
        costs one copy of the table, not 1,000 (4.5 s of the event loop at
        1 TiB in 2 MiB blocks, one region at a time)."""
        gone = sorted((self.slices.pop(r) for r in dict.fromkeys(regions)), key=lambda v: v.start)
        if not gone:
            return
        n = self.n
        dropped = sum(v.count for v in gone)
        # The rows kept after the first dropped slice, as runs between the
        # dropped slices, each moved down by one slice copy per array (rows
        # before the first stay where they are). A boolean-mask compaction
        # took 8.9 ms on the loop to drop the first of five 64 Ki-block
        # regions, slice copies 1.6 ms.
        runs, dst = [], gone[0].start
        for v, nxt in zip(gone, [*gone[1:], None]):
            end = n if nxt is None else nxt.start
            if end > v.stop:
                runs.append((dst, v.stop, end))
                dst += end - v.stop
        for arr in self._a.values():
            for d, lo, hi in runs:
                arr[d : d + hi - lo] = arr[lo:hi]  # down, never onto rows not yet read: safe in place
        self.n = n - dropped
        self.version += 1
        # Each remaining slice moves down by the rows of the dropped slices
        # that start before it.
        before = np.concatenate(([0], np.cumsum([v.count for v in gone], dtype=np.int64)))
        at = np.fromiter((v.start for v in self.slices.values()), dtype=np.int64, count=len(self.slices))
        shift = before[np.searchsorted(np.array([v.start for v in gone], dtype=np.int64), at)]
        self.slices = {r: Slice(v.start - int(d), v.count) for (r, v), d in zip(self.slices.items(), shift)}

    def region_view(self, region: int, name: str) -> np.ndarray:
        s = self.slices[region]
        return self._a[name][s.start : s.stop]

    def rows_of(self, region: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Current row of each (region id, block index), -1 where the region is gone.

        One searchsorted over the sorted region ids (ids can be large: they
        come from clients' state files), no loop over regions.
        """
        region = np.asarray(region, dtype=np.int64)
        if not self.slices or region.size == 0:
            return np.full(region.shape, -1, dtype=np.int64)
        ids = np.fromiter(self.slices, dtype=np.int64, count=len(self.slices))
        starts = np.fromiter((s.start for s in self.slices.values()), dtype=np.int64, count=len(self.slices))
        order = np.argsort(ids)
        ids, starts = ids[order], starts[order]
        k = np.minimum(np.searchsorted(ids, region), ids.size - 1)
        found = ids[k] == region
        return np.where(found, starts[k] + np.asarray(index, dtype=np.int64), -1)

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of every array: what the policy sees, immune to later writes."""
        n = self.n  # once: rows added meanwhile (another thread's copy) are not in any column
        return {name: arr[:n].copy() for name, arr in self._a.items()}


Rows = "np.ndarray | slice"  # table rows: an index array, or a region's contiguous slice


def row_count(rows: np.ndarray | slice) -> int:
    """How many rows ``rows`` names (a slice: stop - start, step 1)."""
    if isinstance(rows, slice):
        return max(0, rows.stop - rows.start)
    return int(np.asarray(rows).size)


def row_select(rows: np.ndarray | slice, mask: np.ndarray) -> np.ndarray:
    """The rows of ``rows`` where ``mask`` (as long as ``rows``) holds, as indices."""
    if isinstance(rows, slice):
        return np.flatnonzero(mask) + rows.start
    return rows[mask]
