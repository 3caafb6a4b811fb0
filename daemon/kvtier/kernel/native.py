"""Checked Python wrappers over the cffi extension built from ffi/.

The only module that calls into C. Every call is checked; a failure raises a
typed error from kvtier.errors carrying errno and a sentence saying what was
attempted. Arrays cross into C without copies or per-page Python work:
numpy buffers are handed over with ``ffi.from_buffer`` and cffi releases the
GIL for the duration of each call.
"""

from __future__ import annotations

import errno
import os
from typing import Iterable

import numpy as np

from kvtier._native import ffi, lib
from kvtier.errors import InvalidArgument, os_error

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
IOV_MAX = int(lib.IOV_MAX)

HAS_PROCESS_MADVISE = bool(lib.KVT_HAS_PROCESS_MADVISE)
HAS_PIDFD_OPEN = bool(lib.KVT_HAS_PIDFD_OPEN)
HAS_PERF_EVENT_OPEN = bool(lib.KVT_HAS_PERF_EVENT_OPEN)
HAS_MOVE_PAGES = bool(lib.KVT_HAS_MOVE_PAGES)
HAS_IO_URING = bool(lib.KVT_HAS_IO_URING)

MPOL_MF_MOVE = lib.MPOL_MF_MOVE
MPOL_MF_MOVE_ALL = lib.MPOL_MF_MOVE_ALL
MPOL_MF_STRICT = lib.MPOL_MF_STRICT
MPOL_DEFAULT = lib.MPOL_DEFAULT
MPOL_PREFERRED = lib.MPOL_PREFERRED
MPOL_BIND = lib.MPOL_BIND
MPOL_INTERLEAVE = lib.MPOL_INTERLEAVE
MADV_PAGEOUT = lib.MADV_PAGEOUT
MADV_COLD = lib.MADV_COLD
MADV_WILLNEED = lib.MADV_WILLNEED

PERF_TYPE_SOFTWARE = lib.PERF_TYPE_SOFTWARE
PERF_TYPE_HARDWARE = lib.PERF_TYPE_HARDWARE
PERF_TYPE_RAW = lib.PERF_TYPE_RAW
PERF_COUNT_SW_PAGE_FAULTS = lib.PERF_COUNT_SW_PAGE_FAULTS
PERF_COUNT_SW_PAGE_FAULTS_MAJ = lib.PERF_COUNT_SW_PAGE_FAULTS_MAJ
PERF_SAMPLE_IP = lib.PERF_SAMPLE_IP
PERF_SAMPLE_TID = lib.PERF_SAMPLE_TID
PERF_SAMPLE_ADDR = lib.PERF_SAMPLE_ADDR
PERF_SAMPLE_TIME = lib.PERF_SAMPLE_TIME
PERF_FLAG_FD_CLOEXEC = lib.PERF_FLAG_FD_CLOEXEC
PERF_ATTR_SIZE = int(lib.kvt_perf_attr_size())

# Nodemasks handed to mbind/migrate_pages: 1024 node bits. The kernel reads
# maxnode-1 bits (a historical off-by-one every caller must honour).
_MASK_LONGS = 16
_MAXNODE = _MASK_LONGS * 64 + 1

# numpy dtype with struct iovec's layout, so iovec arrays are built vectorised.
IOVEC_DTYPE = np.dtype([("base", np.uint64), ("len", np.uint64)])
assert ffi.sizeof("struct iovec") == IOVEC_DTYPE.itemsize


def _errno() -> int:
    return ffi.errno


def _ptr_array(addrs: np.ndarray):
    """View a contiguous uint64 address array as ``void **`` without copying."""
    if addrs.dtype != np.uint64 or not addrs.flags.c_contiguous:
        raise InvalidArgument("page address array must be contiguous uint64")
    return ffi.cast("void **", ffi.from_buffer(addrs))


def numa_available() -> bool:
    return lib.numa_available() >= 0


def numa_max_node() -> int:
    return int(lib.numa_max_node())


def numa_distance(a: int, b: int) -> int:
    """SLIT distance between two nodes; 0 means libnuma could not tell."""
    return int(lib.numa_distance(a, b))


