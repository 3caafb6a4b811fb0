"""The two references every policy is measured against; both know the future.

``feasible-oracle`` (``FeasibleOracle``): a placement policy run by the same
engine, under the same rules as every other policy: the same first-touch
placement of new blocks, the same DRAM capacity, and the same migrator with
its per-tick time budget. What it has that no online policy has is the
future: before each tick it knows when every block will be read next (and
how much), and which blocks the next tick allocates. It keeps DRAM for the
blocks read soonest (farthest next use is evicted first, Belady's rule):
it makes room for the next tick's allocations, promotes into free room,
moves out every resident not read within the next minute (room for the
allocations to come), and with the time left exchanges a CXL block for a
DRAM one where the CXL block is read sooner. It is a real
target: a policy that approaches it cannot be doing much better with the
same machine. It is not proven optimal under a bandwidth limit (a budgeted
placement problem has no known greedy optimum), so an online policy could in
principle beat it by a hair; the tests and the benchmark report it as a
reference, not a theorem.

``belady-min`` (``belady_min``): Belady's MIN over the read sequence, the
miss floor of a demand-fetched cache of DRAM's size. Migration is free and
unlimited; a block not in the cache is fetched when read (one miss, the rest
of its reads in the tick hit) and evicts the cached block read farthest in
the future (or is not kept, if it is that block). A new block is written into
the cache when allocated (no miss); whether it stays is decided, like any
other block, by when it is read next. Reads within a tick are taken as consecutive per block, the
order kindest to a cache, so this ceiling errs high. It counts what no
placement with DRAM's capacity can avoid: compulsory misses and capacity
misses.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from .policies import SimPolicy

NEVER = np.inf


def next_uses(ticks) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """For every tick: the next-read tick (and that tick's read count) after
    each of its reads, and after each of its allocations. A freed or evicted
    id starts a new block, so its later reads do not count."""
    ticks = list(ticks)
    nblk = 1 + max((int(max(t.rows.max(initial=-1), t.alloc.max(initial=-1))) for t in ticks), default=0)
    seen = np.full(nblk, NEVER)
    seen_c = np.zeros(nblk)
    nu_r, nc_r, nu_a, nc_a = [None] * len(ticks), [None] * len(ticks), [None] * len(ticks), [None] * len(ticks)
    for k in range(len(ticks) - 1, -1, -1):
        tk = ticks[k]
        seen[tk.free] = NEVER
        seen_c[tk.free] = 0
        nu_r[k], nc_r[k] = seen[tk.rows], seen_c[tk.rows]
        seen[tk.rows] = k
        seen_c[tk.rows] = tk.counts
        nu_a[k], nc_a[k] = seen[tk.alloc], seen_c[tk.alloc]
        seen[tk.evict] = NEVER
        seen_c[tk.evict] = 0
    return nu_r, nc_r, nu_a, nc_a


def _key(nu: np.ndarray, nc: np.ndarray) -> np.ndarray:
    """Sooner next read first; within a tick, more reads first."""
    return nu - 0.99 * nc / (1.0 + nc)


class FeasibleOracle(SimPolicy):
    name = "feasible-oracle"
    needs_future = True
    # Residents not read within this horizon leave DRAM when the migrator has
    # time to spare (step 3 of decide); blocks read within it are kept.
    LOOKAHEAD_S = 60.0

    def attach(self, eng):
        super().attach(eng)
        self.nu_r, self.nc_r, self.nu_a, self.nc_a = next_uses(eng.future)
        self.key = np.full(eng.n, NEVER)

    def place(self, rows):
        self.key[rows] = _key(self.nu_a[self.eng.k], self.nc_a[self.eng.k])
        return self.eng.first_touch(rows)

    def observe(self, rows, counts, times, now):
        if rows.size:
            k = self.eng.k
            self.key[rows] = _key(self.nu_r[k], self.nc_r[k])

    def freed(self, rows):
        self.key[rows] = NEVER

    def decide(self, now):
        """Moves for the next tick, in the order the migrator should spend its time:

        1. room for the next tick's allocations (they land in DRAM only if it
           has room), evicting the residents read farthest in the future;
        2. promotions of slower blocks read soon, into room beyond what the
           coming allocations need;
        3. every resident not read within ``LOOKAHEAD_S`` leaves: room for the
           allocations to come, one move per new block kept in DRAM (when new
           blocks arrive faster than the migrator moves, DRAM fills however
           late one starts, so the earlier the better);
        4. exchanges of a slower block for a resident read later (two moves
           for one block).
        The migrator stops where its time runs out, so 4 goes first."""
        eng = self.eng
        k = eng.k
        fut = eng.future
        empty = np.zeros(0, np.int64), np.zeros(0, np.int8)
        c = int(eng.cap_blocks[0])
        horizon = max(1, int(round(self.LOOKAHEAD_S / eng.tick_s)))
        coming = fut[k + 1 : k + 1 + horizon]
        alloc1 = int(coming[0].alloc.size) if coming else 0
        allocw = sum(int(t.alloc.size) for t in coming)
        # the next ticks' evictions free DRAM before their allocations land
        gone = np.concatenate([t.evict for t in coming]) if coming else np.zeros(0, np.int64)
        gone = gone[eng.tier[gone] == 0] if gone.size else gone
        free = c - int(eng.occ[0]) + int(gone.size)
        budget = int(eng.tick_s * 1e9 // float(eng.mig_ns[eng.mig_ns > 0].min())) + 1
        key = self.key
        res = np.flatnonzero(eng.tier == 0)
        if gone.size:
            res = np.setdiff1d(res, gone)
        slow = np.flatnonzero(eng.alive & (eng.tier > 0))
        cand = slow[key[slow] < k + 1 + horizon]  # read within the horizon
        cand = _best(cand, key[cand], budget, ascending=True)
        victims = _best(res, key[res], 2 * budget + max(0, allocw - free), ascending=False)
        vk = key[victims]
        # 1. the next tick's allocations (read in that tick: key < k + 2)
        n1 = int(min(max(0, alloc1 - free), np.count_nonzero(vk >= k + 2)))
        free += n1
        # 2. promotions into free room beyond what the coming allocations need
        f = int(min(max(0, free - allocw), cand.size))
        # 3. room for the allocations to come: every resident not read within
        # the horizon, farthest first (one move each buys a new block's reads)
        v3 = victims[n1:]
        n3 = int(np.count_nonzero(key[v3] >= k + 1 + horizon))
        # ... and what that room holds beyond the coming allocations takes promotions
        f2 = int(min(max(0, free + n3 - allocw - f), cand.size - f))
        # 4. exchanges while the slower block is read sooner (two moves each)
        rest, vrest = cand[f + f2 :], v3[n3:]
        m = min(rest.size, vrest.size)
        better = key[rest[:m]] < key[vrest[:m]]
        npair = m if better.all() else int(np.argmin(better))
        parts = [victims[:n1], cand[:f], v3[:n3], cand[f : f + f2],
                 np.column_stack([vrest[:npair], rest[:npair]]).ravel()]
        downs = [np.ones(n1, bool), np.zeros(f, bool), np.ones(n3, bool), np.zeros(f2, bool),
                 np.tile(np.array([True, False]), npair)]
        rows = np.concatenate(parts)
        if rows.size == 0:
            return empty
        is_down = np.concatenate(downs)
        dst = np.zeros(rows.size, np.int8)
        dst[is_down] = eng.demote_target(rows[is_down])
        return rows, dst


def _best(idx: np.ndarray, key: np.ndarray, k: int, ascending: bool) -> np.ndarray:
    if idx.size == 0:
        return idx
    kk = key if ascending else -key
    if k < idx.size:
        part = np.argpartition(kk, k)[:k]
        idx, kk = idx[part], kk[part]
    return idx[np.argsort(kk, kind="stable")]


def belady_min(source, cfg, capacity_blocks: int | None = None):
    """Belady's MIN over the read sequence of ``source``; returns a ``Result``."""
    from .runner import Engine

    eng = Engine(source, cfg)
    ticks = list(source.ticks(cfg.tick_s))
    nu_r, nc_r, nu_a, _ = next_uses(ticks)
    c = int(eng.cap_blocks[0] if capacity_blocks is None else capacity_blocks)
    t0 = time.perf_counter()
    fast = _min_if_nothing_is_evicted(ticks, nu_r, nu_a, c, eng.n)
    if fast is not None:
        hits, misses, fast_t, all_t = fast
        wall = time.perf_counter() - t0
        return _min_result(eng, cfg, hits, misses, len(ticks), wall, (fast_t, all_t), sum(t.rows.size for t in ticks))
    n = max(eng.n, 1)
    cached = np.zeros(n, bool)
    key = np.full(n, NEVER)
    heap: list[tuple[float, int]] = []  # (-next use, id), stale entries skipped
    size = 0
    hits = misses = 0.0
    fast_t = np.zeros(len(ticks))
    all_t = np.zeros(len(ticks))

    def farthest() -> int:
        while True:
            nk, i = heap[0]
            if cached[i] and key[i] == -nk:
                return i
            heapq.heappop(heap)

    def admit(i: int, nk: float) -> None:
        """Keep ``i`` (next read ``nk``) if it is read sooner than the farthest cached block."""
        nonlocal size
        if nk == NEVER or c <= 0:
            return
        if size >= c:
            j = farthest()
            if key[j] <= nk:
                return
            heapq.heappop(heap)
            cached[j] = False
            size -= 1
        cached[i] = True
        key[i] = nk
        size += 1
        heapq.heappush(heap, (-nk, i))

    for k, tk in enumerate(ticks):
        for i in tk.evict.tolist():
            if cached[i]:
                cached[i] = False
                size -= 1
        fresh = set()
        for i, nk in zip(tk.alloc.tolist(), nu_a[k].tolist()):
            if nk == k:
                fresh.add(i)  # written and read in this tick: decide after the reads
            else:
                admit(i, nk)
        h0 = hits
        for i, cnt, nk in zip(tk.rows.tolist(), tk.counts.tolist(), nu_r[k].tolist()):
            if i in fresh:
                hits += cnt
                admit(i, nk)
            elif cached[i]:
                hits += cnt
                if nk == NEVER:
                    cached[i] = False
                    size -= 1
                else:
                    key[i] = nk
                    heapq.heappush(heap, (-nk, i))
            else:
                misses += 1.0
                hits += cnt - 1.0
                admit(i, nk)
        for i in tk.free.tolist():
            if cached[i]:
                cached[i] = False
                size -= 1
        fast_t[k] = hits - h0
        all_t[k] = float(tk.counts.sum())
    wall = time.perf_counter() - t0
    return _min_result(eng, cfg, hits, misses, len(ticks), wall, (fast_t, all_t), sum(t.rows.size for t in ticks))


