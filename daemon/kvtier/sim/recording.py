"""kvtierd recordings (kvtier/record.py) as simulator input.

A recording is kvtier-sim's CSV trace format plus ``#`` lines the plain
reader skips: ``# place`` (a block's tier when it changed, and why), ``# obs``
(hotness-source observations), ``# tick`` / ``# job`` / ``# move`` (the
engine's tick clock and what its migrator was given and did), ``# tiers`` / ``# policy`` / ``# meta`` (the
configuration in force). ``load`` reads a recording directory (the rotated
files oldest first: kvtier.csv.N ... kvtier.csv.1, kvtier.csv) or one file and
returns:

* ``trace``: the alloc/access/free records, ids made dense; the alloc lines
  a rotated file starts with are dropped for blocks already live;
* ``sim_config()`` / ``settings()``: the recorded tiers (kvtier's effective
  capacity, i.e. ``policy.capacity`` applied) and policy, so a replay with no
  other option asks "what did kvtier do here", and ``--dram-gib`` / ``--set``
  ask "what would it have done";
* ``live_fast_hit``: the share of hinted accesses that found their block in
  tier 0 at the moment the hint arrived, from the ``# place`` lines written
  before it — what the daemon's kvtier_tier_hit_ratio{tier="dram"} measured;
* ``machine()``: the recorded machine (``model.RecordedMachine``): the tick
  times, per tier pair the migrator's throughput and fixed cost per batch
  (a least-squares fit of the mover's seconds against bytes over the jobs,
  or bytes / seconds when the jobs do not vary enough to fit), the job
  overhead beyond the batches (median of finish - plan - batch seconds); a
  job still running when the recording ends counts as having taken until
  then (a lower bound, used where no finished job of its pair fits); each
  job's own time from plan to results (a replay job planned at the same
  tick with the same blocks per pair takes it); and whether reads fault swapped blocks back (some ``seen`` place line brought
  a block from swap into memory, or no hinted read ever found one in swap).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from ..errors import InvalidArgument
from ..policy import PolicyConfig
from .model import DEFAULT_SWAP, DEFAULT_TIERS, GIB, RecordedMachine, SimConfig, SimTier
from .trace import CSV_MAGIC, OP_ALLOC, OP_FREE, OP_NAMES, Trace

FILE_NAME = "kvtier.csv"  # kvtier.record.FILE_NAME
RECORDER_TAG = "recorder=kvtierd"
_ROTATED = re.compile(rf"^{re.escape(FILE_NAME)}\.(\d+)$")


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        rotated = sorted((int(m.group(1)), p) for p in path.iterdir() if (m := _ROTATED.match(p.name)))
        out = [p for _, p in reversed(rotated)]
        if (path / FILE_NAME).exists():
            out.append(path / FILE_NAME)
        if not out:
            raise InvalidArgument(f"{path}: no {FILE_NAME} recording in this directory")
        return out
    return [path]


def is_recording(path: str | Path) -> bool:
    p = Path(path)
    try:
        first = _files(p)[0]
        with open(first, errors="replace") as f:  # an .npz trace is binary
            line = f.readline(200)
    except (OSError, InvalidArgument):
        return False
    return line.startswith(CSV_MAGIC) and RECORDER_TAG in line


def _kind(kind: str) -> SimTier:
    base = {t.kind: t for t in (*DEFAULT_TIERS, DEFAULT_SWAP)}
    return base.get(kind, base["cxl"])  # plain far memory: CXL-like figures


@dataclass
class Recording:
    trace: Trace
    tiers: list[tuple[str, str, int]]  # name, kind, capacity (as kvtier saw them, last recorded)
    policy: dict  # PolicyConfig fields as recorded
    meta: dict = field(default_factory=dict)  # tick_s, tau_s
    live_fast_hit: float | None = None
    hinted_accesses: float = 0.0
    files: list[str] = field(default_factory=list)
    tick_times: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ticks_busy: int = 0  # ticks the live mover was still busy (no plan)
    # (tick time, the temperatures' last decay before it, that step) where a tick line says
    tick_clock: tuple = ()
    # per move line: t0, t1, src, dst, blocks, bytes, ok_blocks, ok_bytes, failed_pages, seconds
    moves: np.ndarray = field(default_factory=lambda: np.zeros((0, 10)))
    # jobs still running at the end, per pair: t0, end of recording, src, dst, blocks, bytes, 0, 0, 0,
    # their share (by bytes) of the time from t0 to the end
    unfinished: np.ndarray = field(default_factory=lambda: np.zeros((0, 10)))
    fault_ins: int = 0  # blocks a measurement found back in memory from swap, with no move
    hinted_in_swap: float = 0.0  # hinted accesses that found their block in swap
    first_tier: np.ndarray | None = None  # per dense block id: first measured tier (-1: never)

    def machine(self) -> RecordedMachine | None:
        """The recorded migrator and tick clock; None for a recording
        without ``# move`` / ``# tick`` lines (older recorders)."""
        if not self.tick_times.size and not self.moves.size and not self.unfinished.size:
            return None
        bps, lat = {}, {}
        mv, un = self.moves, self.unfinished
        both = np.concatenate([mv, un])
        for s, d in {(int(a), int(b)) for a, b in both[:, 2:4]}:
            m = mv[(mv[:, 2] == s) & (mv[:, 3] == d) & (mv[:, 9] > 0)]
            x, y = m[:, 5], m[:, 9]
            fit = None
            if m.shape[0] >= 3 and np.ptp(x) > 0.25 * x.mean():
                slope, icpt = np.polyfit(x, y, 1)
                if slope > 0 and icpt >= 0:
                    fit = (1.0 / slope, float(icpt))
            if fit is None:
                a = both[(both[:, 2] == s) & (both[:, 3] == d) & (both[:, 9] > 0)]
                if not a.size:
                    continue
                fit = (float(a[:, 5].sum() / a[:, 9].sum()), 0.0)
            bps[(s, d)], lat[(s, d)] = fit
        overhead = 0.0
        if mv.size:
            jobs, inv = np.unique(mv[:, 0:2], axis=0, return_inverse=True)
            batch = np.bincount(inv.ravel(), weights=mv[:, 9], minlength=jobs.shape[0])
            overhead = float(max(0.0, np.median(jobs[:, 1] - jobs[:, 0] - batch)))
        swap_faults = self.fault_ins > 0 or self.hinted_in_swap == 0
        jobs: dict = {}
        for rows in (mv, un):
            if not rows.size:
                continue
            starts, inv = np.unique(rows[:, 0], return_inverse=True)
            for k, t0 in enumerate(starts.tolist()):
                m = rows[inv.ravel() == k]
                key = RecordedMachine.job_key(t0, ((a, b, n) for a, b, n in m[:, 2:5].tolist()))
                jobs[key] = float(m[0, 1] - t0)
        return RecordedMachine(tuple(self.tick_times.tolist()), bps, lat, overhead, swap_faults, jobs,
                               tick_clock=self.tick_clock)

    def effective_capacity(self, index: int, capacity: int) -> int:
        cap = (self.policy.get("capacity") or {}).get(index)
        if cap is None:
            return capacity
        return int(min(capacity, cap if cap > 1 else cap * capacity))

    def sim_config(self, dram_gib: float | None = None, second_gib: float | None = None,
                   tick_s: float | None = None, migrator: str = "recorded") -> SimConfig:
        """The recorded tiers; ``dram_gib`` / ``second_gib`` resize tier 0 / 1
        (kvtier-sim's --dram-gib / --cxl-gib), ``tick_s`` the tick (every
        ``tick_s`` instead of the recorded tick times). ``migrator``:
        ``recorded`` runs the recorded machine's migrator (when the recording
        has one), ``model`` the tier model's per-tick budget."""
        if not self.tiers:
            raise InvalidArgument("the recording names no tiers (no '# tiers' line)")
        tiers = [replace(_kind(kind), name=name, kind=kind, capacity_bytes=max(1, self.effective_capacity(i, cap)))
                 for i, (name, kind, cap) in enumerate(self.tiers)]
        for i, gib in ((0, dram_gib), (1, second_gib)):
            if gib is not None and i < len(tiers):
                tiers[i] = replace(tiers[i], capacity_bytes=max(1, int(gib * GIB)))
        mach = self.machine() if migrator == "recorded" else None
        if mach is not None and tick_s:
            mach = replace(mach, tick_times=(), tick_clock=())
        if mach is not None and dram_gib is None and second_gib is None:
            mach = replace(mach, first_tier=self.first_tier)  # the recorded tiers: the kernel's placement
        return SimConfig(tuple(tiers), float(tick_s or self.meta.get("tick_s", 1.0)), mach)

    def settings(self) -> tuple[PolicyConfig, float, float]:
        """The recorded policy (capacity moved into the sim's tiers)."""
        known = {f.name for f in fields(PolicyConfig)}
        kw = {k: v for k, v in self.policy.items() if k in known and k != "capacity"}
        # recordings from before end_of_run existed: temperatures that only decayed
        return PolicyConfig(**kw), float(self.meta.get("tau_s", 30.0)), float(self.meta.get("end_of_run", 0.0))

    def summary(self) -> str:
        live = "-" if self.live_fast_hit is None else f"{self.live_fast_hit:.1%}"
        text = (f"recording: {len(self.files)} file(s), {self.hinted_accesses:g} hinted accesses; "
                f"live DRAM hit ratio (daemon, at each hint) {live}")
        m = self.machine()
        if m is not None:
            jobs = np.unique(self.moves[:, 0:2], axis=0).shape[0] if self.moves.size else 0
            speeds = ", ".join(f"{self.tiers[s][0] if 0 <= s < len(self.tiers) else s}->"
                               f"{self.tiers[d][0] if 0 <= d < len(self.tiers) else d} "
                               f"{m.bytes_per_s[(s, d)] / (1 << 20):.0f} MiB/s + {m.latency_s[(s, d)] * 1e3:.1f} ms"
                               for s, d in sorted(m.bytes_per_s))
            text += (f"\nrecorded machine: {len(m.tick_times)} ticks ({self.ticks_busy} with the mover busy), "
                     f"{jobs} move jobs (+{np.unique(self.unfinished[:, 0]).size} unfinished), overhead {m.overhead_s * 1e3:.1f} ms/job; {speeds or 'no moves'}; "
                     f"reads fault swapped blocks back: {'yes' if m.swap_faults else 'no'}")
        return text

    def machine_doc(self) -> dict | None:
        """The recorded machine for --json."""
        m = self.machine()
        if m is None:
            return None
        return {"ticks": len(m.tick_times), "ticks_busy": self.ticks_busy,
                "move_jobs": int(np.unique(self.moves[:, 0:2], axis=0).shape[0]) if self.moves.size else 0,
                "move_jobs_unfinished": int(np.unique(self.unfinished[:, 0]).size),
                "overhead_s": m.overhead_s, "swap_faults": m.swap_faults,
                "pairs": [{"src": s, "dst": d, "bytes_per_s": m.bytes_per_s[(s, d)], "latency_s": m.latency_s[(s, d)]}
                          for s, d in sorted(m.bytes_per_s)]}


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def load(path: str | Path) -> Recording:
    files = _files(Path(path))
    t_parts, id_parts, op_parts, c_parts = [], [], [], []
    seq_base = 0
    place_id, place_seq, place_tier, place_t = [], [], [], []
    block_bytes = 2 << 20
    tiers: list[tuple[str, str, int]] = []
    policy: dict = {}
    meta: dict = {}
    live: set[int] = set()
    names = {n: i for i, n in enumerate(OP_NAMES)}
    acc_seq = []
    first_started = None
    tick_t: list[float] = []
    tick_clock: list[tuple[float, float, float]] = []
    busy = 0
    moves: list[list[float]] = []
    jobs: list[list[float]] = []
    last_t = 0.0
    last_tier: dict[int, int] = {}
    fault_ins = 0
    swap_idx = None
    region_bytes: dict[int, int] = {}  # block size -> blocks registered with it
    for fi, p in enumerate(files):
        with open(p) as f:
            lines = f.read().splitlines()
        if not lines or not lines[0].startswith(CSV_MAGIC):
            raise InvalidArgument(f"{p}: not a kvtier recording (no '{CSV_MAGIC}' header)")
        started = None
        for kv in lines[0][len(CSV_MAGIC):].split():
            k, _, v = kv.partition("=")
            if k == "block_bytes":
                block_bytes = int(v)
            elif k == "started":
                started = float(v)
        # Files of several daemon runs each start at time 0: line them up by wall clock.
        if started is not None:
            first_started = started if first_started is None else first_started
        offset = 0.0 if started is None else started - first_started
        snapshot = fi > 0  # a rotated-in file starts with allocs of live blocks
        for i, line in enumerate(lines[2:]):
            seq = seq_base + i
            if line.startswith("# place "):
                parts = line.split()
                b, tier = int(parts[3]), int(parts[4])
                cause = parts[5] if len(parts) > 5 else "move"  # older recorders wrote no cause
                if cause == "seen" and swap_idx is not None and last_tier.get(b) == swap_idx \
                        and 0 <= tier != swap_idx:
                    fault_ins += 1  # back from swap without a move: a read faulted it in
                last_tier[b] = tier
                place_id.append(b)
                place_seq.append(seq)
                place_t.append(float(parts[2]) + offset)
                place_tier.append(tier)
                continue
            if line.startswith("# tick "):
                _, _, ts, was_busy, *clock = line.split()  # older recorders wrote no clock
                tick_t.append(float(ts) + offset)
                if len(clock) == 2:
                    tick_clock.append((tick_t[-1], float(clock[0]) + offset, float(clock[1])))
                last_t = max(last_t, tick_t[-1])
                busy += was_busy == "1"
                continue
            if line.startswith("# region "):
                _, _, _t, _rid, nbytes, count = line.split()
                region_bytes[int(nbytes)] = region_bytes.get(int(nbytes), 0) + int(count)
                continue
            if line.startswith("# job "):
                v = [float(x) for x in line.split()[2:7]]
                v[0] += offset
                jobs.append(v)
                continue
            if line.startswith("# move "):
                v = [float(x) for x in line.split()[2:12]]
                v[0] += offset
                v[1] += offset
                moves.append(v)
                last_t = max(last_t, v[1])
                continue
            if line.startswith("# tiers "):
                tiers = [(n, k, int(c)) for n, k, c in (x.split(":") for x in line.split()[3:])]
                swap_idx = next((i for i, (_, k, _) in enumerate(tiers) if k == "swap"), None)
                continue
            if line.startswith("# policy "):
                policy = {k: _parse_value(v) for k, _, v in (x.partition("=") for x in line.split()[3:])}
                continue
            if line.startswith("# meta "):
                meta.update({k: _parse_value(v) for k, _, v in (x.partition("=") for x in line.split()[2:])})
                continue
            if not line or line.startswith("#"):
                continue
            ts, bid, op, cnt = line.split(",")
            b, o = int(bid), names[op]
            if o == OP_ALLOC:
                if snapshot and b in live:
                    continue
                live.add(b)
            elif o == OP_FREE:
                live.discard(b)
            else:
                snapshot = False  # the snapshot is the leading allocs only
                acc_seq.append((seq, b, float(cnt)))
            t_parts.append(float(ts) + offset)
            id_parts.append(b)
            op_parts.append(o)
            c_parts.append(float(cnt))
        seq_base += len(lines)
    if not id_parts:
        raise InvalidArgument(f"{path}: the recording holds no block records")
    if t_parts:
        last_t = max(last_t, max(t_parts))
    if region_bytes:  # the regions' own block size (the simulator models one: the most common)
        block_bytes = max(region_bytes, key=lambda b: (region_bytes[b], b))
    raw = np.asarray(id_parts, dtype=np.int64)
    _, first_idx, inv = np.unique(raw, return_index=True, return_inverse=True)
    rank = np.empty(first_idx.size, dtype=np.int64)
    rank[np.argsort(first_idx, kind="stable")] = np.arange(first_idx.size)
    dense = rank[inv.ravel()]
    op = np.asarray(op_parts, dtype=np.uint8)
    known = np.asarray(place_tier, dtype=np.int64) >= 0  # a place of -1 says "not measured yet"
    first_tier = _first_tier(raw, rank[inv.ravel()], int(first_idx.size), np.asarray(place_id, dtype=np.int64)[known],
                             np.asarray(place_tier, dtype=np.int64)[known])
    t = _known_from(np.asarray(t_parts), dense, op, raw, np.asarray(place_id, dtype=np.int64)[known],
                    np.asarray(place_t, dtype=np.float64)[known])
    order = np.argsort(t, kind="stable")
    trace = Trace(t[order], dense[order], op[order],
                  np.asarray(c_parts, dtype=np.float32)[order], int(first_idx.size), block_bytes,
                  {"recording": [str(p) for p in files]})
    swap = next((i for i, (_, k, _) in enumerate(tiers) if k == "swap"), -2)
    live_hit, hinted, in_swap = _live_hit(acc_seq, place_id, place_seq, place_tier, swap)
    return Recording(trace, tiers, policy, meta, live_hit, hinted, [str(p) for p in files],
                     tick_times=np.sort(np.asarray(tick_t, dtype=np.float64)), ticks_busy=busy,
                     tick_clock=tuple(sorted(tick_clock)),
                     moves=np.asarray(moves, dtype=np.float64).reshape(-1, 10),
                     unfinished=_unfinished(jobs, moves, last_t), fault_ins=fault_ins, hinted_in_swap=in_swap,
                     first_tier=first_tier)


