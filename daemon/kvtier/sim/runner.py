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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgument
from .model import GIB, SimConfig
from .policies import SimPolicy
from .trace import OP_ACCESS, OP_ALLOC, OP_FREE, Trace


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
    def __init__(self, trace: Trace, cfg: SimConfig):
        self.trace = trace
        self.cfg = cfg
        self.n = trace.nblocks
        self.block_bytes = trace.block_bytes
        self.tick_s = cfg.tick_s
        T = len(cfg.tiers)
        self.cap_blocks = np.array([t.capacity_bytes // trace.block_bytes for t in cfg.tiers], dtype=np.int64)
        self.tier = np.full(self.n, -1, dtype=np.int8)
        self.alive = np.zeros(self.n, dtype=bool)
        self.occ = np.zeros(T, dtype=np.int64)
        self.swap = np.array([t.kind == "swap" for t in cfg.tiers])
        nt = int(np.ceil(trace.duration / self.tick_s)) + 1 if len(trace) else 0
        self.edges = np.searchsorted(trace.t, np.arange(nt + 1) * self.tick_s, side="left")
        self.edges[-1] = len(trace)
        self.nticks = nt
        self.k = 0
        self.overflow = 0

    # -- helpers for policies -------------------------------------------------

    def first_touch(self, rows: np.ndarray, skip_fast: bool = False) -> np.ndarray:
        """Fastest tier with room for each new block, in allocation order.

        Swap is never a first-touch target (anonymous memory is allocated in
        RAM); if all memory tiers are full the block lands in the slowest
        memory tier anyway and counts as overflow.
        """
        dst = np.empty(rows.size, dtype=np.int8)
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

    def future_accesses(self, j: int):
        """Aggregated (rows, counts) of tick ``j``: for the offline bound only."""
        if j >= self.nticks:
            return np.zeros(0, np.int64), np.zeros(0)
        lo, hi = self.edges[j], self.edges[j + 1]
        m = self.trace.op[lo:hi] == OP_ACCESS
        rows, inv = np.unique(self.trace.block[lo:hi][m], return_inverse=True)
        return rows, np.bincount(inv, weights=self.trace.count[lo:hi][m])

    # -- the loop -------------------------------------------------------------

    def run(self, policy: SimPolicy) -> Result:
        cfg, tr = self.cfg, self.trace
        T = len(cfg.tiers)
        policy.attach(self)
        served = np.zeros(T)
        moved = np.zeros((T, T), dtype=np.int64)
        fast_t = np.zeros(self.nticks)
        all_t = np.zeros(self.nticks)
        mig_ns = np.array([[self.block_bytes / min(a.migrate_gbps, b.migrate_gbps) for b in cfg.tiers] for a in cfg.tiers])
        mem = np.flatnonzero(~self.swap)
        t0 = time.perf_counter()
        for k in range(self.nticks):
            self.k = k
            lo, hi = self.edges[k], self.edges[k + 1]
            now = (k + 1) * self.tick_s
            op = tr.op[lo:hi]
            blk = tr.block[lo:hi]
            a = blk[op == OP_ALLOC]
            if a.size:
                if self.alive[a].any() or np.unique(a).size != a.size:
                    bad = int(a[self.alive[a]][0]) if self.alive[a].any() else int(a[0])
                    raise InvalidArgument(
                        f"trace: block {bad} allocated while alive around t={tr.t[lo]:.3f}s "
                        f"(freed and reused within one {self.tick_s}s tick? use a smaller tick)"
                    )
                dst = policy.place(a)
                self.tier[a] = dst
                self.alive[a] = True
                self.occ += np.bincount(dst, minlength=T)
            m = op == OP_ACCESS
            rows = blk[m]
            cnt = tr.count[lo:hi][m]
            if rows.size:
                tt = self.tier[rows]
                if (tt < 0).any():
                    bad = int(rows[tt < 0][0])
                    raise InvalidArgument(f"trace: block {bad} accessed while not allocated near t={tr.t[lo]:.3f}s")
                per = np.bincount(tt, weights=cnt, minlength=T)
                served += per
                fast_t[k], all_t[k] = per[0], per.sum()
                if self.swap.any():
                    self._swap_in(np.unique(rows[self.swap[tt]]), mem, moved)
            policy.observe(rows, cnt, tr.t[lo:hi][m], now)  # also when empty: "nothing touched"
            f = blk[op == OP_FREE]
            if f.size:
                policy.freed(f)
                self.occ -= np.bincount(self.tier[f], minlength=T)
                self.tier[f] = -1
                self.alive[f] = False
            rows, dst = policy.decide(now)
            if rows.size:
                self._migrate(policy, np.asarray(rows, np.int64), np.asarray(dst, np.int8), mig_ns, moved, now)
        wall = time.perf_counter() - t0
        res = self._result(policy, served, moved, wall)
        res.timeline = (fast_t, all_t)
        return res

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

    def _migrate(self, policy, rows, dst, mig_ns, moved, now) -> None:
        T = len(self.cap_blocks)
        _, first = np.unique(rows, return_index=True)
        keep = np.zeros(rows.size, bool)
        keep[first] = True
        src = self.tier[rows]
        keep &= self.alive[rows] & (src >= 0) & (src != dst) & (dst >= 0) & (dst < T)
        r, s, d = rows[keep], src[keep].astype(np.int64), dst[keep].astype(np.int64)
        n = r.size
        ok = np.ones(n, bool)
        if not policy.unlimited:
            # one migrator with tick_s of time, moves executed in plan order
            ok &= np.cumsum(mig_ns[s, d]) <= self.tick_s * 1e9
        # capacity along the sequence: the first move that overfills its
        # destination stops the migrator (later ones may depend on it). The
        # offline bound may exchange blocks between two full tiers: only its
        # end state must fit.
        for t in range(T):
            occ = self.occ[t] + np.cumsum((d == t).astype(np.int64) - (s == t))
            if policy.unlimited:
                occ = np.where(np.arange(n) == n - 1, occ, 0) if n else occ
            bad = np.flatnonzero((occ > self.cap_blocks[t]) & ((d == t) | policy.unlimited))
            if bad.size:
                ok[(0 if policy.unlimited else bad[0]) :] = False
        stop = n if ok.all() else int(np.argmin(ok))
        ok[stop:] = False
        r2, s2, d2 = r[ok], s[ok], d[ok]
        if r2.size:
            self.tier[r2] = d2
            self.occ -= np.bincount(s2, minlength=T)
            self.occ += np.bincount(d2, minlength=T)
            np.add.at(moved, (s2, d2), self.block_bytes)
        full_ok = np.zeros(rows.size, bool)
        full_ok[np.flatnonzero(keep)[ok]] = True
        policy.moved(rows, dst, full_ok, now)

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
            accesses=self.trace.accesses,
            overflow_blocks=self.overflow,
        )


def simulate(trace: Trace, cfg: SimConfig, policy: SimPolicy) -> Result:
    return Engine(trace, cfg).run(policy)


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
