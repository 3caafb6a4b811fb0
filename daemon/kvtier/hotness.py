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
  started at zero). The reads that start a run stand for the time since
  their source last looked (``add``'s ``span``: one tick, or ``slowdown``
  ticks for a source the engine's CPU budget backed off), and the run
  starts that old: a run started one tick old by a source looking every
  k ticks was ranked k times above the blocks it had seen all along.

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

from .blocks import (F_ENGINE, F_NOT_PRESENT, F_PREFILL_DONE, F_STALE, F_UNMOVABLE, TIER_UNKNOWN, BlockTable,
                     row_select)
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
# Share of one core each source may use (daemon.source_cpu_budget): its
# collect plus its kernel thread. 0.05 left DAMON vaddr in the TCG guest
# (about 0.05 of a vCPU at full rate there) backed off to every 2nd-4th
# tick most of the time, and a moved hot set waited those ticks (2.5 s to
# 90 % in DRAM against 1.5 s); at 0.1 kvtierd plus its kdamond stayed at
# 0.30-0.37x of DAMOS paddr's kdamonds (docs/benchmarks.md). Natively
# DAMON over the same range costs a small fraction of either.
DEFAULT_SOURCE_CPU_BUDGET = 0.1

DEFAULT_TAU_S = 5.0

# A run of reads is over once its silence had less than exp(-END_OF_RUN)
# (5 %) chance if it were still read at its rate (config hotness.end_of_run).
END_OF_RUN = 3.0
# fresh at this value marks a block whose next read starts a new run
_RESTART = np.float32(1.0)
# rows per step of Temperature._arm: 8192 * 8 bytes, under the 256 KiB mmap threshold
_ARM_CHUNK = 8192
# float32 holds every integer up to this exactly (_once stamps positions with them)
_EXACT_F32 = 1 << 24


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
        # check_at is stored relative to this (the first time seen), as float32
        self.epoch: float | None = None
        # rows the last decay's silence test looked at (tests/unit/test_hotness.py
        # checks this does not grow with blocks nobody reads)
        self.rows_checked = 0
        # Rows read since their last arm, armed together (_flush): arming
        # is some 30 numpy calls, and a hint message of a few dozen blocks
        # paid them per message (1000 regions, 1 M hinted blocks/s: a third
        # of the hint path). With the table's version when the first was
        # added (rows of another layout are not these rows), the latest
        # read time seen, and the time up to which every read is armed.
        self._unarmed: list[np.ndarray] = []
        self._unarmed_rows = 0
        self._unarmed_version = -1
        self._latest = -math.inf
        self._armed_to = -math.inf
        self._scratch = np.empty(0, dtype=bool)
        # length of the last decay step: the reads a tick adds stand for that
        # long, so a run of reads starts that old (never 0: no division by 0)
        self.interval = 1.0

    def factor(self, dt: float) -> float:
        return math.exp(-max(0.0, dt) / self.tau_s)

    def decay(self, table: BlockTable, now: float) -> None:
        """Age every temperature to ``now`` (no-op the first time and if time
        went back); the reads since the last arm are armed first, from the
        temperatures they were added to."""
        self._epoch_of(now)
        self._flush(table)
        if self.last_decay is not None and now > self.last_decay:
            dt = now - self.last_decay
            f = np.float32(self.factor(dt))
            table.temp[...] *= f
            # In place under a mask kept between ticks: every column-sized
            # temporary is a fresh mmap in the daemon (daemon.bound_heap), a
            # page fault per 4 KiB of it every tick, and faults are what
            # grows with the host's load.
            fresh = table.fresh
            mask = self._mask(fresh.size)
            np.less(fresh, _RESTART, out=mask)
            np.multiply(fresh, f, out=fresh, where=mask)
            self._silence(table, now, mask)
            self.interval = dt
        if self.last_decay is None or now > self.last_decay:
            self.last_decay = now
            self._armed_to = now

    def resume(self, table: BlockTable, decayed: float, step: float) -> None:
        """Take up another clock: decay to ``decayed`` (when that run's
        temperatures last decayed) and make ``step`` (that decay's length)
        the interval a run started now counts from. kvtier-sim's replay of a
        recording starts where the daemon's clock stood, not at its first
        recorded tick."""
        self.decay(table, decayed)
        if step > 0 and math.isfinite(step):
            self.interval = float(step)

    def _flush(self, table: BlockTable) -> None:
        """Arm the rows read since their last arm, each once, from their
        state now: what arming at each one's latest read gives, as nothing
        but a read changes a row's temperature before the next decay
        (``recheck`` and the phases are bounds an arm keeps). If the rows
        moved meanwhile (a region added or removed), every row read since
        the last decay is tested at the next tick instead (then armed)."""
        if not self._unarmed:
            return
        parts, self._unarmed, self._unarmed_rows = self._unarmed, [], 0
        self._armed_to = max(self._armed_to, self._latest)
        if self._unarmed_version != table.version:
            table.check_at[table.last_access >= self.last_decay] = -np.inf
            return
        rows = np.concatenate(parts)
        self._arm(table, _once(table, rows[rows < len(table)]), self.last_decay, rounds=3)

    def _mask(self, n: int) -> np.ndarray:
        if self._scratch.size < n:
            self._scratch = np.empty(max(n, 2 * self._scratch.size), dtype=bool)
        return self._scratch[:n]

    def _epoch_of(self, now: float) -> float:
        if self.epoch is None:
            self.epoch = float(now)
        return self.epoch

    def _arm(self, table: BlockTable, rows: np.ndarray, t0: float | None, rounds: int = 0) -> None:
        """Set ``check_at`` of ``rows``: a time before which their run cannot end.

        Until the next read (which arms again) a temperature only decays,
        from ``t0`` (the time it was last decayed to), and ``fresh`` with it
        (so the window only grows). The silence test's left side at time t
        is then below temp(t) * log1p((t - last_access) / window): with
        temp(t) <= temp, not before D1 = last_access + window *
        expm1(end_of_run / temp). Each of ``rounds`` refinements uses that
        temp(t) <= temp * exp(-(D1 - t0) / tau) after D1 for a later D2,
        and so on (three rounds: a block read about once a second is then
        not looked at again until its next read, where D1 alone had the
        tick test 3 % of a table read that way, every tick). A bound, not
        the answer: at that time ``_silence`` runs the exact test and arms
        again.

        Rounding: a float32 decay can leave a temperature up to 2**-23 per
        tick above the exact exponential; the rounds allow 1 % for it, i.e.
        80,000 ticks between a read and the end of its run (22 hours of 1 s
        ticks; a run ends within about 100 tau of its last read or never).
        Stored as float32 seconds since ``epoch``, rounded down (checking
        early is only work, late would change when runs end).
        """
        if rows.size == 0:
            return
        if self.end_of_run <= 0:
            table.check_at[rows] = np.inf
            return
        # In chunks whose float64 temporaries stay under glibc's fixed mmap
        # threshold (daemon.bound_heap): a 64 Ki-row hint message in one go
        # cost a fresh mmap and 128 page faults per temporary.
        for lo in range(0, rows.size, _ARM_CHUNK):
            self._arm_rows(table, rows[lo:lo + _ARM_CHUNK], t0 if rounds else None, rounds)

    def _arm_rows(self, table: BlockTable, rows: np.ndarray, t0: float | None, rounds: int) -> None:
        temp = table.temp[rows].astype(np.float64)
        window = table.fresh[rows].astype(np.float64)
        np.subtract(1.0, window, out=window)
        np.maximum(window, 1e-9, out=window)
        window *= self.tau_s
        la = table.last_access[rows]
        e = self.end_of_run * (1.0 - 1e-6)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            at = np.divide(e, temp)
            np.expm1(at, out=at)
            at *= window
            at += la
            if t0 is not None:
                for _ in range(rounds):
                    left = np.maximum(at - t0, 0.0)
                    left *= -1.0 / self.tau_s
                    np.exp(left, out=left)
                    left *= temp * 1.01
                    np.divide(e, left, out=left)
                    np.expm1(left, out=left)
                    left *= window
                    left += la
                    np.maximum(at, left, out=at)
            at -= self.epoch
            np.copyto(at, np.inf, where=~(temp > 0))  # nothing to end (and no NaN from a never-read row)
            at32 = at.astype(np.float32)  # past float32's range: inf, never
        np.nextafter(at32, np.float32(-np.inf), out=at32, where=at32 > at)
        table.check_at[rows] = at32

    def recheck(self, table: BlockTable, rows: np.ndarray) -> None:
        """Rows whose temperature something other than ``add`` raised: test their silence next tick."""
        table.check_at[rows if isinstance(rows, slice) else np.asarray(rows, dtype=np.int64)] = -np.inf

    def _silence(self, table: BlockTable, now: float, mask: np.ndarray) -> None:
        """End the runs whose silence is improbable at their own rate (module doc).

        Only rows whose ``check_at`` has come are looked at (``_arm``): the
        work per tick follows the reads, not the table.
        """
        self.rows_checked = 0
        if self.end_of_run <= 0:
            return
        # now rounded up, as check_at was rounded down
        rel = now - self.epoch
        now32 = np.float32(rel)
        if now32 < rel:
            now32 = np.nextafter(now32, np.float32(np.inf))
        np.less_equal(table.check_at, now32, out=mask)
        rows = np.flatnonzero(mask)
        self.rows_checked = int(rows.size)
        if rows.size == 0:
            return
        temp = table.temp
        la = table.last_access[rows]
        t = temp[rows]
        idle = now - la - self.interval
        fresh = table.fresh[rows].astype(np.float64)
        window = self.tau_s * np.maximum(1.0 - fresh, 1e-9)  # seconds of reads the count stands for
        # the same test, in the same arithmetic, as over every silent row
        cand = (la < now - self.interval) & (t > 0)
        with np.errstate(invalid="ignore"):
            score = t * np.log1p(np.where(cand, idle, 0.0) / window)
        over = cand & (score > self.end_of_run)
        ended = rows[over]
        temp[ended] = 0.0
        table.fresh[ended] = _RESTART
        table.check_at[ended] = np.inf
        # the silent ones refined (they stay silent or are read and armed
        # again); those read since the last tick with the first bound
        left = ~over
        self._arm(table, rows[left & cand], now, rounds=3)
        self._arm(table, rows[left & ~cand], now)

    def add(
        self,
        table: BlockTable,
        rows: np.ndarray,
        counts: np.ndarray | float,
        now: float,
        weight: float = 1.0,
        checked: bool = False,
        span: float | None = None,
    ) -> None:
        """Add ``weight * counts`` to the given rows; duplicate rows add up.
        ``checked``: the caller has checked the rows are in the table.
        ``span``: the seconds these counts stand for (a source that looks
        every few ticks), default the last decay step: a run they start is
        that old."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return
        n = len(table)
        if not checked and (rows.min() < 0 or rows.max() >= n):
            raise InvalidArgument(f"hotness: row out of range 0..{n - 1}")
        # a scalar count stays a scalar: np.add.at takes it as it is
        c = np.asarray(counts, dtype=np.float32)
        if c.ndim and c.shape != rows.shape:
            c = np.broadcast_to(c, rows.shape)
        la = table.last_access
        # A read that starts a run (the block's first, or the first after its
        # run ended): the run is one interval old (the reads of a tick stand
        # for that long).
        old_la = la[rows]
        start = rows[(table.fresh[rows] >= _RESTART) | (old_la == -np.inf)]
        if start.size:
            table.temp[start] = 0.0
            table.fresh[start] = np.float32(self.factor(self.interval if span is None else max(span, self.interval)))
            # one run per block however often it is listed: a buffered fancy
            # add counts a duplicate once (np.unique did the same at ~300 ns a row)
            table.runs[start] += np.float32(1.0)
        # np.add.at (unbuffered, so duplicate rows add up) runs at 20-100 M
        # rows/s on numpy 2: faster than a full-length bincount even for
        # batches of a million (scripts/bench/sim_bench.py).
        np.add.at(table.temp, rows, c * np.float32(weight) if weight != 1.0 else c)
        la[rows] = np.maximum(old_la, now)
        self._epoch_of(now)
        if self.last_decay is None:
            self._arm(table, _once(table, rows), None)
            return
        # A block read in this tick's window cannot end its run at the next
        # tick (its silence starts after that tick's interval), so its arm
        # can wait for the next decay: rows are queued once until armed (a
        # row last read after the last arm is queued already), and armed in
        # batches of _ARM_CHUNK, so at most one arm per block a batch and the
        # arms' fixed cost is paid per batch, not per message.
        # Read last at the instant armed to: armed then, unless that read came
        # after the arm at the same instant (a clock that did not move), so
        # at that instant those are queued again.
        self._latest = max(self._latest, now)
        new = rows[old_la <= self._armed_to] if now <= self._armed_to else rows[old_la < self._armed_to]
        if new.size:
            if not self._unarmed:
                self._unarmed_version = table.version
            self._unarmed.append(new)
            self._unarmed_rows += int(new.size)
            if self._unarmed_rows >= _ARM_CHUNK:
                self._flush(table)

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


def _once(table: BlockTable, rows: np.ndarray) -> np.ndarray:
    """``rows`` with each row once, for ``Temperature._arm`` to overwrite
    the ``check_at`` of every one of them: arming costs some 30 numpy
    passes per row, and a message of a few thousand hints of a few dozen
    blocks (a region's blocks read by many requests) armed each copy. Each
    row's position is stamped into its ``check_at`` and the row whose stamp
    survived is kept (the last of its copies): two gathers and a scatter,
    no sort (np.unique took ~300 ns a row)."""
    k = rows.size
    if k < 2:
        return rows
    if k > _EXACT_F32:  # positions past float32's exact integers
        return np.unique(rows)
    pos = np.arange(k, dtype=np.float32)
    table.check_at[rows] = pos
    return rows[table.check_at[rows] == pos]


PHASES = ("prefill_done", "active", "free", "discard")


def apply_phase(table: BlockTable, rows: np.ndarray | slice, phase: str) -> None:
    """A client's ``phase`` message for table rows, an index array or a
    region's row slice (the registry and kvtier-sim run this).

    ``prefill_done``: read-only from now on, a preferred demotion candidate;
    ``active``: undo that; ``free``: no request reads the blocks now, their
    contents kept (a prefix cache may hand them to a later request):
    temperature 0, first to go; ``discard``: the contents are dead (evicted
    from the prefix cache, or returned to a free list with no cache behind
    it) and the owner has dropped the pages (``client.drop_blocks``), so
    the blocks hold no memory: nothing to move, ever, for what they held.
    The slot's next write is a new block, placed where the kernel's first
    touch puts it; nothing of the old block (its runs, backoffs, the tier it
    was in) carries over. They are measured again (F_STALE): pages an owner
    did not drop are found and are data to the kernel again.
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
    elif phase == "discard":
        # Not the flags of the memory (unmovable, a region's constraints, an
        # operator's pin): those stay.
        flags[rows] &= np.uint8(~F_PREFILL_DONE & 0xFF)
        # An engine-mode block's placement is its engine's word, not pages.
        paged = row_select(rows, (flags[rows] & np.uint8(F_ENGINE)) == 0)
        # bytes counted in the allocation rate leave it (a block resident
        # since before registration was never counted); its next pages are
        # an allocation either way
        gone = np.unique(paged[(table.tier[paged] >= 0) & (table.prior[paged] == 0)])
        table.dropped_bytes += float(table.nbytes[gone].sum())
        table.prior[paged] = 0
        flags[paged] |= np.uint8(F_NOT_PRESENT | F_STALE)
        table.tier[paged] = TIER_UNKNOWN
        table.temp[rows] = 0.0
        table.fresh[rows] = _RESTART
        table.check_at[rows] = np.inf  # no run to end until a read starts one (and arms it)
        table.runs[rows] = 0.0
        table.last_access[rows] = -np.inf
        table.last_move[rows] = -np.inf
        table.returns[rows] = 0
        # A failed move's backoff was about the old contents; an unmovable
        # block's re-probe time is about its memory and stays.
        movable = row_select(rows, (flags[rows] & np.uint8(F_UNMOVABLE)) == 0)
        table.retry_at[movable] = -np.inf
        table.fail_count[movable] = 0
    else:
        raise InvalidArgument(f"unknown phase {phase!r}")
