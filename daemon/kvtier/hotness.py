"""Block temperature: exponentially decayed access counts, and hint ingestion.

temp(t) = sum over accesses a of weight_a * count_a * exp(-(t - t_a) / tau)

Implemented in two steps so each is one vectorised pass: ``decay`` multiplies
every temperature by exp(-(now - last_decay)/tau) once per tick, and ``add``
adds the accesses observed since (at full weight: an access seen during a
tick counts as happening at the tick, which errs by at most one tick of
decay). A block read r times per second settles at r*tau, so tau sets how
long the policy remembers: short tau follows phase changes, long tau smooths
bursty decode schedules.

The hotness sources (client hints, DAMON, access bits, perf samples) measure
different things with different precision, so each carries a weight: a client
hint says exactly which block was read, a DAMON region only that some page in
a range was. ``SOURCE_WEIGHTS`` holds the defaults the sources pass to
``add``.
"""

from __future__ import annotations

import math

import numpy as np

from .blocks import F_PREFILL_DONE, BlockTable
from .errors import ConfigError, InvalidArgument

# Relative trust in each source (multiplies its counts).
SOURCE_WEIGHTS = {
    "hint": 1.0,  # the engine names the block it read
    "perf": 0.5,  # sampled load addresses: exact block, sparse
    "access_bits": 0.5,  # referenced bit per page, once per scan
    "damon": 0.25,  # region-granular estimate
}

# Default memory of a temperature (config hotness.tau_s; the daemon and
# kvtier-sim read it here). 5 s smooths a decode schedule that revisits a
# block every few ticks and still follows a shifting hot set within seconds:
# at 30 s an old hot set took minutes to cool below demote_temp (25 s to get
# 90 % of a moved hot set back in the guest), and on kvtier-sim's chat preset
# the DRAM hit ratio goes 0.78 (30 s) -> 0.82 (5 s) -> 0.85 (1 s), against
# LRU's 0.73 (`kvtier-sim run --preset chat --accesses 300000 --set
# hotness.tau_s=T`). 1 s would leave a DAMON-only block (a quarter weight,
# at most 5 per tick) barely above promote_temp.
DEFAULT_TAU_S = 5.0


class Temperature:
    """Decays and feeds ``BlockTable.temp`` / ``last_access``; holds only the decay clock."""

    def __init__(self, tau_s: float):
        if not tau_s > 0 or not math.isfinite(tau_s):
            raise ConfigError(f"hotness: tau_s must be a positive number, got {tau_s!r}")
        self.tau_s = float(tau_s)
        self.last_decay: float | None = None

    def factor(self, dt: float) -> float:
        return math.exp(-max(0.0, dt) / self.tau_s)

    def decay(self, table: BlockTable, now: float) -> None:
        """Age every temperature to ``now`` (no-op the first time and if time went back)."""
        if self.last_decay is not None and now > self.last_decay:
            temp = table.temp
            temp *= np.float32(self.factor(now - self.last_decay))
        if self.last_decay is None or now > self.last_decay:
            self.last_decay = now

    def add(
        self,
        table: BlockTable,
        rows: np.ndarray,
        counts: np.ndarray | float,
        now: float,
        weight: float = 1.0,
    ) -> None:
        """Add ``weight * counts`` to the given rows; duplicate rows add up."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return
        n = len(table)
        if rows.min() < 0 or rows.max() >= n:
            raise InvalidArgument(f"hotness: row out of range 0..{n - 1}")
        c = np.broadcast_to(np.asarray(counts, dtype=np.float32), rows.shape)
        # np.add.at (unbuffered, so duplicate rows add up) runs at 20-100 M
        # rows/s on numpy 2: faster than a full-length bincount even for
        # batches of a million (scripts/bench/sim_bench.py).
        np.add.at(table.temp, rows, c * np.float32(weight) if weight != 1.0 else c)
        la = table.last_access
        la[rows] = np.maximum(la[rows], now)

    def add_region_hints(
        self,
        table: BlockTable,
        region_id: int,
        block_idx: np.ndarray,
        counts: np.ndarray | float,
        now: float,
        weight: float = SOURCE_WEIGHTS["hint"],
    ) -> None:
        """Client hints: block indices within one region, mapped to table rows."""
        s = table.slices.get(region_id)
        if s is None:
            raise InvalidArgument(f"hotness: region {region_id} is not registered")
        idx = np.asarray(block_idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= s.count):
            raise InvalidArgument(f"hotness: block index out of range 0..{s.count - 1} for region {region_id}")
        self.add(table, idx + s.start, counts, now, weight)


PHASES = ("prefill_done", "active", "free")


def apply_phase(table: BlockTable, rows: np.ndarray, phase: str) -> None:
    """A client's ``phase`` message for table rows (the registry and kvtier-sim run this).

    ``prefill_done``: read-only from now on, a preferred demotion candidate;
    ``active``: undo that; ``free``: the blocks hold no live data (a finished
    request's blocks no later request has taken): temperature 0, first to go.
    """
    flags = table.flags
    if phase == "prefill_done":
        flags[rows] |= np.uint8(F_PREFILL_DONE)
    elif phase == "active":
        flags[rows] &= np.uint8(~F_PREFILL_DONE & 0xFF)
    elif phase == "free":
        flags[rows] |= np.uint8(F_PREFILL_DONE)
        table.temp[rows] = 0.0
    else:
        raise InvalidArgument(f"unknown phase {phase!r}")
