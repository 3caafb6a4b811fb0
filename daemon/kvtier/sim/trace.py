"""KV-block access traces: the in-memory form and the two file formats.

A trace is four parallel arrays sorted by time:

    t      float64  seconds since the start
    block  int64    block id, 0 <= id < nblocks (ids are reused after a free)
    op     uint8    OP_ALLOC, OP_ACCESS or OP_FREE
    count  float32  accesses this record stands for (decode steps aggregated); 0 for alloc/free

plus ``nblocks`` (size of the id space, the KV pool) and ``block_bytes``.

Files:
- ``.npz`` (numpy): arrays ``t, block, op, count`` and scalars ``nblocks,
  block_bytes``; ``meta`` holds the generator's parameters as a JSON string.
- ``.csv``: a header line ``# kvtier-trace nblocks=N block_bytes=B``, then
  ``time,block,op,count`` (optional header key ``blocks_per_seq``) with op one of ``alloc``/``access``/``free``. Handy
  for recordings from a real engine: ids may be any integers, they are mapped
  to dense ids in order of first appearance.

Contract the simulator relies on: an id is allocated before it is accessed,
freed at most once per allocation, and not reallocated within the same tick
as its free (the generator reuses ids first-in first-out, so this holds).

The engine does not read these arrays directly: it consumes ``Tick``s, one per
simulator tick, from any source with ``nblocks``, ``block_bytes`` and
``ticks(tick_s)`` (``Trace.ticks`` cuts the arrays; ``kvtier.sim.requests``
generates ticks lazily from request traces such as Mooncake's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InvalidArgument

OP_ALLOC, OP_ACCESS, OP_FREE = 0, 1, 2
OP_NAMES = ("alloc", "access", "free")
CSV_MAGIC = "# kvtier-trace"


def _none() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class Tick:
    """What happens to the KV pool in one tick, in this order.

    ``evict`` ids are dropped at the start (the engine's prefix cache making
    room), ``alloc`` ids are placed, the reads (``rows`` unique, ``counts``
    reads each, ``last_t`` time of the last one) are served from the placement
    as it stands, and ``free`` ids are released at the end. ``acquired`` /
    ``released`` are the lifecycle the serving engine knows and a kvtier client
    reports with ``phase`` (``active``: a request took a reference on a cached
    block; ``free``: no request references it any more). Flat traces have none.

    Request traces asked for ``timed`` ticks (``RequestTrace.ticks``) also say
    when things happen inside the tick, for a policy that prefetches:
    ``prefetch_rows`` are the cached blocks each request arriving in the tick
    finds (its prefix-cache hits, in its hash-id order), ``prefetch_t`` that
    request's arrival time; ``reads`` are the tick's reads of prompt blocks
    one request at a time (``TimedReads``), so the engine can tell which of
    them came before a block's move ended.
    """

    alloc: np.ndarray
    rows: np.ndarray
    counts: np.ndarray
    last_t: np.ndarray
    free: np.ndarray
    evict: np.ndarray = field(default_factory=_none)
    acquired: np.ndarray = field(default_factory=_none)
    released: np.ndarray = field(default_factory=_none)
    prefetch_rows: np.ndarray = field(default_factory=_none)
    prefetch_t: np.ndarray = field(default_factory=_none)
    reads: "TimedReads | None" = None


@dataclass
class TimedReads:
    """Reads of blocks at known times: ``count[i]`` reads of ``rows[i]``, the
    first at ``first[i]``, then one every ``every[i]`` seconds (0: all at
    once). A row may appear several times (one entry per request reading it)."""

    rows: np.ndarray
    first: np.ndarray
    every: np.ndarray
    count: np.ndarray

    def before(self, rows: np.ndarray, at: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Reads of each of ``rows`` (unique) strictly before its time in ``at``;
        ``pos`` is a scratch lookup of the id space, all -1, left so."""
        pos[rows] = np.arange(rows.size)
        p = pos[self.rows]
        pos[rows] = -1
        m = p >= 0
        p, first, every, count = p[m], self.first[m], self.every[m], self.count[m]
        gap = at[p] - first
        n = np.where(every > 0, np.ceil(gap / np.where(every > 0, every, 1.0)), np.where(gap > 0, count, 0))
        return np.bincount(p, weights=np.clip(n, 0, count), minlength=rows.size)


