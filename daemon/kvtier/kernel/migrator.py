"""Moves KV blocks between NUMA nodes and swap, and measures where they are.

A block is an address range of another process. Every operation works on a
batch of blocks at once: page addresses are generated with numpy (no Python
loop per page), handed to move_pages / process_madvise in a few large
syscalls, and per-page results are folded back into per-block answers with
bincount. Per-page failures never raise; they are counted by errno name and
flagged per block. Only whole-call failures (process gone, no permission,
unknown node) raise typed errors.

Kernel behaviour this module relies on (measured, see DESIGN.md):
- move_pages(nodes=NULL) returns each page's node, -ENOENT for a page that
  is not present (never touched, or swapped out) and -EFAULT for an address
  outside any mapping. pagemap bit 62 tells swapped from never touched.
- Anonymous memory only ever read is mapped to the shared zero page: pagemap
  shows it present, move_pages answers -EFAULT (with or without a target
  node). Such a page is never touched for kvtier, not a failure; so is a
  -EFAULT page inside a mapping that pagemap shows absent (6.1 answers that
  for anonymous memory without a page table yet).
- Shared memory (shmem) swapped out has no swap PTE: pagemap and move_pages
  show it like a page never touched. kernel/shmem.py asks the object
  (cachestat, lseek) instead, for the pages that are not mapped.
- A transparent huge page reports -EBUSY once yet is migrated; re-querying
  resolves it. A page that stays -EBUSY is pinned (long-term GUP: CUDA host
  registrations, RDMA) and is reported as unmovable. A page whose migration
  the kernel tried and gave up on (a long-term pin's extra reference) gets
  no status at all: move_pages returns how many pages did not move and
  writes no status for that batch (native.move_pages reports them -EBUSY);
  re-querying tells which moved.
- MADV_PAGEOUT skips pages mapped by more than one process and pinned pages;
  what really went to swap is read back from pagemap. It refuses an mlock'ed
  mapping (VM_LOCKED) with EINVAL for the whole call, so locked ranges
  (smaps VmFlags "lo") are left out of the call and reported LOCKED.
- No /proc file shows a long-term pin (kpageflags has no such bit, and
  kpagecount is the mapcount, not the pin count). What the kernel's answers
  do show: a page left present after two pageout rounds, mapped by this
  process alone (pagemap's exclusive bit) and not locked, is pinned or was
  read at that moment. Such blocks carry STUCK_PINNED as evidence; the
  policy marks them unmovable only after repeated failures.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvtier.blocks import STUCK_LOCKED, STUCK_NONE, STUCK_PINNED
from kvtier.kernel import native
from kvtier.errors import InvalidArgument, os_error
from kvtier.kernel import procmap, shmem
from kvtier.kernel.procfs import PM_EXCLUSIVE, PM_PRESENT, PM_SWAP, Pagemap, read_locked_ranges

# Pages per move_pages call: large enough that syscall overhead vanishes,
# small enough that one call does not hold the target's mmap lock for long.
DEFAULT_BATCH_PAGES = 1 << 16
# A move is cut into parts of at least this many pages, each one
# move_pages call on its own thread (``move_threads``): below it one call
# does the work and a thread's hand-off would cost more than it saves.
MIN_PART_PAGES = 1024
# Threads a move may use when not configured: the CPUs the daemon may run
# on, at most this many.
MAX_AUTO_MOVE_THREADS = 4
# Re-query/retry rounds for -EBUSY pages before calling them pinned.
BUSY_RETRIES = 2
# A dry run keeps its last calls, not all of them: it may run for weeks.
DRY_RUN_RECORD = 1024

_ENOENT = -errno.ENOENT
_EBUSY = -errno.EBUSY
_EFAULT = -errno.EFAULT


def _errno_name(neg: int) -> str:
    return errno.errorcode.get(-int(neg), str(-int(neg)))


@dataclass
class PageLayout:
    """The pages of a batch of blocks, flattened in block order."""

    addrs: np.ndarray  # uint64 page addresses, all blocks concatenated
    first: np.ndarray  # int64 index of each block's first page in addrs
    pages: np.ndarray  # int64 pages per block
    runs: list[tuple[int, int, int]]  # (start address, first page, npages) contiguous runs

    def per_block(self, page_mask: np.ndarray) -> np.ndarray:
        """Count the True pages of each block (one reduceat, no per-page index)."""
        if not len(self.pages):
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(page_mask.astype(np.int64, copy=False), self.first)


def page_layout(
    starts: np.ndarray, lengths: np.ndarray | int, page_size: int, out: np.ndarray | None = None
) -> PageLayout:
    """Page addresses of a batch of blocks; ``out`` (uint64) is reused if large enough."""
    starts = np.asarray(starts, dtype=np.uint64)
    lengths = np.broadcast_to(np.asarray(lengths, dtype=np.uint64), starts.shape)
    if starts.ndim != 1:
        raise InvalidArgument("starts must be a 1-d array")
    if np.any(lengths == 0):
        raise InvalidArgument("zero-length block")
    ps = np.uint64(page_size)
    lo = starts - starts % ps
    hi = starts + lengths
    hi = hi + (ps - hi % ps) % ps
    pages = ((hi - lo) // ps).astype(np.int64)
    first = np.zeros(len(pages), dtype=np.int64)
    np.cumsum(pages[:-1], out=first[1:])
    total = int(pages.sum())
    addrs = out[:total] if out is not None and len(out) >= total else np.empty(total, dtype=np.uint64)
    # Blocks of one region are adjacent, so a batch is a few contiguous runs:
    # each run's page addresses are one arange (no per-block or per-page work).
    runs: list[tuple[int, int, int]] = []
    if len(pages):
        breaks = np.flatnonzero(lo[1:] != hi[:-1]) + 1
        edges = np.concatenate(([0], breaks, [len(pages)]))
        for a, b in zip(edges[:-1].tolist(), edges[1:].tolist()):
            f = int(first[a])
            n = int(first[b - 1] + pages[b - 1]) - f
            run = addrs[f : f + n]
            np.multiply(np.arange(n, dtype=np.uint64), ps, out=run)
            run += lo[a]
            runs.append((int(lo[a]), f, n))
    return PageLayout(addrs=addrs, first=first, pages=pages, runs=runs)


@dataclass
class Residency:
    """Where each block's pages are."""

    node_pages: np.ndarray  # (blocks, nodes) int64: resident pages per node
    swapped: np.ndarray  # (blocks,) pages in swap
    absent: np.ndarray  # (blocks,) pages never touched (not present, not swapped; zero page)
    errors: dict[str, int]  # other per-page statuses by errno name (EFAULT = unmapped)
    pages: np.ndarray  # (blocks,) pages per block
    # (blocks,) shared memory in RAM but not mapped by the process (another
    # process faulted it in; without cachestat also the swap cache): no node
    cached: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.cached is None:
            self.cached = np.zeros(len(self.pages), dtype=np.int64)

    @property
    def resident(self) -> np.ndarray:
        return self.node_pages.sum(axis=1)

    def dominant_node(self) -> np.ndarray:
        """Node with most of each block's resident pages, -1 if none resident."""
        if self.node_pages.shape[1] == 0:
            return np.full(len(self.pages), -1, dtype=np.int64)
        dom = self.node_pages.argmax(axis=1)
        return np.where(self.resident > 0, dom, -1)

    def to_dict(self) -> dict:
        return {
            "node_pages": self.node_pages.tolist(),
            "swapped": self.swapped.tolist(),
            "absent": self.absent.tolist(),
            "errors": dict(self.errors),
            "pages": self.pages.tolist(),
            "cached": self.cached.tolist(),
        }