def numa_node_size(node: int) -> tuple[int, int]:
    """(total, free) bytes of ``node``; raises for an unknown node."""
    free = ffi.new("long long *")
    total = lib.numa_node_size64(node, free)
    if total < 0:
        raise InvalidArgument(f"numa_node_size64: node {node} does not exist")
    return int(total), int(free[0])


# No status the kernel writes (nodes are >= 0, errors -1..-4095).
_STATUS_UNSET = np.iinfo(np.int32).min


def move_pages(
    pid: int,
    addrs: np.ndarray,
    nodes: np.ndarray | int | None,
    flags: int = MPOL_MF_MOVE,
    status: np.ndarray | None = None,
) -> np.ndarray:
    """move_pages(2) over a whole batch; returns the per-page status array.

    ``nodes=None`` only queries: status holds each page's node or a negative
    errno (-ENOENT not present, -EFAULT unmapped...). With a node (or one node
    per page) the kernel migrates and status holds the resulting node or the
    reason the page did not move. A negative return (bad pid, bad node,
    permission) raises; per-page failures do not.
    """
    n = int(addrs.shape[0])
    if status is None:
        status = np.empty(n, dtype=np.int32)
    if n == 0:
        return status
    if isinstance(nodes, (int, np.integer)):
        node = int(nodes)
        nodes_arr = np.full(n, node, dtype=np.int32)
        what = f"to node {node}"
    elif nodes is None:
        nodes_arr = None
        what = "query"
    else:
        nodes_arr = np.ascontiguousarray(nodes, dtype=np.int32)
        what = "to per-page nodes"
    nodes_ptr = ffi.NULL if nodes_arr is None else ffi.cast("int *", ffi.from_buffer(nodes_arr))
    if nodes_arr is not None:
        status[:] = _STATUS_UNSET
    rc = lib.kvt_move_pages(
        pid, n, _ptr_array(addrs), nodes_ptr, ffi.cast("int *", ffi.from_buffer(status)), flags
    )
    if rc < 0:
        raise os_error(_errno(), f"move_pages(pid={pid}, {n} pages, {what})")
    if rc > 0:
        # rc pages were not migrated (the kernel retried and gave up: a page
        # with extra references, i.e. pinned or under I/O), and the kernel
        # wrote no status for the batch they were in, not even for the pages
        # of it that did move. Report them busy; the caller re-queries.
        status[status == _STATUS_UNSET] = -errno.EBUSY
    return status


