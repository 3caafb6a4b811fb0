"""DAMON virtual-address monitoring of the registered ranges, through sysfs.

One kdamond, one context with ``vaddr`` operations, one target per
registered pid whose initial regions are exactly the pid's registered ranges
(merged and page aligned), and one ``stat`` scheme that matches every region.
Each collect asks the kdamond to dump the regions the scheme tried
(``update_schemes_tried_regions``), reads each region's nr_accesses and age,
and spreads nr_accesses over the blocks each region covers.

A region's nr_accesses says how often DAMON's sampled page in it was found
accessed: it is evidence about the region, and about a block only as far as
the region is that block. Two things spread it onto blocks nobody reads
(both seen in the guest, tests/vm/test_tiering_e2e_vm.py, where they put 11
never-read blocks of 128 into DRAM for good):

- The first dumps. vaddr starts from the registered range as one region and
  splits regions only once per aggregation, so the first dump credits every
  block of a 256 MiB pool with the 2 accessed samples its hot 32 MiB gave
  (and the temperature's run-start correction makes that look like a block
  read throughout). DAMON never merges regions above ``total size /
  min_nr_regions`` (``damon_region_sz_limit`` in mm/damon/core.c), so a
  larger region is one still being split: it credits nothing
  (``region_size_limit``).
- A region straddling the edge of a hot set. Its count is the hot part's
  share; DAMON splits at random points every aggregation and keeps apart
  what differs, so such a region moves and shrinks from one dump to the
  next, while a block that is read is found so in every dump. A block is
  credited what its last two dumps agree on, the smaller of the two
  (``collect``): a boundary passing over it once is not a read of it. A
  block that starts being read is credited from its second dump on; the
  first names it in the observation's ``pending``, and where such a block
  is in a lower tier the engine collects again at once rather than a tick
  later (``Engine._follow_up``).

Kernel behaviour this relies on (Documentation/admin-guide/mm/damon/usage.rst):

- A scheme's access-pattern bounds default to 0..0 (size 0 bytes, 0
  accesses, age 0), which matches nothing; they are written explicitly to
  their full ranges so every region shows up in tried_regions.
- vaddr's "update" step (every ``update_us``) replaces a target's regions by
  the three big areas of its address space (heap, mmap area, stack), which
  would widen monitoring to the whole process. ``update_us`` is therefore
  set very long by default; each ``set_targets`` commit re-applies the
  registered ranges anyway, and regions outside blocks are ignored.
- Writing ``update_schemes_tried_regions`` to ``state`` returns once the
  kdamond has refreshed the dump, i.e. after up to about one aggregation
  interval (plus the sysfs command poll of 100 ms on 6.12): that is the
  latency of ``collect``. The dump is filled while the scheme is applied
  (at the next aggregation), and the kernel gives up on it after twice the
  scheme's apply interval of *wall-clock* time
  (``damos_tried_regions_init_upd_status`` in mm/damon/sysfs-schemes.c sets
  ``upd_timeout_jiffies``), while the apply waits for its turn counted in
  *samples*. A kdamond slower than real time (a loaded host, a TCG guest:
  each sample takes longer than sample_us) then gets an empty dump that
  still "succeeds". The scheme matches every region, so a real dump is
  never empty while targets exist: an empty one is asked for again, up to
  DUMP_ATTEMPTS times (each try starts at another point of the aggregation
  interval). Applying the scheme every sample (``apply_interval_us`` =
  sample_us, 6.7+) would close the window instead, but measured on the
  guest workload it kept DAMON-only tiering from following a moved hot set
  (scripts/bench/vm_tiering_compare.py --modes kvtier_damon: phase 2 4 %
  on DRAM after 15 s, against 100 % in 7 s without it), so it is not done.
- ``nr_targets`` (like every nr_* file) recreates all its subdirectories, so
  a retarget rewrites every target, then ``commit`` applies the new inputs to
  the running kdamond without restarting it (region history is kept where
  the ranges did not change).
- sysfs can only resize ``nr_kdamonds`` while no kdamond runs: a kdamond
  someone else started makes this source unavailable rather than stopping it.
  Except kvtier's own leftovers: a kvtierd killed by SIGKILL (the OOM killer,
  ``systemctl kill -s KILL``, a test harness) runs no ``finally``, so it can
  leave the probe's bare kdamond (nr_kdamonds 1, a context with default
  vaddr ops, no target, no scheme, off) or its monitoring kdamond still on
  (vaddr, one ``stat`` scheme with kvtier's full-range bounds; a vaddr
  kdamond only stops by itself once all its target processes exit). Either
  would make every later start refuse DAMON, so the probe recognises those
  two shapes, removes them and says so (``damon_leftover_removed``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from kvtier import logs
from kvtier.blocks import BlockTable
from kvtier.errors import ConfigError, KvtierError, KvtierOSError
from kvtier.hotness import SOURCE_WEIGHTS
from kvtier.kernel.native import PAGE_SIZE
from kvtier.kernel.sources.base import Availability, BlockIndex, Observation, Source
from kvtier.kernel.sysfs_io import SysfsIO

log = logging.getLogger("kvtier.kernel.sources.damon")

# Paths relative to the sysfs root.
DAMON_ADMIN = "kernel/mm/damon/admin"
KDAMONDS = f"{DAMON_ADMIN}/kdamonds"
NR_KDAMONDS = f"{KDAMONDS}/nr_kdamonds"
KDAMOND = f"{KDAMONDS}/0"  # kvtier uses exactly one kdamond, index 0
STATE = f"{KDAMOND}/state"
KDAMOND_PID = f"{KDAMOND}/pid"
NR_CONTEXTS = f"{KDAMOND}/contexts/nr_contexts"
CTX = f"{KDAMOND}/contexts/0"
AVAIL_OPERATIONS = f"{CTX}/avail_operations"
OPERATIONS = f"{CTX}/operations"
INTERVALS = f"{CTX}/monitoring_attrs/intervals"
NR_REGIONS = f"{CTX}/monitoring_attrs/nr_regions"
TARGETS = f"{CTX}/targets"
NR_TARGETS = f"{TARGETS}/nr_targets"
SCHEMES = f"{CTX}/schemes"
NR_SCHEMES = f"{SCHEMES}/nr_schemes"
SCHEME = f"{SCHEMES}/0"
TRIED_REGIONS = f"{SCHEME}/tried_regions"

OPS_VADDR = "vaddr"
ACTION_STAT = "stat"  # count only; never changes memory

# state commands
ON = "on"
OFF = "off"
COMMIT = "commit"
UPDATE_TRIED_REGIONS = "update_schemes_tried_regions"

# Access-pattern bounds covering everything: sizes are unsigned long, while
# nr_accesses and age are unsigned int inside the kernel.
ULONG_MAX = (1 << 64) - 1
UINT_MAX = (1 << 32) - 1

# Tries of update_schemes_tried_regions per collect while the dump comes
# back empty (timed out in the kernel, see the module docstring).
DUMP_ATTEMPTS = 5

# vaddr re-derives target regions from the whole address space every
# update_us (see the module docstring); 2^40 us is about 12.7 days.
UPDATE_NEVER_US = 1 << 40
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class DamonParams:
    """Monitoring attributes (config table ``[hotness.damon]``)."""

    sample_us: int = 5_000  # one access check per region per sample
    aggr_us: int = 100_000  # nr_accesses counts samples within one aggregation
    update_us: int = UPDATE_NEVER_US
    min_nr_regions: int = 10
    max_nr_regions: int = 1000

    def __post_init__(self) -> None:
        if self.sample_us <= 0 or self.aggr_us < self.sample_us:
            raise ConfigError("hotness.damon: need 0 < sample_us <= aggr_us")
        if self.update_us < self.aggr_us:
            raise ConfigError("hotness.damon.update_us: must be >= aggr_us")
        # The kernel rejects min_nr_regions < 3 (damon_set_attrs).
        if self.min_nr_regions < 3 or self.max_nr_regions < self.min_nr_regions:
            raise ConfigError("hotness.damon: need 3 <= min_nr_regions <= max_nr_regions")

    @property
    def max_nr_accesses(self) -> int:
        return self.aggr_us // self.sample_us


@dataclass(frozen=True)
class TriedRegion:
    start: int
    end: int
    nr_accesses: int
    age: int


class DamonSource(Source):
    name = "damon"
    # Not run over regions whose owner hints (the engine passes the other
    # rows to set_targets): the hints already say which blocks are read, and
    # a kdamond watching them only costs CPU.
    skip_hinted = True

    def __init__(
        self,
        io: SysfsIO,
        params: DamonParams | None = None,
        proc_root: str = "/proc",
        weight: float = SOURCE_WEIGHTS["damon"],
    ):
        self.io = io
        self.params = params or DamonParams()
        self.proc_root = proc_root
        self.weight = weight
        self.running = False
        self.index: BlockIndex | None = None
        self.targets: list[tuple[int, np.ndarray]] = []  # (pid, ranges) in kdamond target order
        self.last_regions: dict[int, list[TriedRegion]] = {}  # per pid, from the last dump
        self.slowdown = 1  # sample and aggregation intervals x this (engine's cost control)
        self._kernel_done = 0.0  # CPU seconds of kdamonds that have stopped
        self._kdamond: tuple[int, float] | None = None  # (pid, CPU seconds last read)
        self.empty_dumps = 0  # tried-regions dumps the kernel timed out on (asked again)

    # -- probe ----------------------------------------------------------------

    def probe(self) -> Availability:
        io = self.io
        admin = io.path(DAMON_ADMIN)
        if not io.exists(DAMON_ADMIN):
            return Availability(False, f"DAMON sysfs interface absent: {admin} missing (CONFIG_DAMON_SYSFS)")
        try:
            nr = io.read_int(NR_KDAMONDS)
            leftover = self._own_leftover() if nr == 1 else None
            if leftover is not None:
                if io.read(STATE) != OFF:
                    io.write(STATE, OFF)
                io.write(NR_KDAMONDS, 0)
                logs.event(log, "damon_leftover_removed", logging.WARNING, kdamond=io.path(KDAMOND), shape=leftover)
                nr = 0
            if nr != 0:
                states = [io.read(f"{KDAMONDS}/{k}/state") for k in io.listdir_numeric(KDAMONDS)]
                return Availability(
                    False,
                    f"{io.path(NR_KDAMONDS)} is {nr} (kdamond states: {', '.join(states) or '?'}): "
                    "another DAMON user owns the kdamonds and sysfs cannot add one beside them",
                )
            # avail_operations exists only inside a context: create one, read, tear down.
            io.write(NR_KDAMONDS, 1)
            try:
                io.write(NR_CONTEXTS, 1)
                avail = io.read(AVAIL_OPERATIONS).split()
            finally:
                io.write(NR_KDAMONDS, 0)
        except KvtierOSError as e:
            return Availability(False, f"DAMON sysfs: {e}")
        if OPS_VADDR not in avail:
            return Availability(
                False,
                f"DAMON {OPS_VADDR} ops not in {io.path(AVAIL_OPERATIONS)} (has: {' '.join(avail) or 'nothing'}; "
                "CONFIG_DAMON_VADDR)",
            )
        return Availability(True, f"DAMON {OPS_VADDR} through {admin}")

    def _own_leftover(self) -> str | None:
        """Which of kvtier's shapes kdamond 0 has (the module docstring), or None."""
        io = self.io
        try:
            if io.read_int(NR_CONTEXTS) == 0:
                return "probe" if io.read(STATE) == OFF else None
            if io.read_int(NR_CONTEXTS) != 1 or io.read(OPERATIONS) != OPS_VADDR:
                return None
            nr_targets, nr_schemes = io.read_int(NR_TARGETS), io.read_int(NR_SCHEMES)
            if nr_targets == 0 and nr_schemes == 0:
                return "probe" if io.read(STATE) == OFF else None
            if nr_schemes != 1 or io.read(f"{SCHEME}/action") != ACTION_STAT:
                return None
            ap = f"{SCHEME}/access_pattern"
            for name, hi in (("sz", ULONG_MAX), ("nr_accesses", UINT_MAX), ("age", UINT_MAX)):
                if io.read_int(f"{ap}/{name}/min") != 0 or io.read_int(f"{ap}/{name}/max") != hi:
                    return None
            return "monitor"
        except (KvtierError, ValueError):
            return None  # not laid out as ours: someone else's

    # -- configuration ----------------------------------------------------------

    def set_targets(self, table: BlockTable, rows: np.ndarray | None = None) -> None:
        """Watch the table's blocks (only ``rows`` when given; none stops the kdamond)."""
        self.index = BlockIndex(table, rows)
        targets = []
        for pid in self.index.pids:
            if not os.path.exists(os.path.join(self.proc_root, str(pid))):
                continue  # exited; the registry drops it soon
            r = self.index.ranges(pid, PAGE_SIZE)
            if len(r):
                targets.append((pid, r))
        if [(p, r.tobytes()) for p, r in targets] == [(p, r.tobytes()) for p, r in self.targets]:
            return
        self.targets = targets
        if not targets:
            self._stop()
            return
        if not self.running:
            self._write_context()
            self._write_targets()
            self._write_scheme()
            self.io.write(STATE, ON)
            self.running = True
        else:
            self._write_targets()
            self.io.write(STATE, COMMIT)

    def _write_context(self) -> None:
        io, p = self.io, self.params
        io.write(NR_KDAMONDS, 1)
        io.write(NR_CONTEXTS, 1)
        io.write(OPERATIONS, OPS_VADDR)
        self._write_intervals()
        io.write(f"{NR_REGIONS}/min", p.min_nr_regions)
        io.write(f"{NR_REGIONS}/max", p.max_nr_regions)

    def _write_intervals(self) -> None:
        io, p, f = self.io, self.params, self.slowdown
        io.write(f"{INTERVALS}/sample_us", p.sample_us * f)
        io.write(f"{INTERVALS}/aggr_us", p.aggr_us * f)
        io.write(f"{INTERVALS}/update_us", max(p.update_us, p.aggr_us * f))

    def set_slowdown(self, factor: int) -> None:
        """Sample ``factor`` times less often (the kdamond's CPU is about
        proportional to samples per second); applied to a running kdamond
        with a commit, which keeps its region history."""
        factor = max(1, int(factor))
        if factor == self.slowdown:
            return
        self.slowdown = factor
        if self.running:
            self._write_intervals()
            self.io.write(STATE, COMMIT)

    def events(self) -> dict[str, int]:
        # EBUSY answers of DAMON's sysfs absorbed by retrying (sysfs_io)
        return {"sysfs_busy_retries": self.io.busy_retries}

    def kernel_cpu_seconds(self) -> float:
        """CPU time of the kdamond(s) this source has run (utime + stime)."""
        pid = None
        if self.running and not self.io.dry_run:
            try:
                pid = self.io.read_int(KDAMOND_PID)
            except (KvtierOSError, ValueError):
                pid = None
        cpu = None
        if pid and pid > 0:
            try:
                with open(os.path.join(self.proc_root, str(pid), "stat")) as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                cpu = (int(rest[11]) + int(rest[12])) / CLK_TCK
            except (OSError, IndexError, ValueError):
                cpu = None
        last = self._kdamond
        if last is not None and (cpu is None or last[0] != pid):
            self._kernel_done += last[1]  # that kdamond is gone: keep what it used
            self._kdamond = None
        if cpu is not None:
            self._kdamond = (pid, cpu)
        return self._kernel_done + (self._kdamond[1] if self._kdamond else 0.0)

    def _write_targets(self) -> None:
        io = self.io
        io.write(NR_TARGETS, len(self.targets))
        for i, (pid, ranges) in enumerate(self.targets):
            t = f"{TARGETS}/{i}"
            io.write(f"{t}/pid_target", pid)
            io.write(f"{t}/regions/nr_regions", len(ranges))
            for j, (s, e) in enumerate(ranges.tolist()):
                io.write(f"{t}/regions/{j}/start", s)
                io.write(f"{t}/regions/{j}/end", e)

    def _write_scheme(self) -> None:
        io = self.io
        io.write(NR_SCHEMES, 1)
        io.write(f"{SCHEME}/action", ACTION_STAT)
        # Explicit bounds: the defaults (0..0) would match no region at all.
        ap = f"{SCHEME}/access_pattern"
        for name, hi in (("sz", ULONG_MAX), ("nr_accesses", UINT_MAX), ("age", UINT_MAX)):
            io.write(f"{ap}/{name}/min", 0)
            io.write(f"{ap}/{name}/max", hi)

    # -- collect ------------------------------------------------------------------

    def read_tried_regions(self) -> list[TriedRegion]:
        io = self.io
        out = []
        for k in io.listdir_numeric(TRIED_REGIONS):
            d = f"{TRIED_REGIONS}/{k}"
            out.append(
                TriedRegion(
                    io.read_int(f"{d}/start"),
                    io.read_int(f"{d}/end"),
                    io.read_int(f"{d}/nr_accesses"),
                    io.read_int(f"{d}/age"),
                )
            )
        return out

    def split_by_target(self, regions: list[TriedRegion]) -> dict[int, list[TriedRegion]]:
        """Assign dumped regions to targets.

        tried_regions lists the regions target by target, each target's in
        ascending address order, but does not say which target a region
        belongs to (targets are different address spaces, so their ranges
        may even coincide). A region stays with the current target while it
        continues upwards inside that target's span; otherwise it belongs to
        the next target whose span contains it.
        """
        out: dict[int, list[TriedRegion]] = {pid: [] for pid, _ in self.targets}
        spans = [(pid, int(r[0, 0]), int(r[-1, 1])) for pid, r in self.targets]
        t = 0
        prev_end = -1
        for reg in regions:
            while t < len(spans):
                pid, lo, hi = spans[t]
                if reg.start >= prev_end and lo <= reg.start and reg.end <= hi:
                    break
                t += 1
                prev_end = -1
            if t == len(spans):
                # The kdamond's view is older than ours (a retarget raced the
                # dump): drop the rest rather than credit the wrong process.
                break
            out[spans[t][0]].append(reg)
            prev_end = reg.end
        return out

    def collect(self, now: float) -> Observation:
        if not self.running or self.index is None:
            return self.empty()
        for attempt in range(DUMP_ATTEMPTS):
            try:
                self.io.write(STATE, UPDATE_TRIED_REGIONS)
            except KvtierOSError:
                # A kdamond stops by itself once every target process has
                # exited; then the command fails. Forget the setup so the
                # next set_targets starts a fresh one.
                if self.io.dry_run or self.io.read(STATE) != OFF:
                    raise
                log.info("kdamond stopped (all target processes exited)")
                self.running = False
                self.targets = []
                return self.empty()
            regions = self.read_tried_regions()
            if regions:
                break
            self.empty_dumps += 1  # the kernel's wall-clock timeout beat the apply: ask again
        if not regions:
            return self.empty()  # no dump: no news (the last one stays what the next is held against)
        per_pid = self.split_by_target(regions)
        limit = self.region_size_limit()
        rows_l, counts_l, pending_l = [], [], []
        for pid, regs in per_pid.items():
            if not regs:
                continue
            rows, now_mean = self._block_means(pid, regs, limit)
            before = self.last_regions.get(pid)
            if before:
                # what both dumps agree each block had (module docstring)
                agreed = np.minimum(now_mean, self._block_means(pid, before, limit)[1])
                rows_l.append(rows)
                counts_l.append(agreed)
                # read more in this dump than the agreement credits: the
                # next dump confirms it or not (the engine may ask for it
                # at once instead of a tick later)
                pending_l.append(rows[now_mean > agreed])
            else:
                pending_l.append(rows[now_mean > 0])
        # pids no longer watched are dropped; a pid missing from this dump keeps its last
        self.last_regions = {pid: per_pid[pid] or self.last_regions.get(pid, []) for pid in per_pid}
        pending = np.concatenate(pending_l) if pending_l else None
        if not rows_l:
            return self.observation(np.zeros(0, np.int64), np.zeros(0, np.float32), pending=pending)
        return self.observation(np.concatenate(rows_l), np.concatenate(counts_l), pending=pending)

    def region_size_limit(self) -> int:
        """Bytes above which a region is one DAMON is still splitting: the
        kernel merges regions only up to the monitored total over
        min_nr_regions (damon_region_sz_limit), so only its initial ones and
        their first pieces are larger."""
        total = sum(int((r[:, 1] - r[:, 0]).sum()) for _, r in self.targets)
        return max(total // self.params.min_nr_regions, PAGE_SIZE)

    def _block_means(self, pid: int, regs: list[TriedRegion], limit: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, byte-weighted mean nr_accesses) of the pid's blocks; regions
        above ``limit`` bytes count as no access."""
        a = np.array([(r.start, r.end, r.nr_accesses) for r in regs], dtype=np.uint64)
        value = np.where(a[:, 1] - a[:, 0] > np.uint64(limit), 0.0, a[:, 2].astype(np.float64))
        return self.index.mean_over_blocks(pid, a[:, 0], a[:, 1], value)

    # -- teardown ---------------------------------------------------------------------

    def _stop(self) -> None:
        if not self.running:
            return
        self.running = False
        try:
            self.io.write(STATE, OFF)
        finally:
            self.io.write(NR_KDAMONDS, 0)

    def close(self) -> None:
        try:
            self._stop()
        except KvtierError as e:
            log.warning("DAMON cleanup failed: %s", e)
        self.targets = []
