"""The shared-memory hint ring: block hints without a system call per batch.

A client asks for a ring on its connection (op ``hint_ring``); the daemon
makes a memfd, maps it, seals its size and passes the fd with SCM_RIGHTS in
the answer; the client maps it too. One producer (the client) writes words
and publishes them by advancing ``head``; one consumer (the daemon) copies
them out every ``daemon.hint_ring_interval`` (backing off to
``IDLE_INTERVAL_MAX`` while every ring is empty) and before each request of
that connection, and advances ``tail``. The layout (docs/protocol.md,
"hint_ring") is defined here once for both sides:

    offset  size  field             written by
    0       8     magic "KVTRING1"  daemon, at creation
    8       4     version (1)       daemon
    12      4     word size (4)     daemon
    16      4     capacity          daemon: words, a power of two
    20      4     words offset      daemon: 4096
    64      8     head              client: words published, in total
    128     8     tail              daemon: words consumed, in total
    4096    4*capacity  words       client: word i at (i mod capacity)

A word is a little-endian u32. One with bit 31 set (a region word) makes
``word & 0x7fffffff`` the current region; every other word is one hint of
that block of the current region. The current region carries over from
one drain to the next; before the first region word there is none. So a
hint call writes one region word and its block indices as they are: one
memcpy of the caller's uint32 array, the least a Python client can do in
a cold cache (each numpy call there costs microseconds:
scripts/bench/hint_cost.py). The region word is written on every call,
even for the region of the last one: an index >= 2**31 passed by mistake
(it reads as a region word) then misdirects the rest of that call only,
and the daemon counts those as bad_region.
Counters only grow (mod 2**64); head - tail never exceeds capacity.

The daemon treats the memory as hostile: the client can write anything at
any time. It reads ``head`` once per drain, keeps its own tail (it never
reads the shared one back), copies the words out before looking at them
and validates the copy; a head that claims more than ``capacity`` words
is counted (``bad_head``) and skipped. The memfd is sealed against
shrinking, so a client cannot make the daemon's reads fault (SIGBUS).
"""

from __future__ import annotations

import collections
import fcntl
import mmap
import os

import numpy as np

MAGIC = b"KVTRING1"
VERSION = 1
WORD_SIZE = 4
WORDS_OFFSET = 4096
OFF_MAGIC, OFF_VERSION, OFF_WORD_SIZE, OFF_CAPACITY, OFF_WORDS = 0, 8, 12, 16, 20
OFF_HEAD = 64  # its own cache line: the client stores it on every hint call
OFF_TAIL = 128  # and the daemon this one, on every drain
REGION_BIT = 1 << 31
WORD_DTYPE = np.dtype("<u4")
MASK64 = (1 << 64) - 1
# madvise(2) advice that write-faults a range in at once (Linux 5.14;
# Python 3.11's mmap module does not name it)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

# The config's defaults (kvtier.config reads them from here):
# limits.hint_ring_entries: 128 Ki words = 512 KiB + the 4 KiB header per
# ring, a connection's hints for a drain interval at over 6 M block hints/s;
# daemon.hint_ring_interval: how late a hint may be applied.
DEFAULT_ENTRIES = 1 << 17
DEFAULT_INTERVAL = 0.02
# A drain pass that finds every ring empty doubles the wait before the next
# one, up to this (never below daemon.hint_ring_interval); the first pass
# that finds a word goes back to the interval. A connection that keeps its
# ring open while it has nothing to hint then costs the daemon about three
# wakeups a second instead of fifty, a busy ring is drained at the interval,
# and the first hint after a quiet spell waits at most this long (or until
# its connection's next request, which drains first).
IDLE_INTERVAL_MAX = 0.32
MIN_ENTRIES = 64

# Why hints were not applied (the daemon's counters, `stats`' hint_ring_entries):
ACCEPTED = "accepted"
BAD_REGION = "bad_region"  # no such region, not one this connection may hint, or no region word yet
BAD_BLOCK = "bad_block"  # block index >= the region's block count
BAD_HEAD = "bad_head"  # head moved back or past tail + capacity: drains skipped


def ring_bytes(capacity: int) -> int:
    return WORDS_OFFSET + WORD_SIZE * capacity


def capacity_for(asked: int | None, limit: int) -> int:
    """The power of two of words a ring gets: what was asked (0/None: the
    limit), rounded down to a power of two, within [MIN_ENTRIES, limit]."""
    n = limit if not asked else min(int(asked), limit)
    n = max(MIN_ENTRIES, n)
    return 1 << (n.bit_length() - 1)


def region_word(region: int) -> int:
    return REGION_BIT | region


