"""The two references every policy is measured against; both know the future.

``feasible-oracle`` (``FeasibleOracle``): a placement policy run by the same
engine, under the same rules as every other policy: the same first-touch
placement of new blocks, the same DRAM capacity, and the same migrator with
its per-tick time budget. What it has that no online policy has is the
future: every block's reads in every coming tick, and what each tick
allocates. It runs two planners over the whole trace, each a feasible
schedule, and replays the one with the higher DRAM hit ratio (knowing the
future, it can):

- ``HorizonPlanner`` ranks a block by its reads in the next D ticks, then
  its reads in the next ``HORIZON_S``; D is one tick when the moves worth
  making fit a tick's migrator time, longer when they do not (how long a
  block moved out now would wait to come back). It pairs the best coming
  blocks (slower blocks, the next tick's allocations, later allocations the
  migrator could not make room for in time) with the cheapest slots (free
  room, then the worst residents) while the block is worth more than the
  slot. It wins where DRAM's capacity binds and the migrator has time
  (Qwen-Bailian-style 16-token blocks, the presets).
- ``NextUsePlanner`` keeps DRAM for the blocks read soonest (Belady's rule)
  and, with time to spare, empties DRAM of everything not read within a
  minute, room for the allocations to come. It wins where allocations
  outrun the migrator (Mooncake's 64-160 MiB blocks at 4 GB/s), and loses
  where they do not: it holds back room for every allocation of the next
  minute and never promotes, and next-use time ties every block of a
  running request, so it never exchanges one for another.

Neither is proven optimal under a bandwidth limit (a budgeted placement
problem has no known greedy optimum), so an online policy could in
principle beat the better of them; on the benchmark grid
(docs/benchmarks.md) and the Bailian-style traces of tests/data/bailian
none does. The tests and the benchmark report it as a reference, not a
theorem.

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


def lifetimes(ticks) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """A lifetime id for every read and every allocation of every tick: an
    id is a block from its allocation to its free or eviction, so the reads
    of a slot's later occupant never count for the block in it now.
    Returns (lifetime of each read, of each allocation, per tick; how many)."""
    ticks = list(ticks)
    nblk = 1 + max((int(max(t.rows.max(initial=-1), t.alloc.max(initial=-1))) for t in ticks), default=0)
    cur = np.full(nblk, -1, np.int64)
    nxt = 0
    read_life, alloc_life = [], []
    for tk in ticks:
        cur[tk.evict] = -1
        cur[tk.alloc] = np.arange(nxt, nxt + tk.alloc.size)
        nxt += tk.alloc.size
        alloc_life.append(cur[tk.alloc])
        life = cur[tk.rows]
        orphan = life < 0  # read before any allocation (the engine refuses these): a lifetime of its own
        if orphan.any():
            life[orphan] = np.arange(nxt, nxt + int(orphan.sum()))
            cur[tk.rows[orphan]] = life[orphan]
            nxt += int(orphan.sum())
        read_life.append(life)
        cur[tk.free] = -1
    return read_life, alloc_life, nxt


class HorizonPlanner(SimPolicy):
    """Ranks blocks by their reads over a span of the future; see decide."""

    name = "horizon"
    needs_future = True
    # A block's worth in DRAM: its reads in the next D ticks, then (to break
    # ties) its reads over the next HORIZON_S.
    HORIZON_S = 30.0
    # Room for allocations to come: the migrator's shortfall against the
    # allocations of the next ROOM_S is kept free, and with time to spare
    # residents not read within the horizon leave for them.
    ROOM_S = 120.0

    def __init__(self, horizon_s: float | None = None, room_s: float | None = None):
        self.horizon_s = self.HORIZON_S if horizon_s is None else horizon_s
        self.room_s = self.ROOM_S if room_s is None else room_s

    def attach(self, eng):
        super().attach(eng)
        self.read_life, self.alloc_life, nlife = lifetimes(eng.future)
        self.horizon = max(1, int(round(self.horizon_s / eng.tick_s)))
        self.room_ticks = max(1, int(round(self.room_s / eng.tick_s)))
        self.spans = sorted({min(2 ** i, self.horizon) for i in range(0, 12)} | {self.horizon})
        self.windows = {d: np.zeros(nlife) for d in self.spans}  # reads of each lifetime in ticks (k, k + d]
        self.hi = {d: 0 for d in self.spans}
        self.lo = 0
        self.window = self.windows[self.horizon]
        self.life = np.full(eng.n, -1, np.int64)  # each block's lifetime now
        # every allocation's lifetime in tick order, and where each tick's start
        self.alloc_flat = np.concatenate(self.alloc_life) if self.alloc_life else np.zeros(0, np.int64)
        self.alloc_cum = np.concatenate([[0], np.cumsum([t.alloc.size for t in eng.future])]).astype(np.int64)

    def place(self, rows):
        self.life[rows] = self.alloc_life[self.eng.k]
        return self.eng.first_touch(rows)

    def _slide(self, k: int) -> None:
        """Move each window to ticks (k, k + d]: add the ticks entering it,
        take out those leaving (each tick's reads once each way)."""
        fut = self.eng.future
        for d, w in self.windows.items():
            top = min(k + d, len(fut) - 1)
            while self.hi[d] < top:
                self.hi[d] += 1
                w[self.read_life[self.hi[d]]] += fut[self.hi[d]].counts
        while self.lo < k:
            self.lo += 1
            for d, w in self.windows.items():
                if self.lo <= self.hi[d]:
                    w[self.read_life[self.lo]] -= fut[self.lo].counts

    def decide(self, now):
        """Moves for the next tick, within the migrator's time and DRAM's capacity.

        A block's worth in DRAM is (its reads in the next D ticks, its reads
        in the next ``HORIZON_S``), compared in that order. D is how long a
        block moved out now would wait for the migrator to bring it back:
        one tick when the moves worth making fit one tick's time (then only
        the next tick's reads count, Belady's rule), longer when they do not
        (D = the ticks the wanted moves take, rounded up to a power of two,
        up to the horizon). Next-use time alone ties every block of a running
        request, and a tie never exchanges.

        The coming blocks, best first, are the slower blocks (one move each),
        the next tick's allocations and those of later ticks the migrator
        could not make room for in time if it started then (no move: first
        touch puts them in DRAM if it has room when they come). The slots,
        cheapest first, are DRAM's free room (after the next tick's
        evictions), then the residents, worst first (one move each). The
        i-th coming block takes the i-th slot while it is worth more than the
        slot's resident and the moves fit the migrator's time; a resident's
        demotion goes before the promotion into its slot, so the move list
        cut at the time budget never overfills DRAM (a cut between the two
        leaves room the next tick uses). With time left, residents not read
        within the horizon leave, as many as the allocations of the next
        ``ROOM_S`` need beyond the free room: when allocations outrun the
        migrator, room made early is what lets new blocks land in DRAM."""
        eng = self.eng
        k = eng.k
        fut = eng.future
        empty = np.zeros(0, np.int64), np.zeros(0, np.int8)
        if k + 1 >= len(fut):
            return empty
        self._slide(k)
        nxt = fut[k + 1]
        cap = int(eng.cap_blocks[0])
        gone = nxt.evict[eng.tier[nxt.evict] == 0]  # evicted at the next tick's start, before its allocations
        free = max(0, cap - int(eng.occ[0]) + int(gone.size))
        move_ns = float(eng.mig_ns[eng.mig_ns > 0].min())
        budget = int(eng.tick_s * 1e9 // move_ns)
        alive = eng.alive.copy()
        alive[gone] = False
        res = np.flatnonzero(alive & (eng.tier == 0))
        slow = np.flatnonzero(alive & (eng.tier > 0))
        lr, ls, la = self.life[res], self.life[slow], self.alloc_life[k + 1]
        nfut = min(self.room_ticks, len(fut) - k - 2)
        if nfut > 0:
            per = np.diff(self.alloc_cum[k + 2 : k + 3 + nfut])
            deficit = int(max(0, (np.cumsum(per) - budget * np.arange(1, nfut + 1)).max()))
        else:
            deficit = 0
        later = self.alloc_flat[self.alloc_cum[k + 2] : self.alloc_cum[k + 2] + deficit] if deficit else self.alloc_flat[:0]
        wh = self.window
        scale = 1.0 + max(wh[lr].max(initial=0.0), wh[ls].max(initial=0.0), wh[la].max(initial=0.0))

        def values(d):
            w = self.windows[d]
            return [w[x] * scale + wh[x] for x in (lr, ls, la, later)]

        want = self._plan(values(self.spans[0]), res, slow, free, budget, demand=True)
        d = next((x for x in self.spans if x >= want / max(budget, 1)), self.horizon)
        rows, is_down = self._plan(values(d), res, slow, free, budget)
        left = budget - rows.size
        w_res = wh[lr]
        if left > 0:
            coming = int(self.alloc_cum[min(k + 2 + self.room_ticks, len(fut))] - self.alloc_cum[k + 1])
            room_after = free + int(is_down.sum()) - int((~is_down).sum())
            need = min(left, coming - room_after)
            if need > 0:
                idle = (w_res == 0) & ~np.isin(res, rows)
                extra = res[idle][:need]
                rows = np.concatenate([rows, extra])
                is_down = np.concatenate([is_down, np.ones(extra.size, bool)])
        if rows.size == 0:
            return empty
        dst = np.zeros(rows.size, np.int8)
        dst[is_down] = eng.demote_target(rows[is_down])
        return rows, dst

    def _plan(self, vals, res, slow, free, budget, demand=False):
        """The pairing of decide: (rows, which are demotions), in plan order;
        with ``demand``, only how many moves the pairs worth making take."""
        w_res, w_slow, w_new, w_later = vals
        lim = budget * self.horizon if demand else budget
        want = w_slow > 0
        slow, w_slow = slow[want], w_slow[want]
        top = _best(np.arange(slow.size), w_slow, lim, ascending=False)
        slow, w_slow = slow[top], w_slow[top]
        v_in = np.concatenate([w_new, w_later, w_slow])
        is_promo = np.concatenate([np.zeros(w_new.size + w_later.size, bool), np.ones(slow.size, bool)])
        ids_in = np.concatenate([np.full(w_new.size + w_later.size, -1, np.int64), slow])
        order = np.lexsort((is_promo, -v_in))
        v_in, is_promo, ids_in = v_in[order], is_promo[order], ids_in[order]
        worst = _best(np.arange(res.size), w_res, lim, ascending=True)
        slot_ids, slot_v = res[worst], w_res[worst]
        n = min(v_in.size, free + worst.size)
        v_in, is_promo, ids_in = v_in[:n], is_promo[:n], ids_in[:n]

        def pair(m):
            s_id = np.full(m, -1, np.int64)
            s_v = np.zeros(m)
            tail = max(0, m - free)
            s_id[m - tail:] = slot_ids[:tail]
            s_v[m - tail:] = slot_v[:tail]
            return s_id, s_v

        s_id, s_v = pair(n)
        gain = v_in - s_v
        cost = is_promo.astype(np.int64) + (s_id >= 0)
        good = np.flatnonzero(gain > 0)
        if demand:
            return int(cost[good].sum())
        spent = np.cumsum(cost[good])
        chosen = good[spent - cost[good] < budget]  # the last may be cut between its demotion and promotion
        v_in, is_promo, ids_in = v_in[chosen], is_promo[chosen], ids_in[chosen]
        s_id, s_v = pair(chosen.size)
        ok = v_in > s_v
        down = np.where(ok, s_id, -1)
        up = np.where(ok & is_promo, ids_in, -1)
        rows = np.column_stack([down, up]).ravel()
        is_down = np.tile(np.array([True, False]), down.size)
        keep = rows >= 0
        rows, is_down = rows[keep][:budget], is_down[keep][:budget]
        return rows, is_down


def _key(nu: np.ndarray, nc: np.ndarray) -> np.ndarray:
    """Sooner next read first; within a tick, more reads first."""
    return nu - 0.99 * nc / (1.0 + nc)


class NextUsePlanner(SimPolicy):
    """Ranks blocks by when they are read next (Belady's rule); see decide."""

    name = "next-use"
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


class FeasibleOracle(SimPolicy):
    """The better of the planners' schedules (module docstring): each is run
    on its own engine over the same trace at attach, then the one with the
    higher DRAM hit ratio is replayed as this policy."""

    name = "feasible-oracle"
    needs_future = True
    PLANNERS = (HorizonPlanner, NextUsePlanner)

    def __init__(self, planners=None):
        self.planners = tuple(planners or self.PLANNERS)
        self.tried: dict[str, float] = {}

    def attach(self, eng):
        from .runner import Engine

        super().attach(eng)
        best = self.planners[0]
        if len(self.planners) > 1:
            for cls in self.planners:
                self.tried[cls.name] = Engine(eng.source, eng.cfg).run(cls()).fast_hit
            best = max(self.planners, key=lambda cls: self.tried[cls.name])
        self.planner = best()
        self.planner.attach(eng)

    def place(self, rows):
        return self.planner.place(rows)

    def observe(self, rows, counts, times, now):
        self.planner.observe(rows, counts, times, now)

    def freed(self, rows):
        self.planner.freed(rows)

    def decide(self, now):
        return self.planner.decide(now)


def _best(idx: np.ndarray, key: np.ndarray, k: int, ascending: bool) -> np.ndarray:
    """The ``k`` entries of ``idx`` with the lowest (or highest) ``key``, in that order."""
    if idx.size == 0 or k <= 0:
        return idx[:0]
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
