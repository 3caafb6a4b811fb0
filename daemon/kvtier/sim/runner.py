"""The simulation engine: replays a trace tick by tick through one policy.

Per tick (``tick_s``), vectorised over all records of the tick:

1. allocations are placed (``policy.place``; first touch = fastest tier with room);
2. accesses are served from the placement as it stands (that is what "hit"
   means: the block sat in the fast tier when it was read); a block read
   from swap is faulted back into the fastest memory tier with room, as the
   kernel does;
3. the policy observes the accesses; frees take effect (a block freed in a
   tick occupies its slot for the whole tick);
4. the policy decides its moves and the modelled migrator executes them in
   order: each move costs ``block_bytes / min(migrate_gbps of src, dst)``
   of the tick's time and must fit the destination's capacity; the first
   move that does not is where the migrator stops for this tick.

With a recorded machine (``SimConfig.machine``, from a kvtierd recording)
the ticks fall at the recorded tick times and step 4 is the daemon's
scheme: the plan becomes one job that takes the recorded migrator's time;
its moves serve the reads of the first tick that are mostly after the
job's end, a tick after the end plans with them, and a tick while it runs
plans nothing. A read of a swapped block
faults it back only if the recording saw reads do so.

A policy that prefetches (``prefetches``: kvtier's client ``prefetch`` at
each request's arrival, request traces only) gets the same migrator inside
the tick: after the plan of the tick before (which had first call on the
migrator's ``tick_s``), each arrival's cached blocks are asked for at the
arrival; when the migrator is free the policy says which of the asked moves
its token buckets pay for (one job), and each block of the job reaches DRAM
at its own time, one after the other at the migrator's rate. Reads of the
block before that time are served from where it was, the rest from DRAM. A
move to a full DRAM is refused (the kernel's ENOMEM). A job still running
at the tick's end keeps the migrator: that tick plans nothing, and
prefetches still waiting for the migrator or tokens go before the next
plan, which waits a tick, as the daemon's tick does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgument
from .model import GIB, SimConfig
from .policies import SimPolicy
from .trace import OP_ALLOC, OP_FREE, Tick, Trace


@dataclass
class Result:
    policy: str
    tiers: list[str]
    served: list[float]  # access counts served per tier
    hit_ratio: list[float]
    migrated_bytes: dict[str, int]  # "src->dst" -> bytes
    mean_ns: float
    p99_ns: float
    decode_penalty: float  # modelled slowdown of KV reads vs all-DRAM
    ticks: int
    sim_s: float
    wall_s: float
    accesses: int
    overflow_blocks: int  # placements that found every tier full
    extra: dict = field(default_factory=dict)
    # fast-tier reads and all reads per tick (for the timeline plot; not in --json)
    timeline: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    @property
    def fast_hit(self) -> float:
        return self.hit_ratio[0]


class Engine:
    """Replays a tick source (``Trace`` or ``RequestTrace``: ``nblocks``,
    ``block_bytes``, ``ticks(tick_s)``) through one policy. The ticks are
    consumed as they are generated; only a policy that reads the future (the
    oracles, ``needs_future``) makes the engine hold them all."""

    def __init__(self, source, cfg: SimConfig):
        self.source = source
        self.cfg = cfg
        self.n = int(source.nblocks)
        self.block_bytes = int(source.block_bytes)
        self.tick_s = cfg.tick_s
        T = len(cfg.tiers)
        self.cap_blocks = np.array([t.capacity_bytes // self.block_bytes for t in cfg.tiers], dtype=np.int64)
        self.tier = np.full(self.n, -1, dtype=np.int8)
        self.alive = np.zeros(self.n, dtype=bool)
        self.occ = np.zeros(T, dtype=np.int64)
        self.swap = np.array([t.kind == "swap" for t in cfg.tiers])
        self.future: list[Tick] | None = None  # all ticks, for oracles only
        self.k = 0
        self.overflow = 0
        # one migrator: tick_s of time per tick, a move costs block / min(gbps of both)
        self.mig_ns = np.array(
            [[self.block_bytes / min(a.migrate_gbps, b.migrate_gbps) for b in cfg.tiers] for a in cfg.tiers]
        )

    # -- helpers for policies -------------------------------------------------

    def first_touch(self, rows: np.ndarray, skip_fast: bool = False) -> np.ndarray:
        """Fastest tier with room for each new block, in allocation order.

        Swap is never a first-touch target (anonymous memory is allocated in
        RAM); if all memory tiers are full the block lands in the slowest
        memory tier anyway and counts as overflow.
        """
        dst = np.empty(rows.size, dtype=np.int8)
        mach = self.cfg.machine
        if mach is not None and mach.first_tier is not None and not skip_fast:
            # where the recording's kernel put them (over kvtier's capacity too, as live)
            seen = mach.first_tier[rows]
            known = (seen >= 0) & (seen < len(self.cap_blocks))
            if known.any():
                dst[known] = seen[known]
                if not known.all():
                    dst[~known] = self.first_touch(rows[~known])
                return dst
        pos = 0
        mem = [i for i in range(len(self.cap_blocks)) if not self.swap[i]]
        for i in mem:
            if skip_fast and i == 0 and len(mem) > 1:
                continue
            take = min(max(0, int(self.cap_blocks[i] - self.occ[i])), rows.size - pos)
            dst[pos : pos + take] = i
            pos += take
        if pos < rows.size:
            dst[pos:] = mem[-1]
            self.overflow += rows.size - pos
        return dst

    def demote_target(self, rows: np.ndarray) -> np.ndarray:
        """For policies without their own cascade: the nearest slower tier with
        room, filled in row order (the next tier down if none has room)."""
        T = len(self.cap_blocks)
        src = self.tier[rows].astype(np.int64)
        dst = np.minimum(src + 1, T - 1)
        room = np.maximum(self.cap_blocks - self.occ, 0)
        done = np.zeros(rows.size, bool)
        for t in range(1, T):
            m = np.flatnonzero(~done & (src < t))
            take = m[: int(room[t])]
            dst[take] = t
            done[take] = True
        return dst.astype(np.int8)

    # -- the loop -------------------------------------------------------------

    def run(self, policy: SimPolicy) -> Result:
        cfg = self.cfg
        T = len(cfg.tiers)
        mach = cfg.machine
        times = mach.tick_times if mach is not None else ()
        # where the daemon's temperature clock stood at ticks whose predecessor the recording lacks
        clock_at = {t: (at, step) for t, at, step in mach.tick_clock} if mach is not None and len(times) else {}
        bounds = self.source.tick_bounds(self.tick_s, times) if len(times) else None
        ticks = self.source.ticks(self.tick_s, times) if len(times) else self.source.ticks(self.tick_s)
        self.job = None  # recorded machine: (end time, rows, dst) of the move job in flight
        self.jobs = self.busy_ticks = 0
        # prefetches: the job in flight (rows, src, when each is done, made: DRAM had room; the job's end)
        self.flight: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float] | None = None
        self.mig_free = 0.0
        self.prefetch_counts = np.zeros(3, dtype=np.int64)  # asked, moved, refused for want of DRAM
        timed = bool(getattr(policy, "prefetches", False) and getattr(self.source, "has_arrivals", False)
                     and mach is None)
        if timed:
            ticks = self.source.ticks(self.tick_s, timed=True)
            self._pos = np.full(self.n, -1, dtype=np.int64)
        if policy.needs_future:
            self.future = list(ticks)
            ticks = iter(self.future)
        policy.attach(self)
        served = np.zeros(T)
        moved = np.zeros((T, T), dtype=np.int64)
        fast_t: list[float] = []
        all_t: list[float] = []
        mem = np.flatnonzero(~self.swap)
        reads = 0
        t0 = time.perf_counter()
        k = -1
        for k, tk in enumerate(ticks):
            self.k = k
            now = (k + 1) * self.tick_s if bounds is None else float(bounds[k + 1])
            if now in clock_at:
                policy.clock(*clock_at[now])  # before the tick's reads, which all came after that decay
            if self.job is not None and bounds is not None and self.job[0] <= (bounds[k] + now) / 2:
                self._land(policy, moved)  # the job ended before most of this tick's reads
            if tk.evict.size:
                self._free(policy, tk.evict, k)
            a = tk.alloc
            if a.size:
                if self.alive[a].any() or np.unique(a).size != a.size:
                    bad = int(a[self.alive[a]][0]) if self.alive[a].any() else int(a[0])
                    raise InvalidArgument(
                        f"trace: block {bad} allocated while alive around t={k * self.tick_s:.3f}s "
                        f"(freed and reused within one {self.tick_s}s tick? use a smaller tick)"
                    )
                dst = policy.place(a)
                self.tier[a] = dst
                self.alive[a] = True
                self.occ += np.bincount(dst, minlength=T)
            flights = self._prefetch(policy, tk, now - self.tick_s, now, moved) if timed else []
            rows, cnt = tk.rows, tk.counts
            f0 = tot = 0.0
            if rows.size:
                tt = self.tier[rows]
                if (tt < 0).any():
                    bad = int(rows[tt < 0][0])
                    raise InvalidArgument(f"trace: block {bad} accessed while not allocated near t={k * self.tick_s:.3f}s")
                per = np.bincount(tt, weights=cnt, minlength=T)
                if flights:
                    per = self._before_moves(tk, flights, per)
                served += per
                f0, tot = float(per[0]), float(per.sum())
                reads += rows.size
                if self.swap.any() and (mach is None or mach.swap_faults):
                    self._swap_in(rows[self.swap[tt]], mem, moved)
            fast_t.append(f0)
            all_t.append(tot)
            policy.observe(rows, cnt, tk.last_t, now)  # also when empty: "nothing touched"
            if tk.acquired.size or tk.released.size:
                policy.lifecycle(tk.acquired, tk.released, now)
            if tk.free.size:
                self._free(policy, tk.free, k)
            if self.job is not None and self.job[0] <= now:
                self._land(policy, moved)  # done before this tick: the daemon plans with its results
            if self.job is not None or self.flight is not None:
                self.busy_ticks += 1  # the mover still runs: no plan this tick, as in the daemon
                continue
            if timed and policy.has_scheduled() and self._start_prefetch(policy, now, moved, []):
                continue  # scheduled moves first; the plan waits for the next tick
            rows, dst = policy.decide(now)
            if rows.size:
                used = self._migrate(policy, np.asarray(rows, np.int64), np.asarray(dst, np.int8), moved, now)
                self.mig_free = now + used
        if self.job is not None:
            self._land(policy, moved)
        wall = time.perf_counter() - t0
        self.nticks = k + 1
        self.records = reads
        res = self._result(policy, served, moved, wall)
        res.timeline = (np.asarray(fast_t), np.asarray(all_t))
        if mach is not None:
            res.extra.update(move_jobs=self.jobs, ticks_busy=self.busy_ticks)
        if timed:
            res.extra.update(prefetch_blocks_asked=int(self.prefetch_counts[0]),
                             prefetch_blocks_moved=int(self.prefetch_counts[1]),
                             prefetch_blocks_refused=int(self.prefetch_counts[2]), ticks_busy=self.busy_ticks)
        return res

    # -- prefetches inside a tick ----------------------------------------------

    def _prefetch(self, policy, tk: Tick, t0: float, t1: float, moved) -> list:
        """The tick's arrivals ask for their cached blocks, in time order, and
        the migrator runs the jobs the policy's tokens pay for while it is
        free. Returns the jobs that ran during the tick (for the reads)."""
        flights = [self.flight] if self.flight is not None else []
        asked_t = tk.prefetch_t
        cuts = np.flatnonzero(np.diff(asked_t)) + 1  # one prefetch message per arrival time
        starts = np.concatenate([[0], cuts]).astype(np.int64) if asked_t.size else np.zeros(0, np.int64)
        ends = np.append(starts[1:], asked_t.size).astype(np.int64)
        i = 0
        while True:
            if self.flight is not None:
                rows, src, done_at, made, end = self.flight
                if end > t1:
                    break  # still running at the tick's end
                self.flight = None
                self.mig_free = end
                policy.scheduled_moved(rows, made, end)
            free_at = max(self.mig_free, t0)
            while i < starts.size and asked_t[starts[i]] <= free_at:
                msg = tk.prefetch_rows[starts[i]:ends[i]]
                self.prefetch_counts[0] += msg.size
                policy.schedule(msg, float(asked_t[starts[i]]))
                i += 1
            if policy.has_scheduled() and self._start_prefetch(policy, free_at, moved, flights):
                continue
            if i == starts.size:
                break
            self.mig_free = float(asked_t[starts[i]])  # idle (or out of tokens) until the next arrival
        return flights

    def _start_prefetch(self, policy, at: float, moved, flights: list) -> bool:
        """One job of the moves the policy's tokens pay for at ``at`` (to
        DRAM, each as far as DRAM has room, one after the other at the
        migrator's rate); False if they pay for none."""
        rows = np.asarray(policy.scheduled_job(at), dtype=np.int64)
        if rows.size == 0:
            return False
        src = self.tier[rows].astype(np.int64)
        live = self.alive[rows] & (src > 0)  # the policy's table lags the engine by a tick's evictions
        rows, src = rows[live], src[live]
        room = max(0, int(self.cap_blocks[0] - self.occ[0]))
        made = np.arange(rows.size) < room
        self.prefetch_counts[1] += int(made.sum())
        self.prefetch_counts[2] += int((~made).sum())
        # the block is DRAM's from the job's start (its room taken), its reads from src until done_at
        done_at = at + np.cumsum(np.where(made, self.mig_ns[src, 0], 0.0)) / 1e9
        self._apply(rows[made], src[made], np.zeros(int(made.sum()), dtype=np.int64), moved)
        self.flight = (rows, src, done_at, made, float(done_at[-1]) if rows.size else at)
        self.mig_free = self.flight[4]
        flights.append(self.flight)
        return True

    def _before_moves(self, tk: Tick, flights: list, per: np.ndarray) -> np.ndarray:
        """``per`` (reads per tier, as placed at the tick's end) with the reads
        of each prefetched block before its move ended served from its old tier."""
        rows = np.concatenate([f[0][f[3]] for f in flights])
        if rows.size == 0 or tk.reads is None:
            return per
        src = np.concatenate([f[1][f[3]] for f in flights])
        done_at = np.concatenate([f[2][f[3]] for f in flights])
        early = tk.reads.before(rows, done_at, self._pos)
        per = per.copy()
        per[0] -= early.sum()
        np.add.at(per, src, early)
        return per

    def _free(self, policy, f: np.ndarray, k: int) -> None:
        if not self.alive[f].all():
            bad = int(f[~self.alive[f]][0])
            raise InvalidArgument(f"trace: block {bad} freed while not allocated near t={k * self.tick_s:.3f}s")
        if self.flight is not None:
            # a slot evicted while its prefetch runs: the move is of contents now gone
            keep = ~np.isin(self.flight[0], f)
            self.flight = (*(a[keep] for a in self.flight[:4]), self.flight[4])
        policy.freed(f)
        self.occ -= np.bincount(self.tier[f], minlength=self.occ.size)
        self.tier[f] = -1
        self.alive[f] = False

    def _swap_in(self, rows, mem, moved) -> None:
        for i in mem:
            if rows.size == 0:
                break
            take = rows[: max(0, int(self.cap_blocks[i] - self.occ[i]))]
            if take.size:
                src = self.tier[take]
                np.add.at(moved, (src, np.full(take.size, i)), self.block_bytes)
                self.occ -= np.bincount(src, minlength=self.occ.size)
                self.occ[i] += take.size
                self.tier[take] = i
            rows = rows[take.size :]

    def _migrate(self, policy, rows, dst, moved, now) -> float:
        """The plan's moves in order within the tick's migrator time; returns the seconds it used."""
        mig_ns = self.mig_ns
        T = len(self.cap_blocks)
        _, first = np.unique(rows, return_index=True)
        keep = np.zeros(rows.size, bool)
        keep[first] = True
        src = self.tier[rows]
        keep &= self.alive[rows] & (src >= 0) & (src != dst) & (dst >= 0) & (dst < T)
        r, s, d = rows[keep], src[keep].astype(np.int64), dst[keep].astype(np.int64)
        n = r.size
        mach = self.cfg.machine
        if mach is not None:
            # the daemon's mover: the whole plan as one job, landing when it ends
            end = now + mach.job_seconds(s, d, np.full(n, self.block_bytes), self.cfg.tiers, planned=now)
            self.job = (end, rows, dst, src, keep)
            self.jobs += bool(n)
            if not n:
                self._land(policy, moved)  # nothing to move: no job, the plan is answered now
            return 0.0
        # one migrator with tick_s of time, moves executed in plan order
        ok = np.cumsum(mig_ns[s, d]) <= self.tick_s * 1e9
        # capacity along the sequence: the first move that overfills its
        # destination stops the migrator (later ones may depend on it)
        for t in range(T):
            occ = self.occ[t] + np.cumsum((d == t).astype(np.int64) - (s == t))
            bad = np.flatnonzero((occ > self.cap_blocks[t]) & (d == t))
            if bad.size:
                ok[bad[0] :] = False
        stop = n if ok.all() else int(np.argmin(ok))
        ok[stop:] = False
        self._apply(r[ok], s[ok], d[ok], moved)
        full_ok = np.zeros(rows.size, bool)
        full_ok[np.flatnonzero(keep)[ok]] = True
        policy.moved(rows, dst, full_ok, now)
        return float(mig_ns[s[ok], d[ok]].sum()) / 1e9

    def _apply(self, r, s, d, moved) -> None:
        if r.size:
            self.tier[r] = d
            self.occ -= np.bincount(s, minlength=self.occ.size)
            self.occ += np.bincount(d, minlength=self.occ.size)
            np.add.at(moved, (s, d), self.block_bytes)

    def _land(self, policy, moved) -> None:
        """The recorded machine's job in flight ends: its moves take effect,
        each if its block is still where it was planned from (a fault or a
        free meanwhile)."""
        end, rows, dst, planned_src, keep = self.job
        self.job = None
        s = self.tier[rows].astype(np.int64)
        d = dst.astype(np.int64)
        # No capacity check: the daemon's mover makes every move of its plan
        # (kvtier's capacity is the plan's to keep; only the kernel's memory
        # could refuse, which a recording does not know).
        ok = keep & self.alive[rows] & (s == planned_src)
        self._apply(rows[ok], s[ok], d[ok], moved)
        policy.moved(rows, dst, ok, end)

    def _result(self, policy, served, moved, wall) -> Result:
        cfg = self.cfg
        total = float(served.sum()) or 1.0
        ns = np.array([t.access_ns(self.block_bytes) for t in cfg.tiers])
        mean = float((served * ns).sum() / total)
        order = np.argsort(ns)
        cum = np.cumsum(served[order]) / total
        p99 = float(ns[order][min(int(np.searchsorted(cum, 0.99, side="left")), len(ns) - 1)])
        names = [t.name for t in cfg.tiers]
        mig = {f"{names[i]}->{names[j]}": int(moved[i, j]) for i in range(len(names)) for j in range(len(names)) if moved[i, j]}
        return Result(
            policy=policy.name,
            tiers=names,
            served=served.tolist(),
            hit_ratio=(served / total).tolist(),
            migrated_bytes=mig,
            mean_ns=mean,
            p99_ns=p99,
            decode_penalty=mean / ns[0] - 1.0,
            ticks=self.nticks,
            sim_s=self.nticks * self.tick_s,
            wall_s=wall,
            accesses=self.records,
            overflow_blocks=self.overflow,
        )