def decode(words: np.ndarray, current: int) -> tuple[np.ndarray, np.ndarray]:
    """(region of each word, which words are region words) for a run of
    words that follows ``current`` (the region in force before it; 0: none).
    One pass of array operations, no loop per word."""
    is_region = words >= REGION_BIT
    last = np.where(is_region, np.arange(words.size), -1)
    np.maximum.accumulate(last, out=last)
    region = np.where(last >= 0, words[last] & (REGION_BIT - 1), current)
    return region.astype(np.uint32), is_region


class _Mapped:
    """A ring mapping and its views (closed together: an mmap with exported
    views cannot be closed)."""

    def __init__(self, fd: int, capacity: int):
        self.capacity = capacity
        self.mask = capacity - 1
        self.map = mmap.mmap(fd, ring_bytes(capacity), flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mv = memoryview(self.map)
        # memoryview items: a store or load of one is a single aligned
        # 8-byte access, and the cheapest code Python has for it
        self.head = mv[OFF_HEAD:OFF_HEAD + 8].cast("Q")
        self.tail = mv[OFF_TAIL:OFF_TAIL + 8].cast("Q")
        self.words = mv[WORDS_OFFSET:].cast("I")
        self.bytes = mv[WORDS_OFFSET:]
        self.array = np.frombuffer(self.map, dtype=WORD_DTYPE, count=capacity, offset=WORDS_OFFSET)
        del mv

    def copy_out(self, start: int, n: int) -> np.ndarray:
        """Words start .. start + n - 1 (n <= capacity), copied out."""
        lo = start & self.mask
        first = min(n, self.capacity - lo)
        if first == n:
            return self.array[lo:lo + n].copy()
        return np.concatenate((self.array[lo:], self.array[:n - first]))

    def close(self) -> None:
        if self.map is None:
            return
        for v in (self.head, self.tail, self.words, self.bytes):
            v.release()
        self.head = self.tail = self.words = self.bytes = self.array = None
        self.map.close()
        self.map = None


class DaemonRing(_Mapped):
    """The daemon's side: made with its memfd, drained by ``take``."""

    def __init__(self, capacity: int, name: str = "kvtier-hint-ring"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, ring_bytes(capacity))
            # The client gets this fd: without the seals it could ftruncate
            # the file to 0 and the daemon's next read of the mapping would
            # be SIGBUS.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            super().__init__(fd, capacity)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd  # passed to the client, then closed (close_fd)
        m = self.map
        m[OFF_MAGIC:OFF_MAGIC + 8] = MAGIC
        for off, v in ((OFF_VERSION, VERSION), (OFF_WORD_SIZE, WORD_SIZE), (OFF_CAPACITY, capacity),
                       (OFF_WORDS, WORDS_OFFSET)):
            m[off:off + 4] = v.to_bytes(4, "little")
        self.consumed = 0  # our tail: the shared one is only written, never read
        self.current = 0  # the region in force after the words consumed (0: none yet)
        self.bad_heads = 0
        self.bad_heads_seen = 0  # of bad_heads, those already counted in ``counts``
        self.taken = 0  # words the last take copied out
        self.waiting = 0  # words published and left in the ring by the last take (its ``limit``)
        self.counts: collections.Counter = collections.Counter()  # result -> hints (ACCEPTED, BAD_*)

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """The hints published since the last take, as (regions, blocks)
        uint32 arrays: ``take_runs`` with each run's region repeated."""
        regions, lengths, blocks = self.take_runs()
        return np.repeat(regions, lengths), blocks

    def take_runs(self, limit: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The hints published since the last take, decoded from a copy of
        the shared words (at most ``capacity``), as runs: (region of each
        run (uint32; 0: none yet), hints in each run (int64), the hints'
        block indices (uint32) in order); and the tail advanced past them.
        A run is the hints after one region word (the first run: after the
        region in force before this take); runs without hints are left
        out. Work in array operations over the words, plus the region
        words (one per client batch). A head that is not within
        ``capacity`` of our tail is counted in ``bad_heads`` and nothing is
        taken; the tail jumps to it, so a client that wrote one bad head
        carries on from there. ``limit``: take at most that many words,
        the rest left for the next take (``waiting`` says how many)."""
        head = self.head[0]  # one load: the client may change it meanwhile
        n = (head - self.consumed) & MASK64
        if n > self.capacity:
            self.bad_heads += 1
            self.consumed = head
            self.tail[0] = head
            n = 0
        if limit is not None and n > limit:
            n = max(0, limit)
        self.waiting = 0
        self.taken = n
        if not n:
            return np.zeros(0, np.uint32), np.zeros(0, np.int64), np.zeros(0, np.uint32)
        words = self.copy_out(self.consumed, n)
        self.waiting = (head - self.consumed - n) & MASK64
        self.consumed = (self.consumed + n) & MASK64
        self.tail[0] = self.consumed  # after the copy: the client may reuse these slots now
        is_hint = words < REGION_BIT
        at = np.flatnonzero(~is_hint)
        if not at.size:
            return np.array([self.current], np.uint32), np.array([n], np.int64), words
        regions = np.empty(at.size + 1, np.uint32)
        regions[0] = self.current
        np.bitwise_and(words[at], REGION_BIT - 1, out=regions[1:])
        self.current = int(regions[-1])
        # hints before the first region word, then after each one up to the next
        lengths = np.empty(at.size + 1, np.int64)
        lengths[0] = at[0]
        lengths[1:-1] = at[1:] - at[:-1] - 1
        lengths[-1] = n - 1 - at[-1]
        kept = lengths > 0
        return regions[kept], lengths[kept], words[is_hint]

    def close(self) -> None:
        self.close_fd()
        super().close()


class ClientRing(_Mapped):
    """The client's side: maps the fd the daemon passed (and closes it)."""

    def __init__(self, fd: int):
        try:
            st = os.fstat(fd)
            with mmap.mmap(fd, min(st.st_size, WORDS_OFFSET), flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ) as hdr:
                if hdr[OFF_MAGIC:OFF_MAGIC + 8] != MAGIC:
                    raise ValueError("not a kvtier hint ring (bad magic)")
                version, wsize, cap, woff = (int.from_bytes(hdr[o:o + 4], "little")
                                             for o in (OFF_VERSION, OFF_WORD_SIZE, OFF_CAPACITY, OFF_WORDS))
            if (version, wsize, woff) != (VERSION, WORD_SIZE, WORDS_OFFSET) or cap < 1 or cap & (cap - 1) \
                    or ring_bytes(cap) > st.st_size:
                raise ValueError(f"unsupported hint ring: version {version}, word size {wsize}, "
                                 f"capacity {cap}, words at {woff}, {st.st_size} bytes")
            super().__init__(fd, cap)
        finally:
            os.close(fd)
        self.written = self.head[0]  # our head (the daemon starts both at 0)
        # Fault every page of the words in now, at the ask (registration),
        # not one at a time in the hint calls: in the TCG guest a batch that
        # crossed into an untouched page took 0.9 ms against 0.2 ms, three
        # in four of a hint set's flushes in a 20 s run (docs/benchmarks.md,
        # "Hint sets"). The pages are the client's to fill anyway (shmem
        # charged to it, docs/protocol.md); a kernel without the advice
        # (EINVAL) faults them in as before.
        try:
            self.map.madvise(MADV_POPULATE_WRITE, WORDS_OFFSET, WORD_SIZE * self.capacity)
        except OSError:
            pass
        self.room_until = 0  # head value up to which the last look at tail showed room
        self.full = 0  # put() calls refused: no room

    def put(self, word: int, packed: bytes) -> bool:
        """Publish one hint per block index of ``packed`` (little-endian
        u32s, each < 2**31) for the region of ``word`` (``region_word``);
        False (nothing written) if the ring has no room for all."""
        k = len(packed) >> 2
        h = self.written
        end = h + k + 1
        if end > self.room_until:
            self.room_until = self.tail[0] + self.capacity
            if end > self.room_until:
                self.full += 1
                return False
        lo = h & self.mask
        words = self.words
        words[lo] = word
        lo = (lo + 1) & self.mask
        at, nbytes = lo * WORD_SIZE, k * WORD_SIZE
        if lo + k <= self.capacity:
            self.bytes[at:at + nbytes] = packed
        else:
            cut = (self.capacity - lo) * WORD_SIZE
            self.bytes[at:] = packed[:cut]
            self.bytes[:nbytes - cut] = packed[cut:]
        # Words first, then head: a plain aligned 8-byte store, which x86-64
        # (TSO) keeps after the stores above. (A C client on a weaker memory
        # model uses a release store; docs/protocol.md.)
        self.written = end
        self.head[0] = end
        return True

    def unconsumed(self) -> int:
        return self.written - self.tail[0]

    def unconsumed_entries(self) -> tuple[np.ndarray, np.ndarray]:
        """The hints published and not taken (the daemon went away), as
        (regions, blocks). Their region may be named by a word already
        consumed, so the words before them still in the ring are decoded too."""
        n = self.unconsumed()
        if not 0 < n <= self.capacity:
            return np.zeros(0, np.uint32), np.zeros(0, np.uint32)
        start = max(0, self.written - self.capacity)
        words = self.copy_out(start, self.written - start)
        regions, is_region = decode(words, 0)
        words, regions, hints = words[-n:], regions[-n:], ~is_region[-n:]
        return regions[hints], words[hints]
