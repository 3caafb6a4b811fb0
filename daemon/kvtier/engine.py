"""The tick: snapshot, decide, act, with every kernel call off the loop thread.

Each tick, on the event-loop thread (where the registry lives, so no locks):
  1. age temperatures, refresh tier free memory, drop regions of dead
     processes the pidfds missed;
  2. move: if the mover thread is idle and anything changed since the last
     plan (hints, observations, measurements, registrations, moves done; or
     IDLE_REPLAN_S passed), plan over the blocks whose tier is known, add
     operator moves (kvtierctl migrate) and hand the moves to the mover;
  3. measure: if the measuring thread is idle, hand it the stale blocks
     (F_STALE: hinted or observed while not present, a failed move, a
     sample that disagreed; the registry and the collector mark them)
     whole, and the next slice of a rotating sample (a window
     of ``residency_sample_pages`` pages per block), together at most
     ``residency_pages_per_s`` pages per second;
  4. collect: if the collecting thread is idle, hand it the hotness sources
     that are due (each at its own pace: a source over its CPU budget is
     collected, and where it can sampled, less often).

Three worker threads, one job each at a time: a slow DAMON collect or a long
move_pages never makes a hinted promotion wait, and the idle cost follows
what changed and the measuring budget, not the registered bytes. Results
come back to the loop thread keyed by (region id, block index) rather than
table row, because regions registered or dropped meanwhile shift the rows.

A mover still busy when the next tick comes makes that tick skip planning
(counted in ``ticks_skipped_busy``), so a slow kernel never queues up stale
plans.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import math
import mmap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
# np.unique imports numpy.ma on its first call (numpy 2): import it with the
# daemon, not in the first residency measurement after a registration (4.5 s
# there in the TCG guest, whose root is a 9p mount; vm_tiering_compare.py --py-spy).
import numpy.ma  # noqa: F401

from kvtier import logs
from kvtier import policy as pol
from kvtier.blocks import (FIELDS, F_ENGINE, F_KEEP_DRAM, F_MANUAL_PIN, F_NEVER_SWAP, F_NOT_PRESENT, F_STALE,
                           F_UNMOVABLE, STUCK_PINNED, TIER_UNKNOWN, BlockTable, Slice, inflow_offset, row_count,
                           row_select)
from kvtier.deferred import relay
from kvtier.engine_moves import EngineMoves
from kvtier.errors import InvalidArgument, KvtierError, RangeNotMapped
from kvtier.hotness import DEFAULT_SOURCE_CPU_BUDGET, Temperature
from kvtier.ports import (AvailabilityView, HotnessSource, MigratorPort, ObservationView, RecorderPort,
                          TopologyView)
from kvtier.registry import Registry
from kvtier.stats import DaemonStats

log = logging.getLogger("kvtier.engine")
PAGE_SIZE = mmap.PAGESIZE

# Without new input (no hint, observation, measurement, registration or
# finished move) the plan can only change through decay, which is slow
# against the default tau of 30 s: replan that rarely instead of every tick.
IDLE_REPLAN_S = 5.0
# Measuring budget accrues for at most this long (a stalled loop does not
# buy a burst of measurement afterwards).
MAX_BUDGET_S = 5.0
# Pages per measuring job when the operator asked for a full re-measurement
# (no per-second budget then): the jobs follow one another as fast as the
# kernel answers, and each one's building and recording on the loop thread
# stays a few ms. One job of 1 Mi pages (a `measure` of a 1 Mi-block
# region) held the loop 1.5 s building it and 0.1 s recording it.
URGENT_JOB_PAGES = 1 << 16
# The rotating sample looks at this many blocks at least per job (a few
# thousand page queries: well under a millisecond on the host): a table
# whose once-per-residency_interval share of a tick is smaller waits until
# that many (or the whole table) are due. A job costs the loop and the
# measurer about a millisecond whatever it measures (build, queries,
# finish; 20-100 ms under TCG), so a 128-block table sampled whole every
# tick had the measuring thread as kvtierd's largest consumer after the
# loop in the guest comparison, for no more than the interval asks.
# Registrations within this many seconds share one retarget of the sources.
RETARGET_COALESCE_S = 0.05
# Registered regions get their first look apart (_first_look_rows), and
# blocks hinted or observed while not known present are measured soon.
MIN_SAMPLE_BLOCKS = 1024
# The rotating sample backs off while it finds nothing: after this many
# windows in a row (or the whole table, if smaller) that all agreed with the
# table, it runs half as often, down to 1/residency_idle_slowdown of its
# rate; the first window that disagrees puts it back to full rate (see
# Engine._sample_yield).
SAMPLE_BACKOFF_BLOCKS = 16384
# Rows per step when looking for stale blocks (stops once enough are found).
STALE_SCAN_CHUNK = 1 << 16
# Sampled blocks per step of the measuring thread (their windows made, asked
# and counted): each numpy call of a step holds the GIL for well under a
# millisecond, so the loop thread is not kept waiting behind a whole job (a
# 64 Ki-block region's first look held it 2.5 ms to build, then as long to
# count, under scripts/bench/robustness.py's `blocks` attacker).
WINDOW_CHUNK = 4096
# Between ticks, a measuring job for blocks just hinted or observed while not
# known present starts at most this often: a job costs the loop about a
# millisecond (build, finish) whatever it measures, and one per hint message
# was most of the daemon's CPU under a stream of hints (scripts/bench/scale.py,
# 64 GiB in 1000 regions, 1 M hinted blocks/s: 20 % of a core). The rows
# marked meanwhile wait in one merged set for the next job.
MEASURE_SOON_S = 0.1
# Rows of that set a job could not fit in its budget stay queued up to this
# many (the rest stay F_STALE: the tick's stale cursor finds them).
SOON_KEEP_ROWS = 1024
# A source over its CPU budget is collected (and sampled) 2, 4, ... up to
# this many times more slowly.
MAX_SLOWDOWN = 64
# Operator moves (kvtierctl migrate) whose pages the kernel skipped for a
# passing reason are tried again with the next ticks, this many times in all:
# MADV_PAGEOUT skips a page being read or under writeback, move_pages one
# being migrated or locked for a moment.
OPERATOR_ATTEMPTS = 3
# Operator moves go to the mover this many blocks per job, one job after the
# other (the next built as the last finishes, not at the next tick): the
# loop thread builds and records one job in a few ms, and the mover's kernel
# calls come in batches of this size. A `migrate` of a whole 1 Mi-block
# region as one job held the loop 1.4 s building it, 0.1-0.4 s recording
# it, and the mover's 1 Mi-block pass starved the loop thread of the GIL
# for up to 2.4 s.
MANUAL_JOB_BLOCKS = 8192
# `explain` copies the table on its own thread; a copy during which a region
# was added or removed is taken again, this many times in all.
EXPLAIN_TRIES = 3
RETRYABLE = frozenset({"NOT_PAGED_OUT", "EBUSY", "EAGAIN", "WRONG_NODE"})
# what the migrator reports for pages of a block that is no longer mapped
UNMAPPED = "UNMAPPED"
_EFAULT = -errno.EFAULT


class ManualMove(NamedTuple):
    """An operator's move: blocks by (region id, index), the tier, its ticket."""

    regions: np.ndarray
    indices: np.ndarray
    tier: int
    ticket: int = -1
    # a retry: moved even if most of the block is there already (the pages
    # left behind are what it is for)
    retry: bool = False


@dataclass
class MoveTicket:
    """One `migrate` request followed to its end: what moved, what did not
    and why, after the retries. ``future`` (with `migrate wait`) gets the
    report once no block of it is pending."""

    id: int
    region: int
    tier: int
    blocks: int
    started: float
    future: "asyncio.Future | None" = None
    pending: int = 0
    attempts: int = 1
    moved: int = 0
    failed: int = 0
    already: int = 0
    gone: int = 0
    unmapped: int = 0
    engine: int = 0
    planned: int = 0  # a dry run would have moved them
    untouched: int = 0  # no page written yet: nothing to move
    retried: int = 0
    pages_moved: int = 0
    failed_pages: collections.Counter = field(default_factory=collections.Counter)
    dry_run: bool = False

    def report(self, now: float) -> dict:
        return {
            "region": self.region, "tier": self.tier, "blocks": self.blocks, "moved": self.moved,
            "failed": self.failed, "already": self.already, "unmapped": self.unmapped, "gone": self.gone,
            "engine": self.engine, "planned": self.planned, "untouched": self.untouched, "retried": self.retried, "attempts": self.attempts,
            "pages_moved": self.pages_moved, "failed_pages": dict(self.failed_pages),
            "dry_run": self.dry_run, "seconds": now - self.started,
        }