def _first_tier(raw: np.ndarray, dense: np.ndarray, n: int, place_raw: np.ndarray,
                place_tier: np.ndarray) -> np.ndarray:
    """Per dense id, the tier of the block's first ``# place`` (file order)."""
    out = np.full(n, -1, dtype=np.int8)
    if place_raw.size == 0:
        return out
    ids, first = np.unique(place_raw, return_index=True)
    lut_raw, lut_pos = np.unique(raw, return_index=True)
    pos = np.searchsorted(lut_raw, ids)
    ok = (pos < lut_raw.size) & (lut_raw[np.minimum(pos, lut_raw.size - 1)] == ids)
    out[dense[lut_pos[pos[ok]]]] = place_tier[first[ok]]
    return out


def _unfinished(jobs: list, moves: list, end: float) -> np.ndarray:
    """``# job`` lines with no ``# move`` of the same plan time: still running
    at ``end``; each pair gets its byte share of the time since the plan."""
    done = {round(m[0], 6) for m in moves}
    left = [j for j in jobs if round(j[0], 6) not in done]
    out = np.zeros((len(left), 10))
    for i, (t0, s, d, blocks, nbytes) in enumerate(left):
        job_bytes = sum(j[4] for j in left if j[0] == t0) or 1.0
        out[i, :6] = (t0, end, s, d, blocks, nbytes)
        out[i, 9] = max(end - t0, 0.0) * nbytes / job_bytes
    return out