@dataclass
class MoveResult:
    op: str  # "move", "pageout", "pagein"
    target: str  # "node N" or "swap"
    pages: int  # pages attempted
    done: int  # pages that ended where asked
    errors: dict[str, int] = field(default_factory=dict)  # pages by errno name
    block_ok: np.ndarray | None = None  # (blocks,) every present page ended at the target
    block_unmovable: np.ndarray | None = None  # (blocks,) the kernel will not move it (pinned, locked)
    seconds: float = 0.0
    dry_run: bool = False
    page_size: int = native.PAGE_SIZE
    # (blocks,) no page written yet, nothing moved: the block is never touched,
    # not where it was sent (ok all the same: never a failure)
    block_untouched: np.ndarray | None = None
    block_done: np.ndarray | None = None  # (blocks,) pages that ended where asked
    # (blocks,) uint8 STUCK_* evidence of why a block did not move (blocks.py)
    block_reason: np.ndarray | None = None

    @property
    def bytes_done(self) -> int:
        return self.done * self.page_size

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "target": self.target,
            "pages": self.pages,
            "done": self.done,
            "bytes_done": self.bytes_done,
            "errors": dict(self.errors),
            "blocks_ok": int(self.block_ok.sum()) if self.block_ok is not None else 0,
            "blocks_unmovable": int(self.block_unmovable.sum()) if self.block_unmovable is not None else 0,
            "blocks_untouched": int(self.block_untouched.sum()) if self.block_untouched is not None else 0,
            "seconds": self.seconds,
            "dry_run": self.dry_run,
        }


