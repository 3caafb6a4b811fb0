"""Block temperature: exponentially decayed access counts, and hint ingestion.

temp(t) = sum over accesses a of weight_a * count_a * exp(-(t - t_a) / tau)

Implemented in two steps so each is one vectorised pass: ``decay`` multiplies
every temperature by exp(-(now - last_decay)/tau) once per tick, and ``add``
adds the accesses observed since (at full weight: an access seen during a
tick counts as happening at the tick, which errs by at most one tick of
decay). A block read r times per second settles at r*tau, so tau sets how
long the policy remembers: short tau follows phase changes, long tau smooths
bursty decode schedules.

What a KV cache's reads look like shapes two corrections, both in
``decay``/``add`` so every consumer of ``temp`` sees them:

- A run of reads ends. Decode reads every block of a request at every step;
  when the request finishes, its blocks are not read again (until a later
  turn takes them). A block that got n reads (its temperature) over the
  T = tau*(1 - fresh) seconds its run has counted so far would, if still
  read at that rate, have missed a silence of s seconds with probability
  (1 + s/T)^-n (Poisson reads, the rate's uncertainty after n of them
  integrated out: one read says little, a hundred say a lot). Once that is
  below exp(-``end_of_run``) the run is over: temperature 0, as phase
  ``free`` sets it. Silence = time since the last read beyond one decay
  interval (a source that reports once per tick is never silent between
  ticks). A decoding request's blocks (20-30 reads/s) go cold within a
  second of its end; a block read once waits 19 times its run's length.
- A run of reads starts. A block read at r settles at r*tau only after a
  few tau: one ``age`` seconds into its run holds r*tau*(1 - exp(-age/tau)).
  Ranked by temperature alone, the blocks a KV cache has just written (a new
  prompt's blocks, the block decode just opened, read by every following
  step) would look colder than blocks read for a long time, and be the ones
  demoted. So each block carries ``fresh`` = exp(-age/tau) of its run
  (decayed with the temperature, set when a read starts a run: the first
  read of a block, the first after its run ended or after phase ``free``),
  and ``rate_temp`` = temp / (1 - fresh) is the unbiased estimate of r*tau
  the policy ranks by (the bias correction of an exponential moving average
  started at zero).

Blocks whose run is over (temperature 0) are not all alike: a prefix many
requests share (a system prompt, a popular document, a conversation that
keeps coming back) starts run after run, a one-off prompt's block never
again, and a turn that ended a second ago is likelier to be followed by the
next than one that ended an hour ago. ``runs`` counts a block's runs, and
``reuse_score`` = runs / seconds since its last read is what the policy
keeps finished blocks by (in both Mooncake traces a released block is
reused more often and sooner the more runs it had: 24 % after one, 72-92 %
after five or more, conversation trace). Runs alone would keep yesterday's
popular prefixes forever (conversation, 8B, DRAM 10 %: 0.90 against 0.98
with the silence in the denominator).
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
# 90 % of a moved hot set back in the guest, before runs ended on silence).
# 1 s would leave a DAMON-only block (a quarter weight, at most 5 per tick)
# barely above promote_temp.
DEFAULT_TAU_S = 5.0

# A run of reads is over once its silence had less than exp(-END_OF_RUN)
# (5 %) chance if it were still read at its rate (config hotness.end_of_run).
END_OF_RUN = 3.0
# fresh at this value marks a block whose next read starts a new run
_RESTART = np.float32(1.0)


# Added to a finished block's silence in reuse_score: within about this long
# of their last read, blocks rank by their runs more than by which ended
# last. The results hardly depend on it (kvtier-sim: 1 s and 30 s within
# 0.5 point on every Mooncake cell and preset tried; rag 0.9735 -> 0.9745);
# 30 s is near the 10th percentile (36 s) of the time from a block's
# release to its reuse in the Mooncake conversation trace.
REUSE_PRIOR_S = 30.0


def reuse_score(runs: np.ndarray, last_access: np.ndarray, now: float) -> np.ndarray:
    """How soon a block whose run is over is read again: runs per second of
    its silence (plus REUSE_PRIOR_S)."""
    idle = np.maximum(now - np.asarray(last_access, dtype=np.float64), 0.0) + REUSE_PRIOR_S
    return np.asarray(runs, dtype=np.float64) / idle


def rate_temp(temp: np.ndarray, fresh: np.ndarray) -> np.ndarray:
    """Temperature corrected for how long the block has been read (see module doc)."""
    # fresh is 1 only on a block whose run is over (temperature 0)
    return np.asarray(temp, dtype=np.float64) / np.maximum(1.0 - np.asarray(fresh, dtype=np.float64), 1e-6)


class Temperature:
    """Decays and feeds ``BlockTable.temp`` / ``last_access``; holds only the decay clock."""

    def __init__(self, tau_s: float, end_of_run: float = END_OF_RUN):
        if not tau_s > 0 or not math.isfinite(tau_s):
            raise ConfigError(f"hotness: tau_s must be a positive number, got {tau_s!r}")
        if not end_of_run >= 0 or not math.isfinite(end_of_run):
            raise ConfigError(f"hotness: end_of_run must be >= 0 (0: never), got {end_of_run!r}")
        self.tau_s = float(tau_s)
        self.end_of_run = float(end_of_run)
        self.last_decay: float | None = None
        # length of the last decay step: the reads a tick adds stand for that
        # long, so a run of reads starts that old (never 0: no division by 0)
        self.interval = 1.0

    def factor(self, dt: float) -> float:
        return math.exp(-max(0.0, dt) / self.tau_s)

    def decay(self, table: BlockTable, now: float) -> None:
        """Age every temperature to ``now`` (no-op the first time and if time went back)."""
        if self.last_decay is not None and now > self.last_decay:
            dt = now - self.last_decay
            f = np.float32(self.factor(dt))
            temp, fresh = table.temp, table.fresh
            temp *= f
            # In place under a mask: every column-sized temporary is a fresh
            # mmap in the daemon (daemon.bound_heap), a page fault per 4 KiB
            # of it every tick, and faults are what grows with the host's load.
            np.multiply(fresh, f, out=fresh, where=fresh < _RESTART)
            self._silence(table, now)
            self.interval = dt
        if self.last_decay is None or now > self.last_decay:
            self.last_decay = now

    def _silence(self, table: BlockTable, now: float) -> None:
        """End the runs whose silence is improbable at their own rate (module doc)."""
        if self.end_of_run <= 0:
            return
        temp = table.temp
        # Rows first, by one-byte masks; the float64 idle time only for them
        # (over the whole table it cost two 8-byte-per-block temporaries,
        # i.e. page faults, every tick: see decay).
        rows = np.flatnonzero((table.last_access < now - self.interval) & (temp > 0))
        if rows.size == 0:
            return
        idle = now - table.last_access[rows] - self.interval
        fresh = table.fresh[rows].astype(np.float64)
        window = self.tau_s * np.maximum(1.0 - fresh, 1e-9)  # seconds of reads the count stands for
        over = rows[temp[rows] * np.log1p(idle / window) > self.end_of_run]
        temp[over] = 0.0
        table.fresh[over] = _RESTART

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
        la = table.last_access
        # A read that starts a run (the block's first, or the first after its
        # run ended): the run is one interval old (the reads of a tick stand
        # for that long).
        start = rows[(table.fresh[rows] >= _RESTART) | (la[rows] == -np.inf)]
        if start.size:
            table.temp[start] = 0.0
            table.fresh[start] = np.float32(self.factor(self.interval))
            np.add.at(table.runs, np.unique(start), np.float32(1.0))
        # np.add.at (unbuffered, so duplicate rows add up) runs at 20-100 M
        # rows/s on numpy 2: faster than a full-length bincount even for
        # batches of a million (scripts/bench/sim_bench.py).
        np.add.at(table.temp, rows, c * np.float32(weight) if weight != 1.0 else c)
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
        table.fresh[rows] = _RESTART  # the next read (a later request taking it) starts a new run
    else:
        raise InvalidArgument(f"unknown phase {phase!r}")
