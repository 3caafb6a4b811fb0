"""kvtierd recordings (kvtier/record.py) as simulator input.

A recording is kvtier-sim's CSV trace format plus ``#`` lines the plain
reader skips: ``# place`` (a block's tier when it changed), ``# obs``
(hotness-source observations), ``# tiers`` / ``# policy`` / ``# meta`` (the
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
  before it — what the daemon's kvtier_tier_hit_ratio{tier="dram"} measured.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from ..errors import InvalidArgument
from ..policy import PolicyConfig
from .model import DEFAULT_SWAP, DEFAULT_TIERS, GIB, SimConfig, SimTier
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

    def effective_capacity(self, index: int, capacity: int) -> int:
        cap = (self.policy.get("capacity") or {}).get(index)
        if cap is None:
            return capacity
        return int(min(capacity, cap if cap > 1 else cap * capacity))

    def sim_config(self, dram_gib: float | None = None, second_gib: float | None = None,
                   tick_s: float | None = None) -> SimConfig:
        """The recorded tiers; ``dram_gib`` / ``second_gib`` resize tier 0 / 1
        (kvtier-sim's --dram-gib / --cxl-gib), ``tick_s`` the tick."""
        if not self.tiers:
            raise InvalidArgument("the recording names no tiers (no '# tiers' line)")
        tiers = [replace(_kind(kind), name=name, kind=kind, capacity_bytes=max(1, self.effective_capacity(i, cap)))
                 for i, (name, kind, cap) in enumerate(self.tiers)]
        for i, gib in ((0, dram_gib), (1, second_gib)):
            if gib is not None and i < len(tiers):
                tiers[i] = replace(tiers[i], capacity_bytes=max(1, int(gib * GIB)))
        return SimConfig(tuple(tiers), float(tick_s or self.meta.get("tick_s", 1.0)))

    def settings(self) -> tuple[PolicyConfig, float, float]:
        """The recorded policy (capacity moved into the sim's tiers)."""
        known = {f.name for f in fields(PolicyConfig)}
        kw = {k: v for k, v in self.policy.items() if k in known and k != "capacity"}
        # recordings from before end_of_run existed: temperatures that only decayed
        return PolicyConfig(**kw), float(self.meta.get("tau_s", 30.0)), float(self.meta.get("end_of_run", 0.0))

    def summary(self) -> str:
        live = "-" if self.live_fast_hit is None else f"{self.live_fast_hit:.1%}"
        return (f"recording: {len(self.files)} file(s), {self.hinted_accesses:g} hinted accesses; "
                f"live DRAM hit ratio (daemon, at each hint) {live}")


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def load(path: str | Path) -> Recording:
    files = _files(Path(path))
    t_parts, id_parts, op_parts, c_parts = [], [], [], []
    seq_base = 0
    place_id, place_seq, place_tier = [], [], []
    block_bytes = 2 << 20
    tiers: list[tuple[str, str, int]] = []
    policy: dict = {}
    meta: dict = {}
    live: set[int] = set()
    names = {n: i for i, n in enumerate(OP_NAMES)}
    acc_seq = []
    first_started = None
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
                _, _, _t, bid, tier = line.split()
                place_id.append(int(bid))
                place_seq.append(seq)
                place_tier.append(int(tier))
                continue
            if line.startswith("# tiers "):
                tiers = [(n, k, int(c)) for n, k, c in (x.split(":") for x in line.split()[3:])]
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
    raw = np.asarray(id_parts, dtype=np.int64)
    _, first_idx, inv = np.unique(raw, return_index=True, return_inverse=True)
    rank = np.empty(first_idx.size, dtype=np.int64)
    rank[np.argsort(first_idx, kind="stable")] = np.arange(first_idx.size)
    t = np.asarray(t_parts)
    order = np.argsort(t, kind="stable")
    trace = Trace(t[order], rank[inv.ravel()][order], np.asarray(op_parts, dtype=np.uint8)[order],
                  np.asarray(c_parts, dtype=np.float32)[order], int(first_idx.size), block_bytes,
                  {"recording": [str(p) for p in files]})
    live_hit, hinted = _live_hit(acc_seq, place_id, place_seq, place_tier)
    return Recording(trace, tiers, policy, meta, live_hit, hinted, [str(p) for p in files])


def _live_hit(acc, place_id, place_seq, place_tier) -> tuple[float | None, float]:
    """Tier of each accessed block at the moment of the access: the last
    ``# place`` of that block written before it (file order is event order)."""
    if not acc:
        return None, 0.0
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
    return (hits / total if total else None), total
