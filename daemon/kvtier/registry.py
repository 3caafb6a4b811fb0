"""Registered regions: per-region metadata in Python, per-block state in the BlockTable.

A region is one contiguous range of one process's memory, cut into
fixed-size KV blocks. The registry checks a registration against the
process's mappings, enforces per-process limits, owns the region's slice of
the ``BlockTable`` and watches the process so that its exit drops its
regions. Everything here runs on the daemon's event-loop thread; the engine's
worker thread sees only snapshots.

Process identity is (pid, start time): a pid alone is reused by the kernel,
so the state file and the liveness checks always compare both.
"""

from __future__ import annotations

import collections
import errno
import heapq
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

import numpy as np

from kvtier import logs

from kvtier.blocks import (
    F_KEEP_DRAM,
    F_MANUAL_PIN,
    F_ENGINE,
    F_NEVER_SWAP,
    F_NOT_PRESENT,
    F_STALE,
    F_UNMOVABLE,
    STUCK_DECLARED,
    BlockTable,
    Staged,
    row_count,
)
from kvtier.hotness import SOURCE_WEIGHTS, Temperature, apply_phase
from kvtier.errors import InvalidArgument, KvtierError, ProcessGone
from kvtier.ports import RecorderPort
from kvtier.stats import DaemonStats

log = logging.getLogger("kvtier.registry")

CONSTRAINT_FLAGS = {"keep_dram": F_KEEP_DRAM, "never_swap": F_NEVER_SWAP}
MIN_BLOCK_SIZE = 4096
# tenant ids are int16 in the block table
TENANT_ID_MAX = int(np.iinfo(np.int16).max)


def _flags(constraints, pinned: bool, engine: bool) -> int:
    """A new region's initial flags bits."""
    flags = 0
    for c in constraints:
        flags |= CONSTRAINT_FLAGS[c]
    if pinned:
        flags |= F_UNMOVABLE
    if engine:
        flags |= F_ENGINE
    return flags


# Region ids travel as the protocol's `region` type: 1..2^31-1.
MAX_REGION_ID = (1 << 31) - 1
# Why recently dropped regions went, so a client's next request on one is
# told (the daemon has no channel to tell a plain client unasked). Bounded:
# the oldest reasons are forgotten first.
MAX_DROP_REASONS = 4096

class NotFound(KvtierError, LookupError):
    code = "not_found"


class LimitExceeded(KvtierError):
    code = "limit_exceeded"


class Overlap(KvtierError):
    code = "overlap"


class PidWatcher(Protocol):
    """Calls back when a process exits (the daemon's implementation puts a
    pidfd in the event loop; a pidfd becomes readable when the process exits)."""

    def watch(self, pid: int, on_exit: Callable[[int], None]) -> None: ...

    def unwatch(self, pid: int) -> None: ...


