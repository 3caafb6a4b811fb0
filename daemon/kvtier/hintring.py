"""The shared-memory hint ring: block hints without a system call per batch.

A client asks for a ring on its connection (op ``hint_ring``); the daemon
makes a memfd, maps it, seals its size and passes the fd with SCM_RIGHTS in
the answer; the client maps it too. One producer (the client) writes
entries and publishes them by advancing ``head``; one consumer (the daemon)
copies them out every ``daemon.hint_ring_interval`` and before each request
of that connection, and advances ``tail``. The layout (docs/protocol.md,
"hint ring") is defined here once for both sides:

    offset  size  field           written by
    0       8     magic "KVTRING1"  daemon, at creation
    8       4     version (1)       daemon
    12      4     entry_size (8)    daemon
    16      4     capacity          daemon: entries, a power of two
    20      4     entries_offset    daemon: 4096
    64      8     head              client: entries published, in total
    128     8     tail              daemon: entries consumed, in total
    4096    8*capacity  entries     client: entry i at (i mod capacity)

An entry is (region u32, block u32), little-endian: one hint of one block.
Counters only grow (mod 2**64); head - tail is the number of entries in the
ring and never exceeds capacity. Fixed 8-byte entries keep both sides free
of a Python loop per entry: the client fills two strided columns with one
slice assignment each, the daemon validates a copy with array operations.

The daemon treats the memory as hostile: the client can write anything at
any time. It reads ``head`` once per drain, keeps its own tail (it never
reads the shared one back), copies the entries out before looking at them
and validates the copy; a head that claims more than ``capacity`` entries
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
ENTRY_SIZE = 8
ENTRIES_OFFSET = 4096
OFF_MAGIC, OFF_VERSION, OFF_ENTRY_SIZE, OFF_CAPACITY, OFF_ENTRIES = 0, 8, 12, 16, 20
OFF_HEAD = 64  # its own cache line: the client stores it on every hint call
OFF_TAIL = 128  # and the daemon this one, on every drain
ENTRY_DTYPE = np.dtype([("region", "<u4"), ("block", "<u4")])
U64 = np.dtype("<u8")
MASK64 = (1 << 64) - 1

# The config's defaults (kvtier.config reads them from here):
# limits.hint_ring_entries: 64 Ki entries = 512 KiB + the 4 KiB header per
# ring, a connection's worth of hints for a drain interval at 1.3 M block
# hints/s; daemon.hint_ring_interval: how late a hint may be applied.
DEFAULT_ENTRIES = 1 << 16
DEFAULT_INTERVAL = 0.02
MIN_ENTRIES = 64

# Why entries were not applied (the daemon's counters, `stats`' hint_ring_entries):
ACCEPTED = "accepted"
BAD_REGION = "bad_region"  # no such region, or not one this connection may hint
BAD_BLOCK = "bad_block"  # block index >= the region's block count
BAD_HEAD = "bad_head"  # head moved back or past tail + capacity: drains skipped


def ring_bytes(capacity: int) -> int:
    return ENTRIES_OFFSET + ENTRY_SIZE * capacity


def capacity_for(asked: int | None, limit: int) -> int:
    """The power of two of entries a ring gets: what was asked (0/None: the
    limit), rounded down to a power of two, within [MIN_ENTRIES, limit]."""
    n = limit if not asked else min(int(asked), limit)
    n = max(MIN_ENTRIES, n)
    return 1 << (n.bit_length() - 1)


class _Mapped:
    """A ring mapping and its numpy views (closed together: an mmap with
    exported views cannot be closed)."""

    def __init__(self, fd: int, capacity: int):
        self.capacity = capacity
        self.mask = capacity - 1
        self.map = mmap.mmap(fd, ring_bytes(capacity), flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.head = np.frombuffer(self.map, dtype=U64, count=1, offset=OFF_HEAD)
        self.tail = np.frombuffer(self.map, dtype=U64, count=1, offset=OFF_TAIL)
        self.entries = np.frombuffer(self.map, dtype=ENTRY_DTYPE, count=capacity, offset=ENTRIES_OFFSET)

    def copy_out(self, start: int, n: int) -> np.ndarray:
        """Entries start .. start + n - 1 (n <= capacity), copied out."""
        lo = start & self.mask
        first = min(n, self.capacity - lo)
        if first == n:
            return self.entries[lo:lo + n].copy()
        return np.concatenate((self.entries[lo:], self.entries[:n - first]))

    def close(self) -> None:
        if self.map is None:
            return
        self.head = self.tail = self.entries = None
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
        for off, v in ((OFF_VERSION, VERSION), (OFF_ENTRY_SIZE, ENTRY_SIZE), (OFF_CAPACITY, capacity),
                       (OFF_ENTRIES, ENTRIES_OFFSET)):
            m[off:off + 4] = v.to_bytes(4, "little")
        self.consumed = 0  # our tail: the shared one is only written, never read
        self.bad_heads = 0
        self.bad_heads_seen = 0  # of bad_heads, those already counted in ``counts``
        self.counts: collections.Counter = collections.Counter()  # result -> entries (ACCEPTED, BAD_*)

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def take(self) -> np.ndarray:
        """The entries published since the last take, copied out of the
        shared memory (an ENTRY_DTYPE array, at most ``capacity``), and the
        tail advanced past them. A head that is not within ``capacity`` of
        our tail is counted in ``bad_heads`` and nothing is taken; the tail
        jumps to it, so a client that wrote one bad head carries on from there."""
        head = int(self.head[0])  # one load: the client may change it meanwhile
        n = (head - self.consumed) & MASK64
        if not n:
            return self.entries[:0].copy()
        if n > self.capacity:
            self.bad_heads += 1
            self.consumed = head
            self.tail[0] = head
            return self.entries[:0].copy()
        out = self.copy_out(self.consumed, n)
        self.consumed = head
        self.tail[0] = head  # after the copy: the client may reuse these slots now
        return out

    def close(self) -> None:
        self.close_fd()
        super().close()


class ClientRing(_Mapped):
    """The client's side: maps the fd the daemon passed (and closes it)."""

    def __init__(self, fd: int):
        try:
            st = os.fstat(fd)
            with mmap.mmap(fd, min(st.st_size, ENTRIES_OFFSET), flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ) as hdr:
                if hdr[OFF_MAGIC:OFF_MAGIC + 8] != MAGIC:
                    raise ValueError("not a kvtier hint ring (bad magic)")
                version = int.from_bytes(hdr[OFF_VERSION:OFF_VERSION + 4], "little")
                esize = int.from_bytes(hdr[OFF_ENTRY_SIZE:OFF_ENTRY_SIZE + 4], "little")
                cap = int.from_bytes(hdr[OFF_CAPACITY:OFF_CAPACITY + 4], "little")
                eoff = int.from_bytes(hdr[OFF_ENTRIES:OFF_ENTRIES + 4], "little")
            if (version, esize, eoff) != (VERSION, ENTRY_SIZE, ENTRIES_OFFSET) or cap < 1 or cap & (cap - 1) \
                    or ring_bytes(cap) > st.st_size:
                raise ValueError(f"unsupported hint ring: version {version}, entry size {esize}, "
                                 f"capacity {cap}, entries at {eoff}, {st.st_size} bytes")
            super().__init__(fd, cap)
        finally:
            os.close(fd)
        self.written = int(self.head[0])  # our head (the daemon starts both at 0)
        self.room_until = 0  # head value up to which the last look at tail showed room
        self.full = 0  # put() calls refused: no room
        # Strided column views, made once: a put is two slice assignments.
        self.regions = self.entries["region"]
        self.blocks = self.entries["block"]

    def put(self, region: int, blocks: np.ndarray) -> bool:
        """Publish one hint per block of ``blocks`` (1-D uint32) for
        ``region``; False (nothing written) if the ring has no room for all."""
        k = blocks.size
        h = self.written
        end = h + k
        if end > self.room_until:
            self.room_until = int(self.tail[0]) + self.capacity
            if end > self.room_until:
                self.full += 1
                return False
        lo = h & self.mask
        if lo + k <= self.capacity:
            self.regions[lo:lo + k] = region
            self.blocks[lo:lo + k] = blocks
        else:
            cut = self.capacity - lo
            self.regions[lo:] = region
            self.blocks[lo:] = blocks[:cut]
            self.regions[:k - cut] = region
            self.blocks[:k - cut] = blocks[cut:]
        # Entries first, then head: a plain aligned 8-byte store, which
        # x86-64 (TSO) keeps after the stores above. (A C client on a weaker
        # memory model uses a release store; docs/protocol.md.)
        self.written = end
        self.head[0] = end
        return True

    def unconsumed(self) -> int:
        return self.written - int(self.tail[0])

    def unconsumed_entries(self) -> np.ndarray:
        """What was published and not taken (the daemon went away): a copy."""
        n = self.unconsumed()
        if not 0 < n <= self.capacity:
            return self.entries[:0].copy()
        return self.copy_out(self.written - n, n)

    def close(self) -> None:
        self.regions = self.blocks = None
        super().close()
