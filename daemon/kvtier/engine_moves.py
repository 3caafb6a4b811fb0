"""Moves that the engine executes itself, for regions registered with mode "engine".

Pinned pages (CUDA host memory, RDMA, io_uring fixed buffers) cannot be
migrated by any kernel mechanism. An engine that keeps pinned pools in
several tiers registers them as one logical region; the policy plans its
blocks like any other, and instead of calling move_pages the daemon sends the
owner a ``move`` event over its connection (blocks, from tier, to tier). The
engine copies the blocks between its pools, updates its block table and
answers ``move_done`` with which blocks it moved; only then does the daemon
record the new tier (and count the migration). Until the answer the blocks
are held out of planning (``retry_at`` = inf); a failed block backs off like a
failed kernel move; a lost connection drops its pending moves and the blocks
stay where they were. Everything here runs on the event-loop thread.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvtier import logs
from kvtier import policy as pol
from kvtier.blocks import BlockTable, F_STALE
from kvtier.errors import InvalidArgument
from kvtier.stats import DaemonStats

log = logging.getLogger("kvtier.engine_moves")

Push = Callable[[str, dict], None]  # (event name, body): writes one frame to the owner


@dataclass
class Pending:
    region: int
    index: np.ndarray  # int64 block indices, in the order sent
    src: np.ndarray  # int8
    dst: np.ndarray  # int8
    nbytes: np.ndarray  # uint64
    owner: Any
    sent_at: float


class EngineMoves:
    def __init__(self, table: BlockTable, stats: DaemonStats, clock: Callable[[], float]):
        self.table = table
        self.stats = stats
        self.clock = clock
        self.channels: dict[int, tuple[Any, Push]] = {}  # region id -> (owner, push)
        self.pending: dict[int, Pending] = {}
        self.next_id = 1

    def attach(self, region_id: int, owner: Any, push: Push) -> None:
        """``owner`` (a connection's peer) executes ``region_id``'s moves from now on."""
        self.drop(lambda p: p.region == region_id, "owner replaced")
        self.channels[region_id] = (owner, push)

    def forget_region(self, region_id: int) -> None:
        self.channels.pop(region_id, None)
        for mid in [m for m, p in self.pending.items() if p.region == region_id]:
            del self.pending[mid]

    def detach(self, owner: Any) -> int:
        """The owner's connection is gone: its regions get no moves until a
        connection attaches again, and its unanswered moves are dropped."""
        for rid in [r for r, (o, _) in self.channels.items() if o is owner]:
            del self.channels[rid]
        return self.drop(lambda p: p.owner is owner, "connection lost")

    def drop(self, which: Callable[[Pending], bool], why: str) -> int:
        gone = [m for m, p in self.pending.items() if which(p)]
        blocks = 0
        for mid in gone:
            p = self.pending.pop(mid)
            rows = self.table.rows_of(np.full(p.index.size, p.region, dtype=np.int64), p.index)
            rows = rows[rows >= 0]
            self.table.retry_at[rows] = -np.inf  # plannable again, tier unchanged
            blocks += int(p.index.size)
        if gone:
            self.stats.engine_moves_dropped_total += blocks
            logs.event(log, "engine_moves_dropped", logging.WARNING, moves=len(gone), blocks=blocks, reason=why)
        return blocks

    def dispatch(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Send the moves of these table rows to their owners, one event per
        (region, from, to). Returns which rows were sent (a region without an
        attached owner gets none)."""
        t = self.table
        sent = np.zeros(rows.size, dtype=bool)
        region = t.region[rows].astype(np.int64)
        keys = np.stack([region, src.astype(np.int64), dst.astype(np.int64)], axis=1)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        inv = inv.ravel()
        now = self.clock()
        for k, (rid, s, d) in enumerate(uniq):
            ch = self.channels.get(int(rid))
            if ch is None:
                continue
            sel = np.flatnonzero(inv == k)
            r = rows[sel]
            mid = self.next_id
            self.next_id += 1
            index = t.index[r].astype(np.int64)
            self.pending[mid] = Pending(int(rid), index, src[sel].astype(np.int8), dst[sel].astype(np.int8),
                                        t.nbytes[r].copy(), ch[0], now)
            t.retry_at[r] = np.inf  # out of planning until the owner answers
            ch[1]("move", {"move": mid, "region": int(rid), "blocks": index.astype("<u4").tobytes(),
                           "src": int(s), "dst": int(d)})
            sent[sel] = True
        self.stats.engine_moves_sent_total += int(sent.sum())
        return sent

    def ack(self, owner: Any, move_id: int, ok: np.ndarray, error: str, cfg: pol.PolicyConfig,
            pstate: pol.PolicyState) -> tuple[dict, pol.PolicyState]:
        """The owner moved ``ok`` of the blocks of ``move_id``: record them."""
        p = self.pending.get(move_id)
        if p is None or p.owner is not owner:
            raise InvalidArgument(f"no pending move {move_id} on this connection (dropped or answered)")
        if ok.size != p.index.size:
            raise InvalidArgument(f"move {move_id} has {p.index.size} blocks; the answer has {ok.size}")
        del self.pending[move_id]
        okb = ok.astype(bool)
        t, st, now = self.table, self.stats, self.clock()
        rows = t.rows_of(np.full(p.index.size, p.region, dtype=np.int64), p.index)
        live = rows >= 0
        pol.record_results(t, rows[live], okb[live], np.zeros(int(live.sum()), dtype=bool), now, cfg,
                           dst=p.dst[live])
        t.flags[rows[live]] &= np.uint8(~F_STALE & 0xFF)
        moved = okb & live
        s, d = int(p.src[0]), int(p.dst[0])
        st.migrations[(s, d)] += int(moved.sum())
        st.migrated_bytes[(s, d)] += int(p.nbytes[moved].sum())
        if (~okb).any():
            # Failures are counted in pages, as for kernel moves (one unit per metric).
            st.migration_failed_pages[(s, d, "engine")] += int(p.nbytes[~okb].sum()) // mmap.PAGESIZE
            logs.event(log, "engine_move_failed", logging.WARNING, region=p.region, move=move_id,
                       blocks_failed=int((~okb).sum()), error=error)
        st.observe_engine_move(now - p.sent_at)
        # The plan paid for these moves; give back what failed.
        plan = pol.Plan(rows, p.src, p.dst, np.zeros(rows.size, dtype=np.uint8), p.nbytes.astype(np.int64), {})
        return {"moved": int(moved.sum()), "failed": int((~okb).sum())}, pol.refund(pstate, plan, okb, cfg)

    def refund_unsent(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray, cfg: pol.PolicyConfig,
                      pstate: pol.PolicyState) -> pol.PolicyState:
        if rows.size == 0:
            return pstate
        plan = pol.Plan(rows, src, dst, np.zeros(rows.size, dtype=np.uint8),
                        self.table.nbytes[rows].astype(np.int64), {})
        return pol.refund(pstate, plan, np.zeros(rows.size, dtype=bool), cfg)

    def bytes_arriving(self, ntiers: int) -> np.ndarray:
        """Bytes per tier that sent, unanswered moves bring there. The table
        still counts each such block in its source tier until the owner
        answers; its engine needs the destination's room already, so the
        plan and the room for hinted promotions count it there too
        (``TierState.arriving_bytes``), or a second batch is sent into room
        the first has taken and the owner, its pool full, refuses it."""
        out = np.zeros(ntiers)
        for p in self.pending.values():
            d = int(p.dst[0])
            if 0 <= d < ntiers:
                out[d] += float(p.nbytes.sum())
        return out

    def status(self) -> dict:
        return {"engine_moves_pending": sum(int(p.index.size) for p in self.pending.values()),
                "engine_regions_attached": len(self.channels)}