def _count_errors(status: np.ndarray, ignore: tuple[int, ...] = ()) -> dict[str, int]:
    neg = status[status < 0]
    if not len(neg):
        return {}
    vals, counts = np.unique(neg, return_counts=True)
    return {_errno_name(v): int(c) for v, c in zip(vals, counts) if int(v) not in ignore}


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class Migrator:
    """Actuator for block placement. ``dry_run`` records instead of acting."""

    def __init__(
        self,
        proc_root: str = "/proc",
        dry_run: bool = False,
        batch_pages: int = DEFAULT_BATCH_PAGES,
        page_size: int = native.PAGE_SIZE,
        max_node: int | None = None,
        move_threads: int = 0,
    ):
        self.proc_root = proc_root
        self.dry_run = dry_run
        self.batch_pages = batch_pages
        self.move_threads = move_threads
        self._parts_pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self.page_size = page_size
        self.max_node = native.numa_max_node() if max_node is None else max_node
        self.record: deque[dict] = deque(maxlen=DRY_RUN_RECORD)  # dry run: the calls not made
        # One move at a time (a move's parts run on threads of their own,
        # _move_all). Measuring (residency, query_nodes) runs on
        # its own thread beside the moves, so that a long move never delays
        # the measurement hinted promotions wait for: the scratch buffers are
        # therefore per thread.
        self._lock = threading.Lock()
        self._local = threading.local()

    def _buf(self, name: str, n: int, dtype) -> np.ndarray:
        """A reusable array of at least ``n`` items.

        Fresh multi-MiB arrays cost a page fault per 4 KiB on first touch,
        which at 64K+ pages per batch is a sizeable share of the syscall
        time itself; reusing the buffers removes it.
        """
        scratch = getattr(self._local, "bufs", None)
        if scratch is None:
            scratch = self._local.bufs = {}
        buf = scratch.get(name)
        if buf is None or len(buf) < n or buf.dtype != dtype:
            buf = np.empty(max(n, 1024), dtype=dtype)
            scratch[name] = buf
        return buf[:n]

    def _layout(self, starts, lengths) -> PageLayout:
        starts = np.asarray(starts, dtype=np.uint64)
        lengths_arr = np.broadcast_to(np.asarray(lengths, dtype=np.uint64), starts.shape)
        ps = self.page_size
        # Upper bound on pages, to size the scratch buffer without a first pass.
        bound = int((lengths_arr // np.uint64(ps)).sum()) + 2 * len(starts)
        return page_layout(starts, lengths_arr, ps, out=self._buf("addrs", bound, np.uint64))

    # -- queries -----------------------------------------------------------

    def _status(self, pid: int, addrs: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        status = self._buf("status", len(addrs), np.int32) if out is None else out
        for i in range(0, len(addrs), self.batch_pages):
            native.move_pages(pid, addrs[i : i + self.batch_pages], None, status=status[i : i + self.batch_pages])
        return status

    def _pagemap(self, pid: int, layout: PageLayout) -> np.ndarray:
        entries = self._buf("pagemap", len(layout.addrs), np.uint64)
        with Pagemap(pid, self.proc_root) as pm:
            for start, first, n in layout.runs:
                entries[first : first + n] = pm.read(start, n, self.page_size)
        return entries

    def query_nodes(self, pid: int, addrs: np.ndarray) -> np.ndarray:
        """Node of each page address (move_pages query), or -errno (-ENOENT:
        not present). No pagemap read: the engine's sampled residency only
        needs to notice that a block is not where the table says."""
        addrs = np.ascontiguousarray(addrs, dtype=np.uint64)
        return self._status(pid, addrs, out=np.empty(len(addrs), dtype=np.int32))

    def residency(self, pid: int, starts: np.ndarray, lengths: np.ndarray | int) -> Residency:
        """Pages per node, swapped and never-touched pages, for each block.

        Not serialised with moves (queries only; its buffers are per thread)."""
        layout = self._layout(starts, lengths)
        nb = len(layout.pages)
        nn = self.max_node + 1
        status = self._status(pid, layout.addrs)
        pm = self._pagemap(pid, layout)
        # A page faulted in between the two reads (a swap-in, a first
        # write) reads "no page" and then present: ask where it is now. Read
        # as never touched, a pool its owner was reading back from swap
        # while a measurement ran had 2,430 of 16,384 blocks "never
        # touched" (tests/host/test_attacks_steps.py).
        late = np.flatnonzero((status == _ENOENT) & ((pm & PM_PRESENT) != 0))
        if late.size:
            status[late] = native.move_pages(pid, np.ascontiguousarray(layout.addrs[late]), None)
        on_node = status >= 0
        node_pages = np.zeros((nb, nn), dtype=np.int64)
        if nb:
            for node in range(nn):  # a handful of nodes: one reduceat each
                node_pages[:, node] = layout.per_block(status == node)
        swap_pte = (pm & PM_SWAP) != 0
        swapped_page = swap_pte & ~on_node
        zero = status == _EFAULT
        if zero.any():  # the zero page is present in pagemap; an unmapped address is not
            zero &= (pm & PM_PRESENT) != 0
        shm = shmem.shared_pages(pid, layout, on_node | swap_pte | zero, self.proc_root, self.page_size)
        absent_page = ((status == _ENOENT) | zero) & ~swapped_page
        if shm.data.any() or shm.unknown.any():
            absent_page &= ~(shm.data | shm.unknown)
        swapped = layout.per_block(swapped_page) + shm.swapped
        absent = layout.per_block(absent_page)
        other = ~on_node & (status != _ENOENT) & ~zero
        errors = _count_errors(status[other])
        for name, n in shm.errors.items():
            errors[name] = errors.get(name, 0) + n
        return Residency(node_pages, swapped, absent, errors, layout.pages, shm.cached)

    def mapped_blocks(self, pid: int, starts: np.ndarray, lengths: np.ndarray | int) -> np.ndarray:
        """Per block, whether all of it is mapped (procmap.mapped_blocks):
        memory freed under the daemon is not attempted at all."""
        starts = np.asarray(starts, dtype=np.uint64)
        return procmap.mapped_blocks(pid, starts, np.broadcast_to(np.asarray(lengths, dtype=np.uint64),
                                                                  starts.shape), self.proc_root)

    def check_mapped(self, pid: int, layout: PageLayout) -> None:
        """Raise RangeNotMapped unless every block lies inside the process's
        private anonymous or shared-memory mappings.

        Checked before acting so an unmapped range is a clear error rather
        than a scatter of per-page EFAULTs. Only memory register accepts: a
        process may map a file over its region (MAP_FIXED) after
        registering it, and MADV_PAGEOUT from the root daemon would evict
        that file's page cache, which the kernel refuses its owner unless
        it may write the file (a page-cache side channel). One PROCMAP_QUERY ioctl per VMA
        of each run (falling back to /proc/PID/maps on kernels before 6.11),
        instead of parsing every mapping of the process on every call.
        """
        for start, _first, n in layout.runs:
            procmap.check_range(pid, start, n * self.page_size, self.proc_root, kv_only=False)

    # -- actions -----------------------------------------------------------

    def _start_to_node(self, op: str, record_op: str, pid: int, starts, lengths, node: int
                       ) -> tuple[PageLayout, float, MoveResult | None]:
        """The opening of every move to a node: the node checked, the pages
        laid out, a dry run recorded (its result returned), the range checked."""
        if not 0 <= node <= self.max_node:
            raise InvalidArgument(f"unknown NUMA node {node} (this machine has nodes 0-{self.max_node})")
        layout = self._layout(starts, lengths)
        t0 = time.monotonic()
        if self.dry_run:
            self.record.append({"op": record_op, "pid": pid, "pages": len(layout.addrs), "node": node})
            return layout, t0, MoveResult(op, f"node {node}", len(layout.addrs), 0, dry_run=True,
                                          page_size=self.page_size)
        self.check_mapped(pid, layout)
        return layout, t0, None

    @_locked
    def move(self, pid: int, starts: np.ndarray, lengths: np.ndarray | int, node: int) -> MoveResult:
        """Migrate the present pages of the blocks to ``node`` (move_pages).

        Swapped-out pages are not present and are left where they are (use
        pagein); they do not count against a block being ok.
        """
        layout, t0, dry = self._start_to_node("move", "move_pages", pid, starts, lengths, node)
        if dry is not None:
            return dry
        status = self._move_all(pid, layout.addrs, node)
        return self._result("move", f"node {node}", layout, status, node, t0, pid)

    def threads(self) -> int:
        """Threads one move may use: ``move_threads``, or with 0 the CPUs
        this process may run on (at most MAX_AUTO_MOVE_THREADS)."""
        if self.move_threads > 0:
            return self.move_threads
        return max(1, min(len(os.sched_getaffinity(0)), MAX_AUTO_MOVE_THREADS))

    def _pool(self) -> ThreadPoolExecutor:
        """The threads that move a move's parts, ``threads()`` of them
        (made again when a reload changed that)."""
        n = self.threads()
        if self._parts_pool is None or self._pool_size != n:
            if self._parts_pool is not None:
                self._parts_pool.shutdown(wait=False)
            self._parts_pool, self._pool_size = ThreadPoolExecutor(n, thread_name_prefix="kvtier-move"), n
        return self._parts_pool

    def _parts(self, n: int) -> list[tuple[int, int]]:
        """[lo, hi) page ranges of a move of ``n`` pages: as many equal parts
        as threads, none below MIN_PART_PAGES, each cut at batch_pages."""
        k = max(1, min(self.threads(), n // MIN_PART_PAGES))
        edges = [n * i // k for i in range(k + 1)]
        return [(i, min(i + self.batch_pages, hi)) for lo, hi in zip(edges, edges[1:])
                for i in range(lo, hi, self.batch_pages)]

    def _move_all(self, pid: int, addrs: np.ndarray, node: int) -> np.ndarray:
        """move_pages over the whole batch, busy pages resolved.

        The kernel migrates a move_pages call's pages on the calling CPU, one
        batch after another; a large move is therefore cut into parts moved
        by several threads at once (cffi releases the GIL in the call), so
        it uses every CPU the daemon may use instead of one. Parts are
        disjoint ranges of pages of one process, and move_pages takes the
        process's mmap lock shared, so the calls run side by side."""
        status = self._buf("status", len(addrs), np.int32)
        parts = self._parts(len(addrs))

        def part(bounds: tuple[int, int]) -> None:
            lo, hi = bounds
            native.move_pages(pid, addrs[lo:hi], node, status=status[lo:hi])

        if len(parts) == 1:
            part(parts[0])
        else:
            pool = self._pool()
            for fut in [pool.submit(part, b) for b in parts]:
                fut.result()  # every part ends before the statuses are read; the first error raises
        return self._resolve_busy(pid, addrs, status, node)

    def _resolve_busy(self, pid: int, addrs: np.ndarray, status: np.ndarray, node: int) -> np.ndarray:
        """Re-query -EBUSY pages; retry those not yet on ``node``.

        One -EBUSY per THP is expected (the huge page is split or migrated
        whole while its tail pages report busy); a page still busy after
        BUSY_RETRIES rounds is pinned.
        """
        busy = np.flatnonzero(status == _EBUSY)
        for _ in range(BUSY_RETRIES + 1):
            if not len(busy):
                break
            now = native.move_pages(pid, np.ascontiguousarray(addrs[busy]), None)
            # Busy pages now on the node (the THP case) are done; a re-query
            # failure (page gone) replaces the busy status too.
            still = (now >= 0) & (now != node)
            status[busy[~still]] = now[~still]
            busy = busy[still]
            if not len(busy) or _ == BUSY_RETRIES:
                break
            res = native.move_pages(pid, np.ascontiguousarray(addrs[busy]), node)
            status[busy] = res
            busy = busy[res == _EBUSY]
        # Whatever is left busy after the retries is pinned: keep -EBUSY.
        status[busy] = _EBUSY
        return status

    def _untouched(self, pid: int, layout: PageLayout, status: np.ndarray) -> np.ndarray:
        """Per page: -EFAULT from move_pages for memory never written (the
        zero page, or no page table yet), not for an address gone meanwhile."""
        efault = status == _EFAULT
        if not efault.any():
            return efault
        present = (self._pagemap(pid, layout) & PM_PRESENT) != 0
        if (efault & ~present).any():
            try:
                self.check_mapped(pid, layout)  # mapped before the move: still?
            except InvalidArgument:
                return efault & present
        return efault

    def _result(self, op: str, target: str, layout: PageLayout, status: np.ndarray, node: int, t0: float,
                pid: int) -> MoveResult:
        done_page = status == node
        untouched_page = (status == _ENOENT) | self._untouched(pid, layout, status)
        ok_page = done_page | untouched_page
        bad_page = ~ok_page
        block_ok = layout.per_block(bad_page) == 0
        block_unmovable = layout.per_block(status == _EBUSY) > 0
        reason = np.where(block_unmovable, np.uint8(STUCK_PINNED), np.uint8(STUCK_NONE))
        errors = _count_errors(status[bad_page & (status < 0)])
        wrong_node = bad_page & (status >= 0)
        if wrong_node.any():
            errors["WRONG_NODE"] = int(wrong_node.sum())
        # A block of only not-present pages is never touched unless some of
        # them are in swap (move() leaves swapped pages where they are).
        untouched = layout.per_block(~untouched_page) == 0
        if untouched.any():
            pm = self._pagemap(pid, layout)
            swapped = (pm & PM_SWAP) != 0
            present = (pm & PM_PRESENT) != 0
            shm = shmem.shared_pages(pid, layout, present | swapped, self.proc_root, self.page_size)
            # a page that was not there for the move and is now (faulted in
            # meanwhile) was written: its block is not untouched
            arrived = (status == _ENOENT) & present
            untouched &= layout.per_block(swapped | arrived | shm.data | shm.unknown) == 0
        return MoveResult(
            op, target, len(layout.addrs), int(done_page.sum()), errors, block_ok, block_unmovable,
            time.monotonic() - t0, page_size=self.page_size, block_untouched=untouched,
            block_done=layout.per_block(done_page), block_reason=reason,
        )

    def _iov(self, layout: PageLayout) -> np.ndarray:
        return native.iovecs(
            np.array([r[0] for r in layout.runs], dtype=np.uint64),
            np.array([r[2] * self.page_size for r in layout.runs], dtype=np.uint64),
        )

    @_locked
    def pageout(self, pid: int, starts: np.ndarray, lengths: np.ndarray | int) -> MoveResult:
        """Push the blocks to swap with process_madvise(MADV_PAGEOUT)."""
        layout = self._layout(starts, lengths)
        t0 = time.monotonic()
        if self.dry_run:
            self.record.append({"op": "pageout", "pid": pid, "pages": len(layout.addrs)})
            return MoveResult("pageout", "swap", len(layout.addrs), 0, dry_run=True, page_size=self.page_size)
        if not native.HAS_PROCESS_MADVISE:
            raise os_error(errno.ENOSYS, "process_madvise", "not supported by these kernel headers")
        self.check_mapped(pid, layout)
        locked = self._locked_pages(pid, layout)
        pidfd = native.pidfd_open(pid)
        try:
            if not locked.any():
                native.process_madvise(pidfd, self._iov(layout), native.MADV_PAGEOUT, f"pageout pid={pid}")
            elif not locked.all():
                native.process_madvise(pidfd, native.iovecs(*self._page_runs(layout.addrs[~locked])),
                                       native.MADV_PAGEOUT, f"pageout pid={pid}")
            stuck = self._stuck_pages(pid, layout)
            stuck = stuck[~locked[stuck]]
            if len(stuck):
                # Pages still in a CPU's LRU add batch are not on the LRU yet,
                # so MADV_PAGEOUT cannot isolate them and skips them, and
                # asking again skips them again: typically the last dozen
                # pages the owner wrote. move_pages drains every CPU's batch
                # (lru_cache_disable) before it migrates; moving the pages to
                # the node they are on changes nothing else, and the second
                # pageout then takes them (measured: 2-10 stuck pages in ~3% of
                # fresh 26 MiB pageouts, none after this).
                addrs = np.ascontiguousarray(layout.addrs[stuck])
                nodes = native.move_pages(pid, addrs, None)
                addrs, nodes = np.ascontiguousarray(addrs[nodes >= 0]), nodes[nodes >= 0]
                if len(addrs):
                    native.move_pages(pid, addrs, nodes)
                    native.process_madvise(pidfd, native.iovecs(*self._page_runs(addrs)),
                                           native.MADV_PAGEOUT, f"pageout retry pid={pid}")
        finally:
            os.close(pidfd)
        return self._swap_result("pageout", layout, pid, t0, locked)

    def _locked_pages(self, pid: int, layout: PageLayout) -> np.ndarray:
        """Per page: inside an mlock'ed mapping (one status read when the
        process locks nothing)."""
        locked = np.zeros(len(layout.addrs), dtype=bool)
        for lo, hi in read_locked_ranges(pid, self.proc_root):
            locked |= (layout.addrs >= np.uint64(lo)) & (layout.addrs < np.uint64(hi))
        return locked

    def _stuck_pages(self, pid: int, layout: PageLayout, pm: np.ndarray | None = None) -> np.ndarray:
        """Indices of the layout's pages still present and not in swap; the
        zero page (memory only ever read) is not stuck, there is nothing to
        page out."""
        pm = self._pagemap(pid, layout) if pm is None else pm
        stuck = np.flatnonzero(((pm & PM_PRESENT) != 0) & ((pm & PM_SWAP) == 0))
        if len(stuck):
            status = native.move_pages(pid, np.ascontiguousarray(layout.addrs[stuck]), None)
            stuck = stuck[status != _EFAULT]
        return stuck

    def _page_runs(self, addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, length) of each run of adjacent pages in sorted ``addrs``."""
        ps = np.uint64(self.page_size)
        breaks = np.flatnonzero(np.diff(addrs) != ps) + 1
        first = np.concatenate(([0], breaks))
        npages = np.diff(np.concatenate((first, [len(addrs)])))
        return addrs[first], npages.astype(np.uint64) * ps

    def _swap_result(self, op: str, layout: PageLayout, pid: int, t0: float, locked: np.ndarray) -> MoveResult:
        pm = self._pagemap(pid, layout)
        swapped = (pm & PM_SWAP) != 0
        present = (pm & PM_PRESENT) != 0
        # A present page after MADV_PAGEOUT was skipped: shared with another
        # process, pinned, or there is no swap space.
        # Locked pages were left out of the call: counted as LOCKED, not
        # twice over as NOT_PAGED_OUT too.
        stuck = np.zeros(len(pm), dtype=bool)
        stuck[self._stuck_pages(pid, layout, pm)] = True
        stuck &= ~locked
        # Shared memory in swap has no swap PTE: its object counts it.
        shm = shmem.shared_pages(pid, layout, present | swapped, self.proc_root, self.page_size)
        # Shared memory that MADV_PAGEOUT unmapped but could not write to
        # swap (no free swap slot) stays in the page cache: in memory, not
        # paged out, though no longer present here.
        left = shm.cached
        n_stuck = int(stuck.sum() + left.sum())
        errors = {"NOT_PAGED_OUT": n_stuck} if n_stuck else {}
        if locked.any():
            errors["LOCKED"] = int(locked.sum())
        block_ok = (layout.per_block(stuck | locked) == 0) & (left == 0)
        # Skipped pages are not proof of pinning: a page being read at that
        # moment, or still under writeback, is skipped too and pages out on a
        # later try. So a failed pageout is a retryable failure (the policy backs
        # off and marks a block unmovable only after repeated failures), never
        # "unmovable" at once: that froze hot blocks out of DRAM for good. Its
        # pages being this process's alone (not the shared-page skip) and not
        # locked is the evidence that names the reason when it comes to that.
        alone = stuck & ((pm & PM_EXCLUSIVE) != 0)
        block_locked = layout.per_block(locked) > 0
        reason = np.where(layout.per_block(alone) > 0, np.uint8(STUCK_PINNED), np.uint8(STUCK_NONE))
        reason[block_locked] = STUCK_LOCKED
        # Present pages that are not stuck (nor locked) are the zero page:
        # never written.
        untouched = layout.per_block(stuck | locked | swapped | shm.data | shm.unknown) == 0
        # A locked mapping is refused for certain, every time: unmovable now.
        return MoveResult(
            op, "swap", len(layout.addrs), int(swapped.sum() + shm.swapped.sum()), errors, block_ok,
            block_locked, time.monotonic() - t0, page_size=self.page_size, block_untouched=untouched,
            block_done=layout.per_block(swapped) + shm.swapped, block_reason=reason,
        )

    @_locked
    def pagein(self, pid: int, starts: np.ndarray, lengths: np.ndarray | int, node: int) -> MoveResult:
        """Bring swapped pages back and place the blocks on ``node``.

        MADV_WILLNEED starts asynchronous swap-in of the whole range; reading
        one byte of each swapped page through process_vm_readv then faults
        it in synchronously (wherever the kernel allocates), and move_pages
        finally puts every present page on ``node``. Swapped shared memory
        has no swap PTE: its pages are those of its object holding data
        that the process has not mapped (kernel/shmem.py); holes are not
        read, which would allocate them. (process_madvise does not take
        MADV_POPULATE_READ, 6.1 to 6.18: the read is the portable fault.)

        Afterwards pagemap says which of those pages are mapped again; the
        others are reported as NOT_PAGED_IN and their blocks as not ok.
        """
        layout, t0, dry = self._start_to_node("pagein", "pagein", pid, starts, lengths, node)
        if dry is not None:
            return dry
        pm = self._pagemap(pid, layout)
        present = (pm & PM_PRESENT) != 0
        private = (pm & PM_SWAP) != 0
        shm = shmem.shared_pages(pid, layout, present | private, self.proc_root, self.page_size)
        want = np.flatnonzero(private | shm.data)
        if len(want):
            if native.HAS_PROCESS_MADVISE:
                pidfd = native.pidfd_open(pid)
                try:
                    native.process_madvise(pidfd, self._iov(layout), native.MADV_WILLNEED, f"pagein pid={pid}")
                finally:
                    os.close(pidfd)
            native.touch_remote(pid, np.ascontiguousarray(layout.addrs[want]))
        status = self._move_all(pid, layout.addrs, node)
        res = self._result("pagein", f"node {node}", layout, status, node, t0, pid)
        if len(want):
            back = (self._pagemap(pid, layout)[want] & PM_PRESENT) != 0
            if not back.all():
                missing = np.zeros(len(layout.addrs), dtype=bool)
                missing[want[~back]] = True
                res.errors["NOT_PAGED_IN"] = int((~back).sum())
                res.block_ok &= layout.per_block(missing) == 0
        return res