@dataclass
class Trace:
    t: np.ndarray
    block: np.ndarray
    op: np.ndarray
    count: np.ndarray
    nblocks: int
    block_bytes: int
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.t = np.asarray(self.t, dtype=np.float64)
        self.block = np.asarray(self.block, dtype=np.int64)
        self.op = np.asarray(self.op, dtype=np.uint8)
        self.count = np.asarray(self.count, dtype=np.float32)
        n = self.t.size
        if not (self.block.size == self.op.size == self.count.size == n):
            raise InvalidArgument("trace: arrays differ in length")
        if n and (np.any(np.diff(self.t) < 0)):
            order = np.argsort(self.t, kind="stable")
            self.t, self.block, self.op, self.count = (a[order] for a in (self.t, self.block, self.op, self.count))
        if n and (self.block.min() < 0 or self.block.max() >= self.nblocks):
            raise InvalidArgument(f"trace: block id outside 0..{self.nblocks - 1}")
        if n and self.op.max() > OP_FREE:
            raise InvalidArgument("trace: unknown op code")

    def __len__(self) -> int:
        return int(self.t.size)

    @property
    def accesses(self) -> int:
        return int(np.count_nonzero(self.op == OP_ACCESS))

    @property
    def duration(self) -> float:
        return float(self.t[-1]) if self.t.size else 0.0

    def tick_bounds(self, tick_s: float, times=()) -> np.ndarray:
        """Tick k holds the records in [bounds[k], bounds[k+1]) and decides at
        bounds[k+1]: every ``tick_s``, or with ``times`` (a recording's tick
        clock) at those times, then every ``tick_s`` after the last."""
        if not len(self):
            return np.zeros(1)
        if len(times):
            last = float(times[-1])
            after = int(np.ceil(max(self.duration - last, 0.0) / tick_s)) + 1
            return np.r_[0.0, np.asarray(times, dtype=np.float64), last + np.arange(1, after + 1) * tick_s]
        return np.arange(int(np.ceil(self.duration / tick_s)) + 2) * tick_s

    def ticks(self, tick_s: float, times=()):
        """The records cut into ticks (``tick_bounds``); reads of one block aggregated."""
        bounds = self.tick_bounds(tick_s, times)
        nt = bounds.size - 1
        edges = np.searchsorted(self.t, bounds, side="left")
        if nt:
            edges[-1] = len(self)
        for k in range(nt):
            lo, hi = edges[k], edges[k + 1]
            op, blk = self.op[lo:hi], self.block[lo:hi]
            m = op == OP_ACCESS
            rows, inv = np.unique(blk[m], return_inverse=True)
            counts = np.bincount(inv, weights=self.count[lo:hi][m], minlength=rows.size)
            last = np.full(rows.size, -np.inf)
            np.maximum.at(last, inv, self.t[lo:hi][m])
            yield Tick(blk[op == OP_ALLOC], rows, counts, last, blk[op == OP_FREE])

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.suffix == ".csv":
            write_csv(self, path)
        else:
            np.savez_compressed(
                path,
                t=self.t,
                block=self.block,
                op=self.op,
                count=self.count,
                nblocks=np.int64(self.nblocks),
                block_bytes=np.int64(self.block_bytes),
                meta=np.array(json.dumps(self.meta)),
            )


def load(path: str | Path) -> Trace:
    path = Path(path)
    if path.suffix == ".csv":
        return read_csv(path)
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"])) if "meta" in z else {}
        return Trace(z["t"], z["block"], z["op"], z["count"], int(z["nblocks"]), int(z["block_bytes"]), meta)


def write_csv(tr: Trace, path: Path) -> None:
    ops = np.array(OP_NAMES)[tr.op]
    with open(path, "w") as f:
        extra = f" blocks_per_seq={tr.meta['blocks_per_seq']:g}" if tr.meta.get("blocks_per_seq") else ""
        f.write(f"{CSV_MAGIC} nblocks={tr.nblocks} block_bytes={tr.block_bytes}{extra}\n")
        f.write("time,block,op,count\n")
        for t, b, o, c in zip(tr.t.tolist(), tr.block.tolist(), ops.tolist(), tr.count.tolist()):
            f.write(f"{t:.6f},{b},{o},{c:g}\n")


def read_csv(path: Path, block_bytes: int = 2 << 20) -> Trace:
    nblocks = None
    meta: dict = {}
    with open(path) as f:
        first = f.readline()
        if first.startswith(CSV_MAGIC):
            for kv in first[len(CSV_MAGIC) :].split():
                k, _, v = kv.partition("=")
                if k == "nblocks":
                    nblocks = int(v)
                elif k == "block_bytes":
                    block_bytes = int(v)
                elif k == "blocks_per_seq":
                    meta[k] = float(v)
            header = f.readline()
        else:
            header = first
        if header.strip().replace(" ", "") != "time,block,op,count":
            raise InvalidArgument(f"{path}: expected header 'time,block,op,count', got {header.strip()!r}")
        rows = [line.split(",") for line in f if line.strip() and not line.startswith("#")]
    if not rows:
        return Trace([], [], [], [], nblocks or 1, block_bytes, meta)
    cols = list(zip(*rows))
    t = np.array(cols[0], dtype=np.float64)
    raw = np.array(cols[1], dtype=np.int64)
    names = {n: i for i, n in enumerate(OP_NAMES)}
    try:
        op = np.array([names[o.strip()] for o in cols[2]], dtype=np.uint8)
    except KeyError as e:
        raise InvalidArgument(f"{path}: unknown op {e.args[0]!r}") from None
    count = np.array(cols[3], dtype=np.float32)
    if nblocks is None or raw.min() < 0 or raw.max() >= nblocks:
        # foreign ids: dense ids in order of first appearance
        _, first_idx, inv = np.unique(raw, return_index=True, return_inverse=True)
        rank = np.empty(first_idx.size, dtype=np.int64)
        rank[np.argsort(first_idx, kind="stable")] = np.arange(first_idx.size)
        raw = rank[inv]
        nblocks = int(first_idx.size)
    return Trace(t, raw, op, count, nblocks, block_bytes, meta)


def concat(parts_t, parts_b, parts_o, parts_c, nblocks: int, block_bytes: int, meta: dict) -> Trace:
    """Build a trace from lists of per-step arrays (the generator's output)."""

    def cat(p, dt):
        return np.concatenate(p).astype(dt) if p else np.zeros(0, dtype=dt)

    return Trace(
        cat(parts_t, np.float64),
        cat(parts_b, np.int64),
        cat(parts_o, np.uint8),
        cat(parts_c, np.float32),
        nblocks,
        block_bytes,
        meta,
    )