def _known_from(t: np.ndarray, dense: np.ndarray, op: np.ndarray, raw: np.ndarray, place_raw: np.ndarray,
                place_t: np.ndarray) -> np.ndarray:
    """Record times with each ``alloc`` moved to when the daemon first knew
    the block's tier (its first ``# place`` at or after the registration):
    the live policy plans no block before it has measured it, and a replay
    that placed blocks at registration would plan them sooner, before the
    client's first hints. Never later than the block's next record (a hint or
    its free) of that allocation."""
    alloc = np.flatnonzero(op == OP_ALLOC)
    if alloc.size == 0 or place_raw.size == 0:
        return t
    # the next record of the same block after each alloc
    by_block = np.lexsort((np.arange(t.size), t, dense))
    nxt = np.full(t.size, np.inf)
    same = dense[by_block[1:]] == dense[by_block[:-1]]
    nxt[by_block[:-1][same]] = t[by_block[1:][same]]
    # the first place of the same block at or after each alloc: one sorted key (block, time)
    span = float(max(t.max(), place_t.max()) - min(t.min(), place_t.min())) + 1.0
    base = min(t.min(), place_t.min())
    pkey = place_raw.astype(np.float64) * span + (place_t - base)
    porder = np.argsort(pkey, kind="stable")
    pkey, praw = pkey[porder], place_raw[porder]
    akey = raw[alloc].astype(np.float64) * span + (t[alloc] - base)
    pos = np.searchsorted(pkey, akey, side="left")
    hit = pos < pkey.size
    pos_c = np.minimum(pos, pkey.size - 1)
    hit &= praw[pos_c] == raw[alloc]
    first = np.where(hit, place_t[porder][pos_c], t[alloc])
    out = t.copy()
    out[alloc] = np.maximum(t[alloc], np.minimum(first, nxt[alloc]))
    return out