def _min_if_nothing_is_evicted(ticks, nu_r, nu_a, c, n):
    """MIN's result without the per-read loop when the cache never has to
    evict a block that is read again: if at no tick more than ``c`` blocks
    are between a touch and their next read, MIN keeps every one of them and
    misses exactly the reads of blocks neither allocated nor read before (one
    miss each). Returns None when that does not hold (run the full loop)."""
    k_n = len(ticks)
    delta = np.zeros(k_n + 2)
    for k, tk in enumerate(ticks):
        for nu in (nu_r[k], nu_a[k]):
            f = nu[np.isfinite(nu)].astype(np.int64)
            delta[k] += f.size
            np.add.at(delta, f, -1.0)
    # a block read at tick k and next at j is held over ticks k..j-1, and a
    # block whose next read is in this same tick (an allocation) too
    if k_n and np.cumsum(delta)[:k_n].max() + max(t.alloc.size for t in ticks) > c:
        return None
    seen = np.zeros(max(n, 1), bool)
    hits = misses = 0.0
    fast_t, all_t = np.zeros(k_n), np.zeros(k_n)
    for k, tk in enumerate(ticks):
        seen[tk.evict] = False
        seen[tk.alloc] = True
        first = ~seen[tk.rows]
        m = float(np.count_nonzero(first))
        tot = float(tk.counts.sum())
        misses += m
        hits += tot - m
        fast_t[k], all_t[k] = tot - m, tot
        seen[tk.rows] = True
        seen[tk.free] = False
    return hits, misses, fast_t, all_t


def _min_result(eng, cfg, hits, misses, nticks, wall, timeline, records):
    from .runner import Result

    names = [t.name for t in cfg.tiers]
    served = [hits, misses] + [0.0] * (len(names) - 2)
    total = hits + misses or 1.0
    ns = np.array([t.access_ns(eng.block_bytes) for t in cfg.tiers])
    mean = float((np.array(served[: len(ns)]) * ns).sum() / total)
    p99 = float(ns[0] if misses / total <= 0.01 else ns[1])
    r = Result(
        policy="belady-min", tiers=names, served=served[: len(names)], hit_ratio=[x / total for x in served[: len(names)]],
        migrated_bytes={f"{names[1]}->{names[0]}": int(misses) * eng.block_bytes} if len(names) > 1 else {},
        mean_ns=mean, p99_ns=p99, decode_penalty=mean / ns[0] - 1.0, ticks=nticks, sim_s=nticks * eng.tick_s,
        wall_s=wall, accesses=records, overflow_blocks=0,
        extra={"note": "demand fetch, free and unlimited migration: fetches are the misses"},
    )
    r.timeline = timeline
    return r