def nodemask(nodes: Iterable[int]) -> np.ndarray:
    mask = np.zeros(_MASK_LONGS, dtype=np.uint64)
    for n in nodes:
        if not 0 <= n < _MASK_LONGS * 64:
            raise InvalidArgument(f"node {n} out of range")
        mask[n // 64] |= np.uint64(1 << (n % 64))
    return mask


def migrate_pages(pid: int, from_nodes: Iterable[int], to_nodes: Iterable[int]) -> int:
    """migrate_pages(2): move all of a process's pages between node sets.

    Returns the number of pages that could not be moved.
    """
    old = nodemask(from_nodes)
    new = nodemask(to_nodes)
    rc = lib.kvt_migrate_pages(
        pid,
        _MAXNODE,
        ffi.cast("unsigned long *", ffi.from_buffer(old)),
        ffi.cast("unsigned long *", ffi.from_buffer(new)),
    )
    if rc < 0:
        raise os_error(_errno(), f"migrate_pages(pid={pid})")
    return int(rc)


def mbind(addr: int, length: int, mode: int, nodes: Iterable[int], flags: int = 0) -> None:
    """mbind(2) on memory of the calling process (placement before pinning)."""
    mask = nodemask(nodes)
    rc = lib.kvt_mbind(
        ffi.cast("void *", addr),
        length,
        mode,
        ffi.cast("unsigned long *", ffi.from_buffer(mask)),
        _MAXNODE,
        flags,
    )
    if rc < 0:
        raise os_error(_errno(), f"mbind(0x{addr:x}, {length}, mode={mode})")


def pidfd_open(pid: int) -> int:
    fd = lib.kvt_pidfd_open(pid, 0)
    if fd < 0:
        raise os_error(_errno(), f"pidfd_open(pid={pid})")
    return int(fd)


def iovecs(starts: np.ndarray, lengths: np.ndarray | int) -> np.ndarray:
    """Array of struct iovec built without a Python loop."""
    iov = np.empty(len(starts), dtype=IOVEC_DTYPE)
    iov["base"] = starts
    iov["len"] = lengths
    return iov


def process_madvise(pidfd: int, iov: np.ndarray, advice: int, what: str = "") -> int:
    """process_madvise(2) over an iovec array of any length; returns bytes advised.

    The kernel takes at most IOV_MAX vectors per call and may stop early
    (returning the bytes it advised so far), so this walks the array until
    every byte is covered or a call fails outright.
    """
    total = 0
    i = 0
    n = len(iov)
    while i < n:
        chunk = iov[i : i + IOV_MAX]
        want = int(chunk["len"].sum())
        rc = lib.kvt_process_madvise(
            pidfd, ffi.cast("struct iovec *", ffi.from_buffer(chunk)), len(chunk), advice, 0
        )
        if rc < 0:
            raise os_error(_errno(), f"process_madvise(advice={advice}{', ' + what if what else ''})")
        total += int(rc)
        if rc >= want:
            i += len(chunk)
            continue
        # Partial: skip the vectors fully done and trim the one in progress.
        done = np.cumsum(chunk["len"])
        k = int(np.searchsorted(done, rc, side="right"))
        if k == 0 and rc == 0:
            raise os_error(_errno() or 5, f"process_madvise(advice={advice}) made no progress")
        rest = iov[i + k :].copy()
        if len(rest):
            consumed = int(rc) - (int(done[k - 1]) if k else 0)
            rest[0]["base"] += np.uint64(consumed)
            rest[0]["len"] -= np.uint64(consumed)
        iov, i, n = rest, 0, len(rest)
    return total


def touch_remote(pid: int, addrs: np.ndarray) -> int:
    """Fault in one byte per page of another process via process_vm_readv.

    Reading through the target's page tables makes the kernel swap the page
    in (get_user_pages_remote), which is how swapped blocks are brought back
    before move_pages places them. Returns the bytes read; a page that cannot
    be read stops the batch with an error naming its address.
    """
    n = len(addrs)
    if n == 0:
        return 0
    scratch = ffi.new("char[]", IOV_MAX)
    local = np.empty(IOV_MAX, dtype=IOVEC_DTYPE)
    local["base"] = int(ffi.cast("uintptr_t", scratch)) + np.arange(IOV_MAX, dtype=np.uint64)
    local["len"] = 1
    remote = iovecs(addrs, 1)
    got = 0
    for i in range(0, n, IOV_MAX):
        r = remote[i : i + IOV_MAX]
        m = len(r)
        rc = lib.process_vm_readv(
            pid,
            ffi.cast("struct iovec *", ffi.from_buffer(local)),
            m,
            ffi.cast("struct iovec *", ffi.from_buffer(r)),
            m,
            0,
        )
        if rc < 0:
            raise os_error(_errno(), f"process_vm_readv(pid={pid}, {m} pages at 0x{int(r[0]['base']):x})")
        got += int(rc)
        if rc < m:
            bad = int(r[int(rc)]["base"])
            raise os_error(14, f"process_vm_readv(pid={pid})", f"page 0x{bad:x} unreadable")
    return got


def perf_open(
    type_: int,
    config: int,
    sample_period: int,
    sample_type: int,
    pid: int,
    cpu: int = -1,
    precise_ip: int = 0,
    exclude_kernel: bool = True,
) -> int:
    fd = lib.kvt_perf_open(
        type_, config, sample_period, sample_type, precise_ip, int(exclude_kernel), pid, cpu,
        PERF_FLAG_FD_CLOEXEC,
    )
    if fd < 0:
        raise os_error(_errno(), f"perf_event_open(type={type_}, config={config}, pid={pid}, cpu={cpu})")
    return int(fd)


def cachestat_ranges(fd: int, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pages in the page cache, pages evicted) of each byte range of an open
    file, one cachestat(2) per range in one C call.

    For shared memory "evicted" is the kernel's own swap count (the entries
    that smaps reports as Swap, pages still in the swap cache included),
    which mincore cannot tell from resident pages. Raises FeatureUnavailable
    before Linux 6.5 and PermissionDenied under a seccomp filter that does
    not know the call (systemd 252: its SystemCallFilter cannot name it).
    """
    offs = np.ascontiguousarray(offsets, dtype=np.uint64)
    lens = np.ascontiguousarray(lengths, dtype=np.uint64)
    cache = np.empty(len(offs), dtype=np.uint64)
    evicted = np.empty(len(offs), dtype=np.uint64)
    if len(offs):
        rc = lib.kvt_cachestat_ranges(
            fd, ffi.cast("unsigned long long *", ffi.from_buffer(offs)),
            ffi.cast("unsigned long long *", ffi.from_buffer(lens)), len(offs),
            ffi.cast("unsigned long long *", ffi.from_buffer(cache)),
            ffi.cast("unsigned long long *", ffi.from_buffer(evicted)),
        )
        if rc < 0:
            raise os_error(_errno(), f"cachestat(fd={fd}, {len(offs)} ranges)")
    return cache.astype(np.int64), evicted.astype(np.int64)


def swap_of_ranges(fd: int, offsets: np.ndarray, lengths: np.ndarray, proc_root: str = "/proc") -> np.ndarray:
    """Pages in swap of each byte range of a shared-memory file, without
    cachestat: each range mapped (never touched) as a VMA of our own, whose
    Swap line in /proc/self/smaps is the kernel's count of the swap entries
    of exactly that range (swap cache included), then unmapped."""
    offs = np.ascontiguousarray(offsets, dtype=np.uint64)
    lens = np.ascontiguousarray(lengths, dtype=np.uint64)
    n = len(offs)
    if not n:
        return np.zeros(0, dtype=np.int64)
    addrs = np.zeros(n, dtype=np.uint64)
    total = ffi.new("unsigned long long *")
    base = lib.kvt_map_ranges(
        fd, ffi.cast("unsigned long long *", ffi.from_buffer(offs)),
        ffi.cast("unsigned long long *", ffi.from_buffer(lens)), n,
        ffi.cast("unsigned long long *", ffi.from_buffer(addrs)), total,
    )
    if base == 0:
        raise os_error(_errno(), f"mmap of {n} ranges of fd {fd}")
    try:
        where = {int(a): i for i, a in enumerate(addrs.tolist())}
        swap = np.zeros(n, dtype=np.int64)
        lo, hi = int(base), int(base) + int(total[0])
        cur = -1
        with open(os.path.join(proc_root, "self", "smaps"), "rb") as f:
            for line in f:
                if line[:1] in b"0123456789abcdef" and b"-" in line[:40]:
                    a = int(line[: line.index(b"-")], 16)
                    cur = where.get(a, -1) if lo <= a < hi else -1
                elif cur >= 0 and line.startswith(b"Swap:"):
                    swap[cur] = int(line.split()[1]) * 1024 // PAGE_SIZE
        return swap
    finally:
        lib.kvt_unmap(base, total[0])


def pin_longterm(iov: np.ndarray) -> int:
    """Pin ranges of this process long-term: io_uring fixed buffers.

    IORING_REGISTER_BUFFERS pins every page with FOLL_PIN | FOLL_LONGTERM,
    the pin CUDA host registrations and RDMA memory regions take, so
    migration and reclaim must leave the pages alone (pages in ZONE_MOVABLE
    are migrated out first). Returns the ring fd; ``unpin_longterm`` drops
    the pins. kvtier never pins KV memory: this is how its tests make a
    real long-term pin without a GPU. Each range must be at most 1 GiB.
    """
    if not HAS_IO_URING:
        raise os_error(errno.ENOSYS, "io_uring_setup", "not supported by these kernel headers")
    fd = lib.kvt_io_uring_setup(1)
    if fd < 0:
        raise os_error(_errno(), "io_uring_setup(1)")
    rc = lib.kvt_io_uring_register_buffers(fd, ffi.cast("struct iovec *", ffi.from_buffer(iov)), len(iov))
    if rc < 0:
        err = _errno()
        os.close(fd)
        raise os_error(err, f"io_uring_register(IORING_REGISTER_BUFFERS, {len(iov)} ranges)")
    return int(fd)


def unpin_longterm(fd: int) -> None:
    """Drop the pins of ``pin_longterm`` now (closing the ring alone defers
    the unpin to a kernel worker) and close the ring."""
    try:
        if lib.kvt_io_uring_unregister_buffers(fd) < 0:
            raise os_error(_errno(), "io_uring_register(IORING_UNREGISTER_BUFFERS)")
    finally:
        os.close(fd)