class ProcessChecker(Protocol):
    """What the registry needs to know about processes (kernel/procfs.py's
    ``ProcProcesses`` reads /proc; tests may pass their own)."""

    def start_time(self, pid: int) -> int: ...

    def check_range(self, pid: int, start: int, length: int) -> None: ...

    def alive(self, pid: int, start_time: int | None) -> bool: ...

    def uids(self, pid: int) -> tuple[int, int]:
        """(real, effective) uid of the process now."""
        ...

    def mapped_blocks(self, pid: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Per block, whether its whole range is mapped (by any mapping)."""
        ...


@dataclass
class Region:
    id: int
    pid: int
    start_time: int
    start: int
    length: int
    block_size: int
    nblocks: int
    name: str
    tenant: str
    tenant_id: int
    priority: int
    constraints: tuple[str, ...]
    owner_uid: int
    registered_at: float = field(default_factory=time.time)
    block_hints: int = 0
    adopted_by: str = ""  # [[watch]] rule that adopted it (kvtier.watch); "" = a client registered it
    # Placed by allocate: {"tier", "tier_name", "node", "reason"}; None for register.
    placement: dict | None = None
    # The engine pins the pages: never planned (F_UNMOVABLE), still counted.
    pinned: bool = False
    # "kernel": the daemon moves its pages; "engine": the owner moves its
    # blocks between its own pools on request (kvtier.engine_moves).
    mode: str = "kernel"
    # blocks found no longer mapped (the owner freed part of the range)
    unmapped_blocks: int = 0
    # allocated blocks kvtier never moved, measured outside their placement's
    # tier: the kernel moved them (Engine.check_placement)
    placement_lost: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    def to_dict(self) -> dict:
        d = asdict(self)
        d["constraints"] = list(self.constraints)
        return d


@dataclass(frozen=True)
class Limits:
    max_regions_per_process: int = 4096
    max_bytes_per_process: int = 1 << 46
    max_blocks_per_region: int = 1 << 22
    max_blocks_total: int = 1 << 24


def _pin_runs(flags: np.ndarray, pin_tier: np.ndarray) -> list[list[int]]:
    """A region's operator pins as [[first block, count, tier], ...] runs of
    pinned blocks with one tier: a whole-region pin of 4 Mi blocks is one
    run, not 4 Mi ints (which took the loop 0.56-0.68 s to list each time
    the state file was written)."""
    pinned = (flags & F_MANUAL_PIN) != 0
    if not pinned.any():
        return []
    key = np.where(pinned, pin_tier.astype(np.int64), -1000)
    brk = np.flatnonzero(np.diff(key) != 0) + 1
    firsts = np.concatenate(([0], brk))
    counts = np.diff(np.concatenate((firsts, [key.size])))
    keep = pinned[firsts]
    return np.stack([firsts[keep], counts[keep], key[firsts[keep]]], axis=1).tolist()


# A hint message lists at least this many blocks, and its region has no
# more than PER_BLOCK_SPAN times as many, before its hints are summed per
# block first (_per_block).
PER_BLOCK_MIN = 64
PER_BLOCK_SPAN = 2


def _per_block(blocks: np.ndarray, counts: np.ndarray | None,
               nblocks: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A message's hints summed per block of its region: (how often each
    block is listed, its counts summed, or None without counts), both of
    length ``nblocks``; (None, None) where that would not pay. Under a
    hint stream a message lists a few dozen blocks thousands of times (the
    requests that read them): folding it first makes every later step of
    ``Registry.hint`` and ``Temperature.add`` work per block, not per
    listing, for two bincounts over the region (each listing counts and
    adds as before; a block gets its counts' sum in one add, which can
    differ from one add per listing in the last bit of a float32)."""
    k = int(blocks.size)
    if k < PER_BLOCK_MIN or nblocks > PER_BLOCK_SPAN * k:
        return None, None
    listed = np.bincount(blocks, minlength=nblocks)
    if counts is None:
        return listed, None
    return listed, np.bincount(blocks, weights=counts.astype(np.float64), minlength=nblocks).astype(np.float32)


class Registry:
    def __init__(
        self,
        table: BlockTable,
        limits: Limits,
        stats: DaemonStats,
        temperature: Temperature,
        processes: ProcessChecker,
        watcher: PidWatcher | None = None,
        on_change: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        recorder: RecorderPort | None = None,
    ):
        self.table = table
        self.limits = limits
        self.stats = stats
        self.temperature = temperature
        self.watcher = watcher
        self.processes = processes
        self.on_change = on_change or (lambda: None)
        # The engine's between-tick hooks (daemon.build wires them): a region
        # added (its blocks get a first look), hints folded in (rows, and
        # those of them just marked F_STALE: not known present).
        # Hints of blocks not in the fastest tier (or not known anywhere):
        # what can make the next plan differ. A hint of a block already in
        # DRAM only makes a resident hotter, which moves nothing.
        self.hints_off_top = 0
        self.on_added: Callable[[int], None] = lambda region_id: None
        self.on_hinted: Callable[[np.ndarray, np.ndarray], None] = lambda rows, unsure: None
        self.clock = clock
        self.regions: dict[int, Region] = {}
        self.by_pid: dict[int, set[int]] = {}
        self.pid_start: dict[int, int] = {}
        # (real, effective) uid of each process when its first region was
        # added: exec of a setuid program keeps pid and start time, so this
        # is what tells that its memory is no longer its owner's.
        self.pid_uids: dict[int, tuple[int, int]] = {}
        self.tenants: dict[str, int] = {"": 0}
        self.tenants_kept: set[str] = set()  # names the config gives quotas: their ids stay theirs
        self._tenant_free: list[int] = []  # heap of ids to hand out
        self._tenant_next = 1  # ids from here on were never handed out
        self.next_id = 1
        self.generation = 0  # bumped whenever table rows shift (region added/removed)
        self.recorder = recorder  # kvtier.record.Recorder when [record] is on
        self.drop_reasons: collections.OrderedDict[int, str] = collections.OrderedDict()

    # -- registration ----------------------------------------------------

    def tenant_id(self, name: str, keep: bool = False) -> int:
        """The id of tenant ``name``, a new one if it has none. ``keep``: the
        config names it (a DRAM quota), so its id is never handed to another
        name. Ids are int16 (the table's column); when they run out, those
        of names that no region and no quota uses are taken back."""
        tid = self.tenants.get(name)
        if tid is None:
            if not self._tenant_free:
                self._collect_tenants()
            if not self._tenant_free:
                raise LimitExceeded(f"too many distinct tenants ({len(self.tenants)}) in use by regions "
                                    "and quotas")
            tid = heapq.heappop(self._tenant_free)
            self.tenants[name] = tid
        if keep:
            self.tenants_kept.add(name)
        return tid

    def quota_tenant_id(self, name: str) -> int:
        """``tenant_id`` of a name the config gives a DRAM quota (kept)."""
        return self.tenant_id(name, keep=True)

    def _collect_tenants(self) -> None:
        """Free the ids of the names no region and no quota uses: a name
        given in a request that failed, or whose regions are all gone, holds
        none (a client naming a new tenant per request took every id, and
        every later register with a new tenant was refused until restart)."""
        used = {r.tenant_id for r in self.regions.values()}
        gone = [n for n, t in self.tenants.items() if n and t not in used and n not in self.tenants_kept]
        for n in gone:
            heapq.heappush(self._tenant_free, self.tenants.pop(n))
        if not self._tenant_free and self._tenant_next <= TENANT_ID_MAX:
            self._tenant_free.append(self._tenant_next)
            self._tenant_next += 1

    def add(
        self,
        pid: int,
        start: int,
        length: int,
        block_size: int,
        *,
        name: str = "",
        tenant: str = "",
        priority: int = 0,
        constraints: tuple[str, ...] | list[str] = (),
        owner_uid: int = 0,
        start_time: int | None = None,
        region_id: int | None = None,
        adopted_by: str = "",
        placement: dict | None = None,
        pinned: bool = False,
        engine_tiers: np.ndarray | None = None,
        staged: Staged | None = None,
    ) -> Region:
        """Validate and add a region. ``start_time`` (re-adoption) must match
        the live process's; ``region_id`` keeps the id a client already holds.
        ``engine_tiers`` (one per block) makes it an engine-mode region: no
        memory of the process is named, so no mapping or overlap is checked.
        ``staged`` (from ``stage``, filled since): its rows become the
        region's, checked again here as the table may have changed."""
        nblocks, live_start = self._admit(pid, start, length, block_size, start_time, engine_tiers)
        engine = engine_tiers is not None
        if pid not in self.by_pid and self.watcher is not None:
            self.watcher.watch(pid, self.drop_pid)
        if region_id is None:
            region_id = self._free_id()
            self.next_id = region_id + 1
        elif region_id in self.regions:
            raise Overlap(f"region id {region_id} already in use")
        else:
            self.next_id = max(self.next_id, region_id + 1)
        flags = _flags(constraints, pinned, engine)
        tid = self.tenant_id(tenant)
        if staged is None:
            self.table.add_region(
                region_id, pid, start, length, block_size, flags=flags, priority=priority, tenant=tid
            )
        else:
            if (staged.pid, staged.start, staged.length, staged.block_size, staged.flags, staged.priority
                    ) != (pid, start, length, block_size, flags, priority):
                raise InvalidArgument("staged rows are not this region's")
            self.table.publish(staged, region_id)
            if staged.tenant != tid:  # staged under a placeholder: ids are made for regions that exist
                self.table.region_view(region_id, "tenant")[:] = tid
        if pinned:
            self.table.region_view(region_id, "stuck")[:] = STUCK_DECLARED
        if engine:
            self.set_engine_tiers(region_id, engine_tiers)
        reg = Region(
            id=region_id, pid=pid, start_time=live_start, start=start, length=length,
            block_size=block_size, nblocks=nblocks, name=name, tenant=tenant, tenant_id=tid,
            priority=priority, constraints=tuple(constraints), owner_uid=owner_uid, adopted_by=adopted_by,
            placement=dict(placement) if placement else None, pinned=bool(pinned),
            mode="engine" if engine else "kernel",
        )
        self.regions[region_id] = reg
        self.drop_reasons.pop(region_id, None)
        if self.recorder is not None:
            self.recorder.region_added(region_id)
        if pid not in self.by_pid:
            self.pid_uids[pid] = self.processes.uids(pid)
        self.by_pid.setdefault(pid, set()).add(region_id)
        self.pid_start[pid] = live_start
        self.stats.regions_registered_total += 1
        self.generation += 1
        self._gauges()
        self.on_change()
        self.on_added(region_id)
        logs.event(log, "region_registered", region=region_id, pid=pid, name=name, tenant=tenant,
                   bytes=length, blocks=nblocks, block_size=block_size)
        return reg

    def _admit(self, pid: int, start: int, length: int, block_size: int, start_time: int | None,
               engine_tiers: np.ndarray | None) -> tuple[int, int]:
        """Every check a new region must pass (limits, overlap, the process
        and its mapping): (blocks, the process's start time)."""
        lim = self.limits
        if block_size < MIN_BLOCK_SIZE:
            raise InvalidArgument(f"block_size {block_size} is below the minimum {MIN_BLOCK_SIZE}")
        if length < block_size:
            raise InvalidArgument(f"length {length} is smaller than block_size {block_size}")
        nblocks = -(-length // block_size)
        if nblocks > lim.max_blocks_per_region:
            raise LimitExceeded(
                f"region of {nblocks} blocks exceeds limits.max_blocks_per_region={lim.max_blocks_per_region}"
            )
        if len(self.table) + nblocks > lim.max_blocks_total:
            raise LimitExceeded(
                f"daemon holds {len(self.table)} blocks; {nblocks} more exceed "
                f"limits.max_blocks_total={lim.max_blocks_total}"
            )
        if engine_tiers is None:
            self._drop_replaced(pid, start, length)
        mine = [self.regions[r] for r in self.by_pid.get(pid, ())]
        if len(mine) + 1 > lim.max_regions_per_process:
            raise LimitExceeded(
                f"pid {pid} already has {len(mine)} regions (limits.max_regions_per_process)"
            )
        held = sum(r.length for r in mine)
        if held + length > lim.max_bytes_per_process:
            raise LimitExceeded(
                f"pid {pid} holds {held} bytes; {length} more exceed limits.max_bytes_per_process="
                f"{lim.max_bytes_per_process}"
            )
        engine = engine_tiers is not None
        for r in mine:
            if not engine and r.mode == "kernel" and start < r.end and r.start < start + length:
                raise Overlap(
                    f"range 0x{start:x}+{length} overlaps region {r.id} "
                    f"(0x{r.start:x}+{r.length}) of pid {pid}"
                )
        # The process must be the one we think it is *before* its maps are
        # trusted: read the start time, then the maps, then the start time
        # again is unnecessary because the pidfd opened by watch() in add pins
        # the identity; a mismatch with a remembered start time means reuse.
        live_start = self.processes.start_time(pid)
        if start_time is not None and live_start != start_time:
            raise ProcessGone(errno.ESRCH, f"adopt pid {pid}", "pid was reused by another process")
        if engine:
            if engine_tiers.size != nblocks:
                raise InvalidArgument(f"{engine_tiers.size} tiers for {nblocks} blocks")
        else:
            self.processes.check_range(pid, start, length)
        return nblocks, live_start

    def stage(self, pid: int, start: int, length: int, block_size: int, *, tenant: str = "",
              priority: int = 0, constraints: tuple[str, ...] | list[str] = (),
              start_time: int | None = None, pinned: bool = False) -> Staged:
        """Check a region as ``add`` would and hand back its rows to write in
        steps (BlockTable.fill), for ``add(..., staged=)`` once written: a
        large region then costs the loop a slice of rows per step instead
        of all of them at once."""
        self._admit(pid, start, length, block_size, start_time, None)
        return self.table.stage(pid, start, length, block_size, flags=_flags(constraints, pinned, False),
                                priority=priority, tenant=self.tenants.get(tenant, 0))

    def set_engine_tiers(self, region_id: int, tiers: np.ndarray) -> None:
        """Where an engine-mode region's blocks are, as its owner says (the
        daemon has no pages to measure): -1 = not placed (never planned)."""
        t = self.table
        view = t.region_view(region_id, "tier")
        if tiers.size != view.size:
            raise InvalidArgument(f"{tiers.size} tiers for {view.size} blocks")
        view[:] = tiers
        flags = t.region_view(region_id, "flags")
        flags[tiers >= 0] &= np.uint8(~F_NOT_PRESENT & 0xFF)
        flags[tiers < 0] |= np.uint8(F_NOT_PRESENT)
        t.region_view(region_id, "prior")[tiers < 0] = 0  # placed later: allocated since

    def _free_id(self) -> int:
        """The next unused id from next_id on, wrapping from MAX_REGION_ID
        (the wire's region type) back to 1: ids count up so that a freed id
        is not handed out again soon (a client may still hold it), and are
        reused once the range runs out instead of failing every register."""
        rid = self.next_id if 1 <= self.next_id <= MAX_REGION_ID else 1
        while rid in self.regions:
            rid = rid + 1 if rid < MAX_REGION_ID else 1
        return rid

    def get(self, region_id: int) -> Region:
        reg = self.regions.get(region_id)
        if reg is None:
            why = self.drop_reasons.get(region_id)
            raise NotFound(f"no region {region_id}" + (f": {why}" if why else ""))
        return reg

    def _dropped(self, reg: Region, why: str) -> None:
        self.drop_reasons[reg.id] = f"dropped at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {why}"
        while len(self.drop_reasons) > MAX_DROP_REASONS:
            self.drop_reasons.popitem(last=False)

    def drop_unmapped(self, region_id: int) -> Region:
        """The region's memory is gone (munmap, free of a large buffer): its
        blocks can never be measured or moved again, and it counts against
        the owner's limits. Forget it and keep the reason for the owner.
        A process that exec'd a setuid program has a new, briefly empty
        address space: its uid change is the reason given when it is one."""
        reg = self.regions[region_id]
        if self._check_uid(reg.pid) and region_id not in self.regions:
            return reg
        reg = self.remove(region_id)
        self.stats.regions_dropped_unmapped_total += 1
        self._dropped(reg, f"its memory 0x{reg.start:x}+{reg.length} is no longer mapped in pid {reg.pid} "
                           "(freed or unmapped)")
        logs.event(log, "region_dropped", logging.WARNING, region=reg.id, pid=reg.pid, name=reg.name,
                   reason="unmapped", bytes=reg.length)
        return reg

    def _drop_replaced(self, pid: int, start: int, length: int) -> None:
        """A process registering a range over one of its regions whose memory
        is no longer all mapped freed that memory and mapped new memory in
        its place (an allocator reusing the address): the old region goes,
        rather than every register of the new buffer failing with overlap."""
        for rid in list(self.by_pid.get(pid, ())):
            r = self.regions.get(rid)
            if r is None or r.mode != "kernel" or not (start < r.end and r.start < start + length):
                continue
            addrs = self.table.region_view(rid, "addr")
            try:
                mapped = self.processes.mapped_blocks(pid, addrs, self.table.region_view(rid, "nbytes"))
            except KvtierError:
                continue
            if not mapped.all():
                self.drop_unmapped(rid)

    def remove(self, region_id: int) -> Region:
        return self.remove_many([region_id])[0]

    def remove_many(self, region_ids: list[int]) -> list[Region]:
        """Forget these regions (each must exist): their rows leave the
        block table in one pass, and the gauges and the state write follow
        once for all of them."""
        regs = [self.get(rid) for rid in region_ids]
        if self.recorder is not None:
            for reg in regs:
                self.recorder.region_removed(reg.id)
        self.table.remove_regions([reg.id for reg in regs])
        for reg in regs:
            del self.regions[reg.id]
            ids = self.by_pid[reg.pid]
            ids.discard(reg.id)
            if not ids:
                del self.by_pid[reg.pid]
                self.pid_start.pop(reg.pid, None)
                self.pid_uids.pop(reg.pid, None)
                if self.watcher is not None:
                    self.watcher.unwatch(reg.pid)
        self.stats.regions_unregistered_total += len(regs)
        self.generation += 1
        self._gauges()
        self.on_change()
        return regs

    def drop_pid(self, pid: int) -> int:
        """The process exited: forget all of its regions."""
        regs = self.remove_many(list(self.by_pid.get(pid, ())))
        for reg in regs:
            self._dropped(reg, f"its process {pid} exited")
        if regs:
            self.stats.regions_dropped_exit_total += len(regs)
            logs.event(log, "regions_dropped", pid=pid, regions=len(regs), reason="process exited")
        return len(regs)

    def _gauges(self) -> None:
        s = self.stats
        s.regions = len(self.regions)
        s.processes = len(self.by_pid)
        s.blocks = len(self.table)
        s.registered_bytes = sum(r.length for r in self.regions.values())

    # -- per-block input -------------------------------------------------

    def rows(self, region_id: int, blocks: np.ndarray | slice | None) -> np.ndarray | slice:
        """BlockTable rows of a region's blocks: an index array, or the
        region's contiguous row slice when ``blocks`` is None (all) or a
        slice of block indices (a region's rows are contiguous, and numpy
        works on a slice in place: ``apply_phase free`` on 4 Mi rows took
        108 ms with indices, 19 ms with the slice). InvalidArgument if an
        index is out of range."""
        reg = self.get(region_id)
        s = self.table.slices[region_id]
        if blocks is None:
            return slice(s.start, s.stop)
        if isinstance(blocks, slice):
            lo, hi, _ = blocks.indices(reg.nblocks)
            return slice(s.start + lo, s.start + max(lo, hi))
        if blocks.size and int(blocks.max()) >= reg.nblocks:
            raise InvalidArgument(
                f"block index {int(blocks.max())} out of range: region {region_id} has {reg.nblocks} blocks"
            )
        return blocks.astype(np.int64) + s.start

    def hint(self, region_id: int, blocks: np.ndarray, counts: np.ndarray | None) -> int:
        """Fold access hints into temperature as they arrive: one vectorised
        add per message, so no per-block Python work and no queue that grows
        between ticks."""
        rows = self.rows(region_id, blocks)
        if counts is not None and counts.size != blocks.size:
            raise InvalidArgument(f"counts has {counts.size} entries, blocks {blocks.size}")
        listed, weights = _per_block(blocks, counts, self.regions[region_id].nblocks)
        if listed is None:
            weights = counts
        else:
            rows = np.flatnonzero(listed)
            listed = listed[rows]
            weights = listed if weights is None else weights[rows]
            rows += self.table.slices[region_id].start
        n = int(blocks.size)
        self._fold_hints(rows, listed, weights, counts is None, n)
        if self.recorder is not None:
            self.recorder.hint(region_id, blocks, counts)
        self.regions[region_id].block_hints += n
        return n

    def hint_rows(self, rows: np.ndarray, listed: np.ndarray | None, n: int,
                  per_region: list[tuple[int, int]]) -> int:
        """``n`` hints (one read each, no counts) of table rows of several
        regions at once, folded as ``hint`` folds a message: what a hint
        ring's drain found, already checked (every row a block of a region
        the client may hint). ``rows`` lists each hint's row, or with
        ``listed`` each row once and how often it was hinted.
        ``per_region``: (region id, hints) for the regions' counters. One
        pass of array operations for all of them, not one ``hint`` per
        region."""
        if not n:
            return 0
        self._fold_hints(rows, listed, listed, True, n)
        for rid, k in per_region:
            self.regions[rid].block_hints += k
        return n

    def _fold_hints(self, rows: np.ndarray, listed: np.ndarray | None, weights: np.ndarray | None,
                    uncounted: bool, n: int) -> None:
        """``hint``'s work on checked rows: ``n`` listings, or (``listed``)
        distinct rows each listed that often, ``weights`` their reads (None:
        one each); ``uncounted``: no counts came with them."""
        # A hinted block not yet seen present may have just been written:
        # F_STALE has the engine measure it. At most once per block a tick:
        # not a block already waiting for it (F_STALE), nor one hinted
        # before in this tick (marked then, and measured since or still
        # waiting). A never-touched block hinted on every message was
        # otherwise marked, measured, found empty and marked again per
        # message, a measuring job each (64 GiB, 1000 regions, 1 M hinted
        # blocks/s: 20 % of a core).
        t = self.table
        tier = t.tier[rows]  # where the hinted blocks were when read
        flags = t.flags[rows]
        unsure = ((flags & np.uint8(F_NOT_PRESENT)) != 0) | (tier < 0)
        unsure &= (flags & np.uint8(F_STALE)) == 0
        since = self.temperature.last_decay
        if since is not None:
            unsure &= t.last_access[rows] < since
        unsure = rows[unsure]
        if unsure.size:
            t.flags[unsure] |= np.uint8(F_STALE)
        self.temperature.add(self.table, rows, 1.0 if weights is None else weights, self.clock(),
                             SOURCE_WEIGHTS["hint"], checked=True)
        self.stats.block_hints_total += n
        # Where the hinted blocks were when read. A message's blocks mostly
        # sit in one tier: without counts each listing counts one, so that
        # is n there, no bincount.
        if uncounted and tier.size and int(tier.min()) == int(tier.max()):
            self.stats.hint_tier_blocks[int(tier[0])] += n
            if tier[0] != 0:
                self.hints_off_top += n
        else:
            if listed is None:
                self.hints_off_top += int(rows.size - np.count_nonzero(tier == 0))
            else:
                self.hints_off_top += int(listed[tier != 0].sum())
            hits = np.bincount(tier.astype(np.int64) + 2,
                               weights=None if weights is None else weights.astype(np.float64))
            for i in np.flatnonzero(hits):
                self.stats.hint_tier_blocks[int(i) - 2] += int(hits[i])
        self.on_hinted(rows, unsure)

    def phase(self, region_id: int, phase: str, blocks: np.ndarray | None) -> int:
        rows = self.rows(region_id, blocks)
        apply_phase(self.table, rows, phase)
        return row_count(rows)

    def pin(self, region_id: int, blocks: np.ndarray | None, tier: int | None) -> int:
        rows = self.rows(region_id, blocks)
        t = self.table
        t.flags[rows] |= np.uint8(F_MANUAL_PIN)
        # pin_tier = -1 means "where it is now" to the policy.
        t.pin_tier[rows] = -1 if tier is None else tier
        self.on_change()  # pins persist across daemon restarts
        return row_count(rows)

    def unpin(self, region_id: int, blocks: np.ndarray | None) -> int:
        rows = self.rows(region_id, blocks)
        t = self.table
        t.flags[rows] &= np.uint8(~F_MANUAL_PIN & 0xFF)
        t.pin_tier[rows] = -1
        self.on_change()
        return row_count(rows)

    # -- persistence -----------------------------------------------------

    STATE_KEYS = ("id", "pid", "start_time", "start", "length", "block_size", "name",
                  "tenant", "priority", "constraints", "owner_uid", "registered_at", "placement", "pinned", "mode")

    def to_state(self) -> list[dict]:
        out = []
        for r in self.regions.values():
            if r.adopted_by:
                continue  # the watcher adopts it again after a restart
            d = {k: getattr(r, k) for k in self.STATE_KEYS}
            d["constraints"] = list(r.constraints)
            runs = _pin_runs(self.table.region_view(r.id, "flags"), self.table.region_view(r.id, "pin_tier"))
            if runs:
                d["pins"] = {"runs": runs}
            out.append(d)
        return out

    def adopt(self, entries: list[dict], next_id: int = 1) -> tuple[int, int]:
        """Re-add regions from the state file whose process is still the same
        one (pid and start time) and whose range is still mapped. Returns
        (adopted, dropped)."""
        if 1 <= next_id <= MAX_REGION_ID:
            self.next_id = max(self.next_id, next_id)
        adopted = dropped = 0
        for e in entries:
            try:
                reg = self.add(
                    int(e["pid"]), int(e["start"]), int(e["length"]), int(e["block_size"]),
                    name=str(e.get("name", "")), tenant=str(e.get("tenant", "")),
                    priority=int(e.get("priority", 0)),
                    constraints=tuple(c for c in e.get("constraints", ()) if c in CONSTRAINT_FLAGS),
                    owner_uid=int(e.get("owner_uid", 0)), start_time=int(e["start_time"]),
                    region_id=int(e["id"]),
                    placement=e.get("placement") if isinstance(e.get("placement"), dict) else None,
                    pinned=bool(e.get("pinned", False)),
                    # an engine region comes back unplaced until its owner attaches
                    engine_tiers=(np.full(-(-int(e["length"]) // int(e["block_size"])), -1, dtype=np.int8)
                                  if e.get("mode") == "engine" else None),
                )
                reg.registered_at = float(e.get("registered_at", reg.registered_at))
                adopted += 1
                self._restore_pins(reg, e.get("pins"))
            except (KvtierError, OSError, KeyError, TypeError, ValueError) as err:
                dropped += 1
                log.info("not re-adopting region %s of pid %s: %s", e.get("id"), e.get("pid"), err)
        self.stats.regions_adopted_total += adopted
        self.stats.regions_stale_total += dropped
        return adopted, dropped

    def _restore_pins(self, reg: Region, pins) -> None:
        if not isinstance(pins, dict):
            return
        try:
            if "runs" in pins:  # [[first, count, tier], ...]
                runs = np.asarray(pins["runs"], dtype=np.int64).reshape(-1, 3)
                counts = np.clip(runs[:, 1], 0, reg.nblocks)
                first = np.repeat(runs[:, 0], counts)
                blocks = first + (np.arange(first.size) - np.repeat(np.cumsum(counts) - counts, counts))
                tiers = np.repeat(runs[:, 2], counts)
            else:  # the state file of a daemon before the runs: one entry per block
                blocks = np.asarray(pins.get("blocks", []), dtype=np.int64)
                tiers = np.asarray(pins.get("tiers", []), dtype=np.int64)
        except (TypeError, ValueError):
            return
        if blocks.shape != tiers.shape or blocks.ndim != 1:
            return
        ok = (blocks >= 0) & (blocks < reg.nblocks) & (tiers >= -1) & (tiers < 64)
        for tier in np.unique(tiers[ok]):
            sel = blocks[ok & (tiers == tier)]
            self.pin(reg.id, sel.astype(np.uint32), None if tier < 0 else int(tier))

    def check_alive(self) -> int:
        """Drop regions of processes that are gone or were replaced: a
        backstop for a missed pidfd event (and the only check when pidfd is
        unavailable)."""
        gone = [
            pid for pid, st in self.pid_start.items()
            if not self.processes.alive(pid, st)
        ]
        return sum(self.drop_pid(pid) for pid in gone) + self.check_uids()

    def check_uids(self) -> int:
        """Drop the regions of unprivileged owners in processes whose uids
        changed since they were registered (exec of a setuid program keeps
        the pid and start time, and so the region; setuid()), unless the
        process now runs as the owner: the owner must not go on moving,
        pinning or hinting memory of a process that is no longer its own.
        Root's regions stay (root may register any process's memory)."""
        return sum(self._check_uid(pid) for pid in list(self.pid_uids))

    def _check_uid(self, pid: int) -> int:
        """check_uids for one process: how many of its regions it dropped."""
        was = self.pid_uids.get(pid)
        ids = [rid for rid in self.by_pid.get(pid, ()) if self.regions[rid].owner_uid != 0]
        if was is None or not ids:
            return 0
        try:
            now = self.processes.uids(pid)
        except (KvtierError, OSError):
            return 0  # gone: the pidfd (or the next check_alive) drops it
        if now == was:
            return 0
        dropped = 0
        for rid in ids:
            reg = self.regions[rid]
            if now == (reg.owner_uid, reg.owner_uid):
                continue
            self.remove(rid)
            self.stats.regions_dropped_uid_total += 1
            self._dropped(reg, f"its process {pid} now runs as uid {now[0]}/{now[1]} (was {was[0]}/{was[1]}: "
                               "exec of a setuid program or setuid()), not as its owner uid "
                               f"{reg.owner_uid}")
            logs.event(log, "region_dropped", logging.WARNING, region=rid, pid=pid, name=reg.name,
                       reason="process uid changed", uid=now[0], euid=now[1], owner_uid=reg.owner_uid)
            dropped += 1
        if pid in self.pid_uids:
            self.pid_uids[pid] = now
        return dropped