def _live_hit(acc, place_id, place_seq, place_tier, swap: int) -> tuple[float | None, float, float]:
    """Tier of each accessed block at the moment of the access: the last
    ``# place`` of that block written before it (file order is event order).
    Returns the tier-0 share, the accesses, and those that found their block
    in tier ``swap``."""
    if not acc:
        return None, 0.0, 0.0
    a = np.asarray(acc, dtype=np.float64)
    ids = np.concatenate([np.asarray(place_id, dtype=np.int64), a[:, 1].astype(np.int64)])
    seq = np.concatenate([np.asarray(place_seq, dtype=np.int64), a[:, 0].astype(np.int64)])
    is_place = np.arange(ids.size) < len(place_id)
    tier = np.concatenate([np.asarray(place_tier, dtype=np.int64), np.full(len(acc), -1)])
    order = np.lexsort((seq, ids))
    ids, is_place, tier = ids[order], is_place[order], tier[order]
    pos = np.arange(ids.size)
    last = np.maximum.accumulate(np.where(is_place, pos, -1))
    start = np.r_[0, np.flatnonzero(np.diff(ids)) + 1]
    group_start = np.repeat(start, np.diff(np.r_[start, ids.size]))
    valid = last >= group_start
    seen = np.where(valid, tier[np.maximum(last, 0)], -1)
    all_counts = np.concatenate([np.zeros(len(place_id)), a[:, 2]])[order]
    acc_mask = ~is_place
    total = float(all_counts[acc_mask].sum())
    hits = float(all_counts[acc_mask & (seen == 0)].sum())
    in_swap = float(all_counts[acc_mask & (seen == swap)].sum())
    return (hits / total if total else None), total, in_swap
