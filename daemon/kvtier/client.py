"""Python client for kvtierd: what an inference engine links against.

    from kvtier.client import Client
    with Client() as kv:
        region = kv.register(kv_cache_tensor_or_mmap, block_size=2 << 20, name="layer0",
                             tenant="team-a", constraints=["never_swap"])
        region.hint([3, 4, 9])          # batched: sent when the batch is full or old
        hs = region.hint_set([3, 4, 9]) # or: the blocks a step reads, declared once,
        hs.touch()                      #   counted per step, sent every hint_interval
        region.phase("prefill_done", [3, 4])
        tiers = region.query()          # numpy int8, one tier per block
        region.unregister()             # or leave the `with region:` block

Blocking I/O on one socket for calls, no background thread (an inference
engine's process should not grow threads behind its back). Hints never
block the engine: ``hint`` appends to a batch. By default registering a
region asks for the connection's shared-memory hint ring (op ``hint_ring``,
kvtier.hintring), and batches without counts are then one copy into memory
the daemon drains, no system call (but for the first batch after a pause
of the ring, which also writes an empty hint so the daemon drains it at
once; ``Client(hint_ring=False)`` turns the ring off; rejected hints
surface in ``flush()``). Otherwise, and for batches
with counts or that do not fit in a full ring, a full or old batch is sent
with non-blocking writes (what the socket cannot take now stays queued and
goes with the next batch), answers are read when they have arrived, and
errors surface later in ``async_errors`` / ``flush()``. If the daemon is so
far behind that more than ``hint_queue_max`` block hints queue up, the
oldest batches are dropped and counted in ``hints_dropped`` (hints are
advisory; blocking a decode step for them is worse). If the daemon
restarts, the next call reconnects (waiting up to ``reconnect_timeout``) and
retries; the daemon re-adopts registrations from its state file, so region
handles stay valid. If it does not come back within that time the call
raises DaemonUnavailable, and so does every later call at once (one connect
attempt, no wait) until a connection is made again: a daemon that is gone
costs the engine one wait, not one per call.
"""

from __future__ import annotations

import collections
import ctypes
import errno as _errno
import grp
import math
import mmap
import os
import socket
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

import msgspec
import numpy as np

from kvtier import hintring, protocol

ENV_SOCKET = "KVTIER_SOCKET"
# Unanswered pipelined requests before the client stops to read answers, so
# neither side's socket buffer fills up while the other waits.
MAX_IN_FLIGHT = 64
# A batch into the hint ring makes no system call, so nothing tells the
# client that the daemon went away (restarted): every this many batches
# (~3 s at one per hint_interval) one non-blocking read of the socket does
# (EOF), and the hints the old ring still held go on the socket after the
# reconnect, so none is lost.
RING_CHECK_BATCHES = 16
MAX_CLOCK_STRIDE = 16  # hint calls between clock reads, at most (Region.hint): bounds how late a batch
# goes out when the engine suddenly hints far less often
# HintSet.touch counts down to its next look at the clock. At each flush
# the pace of the touches since the last one predicts how many fit before
# the next: the looks until then are at most 1/LOOK_SHARE of hint_interval
# apart at that pace, and never more than MAX_TOUCHES_PER_LOOK touches, so
# a pace that drops (or a pause) makes a flush late by at most that many
# touches at the new pace. At the guest workload's pace (1.6 ms a pass)
# that is about LOOK_SHARE + 1 clock reads per interval, where a stride of
# 1-16 touches (as Region.hint's) read it 16 times (a clock read is a
# system call in the TCG guest, whose clocksource is HPET).
LOOK_SHARE = 4
# ... and the countdown stays within the ints CPython keeps as shared
# objects (-5..256), so a touch allocates nothing. An increment of a larger
# int makes a new object: in the guest, between passes of a process
# touching 32 MiB, such a touch took 41 us (p50) against 32 us counting
# down and 19 us for an empty call.
MAX_TOUCHES_PER_LOOK = 32
_RING_BAD = (hintring.BAD_REGION, hintring.BAD_BLOCK, hintring.BAD_HEAD)
_BLOCKS_DTYPE = np.dtype(protocol.BLOCKS_DTYPE)  # numpy's built-in dtypes are singletons: ``is`` compares
_clock = time.monotonic  # the hint set's clock (a name to replace in tests)


class KvtierClientError(Exception):
    """The daemon refused a request: ``code`` (see docs/protocol.md), ``errno``."""

    def __init__(self, op: str, code: str, message: str, errno: int = 0, retry_after_ms: int = 0):
        super().__init__(f"{op}: {code}: {message}")
        self.message = message
        self.op = op
        self.code = code
        self.errno = errno
        self.retry_after_ms = retry_after_ms


class DaemonUnavailable(KvtierClientError, ConnectionError):
    """No connection to kvtierd: not running, no permission on its socket..."""

    def __init__(self, path: str, why: str, errno: int = 0):
        KvtierClientError.__init__(self, "connect", "unavailable", f"kvtierd at {path}: {why}", errno)
        self.path = path


def access_hint(path: str) -> str:
    """What to do about EACCES on the socket: the group that may connect.
    The socket is mode 0660 in a directory kvtierd's unit makes group
    accessible; if a directory on the way is closed to us, name its group."""
    p = os.path.abspath(path)
    while True:
        try:
            st = os.stat(p)  # fails until p is the closed directory (or the socket)
            break
        except OSError:
            if p == os.path.dirname(p):
                return ""
            p = os.path.dirname(p)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return (f"; join group {group!r} (group of {p}, mode {st.st_mode & 0o777:03o}; "
            f"then log in again) or run as root")


def buffer_address(obj: Any) -> tuple[int, int]:
    """(address, length) of a C-contiguous object exposing the buffer protocol
    (mmap, numpy array, bytearray, torch CPU tensor via numpy()). Holds no
    buffer export afterwards, so the caller can still close or resize obj."""
    mv = memoryview(obj)
    try:
        if not mv.c_contiguous:
            raise ValueError("buffer must be C-contiguous")
        n = mv.nbytes
        if mv.readonly:
            # ctypes cannot take a read-only buffer; numpy reads its address.
            arr = np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, dtype=np.uint8)
            addr = int(arr.ctypes.data)
            del arr
        else:
            c = (ctypes.c_char * n).from_buffer(mv)
            addr = ctypes.addressof(c)
            del c
        return addr, n
    finally:
        mv.release()


HUGE_PAGE = 2 << 20  # x86-64 PMD size: THP can back a 2 MiB-aligned pool

_libc = None