def simulate(source, cfg: SimConfig, policy: SimPolicy) -> Result:
    """Replay ``source`` (a ``Trace`` or a ``RequestTrace``) through ``policy``."""
    return Engine(source, cfg).run(policy)


def capacity_cost(trace: Trace, cfg: SimConfig) -> dict:
    """Max concurrent sequences and $/sequence, DRAM-only vs DRAM + the other memory tiers.

    A sequence's footprint is the trace's live blocks per live conversation
    (generator meta ``blocks_per_seq``, shared prefixes amortised); without
    it, the peak live footprint divided by ``seqs`` (meta) or 1.
    """
    bps = float(trace.meta.get("blocks_per_seq") or 0.0)
    if bps <= 0:
        ops = np.where(trace.op == OP_ALLOC, 1, np.where(trace.op == OP_FREE, -1, 0))
        bps = float(np.cumsum(ops).max()) if ops.size else 1.0
    seq_bytes = bps * trace.block_bytes
    dram = cfg.tiers[0]
    mem = [t for t in cfg.tiers if t.kind != "swap"]
    d_seqs = int(dram.capacity_bytes // seq_bytes)
    m_bytes = sum(t.capacity_bytes for t in mem)
    m_seqs = int(m_bytes // seq_bytes)
    d_cost = dram.capacity_bytes / GIB * 1.073741824 * dram.usd_per_gb
    m_cost = sum(t.capacity_bytes / GIB * 1.073741824 * t.usd_per_gb for t in mem)
    return {
        "seq_gib": seq_bytes / GIB,
        "dram_only": {"max_seqs": d_seqs, "usd": d_cost, "usd_per_seq": d_cost / max(d_seqs, 1)},
        "tiered": {
            "tiers": [t.name for t in mem],
            "max_seqs": m_seqs,
            "usd": m_cost,
            "usd_per_seq": m_cost / max(m_seqs, 1),
        },
    }