def _keys_of(slices: dict[int, Slice], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(region id, block index) of table rows under a given slice layout."""
    rows = np.asarray(rows, dtype=np.int64)
    if not slices or rows.size == 0:
        z = np.full(rows.shape, -1, dtype=np.int64)
        return z, z.copy()
    ids = np.fromiter(slices, dtype=np.int64, count=len(slices))
    starts = np.fromiter((s.start for s in slices.values()), dtype=np.int64, count=len(slices))
    order = np.argsort(starts)
    ids, starts = ids[order], starts[order]
    k = np.maximum(np.searchsorted(starts, rows, side="right") - 1, 0)
    return ids[k], rows - starts[k]


@dataclass
class MoveJob:
    """Moves for the mover thread; everything is a copy of the plan's rows."""

    region: np.ndarray  # int64 region id per move
    index: np.ndarray  # int64 block index in its region
    pid: np.ndarray
    addr: np.ndarray  # uint64
    nbytes: np.ndarray  # uint64
    src: np.ndarray  # int8 tier now
    dst: np.ndarray  # int8 tier wanted
    plan: pol.Plan | None = None
    plan_pos: np.ndarray | None = None  # position of each move in plan.rows (-1 = operator move)
    started: float = 0.0
    # a tick's plan (kvtier.policy.plan) made at this time, its moves in this
    # job; None for scheduler hints' and promote-hot jobs
    planned_at: float | None = None
    requested_at: np.ndarray | None = None  # scheduler hints (prefetch/release): when each was asked for
    # plan positions handed to engines (mode "engine"): paid, refunded only by their answer
    engine_pos: np.ndarray | None = None
    ok: np.ndarray | None = None
    unmovable: np.ndarray | None = None
    untouched: np.ndarray | None = None  # no page written yet: nothing moved, never touched
    reason: np.ndarray | None = None  # STUCK_* evidence per block (blocks.py)
    dry: np.ndarray | None = None  # planned moves a dry run did not make
    failures: collections.Counter = field(default_factory=collections.Counter)  # (src, dst, errno) -> pages
    pair_seconds: collections.Counter = field(default_factory=collections.Counter)  # (src, dst) -> mover s
    measured_tier: np.ndarray | None = None  # failed moves, re-measured after the move (-1: not)
    seconds: float = 0.0
    ticket: np.ndarray | None = None  # int64 MoveTicket id per move (-1: none)
    unmapped: np.ndarray | None = None  # the block's memory is not (all) mapped: not attempted
    done_pages: np.ndarray | None = None  # pages that ended at the target, per move
    retry: np.ndarray | None = None  # failed for a passing reason only (operator moves retry it)
    # ticket id -> pages by reason: final, or of batches that will be retried
    ticket_errors: dict = field(default_factory=dict)
    ticket_retry_errors: dict = field(default_factory=dict)

    @classmethod
    def of_rows(cls, table: BlockTable, rows: np.ndarray, src: np.ndarray, dst: np.ndarray, started: float,
                **extra) -> MoveJob:
        """The job for these table rows: the mover thread gets copies, never the live table."""
        return cls(region=table.region[rows].astype(np.int64), index=table.index[rows].astype(np.int64),
                   pid=table.pid[rows].copy(), addr=table.addr[rows].copy(), nbytes=table.nbytes[rows].copy(),
                   src=src, dst=dst, started=started, **extra)


@dataclass
class MeasureJob:
    """Blocks for the measuring thread: ``full`` ones page by page, the
    others through a window of sampled page addresses."""

    region: np.ndarray
    index: np.ndarray
    pid: np.ndarray
    addr: np.ndarray
    nbytes: np.ndarray
    full: np.ndarray  # bool per block
    lut: np.ndarray  # node -> tier, captured with the topology at submit time
    ntiers: int
    swap_index: int | None
    started: float = 0.0
    # the others: a window of sample_pages consecutive pages (of page_size)
    # from a random page of each, drawn by the measuring thread from seed
    sample_pages: int = 1
    page_size: int = PAGE_SIZE
    seed: int = 0
    measured_tier: np.ndarray | None = None  # full blocks: dominant tier or TIER_UNKNOWN
    present: np.ndarray | None = None  # full blocks: some page present or swapped
    window_tier: np.ndarray | None = None  # sampled blocks: dominant tier of the window, -1 none
    window_whole: np.ndarray | None = None  # sampled blocks: every page of the window in that tier
    efault: np.ndarray | None = None  # some page answered EFAULT: maybe no longer mapped
    first: np.ndarray | None = None  # sampled blocks of a region's first look (_first_look_rows)
    pages: int = 0
    seconds: float = 0.0


@dataclass
class CollectJob:
    sources: list[HotnessSource]
    slices: dict[int, Slice]  # the row layout the sources were targeted at
    generation: int
    started: float = 0.0
    follow_up: bool = False  # asked for by the previous collect's pending rows (Engine._follow_up)
    observations: list[ObservationView] = field(default_factory=list)  # rows as at set_targets
    cost: dict = field(default_factory=dict)  # source name -> (daemon CPU s, kernel CPU s)


def _dominant_tier(r: Any, lut: np.ndarray, ntiers: int, swap_index: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(tier holding most of each block's pages or TIER_UNKNOWN, some page
    present or swapped) from a migrator Residency: the next move takes all
    of a block's pages to one tier, so the block belongs to its majority."""
    per_tier = np.zeros((r.node_pages.shape[0], ntiers + 1), dtype=np.int64)
    for node in range(min(r.node_pages.shape[1], lut.size)):
        if lut[node] >= 0:
            per_tier[:, lut[node]] += r.node_pages[:, node]
    if swap_index is not None:
        per_tier[:, swap_index] += r.swapped
    total = per_tier.sum(axis=1)
    # Shared memory in RAM that the owner has not mapped is on no node of its
    # own, yet touched: present, tier unknown.
    touched = (total > 0) | (np.asarray(r.cached) > 0)
    return np.where(total > 0, per_tier.argmax(axis=1), TIER_UNKNOWN).astype(np.int8), touched


class _Worker:
    """One thread, one job at a time."""

    def __init__(self, name: str):
        self.name = name
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvtier-{name}")
        self.future: Future | None = None
        self.job: Any = None  # the job in flight

    @property
    def busy(self) -> bool:
        return self.future is not None


def _windows(addr: np.ndarray, nbytes: np.ndarray, S: int, ps: int, rng: np.random.Generator) -> np.ndarray:
    """(blocks x S) page addresses: S consecutive pages from a random page
    of each block (short blocks repeat their last page, which does not
    change the majority)."""
    npages = np.maximum(1, nbytes.astype(np.int64) // ps)
    first = (rng.random(npages.size) * np.maximum(1, npages - S + 1)).astype(np.int64)
    page = np.minimum(first[:, None] + np.arange(S, dtype=np.int64)[None, :], npages[:, None] - 1)
    base = addr[:, None] - addr[:, None] % np.uint64(ps)
    return base + page.astype(np.uint64) * np.uint64(ps)


def _job_blocks(job: Any) -> int:
    region = getattr(job, "region", None)
    return int(region.size) if region is not None else 0


@dataclass
class SourcePace:
    """How often a hotness source runs, and what it has cost."""

    slowdown: int = 1  # collected every slowdown-th chance
    skip: int = 0
    cpu_s: float = 0.0  # daemon CPU in collect, total
    kernel_s: float = 0.0  # its kernel thread's CPU (kdamond), total
    collects: int = 0
    last_at: float | None = None
    last_kernel: float | None = None
    share: float = 0.0  # of one core over the last collect interval
    carried_s: float = 0.0  # spent in follow-up collects since last_at, not yet in a share


def mark_prefetched(table: Any, temperature: Temperature, rows: np.ndarray, cfg: pol.PolicyConfig) -> None:
    """What a client's ``prefetch`` does to the blocks' hotness: hot as far
    as the policy is concerned, so it does not send them straight back down
    as cold between the watermarks. kvtier-sim's kvtier runs this too."""
    table.temp[rows] = np.maximum(table.temp[rows], np.float32(cfg.promote_temp))
    temperature.recheck(table, rows)  # raised outside Temperature.add: test its silence again


def fit_scheduled(pstate: pol.PolicyState, cfg: pol.PolicyConfig, now: float, nbytes: np.ndarray,
                  up: np.ndarray, asked: np.ndarray) -> tuple[np.ndarray, pol.PolicyState]:
    """Which scheduled moves (prefetch/release) the policy's token buckets
    pay for now, one bucket per direction, oldest request first, and the
    state with those tokens spent; what does not fit waits for the mover's
    next turn. kvtier-sim's kvtier decides its prefetches with this too."""
    nb = nbytes.astype(np.float64)
    pstate = pstate.refill(cfg, now, float(nb.max()))
    fits = np.zeros(nb.size, dtype=bool)
    spent = {}
    order = np.argsort(asked, kind="stable")
    for direction, mask, have in (("promote", up, pstate.promote_tokens),
                                  ("demote", ~up, pstate.demote_tokens)):
        o = order[mask[order]]
        ok = np.cumsum(nb[o]) <= have + 0.5
        fits[o[ok]] = True
        spent[direction] = float(nb[o[ok]].sum())
    return fits, replace(pstate, promote_tokens=pstate.promote_tokens - spent["promote"],
                         demote_tokens=pstate.demote_tokens - spent["demote"])


def dram_room(dram: pol.TierState, cfg: pol.PolicyConfig, pstate: pol.PolicyState, on_way: float) -> float:
    """Bytes a move into DRAM may add now without a demotion first: up to
    what promotions fill DRAM to (``policy.promote_limit``) and within its
    free memory, less ``on_way`` (bytes already on their way there). A
    prefetch and ``_promote_hot`` move only this much; the plan makes more
    room by demoting colder residents. kvtier-sim's kvtier uses it too."""
    on_way += dram.arriving_bytes
    room = pol.promote_limit(dram, cfg, pstate) - dram.used_bytes - on_way
    if dram.free_bytes is not None:
        room = min(room, float(dram.free_bytes) - on_way)
    return room


def fit_room(nbytes: np.ndarray, room: float) -> np.ndarray:
    """The leading moves (in the order given) whose bytes fit in ``room``."""
    return np.cumsum(nbytes.astype(np.float64)) <= room


def movable_now(tier: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """Blocks a prefetch or release may move: measured, present, movable.
    kvtier-sim's kvtier tests its prefetches with this too."""
    return (tier >= 0) & ((flags & (F_UNMOVABLE | F_NOT_PRESENT)) == 0)


def last_requests(rows: np.ndarray) -> np.ndarray:
    """Positions of the last request for each block among ``rows`` (a
    release after a prefetch wins), in the blocks' row order."""
    _, last = np.unique(rows[::-1], return_index=True)
    return rows.size - 1 - last


def oldest_in_room(nbytes: np.ndarray, asked: np.ndarray, room: float) -> np.ndarray:
    """Which moves into DRAM fit in ``room``, the oldest request first
    (DRAM's room may have shrunk since they were queued): a bool mask in
    the moves' own order."""
    order = np.argsort(asked, kind="stable")
    keep = np.zeros(asked.size, dtype=bool)
    keep[order[fit_room(nbytes[order], room)]] = True
    return keep


class Engine:
    def __init__(
        self,
        table: BlockTable,
        registry: Registry,
        topology: TopologyView,
        migrator: MigratorPort,
        temperature: Temperature,
        policy_cfg: pol.PolicyConfig,
        stats: DaemonStats,
        loop: asyncio.AbstractEventLoop,
        *,
        residency_interval: float = 10.0,
        residency_pages_per_s: float = 65536.0,
        residency_sample_pages: int = 16,
        residency_idle_slowdown: int = 8,
        source_cpu_budget: float = DEFAULT_SOURCE_CPU_BUDGET,
        sources: Sequence[HotnessSource] = (),
        availability: Mapping[str, AvailabilityView] | None = None,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
        recorder: RecorderPort | None = None,
    ):
        """``loop`` is the event loop the registry lives on: a finished job
        is applied there (call_soon_threadsafe from the worker)."""
        self.table = table
        self.registry = registry
        self.topology = topology
        self.migrator = migrator
        self.temperature = temperature
        self.policy_cfg = policy_cfg
        self.pstate = pol.PolicyState()
        self.stats = stats
        stats.dry_run = bool(migrator.dry_run)
        self.residency_interval = residency_interval
        self.residency_pages_per_s = residency_pages_per_s
        self.residency_sample_pages = residency_sample_pages
        self.residency_idle_slowdown = residency_idle_slowdown
        self.source_cpu_budget = source_cpu_budget
        self.clock = clock
        # The workers keep the daemon's scheduling priority on purpose: they
        # hold the GIL while they run Python, so a deprioritised worker would
        # make the loop thread wait on it (priority inversion through the GIL).
        self.mover = _Worker("migrate")
        self.measurer = _Worker("measure")
        self.collector = _Worker("collect")
        self.explainer = _Worker("explain")
        self._closed = False  # shutdown() ran: callbacks still queued on the loop start no job
        self.last_tick = 0.0
        self.manual: list[ManualMove] = []
        self.tickets: dict[int, MoveTicket] = {}  # operator moves not finished
        self._mapping_checked: dict[int, float] = {}  # region id -> last mapping check on EFAULT evidence
        self._next_ticket = 1
        # prefetch/release: (region ids, indices, destination tiers, requested at)
        # (region ids, block indices, destination tiers, asked at, timed): timed
        # is False for the daemon's own prefetches, which are not a client's
        # scheduler hint and stay out of its request-to-residency histogram.
        self.scheduled: list[tuple[np.ndarray, np.ndarray, np.ndarray, float | np.ndarray, bool | np.ndarray]] = []
        self.loop = loop
        self.engine_moves = EngineMoves(table, stats, clock)
        self._rng = np.random.default_rng(seed)
        # what the last plan saw; anything new makes the next tick plan again
        self._dirty = True
        self._plan_hints = -1
        self._plan_gen = -1
        self._last_plan = -math.inf
        # When the newest plan whose moves are all done was made (None: none
        # yet): DRAM was brought down to what the policy fills it to then.
        self._plan_settled_at: float | None = None
        # measuring: the rotating sample's cursor, the stale blocks' cursor, the budget clock
        self._cursor = 0
        self._stale_cursor = 0
        self._last_measure_at: float | None = None
        # the rotating sample: blocks due (once per residency_interval each), as of when
        self._sample_due = 0.0
        self._sample_clock: float | None = None
        self._pass_started: float | None = None
        # the sample's back-off: its current slowdown (1 = full rate) and the
        # windows that agreed with the table since the last change of it
        self._sample_slow = 1
        self._sample_clean = 0
        self._urgent = False
        # Hotness sources that probed available; their set_targets runs on
        # this thread while no collect runs, their collect on the collector,
        # so a source is never used by two threads at once.
        self.availability = dict(availability or {})
        self.sources = [s for s in sources if self.availability.get(s.name)]
        self.pace = {s.name: SourcePace() for s in self.sources}
        self._targets_gen = -1
        self._pending_sources: tuple[list[HotnessSource], dict[str, AvailabilityView]] | None = None
        self._pending_topology: tuple[Any, np.ndarray] | None = None
        self.recorder = recorder  # kvtier.record.Recorder when [record] is on
        self._targets_hinted: frozenset[int] | None = None
        self._targets_slices: dict[int, Slice] = {}
        self._hinted_regions: frozenset[int] = frozenset()
        # Some row may have returns > 0 (set by _returned, cleared when
        # _release_returned's scan finds none): no scan of the column until then.
        self._returns_live = False
        self._hinted_at = (-1, -1)
        # Event-driven work between ticks: regions just registered whose
        # blocks get a first look, rows just marked stale (hinted or observed
        # while not known present) merged until a measuring job takes them,
        # and hot rows seen in a lower tier waiting for the next loop turn
        # (each with the registry generation its rows belong to).
        self._first_look: list[int] = []
        # Regions whose sampled windows may miss pages that are there
        # (shared memory, a process with pages in swap; _may_hide_pages):
        # there a window that found none does not say the block is unwritten.
        self._windows_miss: set[int] = set()
        self._swap_lost = 0  # the topology's swap_lost already acted on (_after_swapoff)
        self._retarget_queued = False  # a registration's _retarget_now is due
        self._soon_rows: list[np.ndarray] = []
        self._soon_gen = -1
        self._soon_queued = False  # a measure_soon call is on the loop
        self._soon_at = -math.inf  # loop time of the last job measure_soon started
        self._hot_rows: list[np.ndarray] = []
        self._hot_gen = -1
        self._hot_queued = False
        self._hot_queued_at = 0.0  # monotonic time the queued rows' first arrived (debug log)
        # DRAM had no room for them at the last look: no look again until a
        # move or a measurement changes what DRAM holds (hints come every
        # few ms; the room does not change between them)
        self._dram_full = False
        if recorder is not None:
            recorder.config(self.tier_states(), self.policy_cfg)  # a recording starts with what is in force

    # -- tiers -----------------------------------------------------------

    def tier_names(self) -> list[str]:
        return [t.name for t in self.topology.tiers]

    def check_tier(self, tier: int | None) -> None:
        if tier is not None and not 0 <= tier < len(self.topology.tiers):
            raise InvalidArgument(f"no tier {tier} (tiers: {', '.join(self.tier_names()) or 'none'})")

    def tier_states(self) -> list[pol.TierState]:
        used = self._bytes_by_tier()
        arriving = self.engine_moves.bytes_arriving(used.size)
        return [
            pol.TierState(t.index, t.name, t.kind, int(t.capacity), int(used[t.index]), int(t.free),
                          int(arriving[t.index]))
            for t in self.topology.tiers
        ]

    def _bytes_by_tier(self) -> np.ndarray:
        n = len(self.topology.tiers)
        tier = self.table.tier
        known = tier >= 0
        return np.bincount(tier[known].astype(np.int64), weights=self.table.nbytes[known].astype(np.float64),
                           minlength=n)[:n] if n else np.zeros(0)

    def tiers(self) -> list[dict]:
        used = self._bytes_by_tier()
        blocks = np.bincount(self.table.tier[self.table.tier >= 0].astype(np.int64),
                             minlength=len(self.topology.tiers))
        out = []
        for t in self.topology.tiers:
            out.append({
                "index": t.index, "name": t.name, "kind": t.kind, "nodes": list(t.nodes),
                "total": int(t.total), "free": int(t.free), "capacity": int(t.capacity),
                "kvtier_bytes": int(used[t.index]), "kvtier_blocks": int(blocks[t.index]),
                "read_latency_ns": t.read_latency_ns, "notes": list(t.notes),
            })
        return out

    def _node_for(self, tier_idx: int, pid: int) -> int:
        """The tier's node nearest the process's allowed CPUs (tiers of
        several nodes: each socket's CXL or far memory; Topology.nearest_node)."""
        return self.topology.node_for(tier_idx, pid)[0]

    def _is_swap(self, tier_idx: int) -> bool:
        return self.topology.tiers[tier_idx].kind == "swap"

    # -- topology changes (memory hot-plug, config reload) ----------------

    def latest_topology(self) -> Any:
        return self._pending_topology[0] if self._pending_topology else self.topology

    def set_topology(self, topology: Any, index_map: np.ndarray) -> None:
        """Switch to a re-discovered topology; ``index_map`` maps each tier
        index of ``latest_topology()`` to the new one (-1: gone). Applied
        between jobs: a running job's tier numbers are the old ones."""
        if self._pending_topology is not None:
            first = self._pending_topology[1]
            index_map = np.where(first >= 0, index_map[np.maximum(first, 0)], first).astype(np.int8)
        self._pending_topology = (topology, index_map)
        if self.future is None:
            self._apply_topology()

    def _apply_topology(self) -> None:
        topology, index_map = self._pending_topology
        self._pending_topology = None
        for name in ("tier", "pin_tier"):
            col = getattr(self.table, name)
            known = col >= 0
            col[known] = index_map[col[known].astype(np.int64)]
        kept = []
        for m in (ManualMove(*e) for e in self.manual):
            if index_map[m.tier] >= 0:
                kept.append(m._replace(tier=int(index_map[m.tier])))
            else:
                self._settle(m.ticket, m.regions.size, "gone")
        self.manual = kept
        self.topology = topology
        self._sample_slow, self._sample_clean = 1, 0  # tiers came or went: look at full rate again
        self.stats.residency_sample_slowdown = 1
        # libnuma counts the nodes present when the daemon started: a node
        # hot-added since (a CXL region onlined) must still be a valid target.
        self.migrator.max_node = max(self.migrator.max_node, max(topology.nodes, default=0))
        self._dirty = True
        # Memory went offline under some blocks (the kernel moved their
        # pages) or a tier is new: measure every block where it really is.
        self.request_measure()

    # -- hotness sources replaced (config reload) --------------------------

    def set_sources(self, sources: Sequence[HotnessSource], availability: Mapping[str, AvailabilityView]) -> None:
        """Use these sources from now on (those that probed available);
        applied once no collect runs, since a source is used by one thread
        at a time. Sources no longer in the list are closed then."""
        self._pending_sources = (list(sources), dict(availability))
        if not self.collector.busy:
            self._apply_sources()

    def _apply_sources(self) -> None:
        sources, availability = self._pending_sources
        self._pending_sources = None
        keep = {id(s) for s in sources}
        for old in self.sources:
            if id(old) not in keep:
                try:
                    old.close()
                except (KvtierError, OSError) as e:
                    log.warning("hotness source %s: close failed: %s", old.name, e)
        same = {s.name for s in self.sources if id(s) in keep}  # kept objects keep their pace
        self.availability = availability
        self.sources = [s for s in sources if availability.get(s.name)]
        self.pace = {s.name: self.pace[s.name] if s.name in same else SourcePace() for s in self.sources}
        self._targets_gen = -1  # new sources need their targets

    # -- operator requests -----------------------------------------------

    def request_move(self, rows: np.ndarray, tier: int, *, wait: bool = False) -> MoveTicket:
        """kvtierctl migrate: moved with the next jobs, outside the policy's
        budget (the operator asked for it); blocks the kernel skipped for a
        passing reason are tried again, OPERATOR_ATTEMPTS times in all. The
        ticket follows the move to its end; with ``wait`` its future gets
        the report."""
        ticket = self.open_move(rows, tier, wait=wait)
        self.add_move(ticket, rows)
        self.close_move(ticket)
        return ticket

    def open_move(self, rows: np.ndarray | slice, tier: int, *, wait: bool = False) -> MoveTicket:
        """The ticket of an operator move whose blocks are added in parts
        (``add_move``, a large request a part per loop iteration) and that
        ends no earlier than ``close_move``: its moves start with the first
        part, its report waits for the last. ``rows`` are all of them (a
        region's row slice): the checks fail the request before any part."""
        self.check_tier(tier)
        # The region's own constraints win over an operator's one-off move
        # (unregister and register again to change them).
        flags = np.bitwise_or.reduce(self.table.flags[rows]) if row_count(rows) else 0
        if flags & F_NEVER_SWAP and self._is_swap(tier):
            raise InvalidArgument("blocks of a never_swap region cannot be moved to swap")
        if flags & F_KEEP_DRAM and tier != 0:
            raise InvalidArgument("blocks of a keep_dram region cannot leave tier 0")
        first = rows.start if isinstance(rows, slice) else (int(rows[0]) if rows.size else -1)
        region = int(self.table.region[first]) if row_count(rows) else -1
        # pending 1: the request itself, until close_move
        ticket = MoveTicket(self._next_ticket, region, tier, 0, self.clock(),
                            future=self.loop.create_future() if wait else None, pending=1,
                            dry_run=bool(self.migrator.dry_run))
        self._next_ticket += 1
        self.tickets[ticket.id] = ticket
        return ticket

    def add_move(self, ticket: MoveTicket, rows: np.ndarray) -> None:
        """Queue the table ``rows`` (an index array) under ``ticket``."""
        if not rows.size or ticket.id not in self.tickets:
            return
        ticket.blocks += int(rows.size)
        ticket.pending += int(rows.size)
        self.manual.append(ManualMove(self.table.region[rows].astype(np.int64),
                                      self.table.index[rows].astype(np.int64), ticket.tier, ticket.id))
        if not self.mover.busy:
            self.loop.call_soon(self.kick)  # moved from now on, not from the next tick

    def close_move(self, ticket: MoveTicket) -> None:
        """No more parts: the ticket ends once its queued blocks are done."""
        if ticket.id in self.tickets:
            ticket.pending -= 1
            self._ended(ticket)

    def _settle(self, ticket_id: int, n: int, outcome: str, pages: int = 0,
                errors: Mapping[str, int] | None = None) -> None:
        """``n`` blocks of a ticket are done with ``outcome`` (a MoveTicket
        counter: moved, failed, already, gone, unmapped, engine)."""
        tk = self.tickets.get(int(ticket_id))
        if tk is None:
            return
        setattr(tk, outcome, getattr(tk, outcome) + int(n))
        tk.pages_moved += int(pages)
        if errors:
            tk.failed_pages.update(errors)
        tk.pending -= int(n)
        self._ended(tk)

    def _ended(self, tk: MoveTicket) -> None:
        """Report and forget the ticket if nothing of it is pending."""
        if tk.pending <= 0:
            del self.tickets[tk.id]
            report = tk.report(self.clock())
            if tk.failed or tk.unmapped:
                logs.event(log, "operator_move_partial", logging.WARNING, region=tk.region, tier=tk.tier,
                           moved=tk.moved, failed=tk.failed, unmapped=tk.unmapped, attempts=tk.attempts,
                           failed_pages=",".join(f"{k}:{v}" for k, v in sorted(tk.failed_pages.items())))
            if tk.future is not None and not tk.future.done():
                tk.future.set_result(report)

    def _settle_rows(self, tickets: np.ndarray, mask: np.ndarray, outcome: str,
                     pages: np.ndarray | None = None) -> None:
        """Settle the moves selected by ``mask``, per ticket."""
        sel = mask & (tickets >= 0)
        if not sel.any():
            return
        for tid in np.unique(tickets[sel]):
            mine = sel & (tickets == tid)
            self._settle(int(tid), int(mine.sum()), outcome, int(pages[mine].sum()) if pages is not None else 0)

    # -- memory that goes away ---------------------------------------------

    def _suspect_regions(self, region_ids, now: float) -> list[int]:
        """Regions a measurement saw EFAULT in, at most one mapping check
        per region per residency_interval: the shared zero page answers
        EFAULT too, so a region of never-written blocks would otherwise be
        checked (a pass over all its blocks) with every measuring job."""
        out = []
        for rid in region_ids:
            if now - self._mapping_checked.get(rid, -math.inf) >= self.residency_interval:
                self._mapping_checked[rid] = now
                out.append(rid)
        if len(self._mapping_checked) > 2 * max(16, len(self.registry.regions)):
            self._mapping_checked = {k: v for k, v in self._mapping_checked.items() if k in self.registry.regions}
        return out

    def check_mapping(self, region_ids) -> dict[int, np.ndarray | None]:
        """Which blocks of these regions are still mapped (one PROCMAP_QUERY
        per VMA: cheap enough for the loop thread). A region none of whose
        memory is mapped any more is dropped (the owner learns why from its
        next request on it); the unmapped blocks of a partly unmapped one
        are marked never touched and unplaced, so no plan moves them.
        Returns the mask per region, None for a dropped one."""
        reg, t = self.registry, self.table
        out: dict[int, np.ndarray | None] = {}
        for rid in region_ids:
            r = reg.regions.get(int(rid))
            if r is None or r.mode != "kernel":
                continue
            s = t.slices[r.id]
            try:
                mask = self.mapped_part(r.id, slice(s.start, s.stop))
            except (KvtierError, OSError) as e:  # process gone: the pid watcher drops it
                log.debug("mapping check of region %d: %s", r.id, e)
                continue
            out[r.id] = mask if self.mapping_seen(r.id, int(mask.size - np.count_nonzero(mask))) else None
        return out

    def mapped_part(self, region_id: int, rows: np.ndarray | slice) -> np.ndarray:
        """check_mapping of some of a region's rows (a large region is
        checked a part per loop iteration; ``mapping_seen`` then takes the
        whole region's count): which are mapped; the others are marked
        never touched and unplaced. KvtierError/OSError if the process is
        gone."""
        t = self.table
        mask = self.registry.processes.mapped_blocks(self.registry.regions[region_id].pid, t.addr[rows],
                                                     t.nbytes[rows])
        if not mask.all():
            gone = row_select(rows, ~mask)
            t.tier[gone] = TIER_UNKNOWN
            t.flags[gone] = (t.flags[gone] | np.uint8(F_NOT_PRESENT)) & np.uint8(~F_STALE & 0xFF)
            t.prior[gone] = 0  # mapped again later: new pages
        return mask

    def mapping_seen(self, region_id: int, unmapped: int) -> bool:
        """A mapping check of the whole region found ``unmapped`` of its
        blocks unmapped: a region none of whose memory is mapped any more
        is dropped (False), a change in the count is said and counted."""
        reg = self.registry
        r = reg.regions[region_id]
        if unmapped >= r.nblocks:
            reg.drop_unmapped(r.id)
            self._dirty = True
        elif unmapped != r.unmapped_blocks:
            logs.event(log, "region_partly_unmapped" if unmapped else "region_mapped_again",
                       logging.WARNING if unmapped else logging.INFO, region=r.id, pid=r.pid,
                       blocks_unmapped=unmapped, blocks=r.nblocks)
            r.unmapped_blocks = unmapped
            self._dirty = True
        self.stats.blocks_unmapped = sum(r.unmapped_blocks for r in reg.regions.values())
        return r.id in reg.regions

    def check_placement(self, region_ids) -> None:
        """Allocated regions whose blocks, never moved by kvtier, are
        measured outside the tier ``allocate`` placed them in: the kernel
        moved them. The usual cause is a long-term pin (cudaHostRegister,
        RDMA, io_uring), which first migrates pages out of ZONE_MOVABLE (CXL
        memory onlined by dax kmem usually is), so a pool placed there and
        pinned silently lands elsewhere (measured: the guest's CXL node 2 ->
        node 1). Said once per change, counted, listed by ``regions``."""
        reg, t, names = self.registry, self.table, self.tier_names()
        for rid in region_ids:
            r = reg.regions.get(int(rid))
            if r is None or not r.placement or r.mode != "kernel":
                continue
            tier = t.region_view(r.id, "tier")
            lost = (tier >= 0) & (tier != r.placement["tier"]) & ~np.isfinite(t.region_view(r.id, "last_move"))
            n = int(lost.sum())
            if n != r.placement_lost:
                found = {names[x] if x < len(names) else str(x): int(c)
                         for x, c in zip(*np.unique(tier[lost].astype(np.int64), return_counts=True))}
                logs.event(log, "placement_lost" if n else "placement_regained",
                           logging.WARNING if n > r.placement_lost else logging.INFO, region=r.id, pid=r.pid,
                           placed=r.placement.get("tier_name"), node=r.placement.get("node"), pinned=r.pinned,
                           blocks=n, found=",".join(f"{k}:{v}" for k, v in sorted(found.items())),
                           why="moved by the kernel, not kvtier: a long-term pin migrates pages out of "
                               "ZONE_MOVABLE first" if n else "")
                r.placement_lost = n
        self.stats.blocks_placement_lost = sum(r.placement_lost for r in reg.regions.values())

    def request_measure(self, rows: np.ndarray | None = None) -> int:
        """Full re-measurement on demand: every page of the blocks (all when
        ``rows`` is None), as fast as the kernel answers, regardless of the
        per-second budget."""
        flags = self.table.flags
        if rows is None:
            flags |= np.uint8(F_STALE)
            n = len(self.table)
        else:
            flags[rows] |= np.uint8(F_STALE)
            n = row_count(rows)
        if not self._urgent:
            self._urgent = True
            self.loop.call_soon(self.measure_soon)  # from now on, not from the next tick
        return n

    def explain(self, row: int) -> str:
        snap = self.table.snapshot()
        return self._explained(snap, row, self._policy_explain(snap, row, self.tier_states(), self.policy_cfg,
                                                               self.pstate, self.clock()))

    def _policy_explain(self, snap: Mapping[str, np.ndarray], row: int, tiers, cfg, state, now: float) -> str:
        """``policy.explain`` of a snapshot's row, with the allocation
        counts the plan gets (the table's discarded bytes, and with them
        the snapshot's ``inflow_offset``)."""
        discarded = self.table.dropped_bytes
        return pol.explain(snap, row, tiers, cfg, state, now, inflow_offset(snap, discarded), discarded)

    def read_soon(self, read: Callable[[], Any]) -> "asyncio.Future":
        """``read()`` on the explain thread, for an answer that reads the
        whole table (O(table): hundreds of ms of the loop at 1 Mi blocks);
        run again if the table's layout changed meanwhile (a region added
        or removed moves rows), up to EXPLAIN_TRIES times. ``read`` takes
        what it needs of the registry itself (a copy of a dict is one step
        under the GIL) and must not change anything."""
        reg = self.registry

        def run() -> Any:
            for _ in range(EXPLAIN_TRIES):
                gen = reg.generation
                out = read()
                if reg.generation == gen:
                    return out
            raise KvtierError(f"the block table changed {EXPLAIN_TRIES} times while it was read: try again")

        out = self.loop.create_future()
        loop = self.loop
        self.explainer.executor.submit(run).add_done_callback(
            lambda f: loop.call_soon_threadsafe(relay, f, out))
        return out

    def explain_soon(self, region_id: int, block: int) -> "asyncio.Future[str]":
        """``explain`` of a region's block, the table copied and the policy
        run on the explain thread: both cost O(table), 0.4 s of the loop at
        1 Mi blocks. The copy is taken again if the table's layout changed
        while it was taken (a region added or removed moves rows)."""
        tiers, cfg, state, now = self.tier_states(), self.policy_cfg, self.pstate, self.clock()
        reg = self.registry

        def run() -> tuple[dict, int, str]:
            for _ in range(EXPLAIN_TRIES):
                gen = reg.generation
                s = self.table.slices.get(region_id)
                if s is None:
                    reg.get(region_id)  # raises not_found with the reason
                row = s.start + block
                snap = self.table.snapshot()
                text = self._policy_explain(snap, row, tiers, cfg, state, now)
                if reg.generation == gen:
                    return snap, row, text
            raise KvtierError(f"the block table changed {EXPLAIN_TRIES} times while it was copied: try again")

        out = self.loop.create_future()

        def done(f: Future) -> None:
            relay(f, out, lambda result: self._explained(*result))

        loop = self.loop
        self.explainer.executor.submit(run).add_done_callback(lambda f: loop.call_soon_threadsafe(done, f))
        return out

    def _explained(self, snap: Mapping[str, np.ndarray], row: int, text: str) -> str:
        """The policy's account of a block and what the engine adds to it."""
        pid = int(snap["pid"][row])
        r = self.registry.regions.get(int(snap["region"][row]))
        t = int(snap["tier"][row])
        if r is not None and r.placement and t >= 0 and t != r.placement["tier"] \
                and not np.isfinite(snap["last_move"][row]):
            text += (f"\nplacement lost: allocated on {r.placement.get('tier_name')} (node {r.placement.get('node')}),"
                     f" now in tier {t} though kvtier never moved it: the kernel did (a long-term pin migrates pages"
                     f" out of ZONE_MOVABLE first)")
        # Which node of a multi-node tier this process's blocks go to, and why.
        for t in self.topology.tiers:
            if len(t.nodes) > 1:
                text += f"\nnode in {t.name}: {self.topology.node_for(t.index, pid)[1]}"
        return text

    @property
    def future(self) -> Future | None:
        """A running job of any worker (None when all are idle)."""
        for w in (self.mover, self.measurer, self.collector):
            if w.future is not None:
                return w.future
        return None

    def status(self) -> dict:
        now = self.clock()
        sources = {}
        for name, a in self.availability.items():
            d = {"active": bool(a), "reason": a.reason}
            p = self.pace.get(name)
            if p is not None:
                d.update(cpu_s=p.cpu_s, kernel_cpu_s=p.kernel_s, collects=p.collects, slowdown=p.slowdown,
                         core_share=p.share, over_budget=p.slowdown > 1)
            sources[name] = d
        return {
            "dry_run": bool(self.migrator.dry_run),
            "dry_run_planned": self._dry_status(),
            "tiers": self.tier_names(),
            "last_tick_age_s": now - self.last_tick if self.last_tick else None,
            "job_running": self.mover.busy,
            # since the newest tick whose plan's moves (the kernel's: the
            # mover's) are all done: DRAM holds what that plan left plus the
            # first touches since (None: no such plan yet)
            "plan_settled_age_s": None if self._plan_settled_at is None else now - self._plan_settled_at,
            "workers": {w.name: w.busy for w in (self.mover, self.measurer, self.collector)},
            "manual_moves_pending": sum(int(m[0].size) for m in self.manual),
            "scheduled_moves_pending": sum(int(e[0].size) for e in self.scheduled),
            **self.engine_moves.status(),
            "stale_blocks": int(np.count_nonzero(self.table.flags & F_STALE)),
            "source_cpu_budget": self.source_cpu_budget,
            "sources": sources,
            "warnings": list(getattr(self.topology, "warnings", [])),
        }

    def _dry_status(self) -> dict:
        st, names = self.stats, self.tier_names()

        def name(t: int) -> str:
            return names[t] if 0 <= t < len(names) else str(t)

        def by_pair(blocks, nbytes) -> list[dict]:
            return [{"src": name(s), "dst": name(d), "blocks": n, "bytes": nbytes[(s, d)]}
                    for (s, d), n in sorted(blocks.items())]
        return {"total": by_pair(st.dry_run_moves, st.dry_run_bytes),
                "last_plan": by_pair(st.dry_run_last_moves, st.dry_run_last_bytes)}

    # -- scheduler hints -------------------------------------------------

    def schedule(self, rows: np.ndarray, kind: str, *, timed: bool = True) -> dict:
        """prefetch (to tier 0) or release (one tier down) ``rows``: moved in
        the event loop's next turn once the mover is free, not at the next
        tick, but paid from the policy's own token buckets. Returns what was
        queued, what is already there, and what cannot move (unmeasured,
        untouched, unmovable, or kept in DRAM by a constraint). A prefetch
        queues only what fits in DRAM's room (``dram_room``, oldest request
        first when the mover takes them); the rest is ``deferred``: marked
        hot, so the next plan promotes it and demotes colder residents to
        make room, and no token is spent on a move DRAM would refuse."""
        t = self.table
        tier = t.tier[rows].astype(np.int64)
        flags = t.flags[rows]
        n = row_count(rows)
        movable = movable_now(tier, flags)
        if kind == "prefetch":
            dst = np.zeros(n, dtype=np.int64)
            mark_prefetched(t, self.temperature, rows, self.policy_cfg)
        else:
            slowest_mem = max([x.index for x in self.topology.tiers if x.kind != "swap"], default=0)
            # a block not measured since it was written is taken as in DRAM
            # (first touch), where its owner just wrote it
            dst = np.minimum(np.maximum(tier, 0) + 1, len(self.topology.tiers) - 1)
            dst = np.where((flags & F_NEVER_SWAP) != 0, np.minimum(dst, slowest_mem), dst)
            # Released too: the owner says they are done with them, and the
            # mover finds where their pages are (never-written ones are
            # reported untouched). Skipped, a session paused right after
            # its last decode step kept most of its blocks in DRAM (their
            # hints had queued a measurement that had not run yet).
            unknown = (tier < 0) & ((flags & np.uint8(F_UNMOVABLE | F_ENGINE)) == 0) & (dst > 0)
            movable |= unknown
            movable &= (flags & F_KEEP_DRAM) == 0
            # Cold, so the policy does not promote them back before they are read again.
            t.temp[rows] = 0.0
        there = movable & (dst == tier)
        go = movable & ~there
        deferred = 0
        if kind == "prefetch" and go.any():
            wants = np.flatnonzero(go)
            fits = fit_room(t.nbytes[row_select(rows, go)], self._dram_room())
            go[wants[~fits]] = False
            deferred = int((~fits).sum())
            self._dram_full |= deferred > 0
        if go.any():
            sel = row_select(rows, go)
            self.scheduled.append((t.region[sel].astype(np.int64), t.index[sel].astype(np.int64),
                                   dst[go].astype(np.int8), self.clock(), timed))
            self.loop.call_soon(self.kick)
        out = {"queued": int(go.sum()), "already": int(there.sum()), "skipped": int((~movable).sum())}
        if kind == "prefetch":
            out["deferred"] = deferred
        if self.migrator.dry_run:
            out["dry_run"] = True  # queued to be planned and counted: none of them will move
        return out

    def kick(self) -> None:
        """Hand the scheduled moves to the mover now if it is idle (else its
        finish calls back here)."""
        if self.mover.busy or not (self.scheduled or self.manual) or not self.topology.tiers:
            return
        if len(self.table) == 0:
            return  # the tick settles what is queued
        now = self.clock()
        job = self._build_scheduled(now) if self.scheduled else None
        if job is None and self.manual:
            job = self._build_manual(now)
            if job is None and self.manual:  # that batch had nothing to move: the next one in the next turn
                self.loop.call_soon(self.kick)
        if job is not None:
            self._submit_move(job)

    def _submit_move(self, job: MoveJob) -> None:
        if self.recorder is not None:
            self.recorder.move_started(job.started, job.src, job.dst, job.nbytes)  # a replay's mover is busy from here
        self._submit(self.mover, self._run_move, self._finish_move, job)

    # -- between ticks: registrations, hints, observations ----------------

    def registered(self, region_id: int) -> None:
        """A region was just added: its blocks get a first look (a window of
        pages each) in the event loop's next turn, not at the next tick."""
        self._first_look.append(region_id)
        self._windows_miss.discard(region_id)  # an id used before
        self.loop.call_soon(self.measure_soon)
        if self.sources and not self._retarget_queued:
            # The sources start watching it now, not at the next tick:
            # DAMON's first dumps credit nothing while it splits the new
            # range (a few aggregation intervals), and that started up to a
            # tick late (the guest's first hot set under DAMON alone was
            # promoted 2.3-2.5 s after registration, its first useful dump
            # at the second tick). Registrations in a burst share one.
            self._retarget_queued = True
            self.loop.call_later(RETARGET_COALESCE_S, self._retarget_now)

    def _retarget_now(self) -> None:
        self._retarget_queued = False
        if self._sources_idle():  # else the next tick's collect retargets
            self._retarget()

    def _sources_idle(self) -> bool:
        """Whether the sources may be targeted or collected from the loop
        now, between ticks: no collect running (set_targets runs between
        collects), no reload's sources waiting to replace them, not stopped."""
        return not (self._closed or self.collector.busy or self._pending_sources is not None)

    def hinted(self, rows: np.ndarray, unsure: np.ndarray) -> None:
        """Hints for ``rows`` were just added to their temperatures
        (``unsure``: those of them the registry just marked F_STALE, not
        known to be present): measure those soon, and promote the hinted
        blocks found in a lower tier in the next turn."""
        if unsure.size:
            self._stale_soon(unsure)
        self._hot_soon(rows, at_once=True)

    def _stale_soon(self, rows: np.ndarray) -> None:
        """Add rows just marked F_STALE to the set the next measuring job
        takes first, and have one started: at once if none started within
        MEASURE_SOON_S, else when that has passed."""
        if self._soon_gen != self.registry.generation:
            self._soon_rows.clear()  # rows of another table layout
            self._soon_gen = self.registry.generation
        self._soon_rows.append(rows)
        self._queue_measure()

    def _queue_measure(self) -> None:
        if self._soon_queued:
            return
        self._soon_queued = True
        wait = self._soon_at + MEASURE_SOON_S - self.loop.time()
        if wait > 0:
            self.loop.call_later(wait, self.measure_soon)
        else:
            self.loop.call_soon(self.measure_soon)

    def measure_soon(self) -> None:
        """Hand the measurer the first looks and the rows queued stale
        between ticks now if it is idle (else its finish queues this again);
        the rotating sample and the other stale blocks stay with the ticks."""
        self._soon_queued = False
        if self.measurer.busy or not self.topology.tiers or len(self.table) == 0:
            return
        self._soon_at = self.loop.time()  # a look that found no budget waits too
        job = self._build_measure(self.clock(), sample=False)
        if job is not None:
            self._submit(self.measurer, self._run_measure, self._finish_measure, job)

    def _hot_soon(self, rows: np.ndarray, at_once: bool = False) -> None:
        """Queue rows just hinted, observed or placed for ``_promote_hot``
        in the next loop turn (one look for all that arrive in a turn).
        Not while DRAM is known to have no room: that look would find none.

        ``at_once`` (a client's hints, whose registry work is done): with
        the mover idle and nothing queued, look now instead. The next turn
        came 0.09-0.31 s later in the guest (vm_tiering_compare
        --daemon-log-level debug, hot_promote's queued_s, slowness 7), the
        loop's other callbacks first, while the first hot set's reader
        waited; with the mover busy nothing could start sooner anyway."""
        if rows.size == 0 or len(self.topology.tiers) < 2 or self._dram_full:
            return
        lower = rows[self.table.tier[rows] > 0]
        if lower.size == 0:
            return
        if self._hot_gen != self.registry.generation:
            self._hot_rows.clear()  # rows of another table layout
            self._hot_gen = self.registry.generation
        self._hot_rows.append(lower)
        if not self._hot_queued:
            self._hot_queued = True
            self._hot_queued_at = time.monotonic()
            if at_once and not self.mover.busy:
                self._promote_hot()
            else:
                self.loop.call_soon(self._promote_hot)

    def _promote_hot(self) -> None:
        """Blocks hot enough for the policy to promote, in a lower tier, go
        to DRAM now if DRAM has room for them (below what the policy fills
        it to, less what is on its way there): as a prefetch, paid from the
        same token buckets. Exchanges with colder residents and everything
        else stay with the tick's plan. Work per queued row, not per block:
        DRAM's use is summed only when some row qualifies."""
        self._hot_queued = False
        queued_at = self._hot_queued_at
        rows, self._hot_rows = self._hot_rows, []
        if not rows or self._hot_gen != self.registry.generation or self._dram_full:
            return
        t, cfg = self.table, self.policy_cfg
        tiers = self.topology.tiers
        rows = np.unique(np.concatenate(rows))
        rows = rows[rows < len(t)]
        # Rows already on their way to DRAM (the mover's job, the queue)
        # stay out: queued again, each hint while a move ran put the same
        # blocks in the queue once more, and DRAM's room, which counts the
        # queue, ran out for blocks that were not moving at all.
        rows = rows[~np.isin(rows, self._rows_to_dram())]
        if rows.size == 0:
            return
        now = self.clock()
        tier = t.tier[rows]
        flags = t.flags[rows]
        ok = (tier > 0) & (tier < len(tiers))
        ok &= (flags & np.uint8(F_UNMOVABLE | F_NOT_PRESENT | F_MANUAL_PIN)) == 0
        # as the policy's promotable blocks: not backing off (a block faulted
        # straight back after a pageout is barred from swap only, one whose
        # demotion failed from demotions only; min_residence_s bars demotions only)
        ok &= (t.retry_at[rows] <= now) | (t.returns[rows] > 0) | (t.fail_dir[rows] > 0)
        if cfg.tenant_dram_quota:
            ok &= ~np.isin(t.tenant[rows], np.fromiter(cfg.tenant_dram_quota, dtype=np.int64))
        rows = rows[ok]
        if rows.size == 0:
            return
        eff = pol.effective_temp({"temp": t.temp[rows], "fresh": t.fresh[rows], "flags": t.flags[rows]}, cfg)
        hot = eff >= cfg.promote_temp
        rows, eff = rows[hot], eff[hot]
        if rows.size == 0:
            return
        order = np.argsort(-eff, kind="stable")
        rows = rows[order]
        rows = rows[fit_room(t.nbytes[rows], self._dram_room())]
        if rows.size == 0:
            self._dram_full = True
            return
        self.stats.hot_promotions_total += int(rows.size)
        self.scheduled.append((t.region[rows].astype(np.int64), t.index[rows].astype(np.int64),
                               np.zeros(rows.size, dtype=np.int8), now, False))
        self.kick()
        if log.isEnabledFor(logging.DEBUG):  # the loop's share of a hint's way to the mover
            logs.event(log, "hot_promote", logging.DEBUG, blocks=int(rows.size), mover_busy=self.mover.busy,
                       queued_s=round(time.monotonic() - queued_at, 4))

    def _rows_to_dram(self) -> np.ndarray:
        """Rows the mover's job or the queued scheduler hints bring to DRAM."""
        t = self.table
        parts = [np.zeros(0, dtype=np.int64)]
        job = self.mover.job
        if isinstance(job, MoveJob) and job.region.size:
            up = job.dst == 0
            parts.append(t.rows_of(job.region[up], job.index[up]))
        for regions, indices, dst, _, _ in self.scheduled:
            up = dst == 0
            parts.append(t.rows_of(regions[up], indices[up]))
        return np.concatenate(parts)

    def _dram_room(self) -> float:
        """``dram_room`` for the daemon's DRAM now: its use from the table,
        less what the mover's job and the queue are bringing there."""
        return dram_room(self.tier_states()[0], self.policy_cfg, self.pstate, self._bytes_to_dram())

    def _bytes_to_dram(self) -> float:
        """Bytes on their way into tier 0 and not yet counted there: the
        mover's job and the queued scheduler hints."""
        t = self.table
        total = 0.0
        job = self.mover.job
        if isinstance(job, MoveJob) and job.region.size:
            up = (job.dst == 0) & (job.src > 0)
            total += float(job.nbytes[up].sum())
        for regions, indices, dst, _, _ in self.scheduled:
            r = t.rows_of(regions, indices)
            sel = (r >= 0) & (dst == 0)
            r = r[sel]
            total += float(t.nbytes[r][t.tier[r] > 0].sum())
        return total

    def _to_engines(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Send the moves of engine-mode blocks to their owners; returns the
        mask of rows that stay for the kernel (move_pages / swap)."""
        eng = (self.table.flags[rows] & np.uint8(F_ENGINE)) != 0
        eng_placed = eng & (src >= 0)
        if eng_placed.any() and self.migrator.dry_run:
            # A dry run sends no owner a move either (its tokens stay spent).
            self._count_dry(src[eng_placed], dst[eng_placed], self.table.nbytes[rows[eng_placed]])
        elif eng_placed.any():
            sent = self.engine_moves.dispatch(rows[eng_placed], src[eng_placed], dst[eng_placed])
            # no owner attached: nothing moves, and the plan's tokens come back
            unsent = ~sent
            self.pstate = self.engine_moves.refund_unsent(rows[eng_placed][unsent], src[eng_placed][unsent],
                                                          dst[eng_placed][unsent], self.policy_cfg, self.pstate)
        return ~eng

    def _build_scheduled(self, now: float) -> MoveJob | None:
        t = self.table
        regions = np.concatenate([e[0] for e in self.scheduled])
        indices = np.concatenate([e[1] for e in self.scheduled])
        dst = np.concatenate([e[2] for e in self.scheduled])
        asked = np.concatenate([np.broadcast_to(np.float64(e[3]), e[0].shape) for e in self.scheduled])
        timed = np.concatenate([np.broadcast_to(np.bool_(e[4]), e[0].shape) for e in self.scheduled])
        self.scheduled.clear()
        rows = t.rows_of(regions, indices)
        keep = last_requests(rows)
        keep = keep[rows[keep] >= 0]
        rows, dst, asked, timed = rows[keep], dst[keep], asked[keep], timed[keep]
        src = t.tier[rows].copy()
        # a release of a block not measured yet (schedule) goes from "unknown"
        go = (dst != src) & ((src >= 0) | (dst > 0))
        rows, dst, asked, timed, src = rows[go], dst[go], asked[go], timed[go], src[go]
        if rows.size == 0:
            return None
        # DRAM's room may have shrunk since these were queued (allocations,
        # the plan): moves into DRAM beyond it are dropped before any token
        # is spent on them; they are marked hot, so the plan takes them.
        up = np.flatnonzero(dst == 0)
        if up.size:
            drop = up[~oldest_in_room(t.nbytes[rows[up]], asked[up], self._dram_room())]
            if drop.size:
                self._dram_full = True
                keep = np.ones(rows.size, dtype=bool)
                keep[drop] = False
                rows, dst, asked, timed, src = rows[keep], dst[keep], asked[keep], timed[keep], src[keep]
            if rows.size == 0:
                return None
        fits, self.pstate = fit_scheduled(self.pstate, self.policy_cfg, now, t.nbytes[rows], dst < src, asked)
        if not fits.all():
            w = ~fits
            self.scheduled.append((t.region[rows[w]].astype(np.int64), t.index[rows[w]].astype(np.int64),
                                   dst[w], asked[w].copy(), timed[w].copy()))
        rows, dst, asked, timed, src = rows[fits], dst[fits], asked[fits], timed[fits], src[fits]
        kernel = self._to_engines(rows, src, dst)
        rows, dst, asked, timed, src = rows[kernel], dst[kernel], asked[kernel], timed[kernel], src[kernel]
        if rows.size == 0:
            return None
        return MoveJob.of_rows(t, rows, src, dst, now, plan_pos=np.full(rows.size, -1, dtype=np.int64),
                               requested_at=np.where(timed, asked, np.nan))

    # -- the tick --------------------------------------------------------

    def tick(self) -> None:
        t0 = time.monotonic()
        c0 = time.thread_time()
        now = self.clock()
        try:
            self._tick(now)
        except Exception:  # one bad tick must not stop the loop
            self.stats.tick_errors_total += 1
            log.exception("tick failed")
        self.last_tick = now
        self.stats.observe_tick(time.monotonic() - t0, time.thread_time() - c0)
        self.stats.dry_run = bool(self.migrator.dry_run)

    def _tick(self, now: float) -> None:
        if self._pending_topology is not None and self.future is None:
            self._apply_topology()
        if self._pending_sources is not None and not self.collector.busy:
            self._apply_sources()
        decayed = (self.temperature.last_decay, self.temperature.interval)  # the recording's clock line
        self.temperature.decay(self.table, now)
        self._dram_full = False  # decay and free memory change the room
        self.registry.check_alive()
        try:
            self.topology.refresh_free()
        except (KvtierError, OSError) as e:
            log.warning("topology refresh failed: %s", e)
        self._after_swapoff()
        if len(self.table) == 0 or not self.topology.tiers:
            for m in (ManualMove(*e) for e in self.manual):
                self._settle(m.ticket, m.regions.size, "gone")
            self.manual.clear()
            self.scheduled.clear()
            return
        if self.recorder is not None:
            self.recorder.ticked(now, self.mover.busy, decayed)  # the replay runs on this clock
        self._release_returned(now)
        if self.mover.busy:
            self.stats.ticks_skipped_busy += 1
        else:
            # Scheduler hints still waiting for tokens go first; the plan
            # waits for the next tick.
            job = self._build_scheduled(now) if self.scheduled else None
            if job is None:
                job = self._build_move(now)
            if job is not None:
                self._submit_move(job)
        if not self.measurer.busy:
            # While the mover brings blocks up, the tick measures only what
            # is queued (first looks, blocks hinted or observed while not
            # known present), as between ticks; the rotating sample and the
            # stale cursor wait for the move's end (the sample's due keeps
            # accruing). In the guest the first tick's sample of a pool the
            # first look had just seen (128 blocks) took 1.2 s of the two
            # vCPUs beside the first hot set's move, for blocks whose pages
            # that move was changing under it.
            job = self._build_measure(now, sample=not self._promoting())
            if job is not None:
                self._submit(self.measurer, self._run_measure, self._finish_measure, job)
        if self.sources and not self.collector.busy:
            job = self._build_collect(now)
            if job is not None:
                self._submit(self.collector, self._run_collect, self._finish_collect, job)

    def _release_returned(self, now: float) -> None:
        """Lift the swap bar of returned blocks (``_returned``) whose owner
        hints and has stopped reading them (temperature 0: the run of
        reads it told of is over). The bar protects a reader that faults
        pages back; an owner that hints tells every read, so its silence
        says the reader is gone. Kept for the 30 s and more of
        return_backoff_s, it held a finished hot set in DRAM: a first plan
        pages blocks out blind, the owner's first hints bring them back (a
        return), and the next hot set waited out the backoff for their room
        (tests/host/test_metrics.py took 32 s in 5 runs of 10). Blocks of
        regions nobody hints keep it: a reader seen only by its faults looks
        silent between them (tests/host/test_pageout_host.py)."""
        if not self._returns_live:
            return
        hinted = self._hinted()
        if not hinted:
            return
        t = self.table
        r = np.flatnonzero(t.returns[: len(t)])
        if r.size == 0:
            self._returns_live = False
            return
        r = r[(t.retry_at[r] > now) & (t.temp[r] <= 0.0)]
        r = r[np.isin(t.region[r], np.fromiter(hinted, dtype=np.int64))]
        if r.size:  # the next plan, whatever calls for it, may move them (no replan for this alone)
            t.returns[r] = 0
            t.retry_at[r] = -np.inf

    def _promoting(self) -> bool:
        """Whether the mover's job brings some block to a faster tier."""
        job = self.mover.job
        return isinstance(job, MoveJob) and bool(((job.dst < job.src) & (job.src >= 0)).any())

    def _submit(self, worker: _Worker, run, finish, job) -> None:
        if self._closed:
            # A measure_soon or kick the loop had queued (a timer, a
            # registration's first look) runs after the daemon stopped its
            # workers: nothing is started any more.
            return
        t_submit = time.monotonic()
        fut = worker.executor.submit(run, job)
        worker.future = fut
        worker.job = job
        loop = self.loop

        def done(f: Future) -> None:
            worker.future = None
            worker.job = None
            if log.isEnabledFor(logging.DEBUG):
                logs.event(log, "job_done", logging.DEBUG, worker=worker.name, blocks=_job_blocks(job),
                           seconds=round(time.monotonic() - t_submit, 4))
            if f.cancelled():  # the daemon is stopping (executor shut down with the job queued)
                return
            exc = f.exception()
            if exc is not None:
                self.stats.tick_errors_total += 1
                log.error("%s job failed: %r", worker.name, exc)
                if isinstance(job, MoveJob) and job.ticket is not None:
                    self._settle_rows(job.ticket, np.ones(job.ticket.size, dtype=bool), "failed")
                return
            finish(job)

        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(done, f))

    # -- move --------------------------------------------------------------

    def _build_move(self, now: float) -> MoveJob | None:
        t = self.table
        hints = self.registry.hints_off_top  # hints of DRAM blocks change no plan
        gen = self.registry.generation
        if not (self._dirty or self.manual or hints != self._plan_hints or gen != self._plan_gen
                or now - self._last_plan >= IDLE_REPLAN_S):
            return None
        self._dirty = False
        self._plan_hints, self._plan_gen, self._last_plan = hints, gen, now
        # Only blocks whose tier is known can be planned (the policy skips
        # the others): plan over those rows alone, so a large table of
        # never-touched blocks costs one pass here, not one per policy step.
        # The policy is pure and runs right here, so it may read the live
        # arrays; what the mover reads later is copied.
        known = np.flatnonzero(t.tier >= 0)
        offset = t.inflow_offset(known)
        whole = known.size == len(t)
        live = {name: getattr(t, name) if whole else getattr(t, name)[known] for name in FIELDS}
        plan, self.pstate = pol.plan(live, self.tier_states(), self.policy_cfg, self.pstate, now, offset,
                                      t.dropped_bytes)
        if not whole and len(plan):
            plan = replace(plan, rows=known[plan.rows])
        rows = plan.rows.astype(np.int64)
        dst = plan.dst.astype(np.int8)
        pos = np.arange(len(plan), dtype=np.int64)
        ticket = np.full(rows.size, -1, dtype=np.int64)
        again = np.zeros(rows.size, dtype=bool)
        return self._job_of(now, plan, rows, dst, pos, ticket, again)

    def _take_manual(self, limit: int) -> list[ManualMove]:
        """The first ``limit`` blocks of the operator moves, in request
        order (the rest stays queued for the following jobs)."""
        out, n = [], 0
        while self.manual and n < limit:
            m = ManualMove(*self.manual[0])
            k = m.regions.size
            if n + k <= limit:
                out.append(self.manual.pop(0))
                n += k
                continue
            cut = limit - n
            out.append(m._replace(regions=m.regions[:cut], indices=m.indices[:cut]))
            self.manual[0] = m._replace(regions=m.regions[cut:], indices=m.indices[cut:])
            n = limit
        return out

    def _job_of(self, now: float, plan: pol.Plan | None, rows: np.ndarray, dst: np.ndarray, pos: np.ndarray,
                ticket: np.ndarray, again: np.ndarray) -> MoveJob | None:
        """The job for the plan's moves (``pos``: their plan positions) and
        the next MANUAL_JOB_BLOCKS operator moves, which replace the plan's
        for the same blocks."""
        t = self.table
        manual = self._take_manual(MANUAL_JOB_BLOCKS)
        if manual:
            m_rows, m_dst, m_ticket, m_again = [], [], [], []
            for m in (ManualMove(*e) for e in manual):
                r = t.rows_of(m.regions, m.indices)
                self._settle(m.ticket, int((r < 0).sum()), "gone")  # unregistered meanwhile
                r = r[r >= 0]
                m_rows.append(r)
                m_dst.append(np.full(r.size, m.tier, dtype=np.int8))
                m_ticket.append(np.full(r.size, m.ticket, dtype=np.int64))
                m_again.append(np.full(r.size, m.retry, dtype=bool))
            mr = np.concatenate(m_rows)
            md = np.concatenate(m_dst)
            mt = np.concatenate(m_ticket)
            ma = np.concatenate(m_again)
            # the operator's move replaces the plan's for the same block; the
            # last request for a block wins (the earlier one's ticket is told
            # it is done: the block is in the later request's hands)
            _, last = np.unique(mr[::-1], return_index=True)
            keep = mr.size - 1 - last
            superseded = np.ones(mr.size, dtype=bool)
            superseded[keep] = False
            self._settle_rows(mt, superseded, "gone")
            mr, md, mt, ma = mr[keep], md[keep], mt[keep], ma[keep]
            in_plan = np.isin(rows, mr)
            rows = np.concatenate([rows[~in_plan], mr])
            dst = np.concatenate([dst[~in_plan], md])
            pos = np.concatenate([pos[~in_plan], np.full(mr.size, -1, dtype=np.int64)])
            ticket = np.concatenate([ticket[~in_plan], mt])
            again = np.concatenate([again[~in_plan], ma])
        src = t.tier[rows].copy()
        # A block already where it should be is not moved (manual no-ops),
        # unless it is a retry of pages left behind.
        go = (dst != src) | again
        self._settle_rows(ticket, ~go, "already")
        rows, dst, pos, src, ticket = rows[go], dst[go], pos[go], src[go], ticket[go]
        if plan is not None and len(plan):
            self._dirty = True  # the plan may have been cut by its budget: look again next tick
            logs.event(log, "planned", logging.DEBUG, moves=len(plan), promote_bytes=plan.promote_bytes,
                       demote_bytes=plan.demote_bytes)
        kernel = self._to_engines(rows, src, dst)
        self._settle_rows(ticket, ~kernel, "engine")  # the engine answers with move_done
        engine_pos = pos[~kernel & (pos >= 0)]
        rows, dst, pos, src, ticket = rows[kernel], dst[kernel], pos[kernel], src[kernel], ticket[kernel]
        if rows.size == 0:
            if plan is not None and kernel.all():  # nothing for the mover nor for an engine: the plan is done as made
                self._plan_settled_at = now
            return None
        return MoveJob.of_rows(t, rows, src, dst, now, plan=plan if plan is not None and len(plan) else None,
                               plan_pos=pos, engine_pos=engine_pos, ticket=ticket,
                               planned_at=None if plan is None else now)

    def _build_manual(self, now: float) -> MoveJob | None:
        """A job of operator moves alone, between ticks (the plan waits for
        the next tick)."""
        none = np.zeros(0, dtype=np.int64)
        return self._job_of(now, None, none, none.astype(np.int8), none, none, none.astype(bool))

    def _run_move(self, job: MoveJob) -> None:
        """On the mover thread: only the migrator and the job's arrays."""
        t0 = time.monotonic()
        m = self.migrator
        n = job.region.size
        job.ok = np.zeros(n, dtype=bool)
        job.unmovable = np.zeros(n, dtype=bool)
        job.untouched = np.zeros(n, dtype=bool)
        job.reason = np.zeros(n, dtype=np.uint8)
        job.dry = np.zeros(n, dtype=bool)
        job.unmapped = np.zeros(n, dtype=bool)
        job.retry = np.zeros(n, dtype=bool)
        job.done_pages = np.zeros(n, dtype=np.int64)
        if job.ticket is None:
            job.ticket = np.full(n, -1, dtype=np.int64)
        pages_of = -(-job.nbytes.astype(np.int64) // PAGE_SIZE)
        # One batch per (process, from, to, operator request): a request's
        # outcome is then read straight from its batches' answers.
        keys = np.stack([job.pid.astype(np.int64), job.src.astype(np.int64), job.dst.astype(np.int64),
                         job.ticket], axis=1)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        inv = inv.ravel()
        order = np.argsort(inv, kind="stable")
        cuts = np.flatnonzero(np.diff(inv[order])) + 1
        for (pid, src, dst, tid), sel in zip(uniq, np.split(order, cuts)):
            try:
                # Memory freed under the daemon: only what is still mapped is
                # moved (move_pages and MADV_PAGEOUT refuse the whole batch
                # otherwise); the rest is reported, and its regions checked.
                mapped = m.mapped_blocks(int(pid), job.addr[sel], job.nbytes[sel])
            except (KvtierError, OSError):
                mapped = np.ones(sel.size, dtype=bool)  # the move itself says what is wrong
            if not mapped.all():
                gone = sel[~mapped]
                job.unmapped[gone] = True
                self._move_errors(job, int(src), int(dst), int(tid), {UNMAPPED: int(pages_of[gone].sum())}, False)
                sel = sel[mapped]
                if not sel.size:
                    continue
            starts, lengths = job.addr[sel], job.nbytes[sel]
            t_batch = time.monotonic()
            try:
                if self._is_swap(int(dst)):
                    res = m.pageout(int(pid), starts, lengths)
                elif src < 0 or self._is_swap(int(src)):
                    # From swap, or from where no measurement placed it: shared
                    # memory another process faulted in, or in swap, has no
                    # page here for move_pages to see; pagein brings it too.
                    res = m.pagein(int(pid), starts, lengths, self._node_for(int(dst), int(pid)))
                else:
                    res = m.move(int(pid), starts, lengths, self._node_for(int(dst), int(pid)))
            except (KvtierError, OSError) as e:
                job.pair_seconds[(int(src), int(dst))] += time.monotonic() - t_batch
                name = UNMAPPED if isinstance(e, RangeNotMapped) else (
                    getattr(e, "errno_name", None) or type(e).__name__)
                if name == UNMAPPED:
                    job.unmapped[sel] = True  # unmapped since the check: the region check says how much
                # Nothing of the batch moved: count its pages, the unit of
                # the kernel's per-page statuses below (one unit per metric).
                retry = name in RETRYABLE
                job.retry[sel] = retry
                self._move_errors(job, int(src), int(dst), int(tid), {name: int(pages_of[sel].sum())}, retry)
                logs.event(log, "migration_batch_failed", logging.WARNING, pid=int(pid), src=int(src),
                           dst=int(dst), blocks=int(sel.size), reason=name, error=str(e))
                continue
            job.pair_seconds[(int(src), int(dst))] += time.monotonic() - t_batch
            if res.dry_run:
                # Nothing moved: neither a success (the tier stays what the
                # kernel says) nor a failure (no backoff); counted apart.
                job.dry[sel] = True
                continue
            job.ok[sel] = res.block_ok
            job.unmovable[sel] = res.block_unmovable
            if res.block_untouched is not None:
                job.untouched[sel] = res.block_untouched
            if getattr(res, "block_reason", None) is not None:
                job.reason[sel] = res.block_reason
            done = getattr(res, "block_done", None)
            job.done_pages[sel] = done if done is not None else np.where(res.block_ok, pages_of[sel], 0)
            # A batch that failed only for passing reasons (a page under
            # read, a migration in progress) is worth another try.
            retry = bool(res.errors) and set(res.errors) <= RETRYABLE
            if retry:
                job.retry[sel] = ~res.block_ok & ~res.block_unmovable
            self._move_errors(job, int(src), int(dst), int(tid), res.errors, retry)
            if res.errors:
                # One line per batch, never per page: which pages failed and why.
                logs.event(log, "migration_batch_partial", logging.WARNING, pid=int(pid), src=int(src),
                           dst=int(dst), blocks=int(sel.size), blocks_failed=int((~res.block_ok).sum()),
                           blocks_unmovable=int(res.block_unmovable.sum()),
                           errors=",".join(f"{k}:{v}" for k, v in sorted(res.errors.items())))
        self._remeasure_failed(job)
        job.seconds = time.monotonic() - t0

    @staticmethod
    def _move_errors(job: MoveJob, src: int, dst: int, ticket: int, errors: Mapping[str, int], retry: bool) -> None:
        for name, pages in errors.items():
            job.failures[(src, dst, name)] += pages
        if ticket >= 0 and errors:
            book = job.ticket_retry_errors if retry else job.ticket_errors
            book.setdefault(ticket, collections.Counter()).update(errors)

    def _remeasure_failed(self, job: MoveJob) -> None:
        """Where the blocks whose move failed or was partial really are,
        measured right after the move on this thread: the next plan must not
        see such a block in its old tier (a pageout that left a few pages
        behind, counted "in DRAM", made the plan evict a hot block for room
        that was already free)."""
        job.measured_tier = np.full(job.region.size, TIER_UNKNOWN, dtype=np.int8)
        failed = ~job.ok if job.dry is None else ~job.ok & ~job.dry
        if not failed.any():
            return
        topo = self.topology
        swap = topo.swap_tier
        lut, ntiers = topo.node_tier_lut(), len(topo.tiers)
        for pid in np.unique(job.pid[failed]):
            sel = np.flatnonzero(failed & (job.pid == pid))
            try:
                r = self.migrator.residency(int(pid), job.addr[sel], job.nbytes[sel])
            except (KvtierError, OSError) as e:
                log.debug("residency after a failed move, pid %d: %s", pid, e)
                continue
            job.measured_tier[sel] = _dominant_tier(r, lut, ntiers, None if swap is None else swap.index)[0]

    def _moved_back(self, job: MoveJob, mv: np.ndarray, rows: np.ndarray,
                    untouched: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of the finished moves ``mv`` (table ``rows``), the daemon's own
        that show the block's reader has it in use right now, the same
        evidence as a block faulted straight back after a pageout (read
        before record_results overwrites last_move): (held, back) masks.

        held: a pageout that left pages of this process alone behind (the
        migrator's STUCK_PINNED evidence: read at that moment, or pinned;
        the shared-page skip and mlock'ed mappings are no sign of use), the
        block measured after it still in memory. A reader does that: the
        pageout puts its pages in the swap cache and the reader maps them
        straight back. Such a pageout was tried again after backoff_base_s
        (1 s) while the reader went on. It stays a failure (one pageout
        cannot tell a reader from a long-term pin, and a pin must still end
        unmovable after unmovable_after tries), retried after the return
        backoff instead. A block measured in swap after it is where the
        table says: if its reader faults it in, a measurement sees that.

        back: a pagein within return_window_s of the block's pageout (the
        fault prefetch ahead of a reader, a promotion of a block hinted
        hot): the daemon brought it back for its reader, so no measurement
        ever saw it return, and a quota paged the same blocks out again
        after each prefetch (one block 6 times in 1 s).

        Operator moves are the operator's (they retry and report their own)."""
        swap = self.topology.swap_tier
        none = np.zeros(mv.size, dtype=bool)
        if swap is None:
            return none, none
        t, cfg = self.table, self.policy_cfg
        ok, src, dst = job.ok[mv], job.src[mv], job.dst[mv]
        ours = job.ticket[mv] < 0 if job.ticket is not None else ~none
        held = ~ok & ~job.unmovable[mv] & (dst == swap.index) & (job.reason[mv] == STUCK_PINNED)
        measured = job.measured_tier[mv] if job.measured_tier is not None else np.full(mv.size, TIER_UNKNOWN)
        held &= (measured >= 0) & (measured != swap.index)
        back = ok & ~untouched & (src == swap.index) & (dst != swap.index) & (dst >= 0)
        back &= job.started - t.last_move[rows] <= cfg.return_window_s
        return ours & held, ours & back

    def _finish_move(self, job: MoveJob) -> None:
        self._dram_full = False
        if job.planned_at is not None:
            self._plan_settled_at = job.planned_at
        st = self.stats
        st.observe_migration(job.seconds)
        t = self.table
        rows = t.rows_of(job.region, job.index)
        live = rows >= 0
        now = self.clock()
        self._dirty = True
        dry = job.dry if job.dry is not None else np.zeros(rows.size, dtype=bool)
        if dry.any():
            self._count_dry(job.src[dry & live], job.dst[dry & live], job.nbytes[dry & live])
        mv = np.flatnonzero(live & ~dry)
        if mv.size:
            # A block with no page written yet moved nothing: it is never
            # touched, not in the tier it was sent to (and not a migration).
            unt = job.untouched[mv] if job.untouched is not None else np.zeros(mv.size, dtype=bool)
            dst = np.where(unt, np.int8(TIER_UNKNOWN), job.dst[mv]).astype(np.int8)
            held, back = self._moved_back(job, mv, rows[mv], unt)
            pol.record_results(t, rows[mv], job.ok[mv], job.unmovable[mv], now, self.policy_cfg, dst=dst,
                               reason=job.reason[mv])
            # a held pageout is a failure in a row: its count doubles the delay
            self._returned(rows[mv][held], t.fail_count[rows[mv][held]] - 1, failed=True)
            self._returned(rows[mv][back], t.returns[rows[mv][back]])
            t.flags[rows[mv[unt]]] |= np.uint8(F_NOT_PRESENT)
            # What was just paged out is measured again with the next tick: a
            # reader faults a hot block straight back in, and the table must
            # say so (and _pageout_returns back it off) rather than count it
            # in swap while the kernel has it in DRAM.
            swap = self.topology.swap_tier
            if swap is not None:
                out = mv[job.ok[mv] & ~unt & (job.dst[mv] == swap.index)]
                t.flags[rows[out]] |= np.uint8(F_STALE)
            # A failed or partial move leaves pages wherever they are: the
            # mover measured them; what it could not measure is measured next.
            failed = mv[~job.ok[mv]]
            measured = job.measured_tier[failed] if job.measured_tier is not None else np.zeros(0, np.int8)
            seen = measured >= 0
            t.tier[rows[failed[seen]]] = measured[seen]
            # Most of such a block's pages did move: a measurement started
            # before the move must not put it back (_finish_measure compares
            # last_move with its start).
            t.last_move[rows[failed[seen]]] = now
            t.flags[rows[failed[~seen]]] |= np.uint8(F_STALE)
            okm = job.ok[mv] & ~unt
            pairs = np.stack([job.src[mv], job.dst[mv]], axis=1)[okm].astype(np.int64)
            nb = job.nbytes[mv][okm].astype(np.int64)
            if pairs.size:
                uniq, inv = np.unique(pairs, axis=0, return_inverse=True)
                inv = inv.ravel()
                counts = np.bincount(inv, minlength=len(uniq))
                nbytes = np.bincount(inv, weights=nb, minlength=len(uniq))
                for k, (s, d) in enumerate(uniq):
                    if s == d:
                        continue  # a retry of pages an operator move left behind: the block's tier is unchanged
                    st.migrations[(int(s), int(d))] += int(counts[k])
                    st.migrated_bytes[(int(s), int(d))] += int(nbytes[k])
        for key, n in job.failures.items():
            st.migration_failed_pages[key] += n
        if job.unmapped is not None and job.unmapped.any():
            self.check_mapping(np.unique(job.region[job.unmapped]).tolist())
        self._follow_tickets(job, live)
        if job.requested_at is not None:
            # Scheduler hints, measured: from the request to the block in its tier.
            done = mv[job.ok[mv] & ~np.isnan(job.requested_at[mv])]
            for waited, up in zip(now - job.requested_at[done], job.dst[done] < job.src[done]):
                st.observe_scheduled("prefetch" if up else "release", float(waited))
        if self.scheduled or self.manual:
            self.loop.call_soon(self.kick)  # scheduler hints and operator moves do not wait for the next tick
        if job.plan is not None:
            ok_plan = np.zeros(len(job.plan), dtype=bool)
            has = job.plan_pos >= 0
            # a dry run's planned moves keep their tokens: the plan is paced as the real one would be
            ok_plan[job.plan_pos[has]] = (job.ok[has] | dry[has]) & live[has]
            if job.engine_pos is not None:
                ok_plan[job.engine_pos] = True  # in the engines' hands: refunded by their answers
            self.pstate = pol.refund(self.pstate, job.plan, ok_plan, self.policy_cfg)
        if self.recorder is not None:
            real = live & ~dry  # what the kernel was asked to do (a dry run's moves cost nothing)
            self.recorder.moved(job.started, now, job.src[real], job.dst[real], job.nbytes[real], job.ok[real],
                                job.pair_seconds, job.failures)
        self._record_placements()

    def _count_dry(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """A dry run's planned moves, by (src, dst): counted, and kept as
        the last plan's (what the daemon would be doing now)."""
        st = self.stats
        last: collections.Counter = collections.Counter()
        last_bytes: collections.Counter = collections.Counter()
        for s, d, nb in zip(src.tolist(), dst.tolist(), nbytes.tolist()):
            last[(s, d)] += 1
            last_bytes[(s, d)] += int(nb)
        for key, n in last.items():
            st.dry_run_moves[key] += n
            st.dry_run_bytes[key] += last_bytes[key]
        st.dry_run_last_moves, st.dry_run_last_bytes = last, last_bytes

    def _follow_tickets(self, job: MoveJob, live: np.ndarray) -> None:
        """Operator moves: settle what is done, queue again what failed for
        a passing reason (until OPERATOR_ATTEMPTS), report the rest."""
        if job.ticket is None or not (job.ticket >= 0).any():
            return
        for tid in np.unique(job.ticket[job.ticket >= 0]):
            tk = self.tickets.get(int(tid))
            if tk is None:
                continue
            mine = job.ticket == tid
            self._settle(tk.id, int((mine & ~live).sum()), "gone")
            mine &= live
            if job.dry is not None:
                self._settle(tk.id, int((mine & job.dry).sum()), "planned")  # a dry run: nothing moved
                mine &= ~job.dry
            if job.untouched is not None:
                self._settle(tk.id, int((mine & job.untouched).sum()), "untouched")  # no page written yet
                mine &= ~job.untouched
            ok = mine & job.ok
            self._settle(tk.id, int(ok.sum()), "moved", int(job.done_pages[ok].sum()))
            unm = mine & ~job.ok & job.unmapped
            retry = mine & ~job.ok & ~job.unmapped & job.retry
            final = mine & ~job.ok & ~job.unmapped & ~retry
            errors = job.ticket_errors.get(tk.id, collections.Counter())
            again = job.ticket_retry_errors.get(tk.id, collections.Counter())
            if retry.any() and tk.attempts < OPERATOR_ATTEMPTS:
                tk.attempts += 1
                tk.retried += int(retry.sum())
                self.manual.append(ManualMove(job.region[retry].copy(), job.index[retry].copy(), tk.tier, tk.id,
                                              retry=True))
            else:
                final |= retry
                errors = errors + again
            # the unmapped pages are booked with the unmapped blocks
            unm_pages = errors.pop(UNMAPPED, 0)
            self._settle(tk.id, int(unm.sum()), "unmapped", errors={UNMAPPED: unm_pages} if unm_pages else None)
            # what of a failed block did reach the target counts as moved pages
            self._settle(tk.id, int(final.sum()), "failed", int(job.done_pages[final].sum()), errors=errors)

    def _record_placements(self, cause: str = "move") -> None:
        if self.recorder is not None:
            self.recorder.config(self.tier_states(), self.policy_cfg)
            self.recorder.placed(cause)

    # -- measure -----------------------------------------------------------

    def _build_measure(self, now: float, sample: bool = True) -> MeasureJob | None:
        """First looks at regions just registered, stale blocks in full,
        then (``sample``) the rotating sample, within the budget.

        The budget is in pages (one move_pages status each, plus a pagemap
        entry for full blocks): what a pass costs the kernel and us. At the
        default 65,536 pages/s that is a few ms of CPU per second whatever
        is registered; the sample then takes longer than
        ``residency_interval`` to visit every block of a very large table.
        """
        t = self.table
        n = len(t)
        ps = int(self.migrator.page_size)
        dt = 1.0 if self._last_measure_at is None else min(MAX_BUDGET_S, max(0.0, now - self._last_measure_at))
        urgent = self._urgent
        budget = URGENT_JOB_PAGES if urgent else self.residency_pages_per_s * dt
        S = max(1, int(self.residency_sample_pages))
        # 0. regions just registered: a window of pages of each of their
        #    blocks (of their first second of budget; the rotating sample
        #    finds the rest), so the hints that follow find blocks whose tier
        #    is known. Paid apart from the budget: once per registration.
        look_rows = self._first_look_rows(int(self.residency_pages_per_s // S))
        # 1. stale blocks, whole: first those queued stale between ticks
        #    (hinted or observed while not known present), then (at a tick)
        #    the others in row order from a cursor; at most 3/4 of the budget
        #    so the rotating sample always advances
        full_rows = np.zeros(0, dtype=np.int64)
        # engine-mode blocks have no pages: their owners report their tiers
        cap = budget if urgent else 0.75 * budget
        soon = self._take_soon(n)
        if sample or urgent:
            # Every block has at least one page: no more than cap + 1 of them fit.
            stale, complete = self._stale_rows(int(cap) + 1)
            if soon.size:
                stale = np.concatenate([soon, stale[~np.isin(stale, soon)]])
        else:
            stale, complete = soon, False
        if stale.size:
            pages = (t.nbytes[stale].astype(np.int64) + ps - 1) // ps
            k = int(np.searchsorted(np.cumsum(pages), cap, side="right"))
            if sample or urgent:
                k = max(1, k)  # the tick measures one block at least, whatever its size
            full_rows = stale[:k]
            if k > soon.size:
                self._stale_cursor = int(full_rows[-1]) + 1
            budget -= float(pages[:k].sum())
            if k < soon.size:
                self._keep_soon(soon[k:])
            if urgent and complete and k == stale.size:
                self._urgent = False
        elif urgent:
            self._urgent = False
        # 2. the rotating sample: the next blocks after the cursor, a window
        #    of sample pages each, so every block is looked at once per
        #    residency_interval when the budget allows
        #    (in jobs of MIN_SAMPLE_BLOCKS at least, or the whole table, or
        #    what a second of budget pays for; at most that second's worth)
        #    (slower while it keeps finding nothing: _sample_yield)
        k2 = 0
        if sample and not urgent and n:
            per_s = max(1, int(self.residency_pages_per_s // S))
            if self._sample_clock is None:
                self._sample_due = float(min(n, MIN_SAMPLE_BLOCKS))
            else:
                # blocks per second: the interval's, as far as the budget
                # pays, divided by the back-off (the jobs keep their size
                # and come less often: a job's fixed cost is the same)
                rate = min(n / self.residency_interval, per_s) / self._sample_slow
                since = max(0.0, now - self._sample_clock)
                self._sample_due = min(float(n), self._sample_due + rate * since)
            self._sample_clock = now
            if self._sample_due >= min(n, MIN_SAMPLE_BLOCKS, per_s) - 1e-6:
                k2 = int(max(0, min(n, math.ceil(self._sample_due - 1e-6), budget // S, per_s)))
                self._sample_due = max(0.0, self._sample_due - k2)
        win_rows = np.zeros(0, dtype=np.int64)
        if k2:
            c = self._cursor % n
            if self._pass_started is None:
                self._pass_started = now
            win_rows = (c + np.arange(k2, dtype=np.int64)) % n
            self._cursor = c + k2
            if self._cursor >= n:
                self._cursor %= n
                self.stats.residency_passes_total += 1
                self.stats.residency_pass_seconds = now - self._pass_started
                self._pass_started = now
            if full_rows.size or look_rows.size:
                win_rows = win_rows[~np.isin(win_rows, np.concatenate([full_rows, look_rows]))]
            win_rows = win_rows[(t.flags[win_rows] & np.uint8(F_ENGINE)) == 0]
        if look_rows.size:
            look_rows = look_rows[~np.isin(look_rows, full_rows)] if full_rows.size else look_rows
            win_rows = np.concatenate([look_rows, win_rows])
        rows = np.concatenate([full_rows, win_rows])
        if rows.size == 0:
            return None  # nothing measured: the budget keeps accruing
        self._last_measure_at = now
        full = np.zeros(rows.size, dtype=bool)
        full[: full_rows.size] = True
        topo = self.topology
        swap = topo.swap_tier
        # The sampled blocks' windows are the measuring thread's to make
        # (_windows): (blocks x S) of work on the loop was 2.5 ms for a
        # 64 Ki-block region's first look, every other client waiting.
        return MeasureJob(
            region=t.region[rows].astype(np.int64), index=t.index[rows].astype(np.int64), pid=t.pid[rows].copy(),
            addr=t.addr[rows].copy(), nbytes=t.nbytes[rows].copy(), full=full, lut=topo.node_tier_lut(),
            ntiers=len(topo.tiers), swap_index=None if swap is None else swap.index, started=now,
            sample_pages=S, page_size=ps, seed=int(self._rng.integers(1 << 63)),
            first=np.isin(rows, look_rows) if look_rows.size else None,
        )

    def _sample_yield(self, looked: int, found: int) -> None:
        """The rotating sample's control law: look less where looking finds
        nothing. The sample is there to catch pages moved by what is not
        the daemon (kernel reclaim to swap, a fault bringing a page back,
        numa balancing, another tool's moves); on a quiet machine every
        window agrees with the table, and the sample was most of an idle
        daemon's cost (docs/benchmarks.md, "Cost at scale"). So after
        SAMPLE_BACKOFF_BLOCKS windows (or the whole table) without one
        block found away from the tier the table knew (``found``), the
        sample runs half as often, down to 1/residency_idle_slowdown of its
        rate; one such block puts it back to full rate at once: whatever
        moved it may be moving more. Blocks the table has no tier for yet
        do not count (their first page seen is news, not drift; sparse
        blocks show one now and then), nor do stale blocks (hinted or
        observed while not known present, failed moves): those are
        measured whole whatever the slowdown, and `kvtierctl measure`
        measures everything on demand."""
        if found:
            self._sample_slow, self._sample_clean = 1, 0
        else:
            self._sample_clean += looked
            step = min(len(self.table), SAMPLE_BACKOFF_BLOCKS)
            if self._sample_clean >= step and self._sample_slow * 2 <= max(1, self.residency_idle_slowdown):
                self._sample_slow, self._sample_clean = self._sample_slow * 2, 0
        self.stats.residency_sample_slowdown = self._sample_slow

    def _take_soon(self, n: int) -> np.ndarray:
        """The rows queued stale between ticks, once each, that are still
        stale and have pages to measure; the queue is emptied."""
        parts, self._soon_rows = self._soon_rows, []
        if not parts or self._soon_gen != self.registry.generation:
            return np.zeros(0, dtype=np.int64)
        rows = np.unique(np.concatenate(parts).astype(np.int64, copy=False))
        rows = rows[rows < n]
        return rows[(self.table.flags[rows] & np.uint8(F_STALE | F_ENGINE)) == np.uint8(F_STALE)]

    def _keep_soon(self, rows: np.ndarray) -> None:
        """Queued rows a job had no budget for: first in line for the next
        (up to SOON_KEEP_ROWS; the rest wait for the stale cursor)."""
        self._soon_rows.insert(0, rows[:SOON_KEEP_ROWS])

    def _first_look_rows(self, max_blocks: int) -> np.ndarray:
        """Rows of the regions registered since the last measurement whose
        tier is not known yet, at most ``max_blocks`` of each."""
        t = self.table
        parts = []
        for rid in self._first_look:
            sl = t.slices.get(rid)
            if sl is None:
                continue
            r = np.arange(sl.start, min(sl.stop, sl.start + max(1, max_blocks)), dtype=np.int64)
            parts.append(r[(t.tier[r] < 0) & ((t.flags[r] & np.uint8(F_ENGINE)) == 0)])
        self._first_look.clear()
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _stale_rows(self, want: int) -> tuple[np.ndarray, bool]:
        """Up to ``want`` F_STALE rows from the stale cursor on (wrapping once),
        and whether the whole table was scanned for them. Scans in chunks
        and stops when it has enough: with many stale blocks (a hint storm
        over never-touched ones) that is a small part of the table."""
        flags = self.table.flags
        n = flags.size
        if n == 0 or want <= 0:
            return np.zeros(0, dtype=np.int64), True
        pos = self._stale_cursor % n
        parts, got, scanned = [], 0, 0
        while scanned < n and got < want:
            end = min(n, pos + min(STALE_SCAN_CHUNK, n - scanned))
            part = flags[pos:end] & np.uint8(F_STALE | F_ENGINE)
            idx = np.flatnonzero(part == np.uint8(F_STALE))[: want - got] + pos
            parts.append(idx)
            got += idx.size
            scanned += end - pos
            pos = end % n
        rows = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return rows.astype(np.int64, copy=False), scanned >= n and got < want

    def _run_measure(self, job: MeasureJob) -> None:
        t0 = time.monotonic()
        nb = job.region.size
        lut = job.lut
        ntiers = job.ntiers
        job.measured_tier = np.full(nb, TIER_UNKNOWN, dtype=np.int8)
        job.present = np.zeros(nb, dtype=bool)
        job.window_tier = np.full(nb, TIER_UNKNOWN, dtype=np.int8)
        job.window_whole = np.zeros(nb, dtype=bool)
        job.efault = np.zeros(nb, dtype=bool)
        rng = np.random.default_rng(job.seed)
        pages = 0
        for pid in np.unique(job.pid):
            mine = job.pid == pid
            sel = np.flatnonzero(mine & job.full)
            if sel.size:
                try:
                    r = self.migrator.residency(int(pid), job.addr[sel], job.nbytes[sel])
                except (KvtierError, OSError) as e:
                    log.debug("residency of pid %d: %s", pid, e)
                else:
                    pages += int(r.pages.sum())
                    job.measured_tier[sel], job.present[sel] = _dominant_tier(r, lut, ntiers, job.swap_index)
                    if r.errors.get("EFAULT"):
                        job.efault[sel] = True
            sampled = np.flatnonzero(mine & ~job.full)
            for lo in range(0, sampled.size, WINDOW_CHUNK):
                sel = sampled[lo:lo + WINDOW_CHUNK]
                addrs = _windows(job.addr[sel], job.nbytes[sel], job.sample_pages, job.page_size, rng)
                try:
                    status = self.migrator.query_nodes(int(pid), addrs.ravel()).reshape(addrs.shape)
                except (KvtierError, OSError) as e:
                    log.debug("sampled residency of pid %d: %s", pid, e)
                    break
                pages += int(status.size)
                job.efault[sel] = (status == _EFAULT).any(axis=1)
                on = (status >= 0) & (status < lut.size)
                tier = np.where(on, lut[np.where(on, status, 0)], -1)
                # pages per tier (ntiers + 1: swap past the memory tiers), a column at a time
                counts = np.stack([(tier == k).sum(axis=1) for k in range(ntiers + 1)], axis=1)
                job.window_tier[sel] = np.where(counts.sum(axis=1) > 0, counts.argmax(axis=1), TIER_UNKNOWN)
                job.window_whole[sel] = counts.max(axis=1) == addrs.shape[1]
        job.pages = pages
        job.seconds = time.monotonic() - t0

    def _finish_measure(self, job: MeasureJob) -> None:
        self._dram_full = False
        st = self.stats
        st.residency_scans_total += 1
        st.residency_seconds_sum += job.seconds
        st.residency_pages_total += job.pages
        st.residency_blocks_total += int(job.region.size)
        st.residency_full_blocks_total += int(job.full.sum())
        t = self.table
        rows = t.rows_of(job.region, job.index)
        # A move that finished after this measurement started knows better,
        # and so does one still running: the measurement may have caught its
        # blocks half-way (pages already in DRAM before the move's result
        # was recorded read as "paged in", without a migration counted).
        live = rows >= 0
        live[live] = t.last_move[rows[live]] < job.started
        moving = self.mover.job
        if moving is not None:
            live &= ~np.isin(rows, t.rows_of(moving.region, moving.index))
        flags = t.flags
        ms = np.flatnonzero(job.full & live)
        if ms.size:
            r = rows[ms]
            measured = job.measured_tier[ms]
            pres = job.present[ms]
            changed = t.tier[r] != measured
            if changed.any() or ((flags[r] & np.uint8(F_NOT_PRESENT)) != 0).any():
                self._dirty = True
                self._hot_soon(r[changed])
            if job.swap_index is not None:
                self._pageout_returns(r, measured, job.swap_index, job.started)
            t.tier[r] = measured
            t.prior[r[measured < 0]] = 0  # no page now: one found later was allocated since
            flags[r[pres]] &= np.uint8(~F_NOT_PRESENT & 0xFF)
            flags[r[~pres]] |= np.uint8(F_NOT_PRESENT)
            flags[r] &= np.uint8(~F_STALE & 0xFF)
        ws = np.flatnonzero(~job.full & live)
        if ws.size:
            r = rows[ws]
            wt = job.window_tier[ws]
            # The sample is only evidence that something changed: pages where
            # the table says none are, or most sampled pages in another tier.
            # Those blocks are measured in full next (a window that found no
            # page says nothing: sparse blocks have untouched windows).
            off = (wt >= 0) & ((t.tier[r] != wt) | ((flags[r] & np.uint8(F_NOT_PRESENT)) != 0))
            # A block never placed until now takes the window's tier at once
            # (plannable this tick). The whole-block measurement follows
            # unless every page of the window was in that tier: a region
            # registered whole in one place (the usual pool) is then not
            # measured twice over, which in the TCG guest was 1 s of the
            # measuring thread for 256 MiB, run beside the first hot set's
            # move; the rotating sample's next windows still catch a block
            # that is not all where its window was.
            new = off & (t.tier[r] < 0)
            # A first look whose window found no page here: never written, or
            # shared memory this process has not mapped (in swap, or faulted
            # in by another process: the pool of a second engine process),
            # or a private page in swap, which only the whole block's
            # measurement sees: such blocks (_may_hide_pages) are measured in
            # full once, so they do not read "never touched"; the rest are
            # not written yet.
            if job.first is not None:
                looked = r[job.first[ws]]
                hidden = self._may_hide_pages(looked)
                if hidden.size:
                    self._windows_miss.update(np.unique(t.region[hidden]).tolist())
                    if len(self._windows_miss) > 2 * len(self.registry.regions) + 64:
                        self._windows_miss &= set(self.registry.regions)
                    unseen = hidden[(t.tier[hidden] < 0) & np.isin(hidden, r[(wt < 0)])]
                    flags[unseen] |= np.uint8(F_STALE)
            # what the sample is for: a block whose placement the table knew,
            # found elsewhere (a block seen for the first time is news, not drift)
            self._sample_yield(int(ws.size), int(np.count_nonzero(off & (t.tier[r] >= 0) & (t.tier[r] != wt))))
            flags[r[off & ~(new & job.window_whole[ws])]] |= np.uint8(F_STALE)
            # a block of unknown tier whose window found no page: its pages
            # found later count as allocated since (not a resident pool's),
            # unless windows may miss pages there (a second process's
            # mapping of a shared pool: its measurement in full finds them)
            nopage = r[(wt < 0) & (t.tier[r] < 0)]
            if self._windows_miss and nopage.size:
                nopage = nopage[~np.isin(t.region[nopage], np.fromiter(self._windows_miss, dtype=np.int64))]
            t.prior[nopage] = 0
            if new.any():
                t.tier[r[new]] = wt[new]
                flags[r[new]] &= np.uint8(~F_NOT_PRESENT & 0xFF)
                self._dirty = True
                self._hot_soon(r[new])
        # EFAULT: no page there (freed under the daemon) or the shared zero
        # page (never written): the mappings tell them apart. Regions already
        # partly unmapped are looked at again (the owner may map it back).
        if ms.size:
            self.check_placement(np.unique(job.region[ms]))
        suspect = set(job.region[job.efault & (rows >= 0)].tolist()) if job.efault is not None else set()
        suspect |= {r.id for r in self.registry.regions.values() if r.unmapped_blocks}
        suspect = self._suspect_regions(sorted(suspect), self.clock()) if suspect else []
        if suspect:
            self.check_mapping(suspect)
        self._record_placements("seen")
        if self._urgent:
            self.loop.call_soon(self.measure_soon)  # an operator's full re-measurement: its next job now
        elif self._soon_rows or self._first_look:
            self._queue_measure()

    def _may_hide_pages(self, rows: np.ndarray) -> np.ndarray:
        """Of a first look's rows, those whose windows may miss pages that
        are there: all of a process with pages in swap (a swapped page has
        no node for move_pages), and blocks in shared mappings (pages
        another process faulted in or paged out). Where the others' window
        found no page they are not written yet: measuring them in full
        would find nothing either (a 1 TiB sparse region: 268 M pages, an
        hour of the residency budget)."""
        if rows.size == 0:
            return rows
        procs = self.registry.processes
        shared, swapped = getattr(procs, "shared_blocks", None), getattr(procs, "swapped_bytes", None)
        if shared is None or swapped is None:
            return rows[:0]
        t = self.table
        keep = np.zeros(rows.size, dtype=bool)
        pids = t.pid[rows]
        for pid in np.unique(pids).tolist():
            mine = pids == pid
            try:
                keep[mine] = True if swapped(int(pid)) > 0 else shared(int(pid), t.addr[rows[mine]],
                                                                         t.nbytes[rows[mine]])
            except (KvtierError, OSError) as e:
                log.debug("mappings of pid %d: %s", pid, e)
        return rows[keep]

    def _after_swapoff(self) -> None:
        """A swap device went away (swapoff): the kernel read its pages back
        into memory, private ones into their process's page tables (the
        sample sees them), shared memory only into its object's page cache,
        which no sampled window sees. Every block measured in swap is
        measured again in full, or it would read swap for good."""
        lost = getattr(self.topology, "swap_lost", 0)
        if lost == self._swap_lost:
            return
        self._swap_lost = lost
        swap = self.topology.swap_tier
        if swap is not None and len(self.table):
            t = self.table
            t.flags[t.tier == swap.index] |= np.uint8(F_STALE)
            self._dirty = True

    def _pageout_returns(self, rows: np.ndarray, measured: np.ndarray, swap: int, at: float) -> None:
        """Blocks the table has in swap since a pageout less than
        return_window_s before this measurement, measured back in memory:
        their reader faulted them straight back in (_returned); a block
        that stayed out starts over."""
        t, cfg = self.table, self.policy_cfg
        was_out = t.tier[rows] == swap
        recent = at - t.last_move[rows] <= cfg.return_window_s
        back = rows[was_out & recent & (measured >= 0) & (measured != swap)]
        t.returns[rows[was_out & ~recent & (measured == swap)]] = 0
        self._returned(back, t.returns[back])

    def _returned(self, rows: np.ndarray, returns: np.ndarray, failed: bool = False) -> None:
        """``rows`` came straight back to their reader (``returns``: their
        returns in a row so far). Paging them out again would only repeat
        that (a quota held against a reader paged the same hot blocks out
        206 times in 20 s), so they are not paged out for
        return_backoff_s, doubled per return in a row: barred from swap
        only (``returns`` set: promotion stays open), or, ``failed`` (a
        held pageout, record_results' failure), from every move as a
        failure is, the failure's own delay if longer."""
        if not rows.size:
            return
        t, cfg = self.table, self.policy_cfg
        n = np.minimum(returns.astype(np.int64) + 1, np.iinfo(np.uint8).max)
        if not failed:
            t.returns[rows] = n
            self._returns_live = True
        delay = np.minimum(cfg.backoff_max_s, cfg.return_backoff_s * np.exp2(np.minimum(n - 1, 62)))
        t.retry_at[rows] = np.maximum(t.retry_at[rows], self.clock() + delay)
        self.stats.pageout_returns_total += int(rows.size)
        logs.event(log, "pageout_returned", blocks=int(rows.size), held=failed, backoff_s=float(delay.min()),
                   max_backoff_s=float(delay.max()))

    # -- collect -----------------------------------------------------------

    def _hinted(self) -> frozenset[int]:
        """Regions whose owner sends hints (recomputed only when hints or
        registrations changed)."""
        key = (self.stats.block_hints_total, self.registry.generation)
        if key != self._hinted_at:
            self._hinted_regions = frozenset(rid for rid, r in self.registry.regions.items() if r.block_hints)
            self._hinted_at = key
        return self._hinted_regions

    def _retarget(self) -> None:
        """Point the sources at the table as it is now. A source that says
        ``skip_hinted`` (DAMON) is not run over regions whose owner hints:
        the hints already say exactly which blocks are read."""
        t = self.table
        hinted = self._hinted()
        if self._targets_gen == self.registry.generation and self._targets_hinted == hinted:
            return
        unhinted = None
        if hinted:
            unhinted = np.flatnonzero(~np.isin(t.region, np.fromiter(hinted, dtype=np.int64)))
        for source in self.sources:
            try:
                if getattr(source, "skip_hinted", False):
                    source.set_targets(t, rows=unhinted)
                else:
                    source.set_targets(t)
            except (KvtierError, OSError) as e:
                log.warning("hotness source %s: set_targets failed: %s", source.name, e)
        self._targets_gen = self.registry.generation
        self._targets_hinted = hinted
        self._targets_slices = dict(t.slices)

    def _build_collect(self, now: float) -> CollectJob | None:
        self._retarget()
        due = []
        for source in self.sources:
            p = self.pace[source.name]
            if p.skip > 0:
                p.skip -= 1
                continue
            p.skip = p.slowdown - 1
            due.append(source)
        if not due:
            return None
        return CollectJob(due, self._targets_slices, self._targets_gen, started=now)

    def _run_collect(self, job: CollectJob) -> None:
        for source in job.sources:
            c0 = time.thread_time()
            try:
                job.observations.append(source.collect(job.started))
            except (KvtierError, OSError) as e:
                log.warning("hotness source %s: collect failed: %s", source.name, e)
            kernel = source.kernel_cpu_seconds() if hasattr(source, "kernel_cpu_seconds") else None
            job.cost[source.name] = (time.thread_time() - c0, kernel)

    def _finish_collect(self, job: CollectJob) -> None:
        t = self.table
        now = self.clock()
        again: list[HotnessSource] = []
        for obs, source in zip(job.observations, job.sources):
            if not job.follow_up and self._waits_below(job, obs.pending):
                again.append(source)
            if not len(obs):
                continue
            r = self._collected_rows(job, obs.rows)
            ok = (r >= 0) & (r < len(t))
            r = r[ok]
            # A source backed off looks once every `slowdown` ticks: a run
            # its look starts is that old (hotness.Temperature.add, span).
            span = self.pace[source.name].slowdown * self.temperature.interval
            self.temperature.add(t, r, obs.counts[ok], now, obs.weight, span=span)
            if self.recorder is not None:
                self.recorder.observed(obs.source, r, obs.counts[ok], obs.weight)
            # seen accessed while the table says not present: measure it
            f = t.flags[r]
            unsure = r[(((f & np.uint8(F_NOT_PRESENT)) != 0) | (t.tier[r] < 0)) & ((f & np.uint8(F_STALE)) == 0)]
            t.flags[unsure] |= np.uint8(F_STALE)
            self._dirty = True
            if unsure.size:
                self._stale_soon(unsure)
            self._hot_soon(r)
            if obs.prefetch.size:
                pf = self._collected_rows(job, obs.prefetch)
                self._prefetch_swapped(pf[(pf >= 0) & (pf < len(t))])
        for source in job.sources:
            self._pace(source, job.cost.get(source.name, (0.0, None)), now, job.follow_up)
        if again:
            self.loop.call_soon(self._follow_up, again)

    def _collected_rows(self, job: CollectJob, rows: np.ndarray) -> np.ndarray:
        """Rows a source named as at its set_targets, in the table as it is
        now (-1: a region removed since, past the end: rows shifted)."""
        if job.generation == self.registry.generation:
            return rows
        return self.table.rows_of(*_keys_of(job.slices, rows))  # rows shifted since the sources were targeted

    def _waits_below(self, job: CollectJob, pending: np.ndarray) -> bool:
        """Whether a source saw reads it does not credit yet (``pending``)
        of a block in a lower tier, movable: a promotion waits on its next
        collect. Blocks already in DRAM never wait on it (the edges of a
        hot set DAMON splits anew each dump stay pending there)."""
        if not pending.size:
            return False
        t = self.table
        r = self._collected_rows(job, pending)
        r = r[(r >= 0) & (r < len(t))]
        return bool(((t.tier[r] > 0) & ((t.flags[r] & np.uint8(F_UNMOVABLE | F_ENGINE)) == 0)).any())

    def _follow_up(self, sources: list[HotnessSource]) -> None:
        """Collect ``sources`` again now, not at the next tick: their last
        collect saw a block in a lower tier read that they credit only once
        a second look agrees (DAMON's dumps: module docstring of
        kernel/sources/damon.py). With one collect a tick, a moved hot set
        under DAMON alone was promoted two ticks after its first reads
        (3.26 s and 2.25 s to 90 % in DRAM in the guest comparison, every
        source budget alike) where the second dump is one aggregation
        interval away. One follow-up per regular collect (a follow-up asks
        for none), paid from the source's budget like any collect
        (``_pace``)."""
        if not self._sources_idle():
            return  # the tick's collect comes instead
        live = [s for s in sources if s in self.sources]
        if live:
            self._retarget()
            job = CollectJob(live, self._targets_slices, self._targets_gen, started=self.clock(), follow_up=True)
            self.stats.source_follow_ups_total += 1
            self._submit(self.collector, self._run_collect, self._finish_collect, job)

    def _prefetch_swapped(self, rows: np.ndarray) -> None:
        """A source expects these blocks to be read soon (perf_fault: the
        blocks after one that took major faults): those in swap are paged in
        now, as a prefetch (to tier 0, paid from the promotion tokens), so
        a sequential reader finds them in DRAM instead of faulting on each."""
        swap = self.topology.swap_tier
        if swap is None or rows.size == 0:
            return
        t = self.table
        rows = rows[(t.tier[rows] == swap.index) & ((t.flags[rows] & np.uint8(F_UNMOVABLE | F_ENGINE)) == 0)]
        moving = self.mover.job
        if moving is not None and rows.size:  # already on their way in
            rows = rows[~np.isin(rows, t.rows_of(moving.region, moving.index))]
        if rows.size:
            self.stats.fault_prefetch_blocks_total += self.schedule(rows, "prefetch", timed=False)["queued"]

    def _pace(self, source, cost: tuple[float, float | None], now: float, follow_up: bool = False) -> None:
        """Per-source cost control: share of one core = (CPU in collect +
        its kernel thread's CPU) / wall time since its last collect. Above
        the budget the source slows down x2 (collected every 2nd, 4th ...
        tick, and sampling less often where it can: DAMON's intervals);
        below half the budget it speeds up again. Multiplicative steps
        because the cost of a source scales with its rate.

        A follow-up collect's cost is carried into the next regular
        collect's share (over the whole interval between the two regular
        collects): its own interval, a fraction of a tick, made any share
        look several times its rate (the guest: 0.12-0.21 of a core against
        0.04 over the tick, and a backoff after every follow-up)."""
        p = self.pace[source.name]
        cpu, kernel = cost
        p.cpu_s += cpu
        self.stats.source_cpu_seconds[source.name] += cpu
        spent = cpu
        if kernel is not None:
            if p.last_kernel is not None and kernel >= p.last_kernel:
                p.kernel_s += kernel - p.last_kernel
                self.stats.source_kernel_seconds[source.name] += kernel - p.last_kernel
                spent += kernel - p.last_kernel
            p.last_kernel = kernel
        p.collects += 1
        if follow_up:
            p.carried_s += spent
            return
        spent, p.carried_s = spent + p.carried_s, 0.0
        if p.last_at is not None and now > p.last_at:
            p.share = spent / (now - p.last_at)
            old = p.slowdown
            if p.share > self.source_cpu_budget and p.slowdown < MAX_SLOWDOWN:
                p.slowdown *= 2
            elif p.share < self.source_cpu_budget / 2 and p.slowdown > 1:
                p.slowdown //= 2
            if p.slowdown != old:
                p.skip = p.slowdown - 1
                if hasattr(source, "set_slowdown"):
                    try:
                        source.set_slowdown(p.slowdown)
                    except (KvtierError, OSError) as e:
                        log.warning("hotness source %s: set_slowdown failed: %s", source.name, e)
                logs.event(log, "source_backoff" if p.slowdown > old else "source_speedup",
                           logging.WARNING if p.slowdown > old else logging.INFO, source=source.name,
                           slowdown=p.slowdown, core_share=round(p.share, 4), budget=self.source_cpu_budget)
            self.stats.source_slowdown[source.name] = p.slowdown
        p.last_at = now

    # -- lifecycle ---------------------------------------------------------

    def wait_idle(self, timeout: float | None = None) -> None:
        for w in (self.mover, self.measurer, self.collector):
            fut = w.future
            if fut is not None:
                try:
                    fut.result(timeout)
                except Exception:
                    pass

    def shutdown(self) -> None:
        self._closed = True
        for w in (self.mover, self.measurer, self.collector, self.explainer):
            w.executor.shutdown(wait=True, cancel_futures=True)
        for source in self.sources:
            try:
                source.close()
            except (KvtierError, OSError) as e:
                log.warning("hotness source %s: close failed: %s", source.name, e)