def _madvise(addr: int, length: int, advice: int) -> int:
    """madvise(2) on this process's memory; 0 or the errno."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return 0 if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0 else ctypes.get_errno()


def block_runs(blocks: Iterable[int] | np.ndarray) -> np.ndarray:
    """Sorted distinct block indices as [first, stop) runs of consecutive blocks, shape (n, 2)."""
    b = np.unique(np.asarray(blocks, dtype=np.int64).ravel())
    if b.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    cut = np.flatnonzero(np.diff(b) != 1) + 1
    first = b[np.concatenate(([0], cut))]
    last = b[np.concatenate((cut - 1, [b.size - 1]))]
    return np.stack([first, last + 1], axis=1)


def drop_blocks(start: int, block_size: int, blocks: Iterable[int] | np.ndarray) -> int:
    """Free the memory of these blocks of this process's pool at [start, ...):
    their contents are dead, and the next write to them faults in fresh
    zeroed pages wherever the kernel's first touch places them. Returns the
    bytes dropped (whole pages inside the blocks).

    Only the owner can do this: process_madvise(2) accepts neither
    MADV_DONTNEED nor MADV_REMOVE, so the daemon can only move dead data.
    Shared memory (shmem, memfd, /dev/shm: what ``mmap.mmap(-1, n)`` makes)
    needs MADV_REMOVE, which frees its pages and swap slots; DONTNEED only
    unmaps them from this process. Private memory takes MADV_DONTNEED
    (MADV_REMOVE refuses it with EINVAL, no backing file). Swapped-out pages
    are freed without being read back. Raises OSError (nothing is dropped
    of the run that failed) for memory the kernel will not drop: mlock'ed
    (EINVAL) or not mapped (ENOMEM)."""
    runs = block_runs(blocks)
    page = mmap.PAGESIZE
    done = 0
    for first, stop in runs.tolist():
        lo = -(-(start + first * block_size) // page) * page
        hi = (start + stop * block_size) // page * page
        if hi <= lo:
            continue
        err = _madvise(lo, hi - lo, mmap.MADV_REMOVE)
        if err in (_errno.EINVAL, _errno.EACCES, _errno.EOPNOTSUPP):
            err = _madvise(lo, hi - lo, mmap.MADV_DONTNEED)
        if err:
            raise OSError(err, f"dropping blocks {first}..{stop - 1} (0x{lo:x}+{hi - lo}): {os.strerror(err)}")
        done += hi - lo
    return done


class PoolMemory:
    """Anonymous memory mapped for ``Client.allocate``: page aligned, 2 MiB
    aligned from 2 MiB up (the mapping is made that much larger and the
    unused head and tail are never touched, so they cost address space, not
    memory). ``buffer`` is a writable memoryview of exactly ``length`` bytes."""

    def __init__(self, length: int):
        align = HUGE_PAGE if length >= HUGE_PAGE else mmap.PAGESIZE
        # Private, not Python's default MAP_SHARED: shared anonymous memory
        # swaps through shmem, where pagemap cannot tell swapped from never
        # touched, and THP serves it only if shmem_enabled allows.
        self._map = mmap.mmap(-1, length + (align if align > mmap.PAGESIZE else 0),
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base, _ = buffer_address(self._map)
        self.offset = (-base) % align
        self.addr = base + self.offset
        self.length = length
        self.buffer = memoryview(self._map)[self.offset : self.offset + length]

    def bind(self, node: int, strict: bool) -> None:
        """mbind before the first touch: MPOL_BIND for a pool that will be
        pinned (it must be where the daemon counted it), MPOL_PREFERRED
        otherwise (the daemon moves it later anyway; a full node then falls
        back instead of failing the fault)."""
        from kvtier.kernel import native  # the cffi extension; register() does not need it

        native.mbind(self.addr, self.length, native.MPOL_BIND if strict else native.MPOL_PREFERRED, [node])

    def populate(self) -> None:
        """Fault every page in now (one strided write), so the pool sits on
        its node before the engine pins or reads it."""
        np.frombuffer(self.buffer, dtype=np.uint8)[:: mmap.PAGESIZE] = 0

    def request(self, block_size: int, tier: str | int, pinned: bool, **fields: Any) -> protocol.Allocate:
        return protocol.Allocate(start=self.addr, length=self.length, block_size=block_size, tier=str(tier),
                                 pinned=pinned, **{k: (list(v) if k == "constraints" else v)
                                                   for k, v in fields.items()})

    def place(self, node: int, pinned: bool, populate: bool) -> None:
        self.bind(node, strict=pinned)
        if populate:
            self.populate()

    def numpy(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray:
        arr = np.frombuffer(self.buffer, dtype=dtype)
        return arr if shape is None else arr.reshape(shape)


def _next_stride(stride: int, span: float, interval: float) -> int:
    """Calls between clock reads, from the time ``span`` the last ``stride``
    calls took: doubled (up to MAX_CLOCK_STRIDE) while they come fast
    against ``interval``, back to 1 at once when slow (the next batch must
    not wait for 16 slow calls)."""
    if span < interval / 16 and stride < MAX_CLOCK_STRIDE:
        return stride * 2
    if span > interval / 4:
        return 1
    return stride


def _prefetch_selection(blocks: Iterable[int] | np.ndarray | None) -> slice | np.ndarray:
    """The blocks a prefetch named, as the daemon counts them (a block named
    twice counts twice in ``already`` / ``queued``)."""
    return slice(None) if blocks is None else np.asarray(blocks, dtype=np.int64).ravel()


class Region:
    """A registered region; a context manager that unregisters on exit."""

    def __init__(self, client: "Client", info: dict, start: int, length: int, keepalive: Any = None):
        self.client = client
        self.id: int = info["region"]
        self.nblocks: int = info["blocks"]
        self.block_size: int = info["block_size"]
        self.start = start
        self.length = length
        self._keepalive = keepalive  # the buffer must outlive the registration
        # Pending hints as bytes, one item per hint call (counts beside them
        # only once some hint of the batch had counts). The engine's call
        # then costs one tobytes() copy and a list append: the least code a
        # safe copy can run, which is what counts when the call comes
        # between decode steps with cold caches (scripts/bench/hint_cost.py).
        # Bytes are not tracked by the garbage collector.
        self._parts: list[bytes] = []
        self._cparts: list[bytes | None] | None = None  # None: one access each
        self._pending_b = 0  # bytes of block ids in _parts (4 per hint)
        self._batch_b = 4 * client.hint_batch  # _pending_b that sends at once (re-read in _check)
        self._first_pending = 0.0
        # The clock is read every ``_stride`` calls, not every call: in a VM
        # whose clocksource is not the TSC (HPET under QEMU TCG), a
        # time.monotonic() is a system call costing as much as the rest of
        # the hint. The stride doubles while that many calls span under
        # 1/16 of hint_interval and halves when they span over 1/4 of it, so a
        # batch is late by at most about a quarter interval at a steady rate.
        self._stride = 1
        self._until_clock = 0  # calls left before the next clock read
        self._clock_at = 0.0  # when the clock was last read
        self._sent_at = -math.inf  # when the last batch left (about: the clock read before it)
        self._first_pending = 0.0
        self.closed = False
        # The region's open hint sets (HintSet): flushed with its hints,
        # closed with it. Weak: a set the engine drops without closing it
        # takes at most its last interval's counts with it, not memory.
        self._hint_sets: weakref.WeakSet[HintSet] = weakref.WeakSet()
        self._ring_word = hintring.region_word(self.id)  # names this region in the hint ring
        self.memory: PoolMemory | None = None  # set by Client.allocate
        self.placement: dict = {k: info[k] for k in ("tier", "tier_name", "node", "reason", "pinned") if k in info}

    @property
    def buffer(self) -> memoryview:
        """The pool of an allocated region (``torch.frombuffer(region.buffer, dtype=...)``)."""
        if self.memory is None:
            raise ValueError("only regions made by Client.allocate own their memory")
        return self.memory.buffer

    def numpy(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray:
        if self.memory is None:
            raise ValueError("only regions made by Client.allocate own their memory")
        return self.memory.numpy(dtype, shape)

    def __repr__(self) -> str:
        return f"<kvtier Region {self.id} 0x{self.start:x}+{self.length} blocks={self.nblocks}>"

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc) -> None:
        self.unregister()

    def hint(self, blocks: Iterable[int] | np.ndarray, counts: Iterable[int] | np.ndarray | None = None) -> None:
        """Record accesses to blocks; sent once ``hint_batch`` block hints are
        pending or the oldest is ``hint_interval`` seconds old. The blocks are
        copied at once (the caller may reuse its array); a 1-D array of
        ``protocol.BLOCKS_DTYPE`` (uint32) is the cheapest to pass."""
        if counts is None and type(blocks) is np.ndarray and blocks.dtype is _BLOCKS_DTYPE \
                and self._cparts is None:
            # The engine's own call, between decode steps: a copy (C order,
            # any shape: what ravel() gives), its length, one countdown.
            # Everything else (the batch's size and age, the clock) is
            # looked at every _stride calls, in _check.
            b = blocks.tobytes()
            self._parts.append(b)
            self._pending_b += len(b)
            self._until_clock -= 1
            if self._until_clock <= 0 or self._pending_b >= self._batch_b:
                self._check(len(b))
            return
        self._hint_any(blocks, counts)

    def _block_ids(self, blocks: Any) -> np.ndarray:
        """``blocks`` as int64 indices, ValueError unless each is an integer
        in 0..nblocks-1 of this (still registered) region."""
        if self.closed:
            raise ValueError(f"region {self.id} is unregistered")
        a = np.asarray(blocks)
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"block indices must be integers, got {a.dtype} for region {self.id}")
        arr = a.astype(np.int64, copy=False).ravel()
        if arr.size and (arr.min() < 0 or arr.max() >= self.nblocks):
            raise ValueError(f"block index out of range 0..{self.nblocks - 1} for region {self.id}")
        return arr

    def _hint_any(self, blocks: Any, counts: Any) -> None:
        """``hint`` for ids of any type and for counts (checked: a wrong id
        is an error here, not a count in the daemon's answer later)."""
        if type(blocks) is np.ndarray and blocks.dtype is _BLOCKS_DTYPE and not self.closed:
            b = blocks.ravel()  # uint32: an index past the region is the daemon's to count
        else:
            b = self._block_ids(blocks).astype(_BLOCKS_DTYPE)
        k = b.size
        if not k:
            return
        if counts is not None:
            c = np.asarray(counts, dtype=protocol.COUNTS_DTYPE).ravel()
            if c.size != k:
                raise ValueError(f"{c.size} counts for {k} blocks")
            if self._cparts is None:
                self._cparts = [None] * len(self._parts)
            self._cparts.append(c.tobytes())
        elif self._cparts is not None:
            self._cparts.append(None)
        self._parts.append(b.tobytes())
        self._pending_b += 4 * k
        self._until_clock -= 1
        if self._until_clock <= 0 or self._pending_b >= self._batch_b:
            self._check(4 * k)

    @property
    def _pending(self) -> int:
        """Block hints waiting to be sent."""
        return self._pending_b >> 2

    def _check(self, last: int) -> None:
        """Every _stride calls, and when the batch is full: send a full
        batch, or read the clock (``last``: bytes the call just added)."""
        cl = self.client
        self._batch_b = 4 * cl.hint_batch
        if self._pending_b >= self._batch_b:
            self._flush_hints()
            return
        self._clock(self._pending_b - last, cl.hint_interval)

    def _clock(self, n: int, interval: float) -> None:
        """The clock read of ``hint``: start the batch's age, adapt the stride,
        send a batch that is ``interval`` old."""
        now = time.monotonic()
        if not n:
            self._first_pending = now
            if now - self._sent_at >= interval:
                # The first hint after an interval without any: nothing to
                # batch it with, and it is the one a promotion waits for
                # (a new request's blocks, a resumed session): it goes now.
                self._clock_at = now
                self._until_clock = self._stride
                self._flush_hints()
                return
        else:
            self._stride = _next_stride(self._stride, now - self._clock_at, interval)
        self._clock_at = now
        self._until_clock = self._stride
        if now - self._first_pending >= interval:
            self._flush_hints()

    def _drop_pending(self) -> None:
        self._sent_at = self._clock_at  # (the last clock read: close enough for "idle since")
        self._parts, self._cparts, self._pending_b = [], None, 0
        self._until_clock = 0  # the next hint reads the clock: its batch's age starts there

    def _take(self) -> tuple[bytes, bytes | None]:
        """The pending hints as packed blocks and counts (None: all 1)."""
        parts, cparts = self._parts, self._cparts
        self._drop_pending()
        b = parts[0] if len(parts) == 1 else b"".join(parts)
        if cparts is None:
            return b, None
        ones = lambda nbytes: np.ones(nbytes // 4, dtype=protocol.COUNTS_DTYPE).tobytes()  # noqa: E731
        return b, b"".join(ones(len(p)) if cp is None else cp for p, cp in zip(parts, cparts))

    def flush(self) -> None:
        """Send the pending hints and the counts of the region's hint sets
        now (without waiting for the daemon)."""
        self._flush_hints()
        for hs in list(self._hint_sets):
            hs.flush()

    def _flush_hints(self) -> None:
        if self._pending:
            self._send(*self._take())

    def _send(self, b: bytes, c: bytes | None) -> None:
        """Packed block indices (and counts, None: 1 each) to the daemon: into
        the connection's hint ring if it has one and room, else (and for
        hints with counts) on the socket."""
        if c is None and self.client._ring_put(self._ring_word, b):
            return
        # Stay under the daemon's frame limit: 8 bytes per entry (index +
        # count) plus a little for the map around them. Packed bytes are
        # cut as they are: 4 bytes per entry in both.
        limit = self.client.server.get("max_message_bytes", protocol.DEFAULT_MAX_MESSAGE)
        step = 4 * max(1, (limit - 256) // 8)
        for i in range(0, len(b), step):
            cb = b[i : i + step]
            cc = None if c is None else c[i : i + step]
            if cc is not None and bool((np.frombuffer(cc, dtype=protocol.COUNTS_DTYPE) == 1).all()):
                cc = None  # absent = 1 each
            self.client._send_hint(protocol.Hint(region=self.id, blocks=cb, counts=cc), len(cb) // 4)

    def phase(self, phase: str, blocks: Iterable[int] | np.ndarray | None = None) -> int:
        """"prefill_done" (blocks now read-only: demotion candidates), "active"
        (undo), "free" (no request reads them now; contents kept for a prefix
        cache) or "discard" (contents dead: see ``discard``, which also drops
        the pages)."""
        self.flush()
        packed = None if blocks is None else protocol.pack_blocks(np.asarray(blocks).ravel())
        return self.client.call(protocol.Phase(region=self.id, phase=phase, blocks=packed))["blocks"]

    def discard(self, blocks: Iterable[int] | np.ndarray, drop: bool = True) -> int:
        """These blocks' contents are dead (a finished request's blocks back on
        a free list with no prefix cache behind it, or a cached block the
        engine evicts to reuse the slot). With ``drop`` (the default) their
        pages are freed first (``drop_blocks``: no swap-in, no migration of
        data nobody will read), then the daemon is told (phase "discard"):
        it moves nothing for them, and the slot's next write is a new block,
        placed by the kernel's first touch and measured from there. Without
        ``drop`` the pages stay and the daemon will find them and treat them
        as data (it cannot free another process's memory). Returns the
        blocks the daemon changed."""
        arr = self._block_ids(blocks)
        if drop and self.placement.get("pinned"):
            # A pinned pool (cudaHostRegister, RDMA) must keep its pages: a
            # device keeps reading the frames the pin holds, whatever the
            # process's page tables say.
            raise ValueError(f"region {self.id} is pinned: its pages cannot be dropped; discard(blocks, drop=False)")
        if drop:
            drop_blocks(self.start, self.block_size, arr)
        return self.phase("discard", arr)

    def prefetch(self, blocks: Iterable[int] | np.ndarray | None = None, *, wait: bool = False,
                 timeout: float = 30.0) -> dict:
        """These blocks are about to be read: the daemon brings them to tier 0
        in its next event-loop turn (within its migration rate limits).
        Returns ``queued`` / ``already`` (in tier 0) / ``skipped`` (cannot
        move: unmeasured, untouched or pinned). ``wait=True`` returns once
        the daemon reports the queued ones in tier 0 (as many of the named
        blocks there as ``already`` + ``queued``), with ``seconds`` waited:
        ``skipped`` blocks never move and ``deferred`` ones (no room in DRAM
        now, docs/protocol.md) go up with a later plan, so neither is waited
        for. A daemon that runs dry (``dry_run`` in the answer) moves
        nothing: that answer comes back at once, not waited on."""
        self.flush()
        packed = None if blocks is None else protocol.pack_blocks(np.asarray(blocks).ravel())
        t0 = time.monotonic()
        r = self.client.call(protocol.Prefetch(region=self.id, blocks=packed))
        if wait and r["queued"] and not r.get("dry_run"):
            sel = _prefetch_selection(blocks)
            while np.count_nonzero(self.query()[sel] == 0) < r["already"] + r["queued"]:
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"region {self.id}: {r['queued']} prefetched blocks not in tier 0 after {timeout}s")
                time.sleep(0.001)
            r["seconds"] = time.monotonic() - t0
        return r

    def release(self, blocks: Iterable[int] | np.ndarray | None = None) -> dict:
        """The session is paused: these blocks may go one tier down now
        (never below a constraint), blocks written since the daemon last
        measured them included. Same answer as ``prefetch``."""
        self.flush()
        packed = None if blocks is None else protocol.pack_blocks(np.asarray(blocks).ravel())
        return self.client.call(protocol.Release(region=self.id, blocks=packed))

    def query(self, first: int = 0, count: int | None = None) -> np.ndarray:
        """Tier index per block (0 = DRAM; -1 unknown/not yet touched)."""
        # The daemon answers in pages (each within its frame limit); ``next``
        # is where the following page starts.
        parts = []
        stop = None if count is None else first + count
        while True:
            r = self.client.call(protocol.Query(region=self.id, first=first,
                                         count=None if stop is None else stop - first))
            parts.append(np.frombuffer(r["tiers"], dtype=protocol.TIERS_DTYPE))
            if r.get("next") is None:
                break
            first = r["next"]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def hint_set(self, blocks: Iterable[int] | np.ndarray = ()) -> "HintSet":
        """The blocks one step of the engine reads, declared once: then
        ``touch()`` per step instead of ``hint(blocks)`` (see HintSet).
        No round trip: the connection's hint ring was asked for when the
        region was registered."""
        hs = HintSet(self, blocks)
        self._hint_sets.add(hs)
        return hs

    def _close_hint_sets(self) -> None:
        """The region is going: its sets' counts would name nothing."""
        for hs in list(self._hint_sets):
            hs._detach()

    def unregister(self) -> None:
        if self.closed:
            return
        self._drop_pending()
        self._close_hint_sets()
        self.client.call(protocol.Unregister(region=self.id))
        self._forget()

    def _forget(self) -> None:
        """The daemon no longer has the region: this side drops it too."""
        self.closed = True
        self._cparts = []  # hint()'s fast path tests this: it now takes the path that says "unregistered"
        self._keepalive = None
        self.client._regions.pop(self.id, None)


class HintSet:
    """The blocks an engine's step reads, declared once; ``touch()`` per step.

        hs = region.hint_set(block_table_of_this_sequence)
        for step in decode:
            hs.touch()                    # every block of the set read once
            if grew:
                hs.extend([new_block])    # read from this step on
        hs.close()                        # or ``with region.hint_set(...) as hs:``

    The daemon sees what ``region.hint(blocks)`` once per step would have
    told it (the same entries, so the same temperatures and hint counters),
    at a cost per step of one attribute decrement and a comparison with 0:
    ``touch()`` counts down (in ints CPython keeps cached: no allocation)
    to its next look at the clock. Once ``hint_interval`` has passed since
    the last flush, the look sends the counts and plans the looks to the
    next one from the pace since: a quarter of the interval apart
    (LOOK_SHARE) and at most 32 touches (MAX_TOUCHES_PER_LOOK), the last
    just past the flush's time; the looks between two flushes only read
    the clock and compare. About five clock reads an interval at a pace of
    1.6 ms a step. The first
    touch of a set is sent at once; after a pause, or when the steps slow
    down, the counts leave at the next look, at most 32 touches later (the
    first touches after a pause are the ones a promotion waits for).

    A flush sends each block as often as it was read, through the hint ring
    where the connection has one (no system call), else on the socket;
    past ``hint_batch`` entries in one flush, as one entry per block with
    its count instead (the same temperatures; the daemon's hint counters
    then count entries, fewer). Errors come later, as for any hint
    (``Client.flush()``, ``async_errors``).

    ``extend`` (a sequence grew) and ``replace`` (a different set) are cheap
    (one numpy add over the set, amortised growth): touches before the
    change count for the blocks the set held then, touches after it for
    the new ones. ``Region.flush``, ``Client.flush`` and ``Client.close``
    flush every open set; ``close()`` flushes and retires this one;
    unregistering the region retires its sets without sending (their
    region is gone). A touch of a retired set raises ValueError, at the
    latest at its next look at the clock."""

    def __init__(self, region: Region, blocks: Iterable[int] | np.ndarray = ()):
        self.region = region
        # touch() counts down _left from _run, then looks at the clock;
        # touches before that run: _base (so touches = _base + _run - _left)
        self._base = 0
        self._run = self._left = 1  # the first touch looks
        self._looked_at = _clock()  # when the clock was last read in full ...
        self._looked_touches = 0  # ... and the touches then: the pace
        self._due_at = -math.inf  # when the next flush is due (the first touch: at once)
        self._stride = 1  # touches between two looks at the clock
        self._since = 0  # touches when the current blocks were last counted (flush or change)
        self._ids = np.zeros(0, dtype=_BLOCKS_DTYPE)  # the set, in its first _len entries
        self._acc = np.zeros(0, dtype=protocol.COUNTS_DTYPE)  # reads counted at changes, per entry
        self._folded = False  # _acc has something not sent yet
        self._len = 0
        self._packed: bytes | None = None  # the set's ids packed (None: to pack again, it changed)
        # every index of the set is below the ring's region bit: no need to look at each flush
        self._below_region_bit = region.nblocks <= hintring.REGION_BIT
        self._retired: list[tuple[np.ndarray, np.ndarray]] = []  # replaced sets' (blocks, counts) not sent
        self.closed = False
        self.extend(blocks)

    def touch(self) -> None:
        """One step read every block of the set."""
        self._left -= 1
        if self._left <= 0:
            self._due()

    @property
    def touches(self) -> int:
        """touch() calls, in all."""
        return self._base + self._run - self._left

    def __len__(self) -> int:
        return self._len

    @property
    def blocks(self) -> np.ndarray:
        """The set now (a copy)."""
        return self._ids[: self._len].copy()

    @property
    def pending(self) -> int:
        """Block reads counted and not sent yet."""
        n = (self.touches - self._since) * self._len
        if self._folded:
            n += int(self._acc[: self._len].sum())
        return n + sum(int(c.sum()) for _, c in self._retired)

    def _valid(self, blocks: Iterable[int] | np.ndarray) -> np.ndarray:
        if self.closed:
            raise ValueError(f"hint set of region {self.region.id} is closed")
        b = np.asarray(blocks if isinstance(blocks, np.ndarray) else list(blocks), dtype=np.int64).ravel()
        if b.size and (int(b.min()) < 0 or int(b.max()) >= self.region.nblocks):
            raise ValueError(f"block index out of range 0..{self.region.nblocks - 1} for region {self.region.id}")
        return b

    def _fold(self) -> None:
        """Count the touches since the last count for the blocks held now."""
        n = self.touches - self._since
        if n and self._len:
            self._acc[: self._len] += np.uint32(n)
            self._folded = True
        self._since = self.touches

    def extend(self, blocks: Iterable[int] | np.ndarray) -> None:
        """Add blocks to the set; they count from the next touch."""
        b = self._valid(blocks)
        if not b.size:
            return
        self._fold()
        end = self._len + b.size
        if end > self._ids.size:
            cap = max(end, 2 * self._ids.size, 16)
            ids = np.zeros(cap, dtype=_BLOCKS_DTYPE)
            acc = np.zeros(cap, dtype=protocol.COUNTS_DTYPE)
            ids[: self._len], acc[: self._len] = self._ids[: self._len], self._acc[: self._len]
            self._ids, self._acc = ids, acc
        self._ids[self._len : end] = b
        self._acc[self._len : end] = 0
        self._len = end
        self._packed = None

    def replace(self, blocks: Iterable[int] | np.ndarray) -> None:
        """The set is now ``blocks``; touches so far stay with the old one."""
        b = self._valid(blocks)
        self._fold()
        if self._folded:
            counts = self._acc[: self._len].copy()
            keep = counts > 0
            self._retired.append((self._ids[: self._len][keep].copy(), counts[keep]))
        self._len, self._folded, self._packed = 0, False, None
        self.extend(b)

    def _due(self) -> None:
        """touch() counted down to 0: look at the clock, flush if due."""
        if self.closed:
            raise ValueError(f"hint set of region {self.region.id} is closed")
        touches = self._base = self._base + self._run - self._left
        now = _clock()
        if now < self._due_at:
            # A look between flushes: the clock and one comparison. (The
            # full look below, with cold caches in the TCG guest, took
            # 120 us to this one's ~10: vm_tiering_compare.py's touch_kinds.)
            self._run = self._left = self._stride
            return
        self._run = self._left = 0  # (touches stays right if a flush below raises)
        self._send(now)
        # The looks until the next flush: the touches the pace since the
        # last full look puts in an interval, and one more (so that at a
        # steady pace the last look lands just past the flush's time), in
        # LOOK_SHARE looks or more, at most MAX_TOUCHES_PER_LOOK touches
        # apart; the first takes what does not divide evenly. (A clock that
        # did not move: the most.)
        span = now - self._looked_at
        stride = first = MAX_TOUCHES_PER_LOOK
        if span > 0:
            total = math.ceil((touches - self._looked_touches) * self.region.client.hint_interval / span) + 1
            looks = max(LOOK_SHARE, math.ceil(total / MAX_TOUCHES_PER_LOOK))
            stride = math.ceil(total / looks)
            first = max(1, total - (looks - 1) * stride)
        self._looked_at, self._looked_touches = now, touches
        self._stride = stride
        self._run = self._left = first

    def _take(self) -> list[tuple[np.ndarray, np.ndarray | int]]:
        """What is counted and not sent: (blocks, counts per block, or one
        count for all), and counting starts again from zero. (The blocks
        may be a view of the set: to be packed before the set changes.)"""
        n = self.touches - self._since
        out: list[tuple[np.ndarray, np.ndarray | int]] = list(self._retired)
        self._retired = []
        ids = self._ids[: self._len]
        if self._folded:
            out.append((ids, self._acc[: self._len] + np.uint32(n)))
            self._acc[: self._len] = 0
            self._folded = False
        elif n and self._len:
            out.append((ids, n))
        self._since = self.touches
        return out

    def flush(self) -> None:
        """Send the counts now (without waiting for the daemon)."""
        self._send(_clock())

    def _send(self, now: float) -> None:
        self._due_at = now + self.region.client.hint_interval  # the next flush
        region = self.region
        n = self.touches - self._since
        if not (self._retired or self._folded) and n * self._len <= region.client.hint_batch:
            # The common flush, of a set unchanged since the last one: its
            # packed ids (packed once per change) n times over, straight
            # into the ring; every Python call counts here (in the TCG
            # guest ~25 us each: scripts/bench/hint_cost.py).
            self._since = self.touches
            if not n or not self._len:
                return
            if self._packed is None:
                self._packed = self._ids[: self._len].tobytes()
            packed = self._packed * n
            if not region.client._ring_put(region._ring_word, packed, self._below_region_bit):
                region._send(packed, None)
            return
        parts = self._take()
        if not parts:
            return
        total = sum(int(b.size) * c if isinstance(c, int) else int(c.sum()) for b, c in parts)
        if total <= region.client.hint_batch:
            # Each block as often as it was read: the entries a hint per
            # step would have made, in their order where the set did not
            # change (the packed set repeated: one copy, no numpy call).
            region._send(b"".join(b.tobytes() * c if isinstance(c, int) else np.repeat(b, c).tobytes()
                                  for b, c in parts), None)
            return
        blocks = np.concatenate([b for b, _ in parts])
        counts = np.concatenate([np.full(b.size, c, dtype=protocol.COUNTS_DTYPE) if isinstance(c, int)
                                 else c.astype(protocol.COUNTS_DTYPE) for b, c in parts])
        read = counts > 0  # a block added and not touched since: no entry (one would start its run)
        region._send(blocks[read].tobytes(), counts[read].tobytes())

    def _detach(self) -> None:
        self.closed = True
        self._base, self._run, self._left = self.touches, 0, 0  # the next touch raises
        self._retired, self._len, self._folded = [], 0, False
        self.region._hint_sets.discard(self)

    def close(self) -> None:
        """Send what is counted and retire the set."""
        if self.closed:
            return
        if not self.region.closed:
            self.flush()
        self._detach()

    def __enter__(self) -> "HintSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def register_range(obj: Any, length: int | None, addr: int | None) -> tuple[int, int, Any]:
    """(address, length, object to keep alive) of what ``register`` names."""
    keep = None
    if isinstance(obj, int):
        addr, obj = obj, None
    if obj is not None:
        addr, n = buffer_address(obj)
        length = n if length is None else length
        keep = obj
    if addr is None or length is None:
        raise ValueError("register needs a buffer, or an address and a length")
    return addr, length, keep


def next_page(op: str, fields: dict, answer: dict) -> dict | None:
    """The request fields for the page after ``answer`` of a paged op
    (``query``/``blocks`` continue at ``first``, ``regions`` at ``after``), or
    None if ``answer`` was the last. A ``count`` keeps meaning the range
    asked for first."""
    nxt = answer.get("next")
    if nxt is None:
        return None
    out = dict(fields)
    if op == "regions":
        out["after"] = nxt
    else:
        if out.get("count") is not None:
            out["count"] -= nxt - out.get("first", 0)
        out["first"] = nxt
    return out


def moved_mask(answer: Any, n: int) -> np.ndarray:
    """An on_move callback's answer (True, False or one bool per block) as a mask."""
    return np.broadcast_to(np.asarray(answer, dtype=bool), (n,)).copy()


class EngineRegion(Region):
    """A mode-"engine" region: the daemon plans, the engine moves.

    ``on_move(blocks, src, dst)`` is called (from ``Client.poll`` or at the
    end of any other call) when the daemon wants ``blocks`` (uint32 indices)
    moved from tier ``src`` to tier ``dst``: copy them between your pools,
    update your block table, and return True, False, or a bool per block.
    An exception counts as failure for every block. ``tiers`` is where this
    side believes each block is (sent again after a reconnect)."""

    def discard(self, blocks: Iterable[int] | np.ndarray, drop: bool = False) -> int:
        """As Region.discard, but the pools are the engine's: free the blocks
        there yourself; ``drop`` is refused (the daemon knows no address)."""
        if drop:
            raise ValueError("engine-mode region: free the blocks in your own pools, then discard(blocks)")
        return super().discard(blocks, drop=False)

    def __init__(self, client: "Client", info: dict, tiers: np.ndarray, on_move: Callable):
        super().__init__(client, info, 0, info["blocks"] * info["block_size"])
        self.tiers = tiers
        self.on_move = on_move
        self.moves_done = 0
        self.moves_failed = 0

    def _move(self, body: dict) -> tuple[np.ndarray, str]:
        blocks = np.frombuffer(body["blocks"], dtype=protocol.BLOCKS_DTYPE)
        src, dst = int(body["src"]), int(body["dst"])
        error = ""
        try:
            ok = moved_mask(self.on_move(blocks, src, dst), blocks.size)
        except Exception as e:  # the engine's failure is the daemon's news, not ours to raise
            ok, error = np.zeros(blocks.size, dtype=bool), f"{type(e).__name__}: {e}"
        return self._record(blocks, ok, dst), error

    def _record(self, blocks: np.ndarray, ok: np.ndarray, dst: int) -> np.ndarray:
        self.tiers[blocks[ok]] = dst
        self.moves_done += int(ok.sum())
        self.moves_failed += int((~ok).sum())
        return ok


class Client:
    """One connection to kvtierd. Not thread-safe: one Client per thread."""

    def __init__(
        self,
        path: str | None = None,
        *,
        timeout: float = 10.0,
        reconnect_timeout: float = 30.0,
        hint_batch: int = 65536,
        # Hints only need to arrive before the next 1 s tick: five messages a
        # second per region cost the daemon a quarter of twenty.
        hint_interval: float = 0.2,
        hint_queue_max: int = 1 << 22,
        hint_ring: bool = True,
        hint_ring_entries: int = 0,
        name: str = "",
        connect: bool = True,
    ):
        self.path = path or os.environ.get(ENV_SOCKET) or protocol.DEFAULT_SOCKET
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.hint_batch = hint_batch
        self.hint_interval = hint_interval
        self.hint_queue_max = hint_queue_max
        self.hints_dropped = 0  # block hints dropped because the daemon fell that far behind
        # Encoded hint frames not yet written (the socket was full): (frame,
        # request id, block hints in it, op).
        self._hint_queue: collections.deque[tuple[bytes, int, int, str]] = collections.deque()
        self._hint_queued = 0
        self._wpartial = b""  # the unsent tail of a frame a non-blocking write cut short
        self.name = name or f"python pid {os.getpid()}"
        self.sock: socket.socket | None = None
        self.server: dict = {}
        self._next_id = 1
        self._in_flight: dict[int, str] = {}  # pipelined request id -> op
        # The hello of a connection a hint made (_connect_nowait), not
        # answered yet: its request id (0: none). Its answer is collected
        # with the others and completes the connection (_greeted).
        self._greeting = 0
        self._rbuf = bytearray()
        self._regions: dict[int, Region] = {}
        self._events: list[protocol.Response] = []  # unasked frames (engine-mode moves) not served yet
        self._engine = 0  # engine-mode regions registered here: poll() must read even with nothing in flight
        self.async_errors: list[KvtierClientError] = []  # answers to pipelined hints
        self.reconnects = 0
        self.connected_once = False  # reconnect_timeout applies only after a connection existed
        # A wait of reconnect_timeout ran out and no connection was made
        # since: the daemon is not restarting, it is gone, and every call
        # waiting that long again would stall the engine that long per call.
        self.unreachable = False
        # The shared-memory hint ring (kvtier.hintring), asked for once per
        # connection if ``hint_ring`` and the daemon has the op: when a
        # region is registered (or a connection made with regions held), so
        # the round trip is paid there and never in the hint path (in the
        # TCG guest it was a third of the hint calls' time: docs/benchmarks.md,
        # "Hint sets"); a connection whose ask failed hints on the socket.
        # Hints without counts go there, the rest (and those that do not
        # fit in a full ring) on the socket. ``hint_ring_entries``: the
        # size asked for (0: the daemon's limits.hint_ring_entries).
        self.use_ring = hint_ring
        self.hint_ring_entries = hint_ring_entries
        self.ring: hintring.ClientRing | None = None
        self._ring_wanted = False  # to be asked for on this connection (at the next register)
        self.ring_error: KvtierClientError | None = None  # why the last ask failed
        self._ring_synced = 0  # ring head the daemon's counters were last read at
        self._ring_counts: dict = {}  # those counters
        self._ring_countdown = RING_CHECK_BATCHES  # ring batches before the next look at the socket
        self._ring_put_at = -math.inf  # when the last batch went into the ring
        if connect:
            self.connect()

    # -- connection ------------------------------------------------------

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
        except OSError as e:
            s.close()
            why = os.strerror(e.errno) if e.errno else str(e)
            if e.errno in (_errno.EACCES, _errno.EPERM):
                why += access_hint(self.path)
            elif e.errno in (_errno.ENOENT, _errno.ECONNREFUSED):
                why += "; is kvtierd running? (systemctl status kvtierd)"
            raise DaemonUnavailable(self.path, why, e.errno or 0) from None
        self._new_connection(s)
        try:
            server = self._call_once(protocol.Hello(client=self.name))
        except socket.timeout:
            # A listening socket nobody serves: kvtierd.socket while the
            # service is stopped or restarting takes connections at once.
            self.close_socket(salvage=True)
            raise DaemonUnavailable(self.path, f"connected, but it did not answer in time ({self.timeout} s): "
                                    "kvtierd is starting, or stopped while its socket unit holds the socket") from None
        # A new connection executes the engine regions' moves from now on
        # (the daemon dropped the moves pending on the old one).
        for req in self._attaches():
            self._call_once(req)
        self._greeted(server)
        self._ready_ring()

    def _attaches(self) -> list[protocol.Attach]:
        """The ``attach`` of every engine region held, for a new connection."""
        return [protocol.Attach(region=r.id, tiers=r.tiers.astype(protocol.TIERS_DTYPE).tobytes())
                for r in list(self._regions.values()) if isinstance(r, EngineRegion) and not r.closed]

    def _new_connection(self, s: socket.socket) -> None:
        self.sock = s
        self.connected_once = True
        self._rbuf.clear()
        self._in_flight.clear()
        self._wpartial = b""
        self._greeting = 0
        self.server = {}
        self._close_ring()

    def _greeted(self, server: dict) -> None:
        """hello answered: the daemon serves this connection."""
        self.server = server
        self.unreachable = False
        # asked for once a region is held (now, on a reconnect: by connect or the next call)
        self._ring_wanted = self.use_ring and "hint_ring" in server.get("capabilities", ())

    def _connect_nowait(self) -> bool:
        """The hint path's one connection attempt: connect, write hello (and
        the engine regions' attach) and return without reading an answer.
        A unix connect completes at once or fails at once; what answers it
        may not run yet (kvtierd.socket holds the socket while the service
        restarts), and hints never wait. The queued hints follow hello on
        the socket (the daemon answers frames in order); hello's answer is
        collected with theirs (_collect) and completes the connection. The
        ring is asked for by the next call that waits anyway."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            s.connect(self.path)
        except OSError:  # absent, refused, or a full backlog (EAGAIN): the hints stay queued
            s.close()
            return False
        s.settimeout(self.timeout)
        self._new_connection(s)
        frames = [protocol.Hello(client=self.name), *self._attaches()]
        data = b""
        for req in frames:
            req.id = self._next_id
            self._next_id += 1
            self._in_flight[req.id] = req.__struct_config__.tag
            data += protocol.encode_request(req)
        self._greeting = frames[0].id
        self._wpartial = data  # written first by _push_hints, before any queued hint
        self.reconnects += 1
        return True

    def _reconnect(self) -> None:
        """Connect again, retrying for up to ``reconnect_timeout`` (a daemon
        restarting). Once such a wait ran out, later calls try once and fail
        at once (DaemonUnavailable) until a connection is made again (by a
        call or a hint's attempt): the engine waits once per outage, not
        once per call."""
        self.close_socket(salvage=True)
        deadline = time.monotonic() + (0.0 if self.unreachable else self.reconnect_timeout)
        delay = 0.01
        while True:
            try:
                self.connect()
                self.reconnects += 1
                return
            except (DaemonUnavailable, ConnectionError):
                if time.monotonic() >= deadline:
                    self.unreachable = True
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def close_socket(self, salvage: bool = False) -> None:
        """``salvage``: the connection was lost, so nobody will drain the
        ring: queue what it holds as hint frames for the next connection."""
        self._close_ring(salvage)
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    # -- the shared-memory hint ring ---------------------------------------

    def _close_ring(self, salvage: bool = False) -> None:
        if self.ring is not None:
            if salvage:
                self._requeue(self.ring.unconsumed_entries())
            self.ring.close()
            self.ring = None
        self._ring_wanted = False
        self._ring_synced, self._ring_counts = 0, {}

    def _open_ring(self) -> hintring.ClientRing | None:
        """Ask for this connection's ring (once per connection): None, with
        ``ring_error`` set, if the daemon refuses or the fd does not come."""
        self._ring_wanted = False
        fds: list[int] = []
        try:
            self._drain()  # nothing unread before the answer that carries the fd
            if self.sock is None:
                return None
            rid = self._send(protocol.HintRing(entries=self.hint_ring_entries))
            while True:
                resp = self._recv_one(fds)
                if resp.id == rid and resp.event is None:
                    break
                self._collect(resp)
            if not resp.ok:
                e = resp.error
                raise KvtierClientError("hint_ring", e.code, e.message, e.errno)
            if not fds:
                raise KvtierClientError("hint_ring", protocol.E_UNAVAILABLE, "the answer carried no fd")
            self.ring = hintring.ClientRing(fds.pop(0))
            self._ring_synced = self.ring.written
            self._ring_put_at = -math.inf  # the first batch wakes the daemon
            self._ring_counts = {k: resp.result.get(k, 0) for k in _RING_BAD}
        except KvtierClientError as e:
            self.ring_error = e
        except (ValueError, OSError) as e:  # a ring this client cannot use; the socket still can
            self.ring_error = KvtierClientError("hint_ring", protocol.E_UNAVAILABLE, str(e))
            if isinstance(e, (ConnectionError, socket.timeout)):
                self._lost_connection()
        finally:
            for fd in fds:
                os.close(fd)
        return self.ring

    def _requeue(self, hints: tuple[np.ndarray, np.ndarray]) -> None:
        """Ring hints (regions, blocks) as hint frames in the socket queue, one per region."""
        regions, blocks = hints
        for rid in np.unique(regions).tolist():
            if rid:  # 0: before any region word (a ring written by hand)
                b = blocks[regions == rid]
                self._queue_hint(protocol.Hint(region=rid, blocks=b.tobytes()), int(b.size))

    def _ready_ring(self) -> None:
        """Ask for this connection's ring now if it is wanted, not asked yet,
        and a region is held (the ring carries regions' hints)."""
        if self.ring is None and self._ring_wanted and self._regions:
            self._open_ring()

    def _ring_put(self, word: int, packed: bytes, checked: bool = False) -> bool:
        """A region's batch of packed block indices into the ring (never
        asked for here: registering did); False: no ring, no room, or
        an index >= 2**31 (it would read as a region word there; the socket
        refuses such a batch with an error)."""
        ring = self.ring
        if ring is None:
            return False
        if not packed or not checked and \
                int(np.frombuffer(packed, dtype=protocol.BLOCKS_DTYPE).max()) >= hintring.REGION_BIT:
            return False
        if not ring.put(word, packed):
            return False
        # The daemon drains the ring on a timer that backs off to
        # hintring.IDLE_INTERVAL_MAX while the rings are empty: the first
        # batch after such a pause (and the ring's first) would wait up to
        # that long, and it is the one a promotion waits for (in the guest
        # comparison the first hot set's move started 0.2 s after the first
        # hint). So it also sends an empty hint, which has the daemon drain
        # this ring at once (a request drains its connection's ring first)
        # and resume draining at the interval: one write per pause, not per batch.
        now = time.monotonic()
        if now - self._ring_put_at >= hintring.IDLE_INTERVAL_MAX:
            self._send_hint(protocol.Hint(region=word & (hintring.REGION_BIT - 1), blocks=b""), 0)
        self._ring_put_at = now
        self._ring_countdown -= 1
        if self._ring_countdown <= 0:
            self._ring_check()
        return True

    def _ring_check(self) -> None:
        """Every RING_CHECK_BATCHES ring batches: answers that came are read
        and a daemon that went away is noticed (non-blocking, one read)."""
        self._ring_countdown = RING_CHECK_BATCHES
        try:
            self._poll_answers(always=True)
        except (ConnectionError, socket.timeout):
            self._lost_connection()

    def _sync_ring(self) -> None:
        """Have the daemon drain the ring now and report, as async errors,
        the entries it rejected since the last look (hint_ring again)."""
        ring = self.ring
        if ring is None or ring.written == self._ring_synced or self.sock is None:
            return
        r = self._call_once(protocol.HintRing())
        self._ring_synced = ring.written
        bad = {k: r.get(k, 0) - self._ring_counts.get(k, 0) for k in _RING_BAD}
        self._ring_counts = {k: r.get(k, 0) for k in _RING_BAD}
        if any(bad.values()):
            what = ", ".join(f"{n} {k}" for k, n in bad.items() if n)
            self.async_errors.append(KvtierClientError(
                "hint_ring", protocol.E_INVALID_ARGUMENT,
                f"ring entries rejected: {what} (no such region of yours / block out of range / bad head)"))

    def close(self) -> None:
        if self.sock is not None:
            try:
                for r in list(self._regions.values()):
                    r.flush()
                self._drain()
            except (KvtierClientError, OSError):
                pass
        self.close_socket()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- framing ---------------------------------------------------------

    def _send(self, req: protocol.Request) -> int:
        rid = self._next_id
        self._next_id += 1
        req.id = rid
        if self.sock is None:
            raise ConnectionResetError(_errno.ENOTCONN, "not connected")
        if self.server or self._greeting:  # after hello: frames stay in order, queued hints first
            self._push_hints(block=True)
        self.sock.sendall(protocol.encode_request(req))
        return rid

    # -- hints: never blocking the engine ----------------------------------

    def _send_hint(self, req: protocol.Hint, nblocks: int) -> None:
        """Queue one hint frame and write what the socket takes now."""
        self._queue_hint(req, nblocks)
        try:
            # one attempt, no waiting: the queue holds the hints meanwhile
            if self.sock is None and not self._connect_nowait():
                return
            # Answers are read once half the in-flight window is used, not
            # per batch: a read is a system call the engine pays for, and the
            # daemon's answers to hints are a few dozen bytes each.
            if len(self._in_flight) >= MAX_IN_FLIGHT // 2 or self._engine or self._greeting:
                self._poll_answers()
            self._push_hints(block=False)
        except (ConnectionError, BrokenPipeError, socket.timeout):
            # The daemon went away: the queued hints wait for the next call's
            # reconnect (it may be restarting); nothing is raised to the engine.
            self._lost_connection()

    def _queue_hint(self, req: protocol.Hint, nblocks: int) -> None:
        """One hint frame at the end of the queue (the oldest dropped past hint_queue_max)."""
        rid = self._next_id
        self._next_id += 1
        req.id = rid
        self._hint_queue.append((protocol.encode_request(req), rid, nblocks, req.__struct_config__.tag))
        self._hint_queued += nblocks
        while self._hint_queued > self.hint_queue_max and len(self._hint_queue) > 1:
            _, _, n, _ = self._hint_queue.popleft()  # oldest first: hints age
            self._hint_queued -= n
            self.hints_dropped += n

    def _lost_connection(self) -> None:
        for rid, op in self._in_flight.items():
            self.async_errors.append(KvtierClientError(op, "unavailable", "kvtierd closed the connection"))
        self._in_flight.clear()
        self._wpartial = b""
        self.close_socket(salvage=True)

    def _push_hints(self, block: bool) -> None:
        """Write queued hint frames: all of them (``block``), or as many as
        the socket buffer takes without waiting and at most MAX_IN_FLIGHT
        unanswered (the daemon's answers must not pile up unread either)."""
        sock = self.sock
        if sock is None or not (self._wpartial or self._hint_queue):
            return
        if block:
            if self._wpartial:
                sock.sendall(self._wpartial)
                self._wpartial = b""
            while self._hint_queue:
                if len(self._in_flight) >= MAX_IN_FLIGHT:
                    self._collect(self._recv_one())
                    continue
                data, rid, n, op = self._hint_queue.popleft()
                self._hint_queued -= n
                self._in_flight[rid] = op
                sock.sendall(data)
            return
        try:
            while True:
                if self._wpartial:
                    sent = self._write_now(self._wpartial)
                    self._wpartial = self._wpartial[sent:]
                    if self._wpartial:
                        return
                if not self._hint_queue or len(self._in_flight) >= MAX_IN_FLIGHT:
                    return
                data, rid, n, op = self._hint_queue[0]
                sent = self._write_now(data)  # BlockingIOError: nothing sent, frame stays queued
                self._hint_queue.popleft()
                self._hint_queued -= n
                self._in_flight[rid] = op
                self._wpartial = data[sent:]
        except BlockingIOError:
            return

    # A socket with a timeout is non-blocking at the OS level (that is how
    # Python implements timeouts; see the socket module's notes on
    # timeouts), so a write or read that must not wait is one system call
    # on its fd; only a socket without timeout is switched back and forth.

    def _write_now(self, data: bytes) -> int:
        """Bytes of ``data`` the socket takes without waiting (BlockingIOError: none)."""
        sock = self.sock
        if self.timeout is not None:
            return os.write(sock.fileno(), data)
        sock.setblocking(False)
        try:
            return sock.send(data)
        finally:
            sock.setblocking(True)

    def _read_now(self) -> bytes:
        """What has arrived, without waiting (BlockingIOError: nothing; b"": closed)."""
        sock = self.sock
        if self.timeout is not None:
            return os.read(sock.fileno(), 1 << 20)
        sock.setblocking(False)
        try:
            return sock.recv(1 << 20)
        finally:
            sock.setblocking(True)

    def _poll_answers(self, always: bool = False) -> None:
        """Collect the answers that have arrived, without waiting for any
        (``always``: read even with none expected, to see an EOF)."""
        sock = self.sock
        if sock is None or not (self._in_flight or self._engine or always):
            return
        try:
            while True:
                chunk = self._read_now()
                if not chunk:
                    raise ConnectionResetError(_errno.ECONNRESET, "kvtierd closed the connection")
                self._rbuf += chunk
        except BlockingIOError:
            pass
        buf = self._rbuf
        while len(buf) >= protocol.HEADER_SIZE:
            (size,) = protocol.HEADER.unpack_from(buf, 0)
            end = protocol.HEADER_SIZE + size
            if len(buf) < end:
                break
            resp = protocol.decode_response(bytes(buf[protocol.HEADER_SIZE:end]))
            del buf[:end]
            self._collect(resp)

    def _recv_one(self, fds: list[int] | None = None) -> protocol.Response:
        """The next frame; with ``fds``, read with recvmsg and the fds that
        came (SCM_RIGHTS) appended to it."""
        buf = self._rbuf
        while True:
            if len(buf) >= protocol.HEADER_SIZE:
                (size,) = protocol.HEADER.unpack_from(buf, 0)
                end = protocol.HEADER_SIZE + size
                if len(buf) >= end:
                    resp = protocol.decode_response(bytes(buf[protocol.HEADER_SIZE:end]))
                    del buf[:end]
                    return resp
            if fds is None:
                chunk = self.sock.recv(1 << 20)
            else:
                chunk, got, _, _ = socket.recv_fds(self.sock, 1 << 20, 4)
                fds.extend(got)
            if not chunk:
                raise ConnectionResetError(_errno.ECONNRESET, "kvtierd closed the connection")
            buf += chunk

    def _collect(self, resp: protocol.Response) -> None:
        if resp.event is not None:
            self._events.append(resp)  # run by poll() / after the current call, never re-entrantly
            return
        op = self._in_flight.pop(resp.id, "?")
        if resp.id == self._greeting:
            self._greeting = 0
            if resp.ok:
                self._greeted(resp.result)
                return
        if not resp.ok:
            e = resp.error
            self.async_errors.append(KvtierClientError(op, e.code, e.message, e.errno, e.retry_after_ms))

    def _drain(self) -> None:
        try:
            if self.sock is None and self._hint_queue:
                self._reconnect()  # an explicit flush may wait for a restarting daemon
            self._push_hints(block=True)
            while self._in_flight:
                self._collect(self._recv_one())
        except (ConnectionError, socket.timeout) as e:
            # The daemon went away with hints in flight. Hints are advisory:
            # report them lost and let the next call reconnect.
            for rid, op in self._in_flight.items():
                self.async_errors.append(KvtierClientError(op, "unavailable", f"answer lost: {e}"))
            self._in_flight.clear()
            self.close_socket(salvage=True)

    def _call_once(self, req: protocol.Request) -> Any:
        rid = self._send(req)
        op = req.__struct_config__.tag
        while True:
            resp = self._recv_one()
            if resp.id == rid and resp.event is None:
                break
            self._collect(resp)
        if not resp.ok:
            e = resp.error
            raise KvtierClientError(op, e.code, e.message, e.errno, e.retry_after_ms)
        return resp.result

    def _await_greeting(self) -> None:
        """A call on a connection a hint made: wait for its hello's answer
        first, as connect() does; none in ``timeout``: the connection is
        dropped (ConnectionError), so call() reconnects, waiting as usual."""
        try:
            self._push_hints(block=True)
            while self._greeting:
                self._collect(self._recv_one())
        except socket.timeout:
            self._lost_connection()
            raise ConnectionResetError(_errno.ETIMEDOUT, "no answer to hello") from None

    def call(self, req: protocol.Request) -> Any:
        """Send one request and wait for its answer; reconnect once if the
        daemon went away (it may be restarting)."""
        for attempt in (0, 1):
            try:
                if self.sock is None:
                    # Client(connect=False) with no daemon: say so now. Waiting
                    # out reconnect_timeout is for a daemon that was there
                    # and is restarting.
                    if self.connected_once:
                        self._reconnect()
                    else:
                        self.connect()
                elif self._greeting:
                    self._await_greeting()
                self._ready_ring()
                result = self._call_once(req)
                if self._events and not isinstance(req, protocol.MoveDone):
                    self._run_events()
                return result
            except (ConnectionError, BrokenPipeError) as e:
                if attempt or isinstance(e, DaemonUnavailable):
                    raise
                self._reconnect()

    def request(self, op: str, **fields: Any) -> Any:
        """Any op by name (kvtierctl uses this): ``request("status")``."""
        try:
            t = protocol.OPS[op]
        except KeyError:
            raise ValueError(f"unknown op {op!r}") from None
        return self.call(msgspec.convert(fields, t) if fields else t())

    def pages(self, op: str, **fields: Any) -> Iterator[dict]:
        """Every answer of a paged op, one request per page as the caller
        iterates: ``query``/``blocks`` continue at ``first`` = ``next``,
        ``regions`` at ``after`` = ``next``, until an answer has no ``next``."""
        req: dict | None = fields
        while req is not None:
            r = self.request(op, **req)
            yield r
            req = next_page(op, req, r)

    def regions(self, pid: int | None = None) -> Iterator[dict]:
        """The regions this caller may see (all of them when privileged), by
        ascending id, fetched a page at a time."""
        for page in self.pages("regions", **({} if pid is None else {"pid": pid})):
            yield from page["regions"]

    # -- API -------------------------------------------------------------

    def register(
        self,
        obj: Any = None,
        length: int | None = None,
        *,
        addr: int | None = None,
        block_size: int,
        name: str = "",
        tenant: str = "",
        priority: int = 0,
        constraints: Iterable[str] = (),
        pid: int | None = None,
    ) -> Region:
        """Register ``obj`` (a buffer-protocol object) or an address + length."""
        addr, length, keep = register_range(obj, length, addr)
        info = self.call(protocol.Register(
            start=addr, length=length, block_size=block_size, name=name, tenant=tenant,
            priority=priority, constraints=list(constraints), pid=pid,
        ))
        region = Region(self, info, addr, length, keep)
        self._regions[region.id] = region
        self._ready_ring()
        return region

    def allocate(
        self,
        nbytes: int,
        block_size: int,
        *,
        tier: str | int = "auto",
        name: str = "",
        tenant: str = "",
        priority: int = 0,
        constraints: Iterable[str] = (),
        pinned: bool = False,
        populate: bool = True,
    ) -> Region:
        """Map ``nbytes`` of memory placed where the daemon chooses, registered.

        The daemon picks the tier and node (``tier="auto"``: the fastest tier
        with room within the tenant's quota; among several nodes the one
        nearest this process's CPUs) and this call mbinds the mapping there
        before anything touches it, then faults it in (``populate``).
        ``pinned=True`` says the engine will pin the pages (CUDA host
        registration, RDMA, io_uring fixed buffers): the daemon never moves
        them, counts them, and refuses nodes whose memory is ZONE_MOVABLE.
        The region's ``buffer`` / ``numpy()`` expose the memory; it stays
        mapped as long as the region or any view of it is alive.
        """
        mem = PoolMemory(int(nbytes))
        info = self.call(mem.request(block_size, tier, pinned, name=name, tenant=tenant, priority=priority,
                                     constraints=constraints))
        region = self._regions[info["region"]] = Region(self, info, mem.addr, mem.length, mem)
        region.memory = mem
        self._ready_ring()
        try:
            mem.place(info["node"], pinned, populate)
        except BaseException:
            region.unregister()
            raise
        return region

    def register_engine(
        self,
        nblocks: int,
        block_size: int,
        tiers: Iterable[int] | np.ndarray,
        on_move: Callable[[np.ndarray, int, int], Any],
        *,
        name: str = "",
        tenant: str = "",
        priority: int = 0,
        constraints: Iterable[str] = (),
    ) -> EngineRegion:
        """Register a logical region whose blocks live in pools this engine
        owns in several tiers (pinned: the kernel cannot move them) and which
        this engine moves itself when the daemon asks (see EngineRegion).
        ``tiers``: the tier each block is in now (-1: not placed). Call
        ``poll()`` from the engine's loop so move requests are served."""
        t = np.array(tiers, dtype=protocol.TIERS_DTYPE).ravel()
        info = self.call(protocol.RegisterEngine(
            blocks=nblocks, block_size=block_size, tiers=t.tobytes(), name=name, tenant=tenant,
            priority=priority, constraints=list(constraints),
        ))
        region = EngineRegion(self, info, t.copy(), on_move)
        self._regions[region.id] = region
        self._engine += 1
        self._ready_ring()
        return region

    def poll(self) -> int:
        """Serve the move requests that have arrived, without waiting; returns
        how many were served. Engine-mode owners call this from their loop."""
        try:
            self._poll_answers()
        except (ConnectionError, socket.timeout):
            self._lost_connection()
            return 0
        return self._run_events()

    def _run_events(self) -> int:
        served = 0
        while self._events:
            ev = self._events.pop(0)
            if ev.event != "move":
                continue
            region = self._regions.get(int(ev.result["region"]))
            if not isinstance(region, EngineRegion):
                ok, error = np.zeros(len(ev.result["blocks"]) // 4, dtype=bool), "region not served here"
            else:
                ok, error = region._move(ev.result)
            try:
                self.call(protocol.MoveDone(move=int(ev.result["move"]), ok=ok.astype(np.uint8).tobytes(),
                                            error=error))
            except KvtierClientError as e:
                # dropped meanwhile (the daemon restarted or the move was replaced): nothing to record
                self.async_errors.append(e)
            served += 1
        return served

    def flush(self) -> list[KvtierClientError]:
        """Send pending hints of every region, wait for all answers and
        return (and clear) the errors they produced."""
        for r in list(self._regions.values()):
            r.flush()
        self._drain()
        try:
            self._sync_ring()
        except (ConnectionError, socket.timeout):
            # The daemon went away with hints in the ring: they go on the
            # socket of the next connection, as queued socket hints do.
            self._lost_connection()
            self._drain()
        errs, self.async_errors = self.async_errors, []
        return errs

    def stats(self) -> dict:
        return self.call(protocol.Stats())

    def status(self) -> dict:
        return self.call(protocol.Status())
