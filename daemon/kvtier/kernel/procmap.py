"""Range checks through the PROCMAP_QUERY ioctl (Linux 6.11+), maps text otherwise.

Registering a region must check that its range lies in the process's
private anonymous or shared-memory mappings. Reading /proc/PID/maps makes
the kernel format every VMA of the process (hundreds for a Python process,
thousands with CUDA) and Python parse them: ~1 ms for 270 VMAs here, which
alone would blow the register round trip budget. The PROCMAP_QUERY ioctl on
an open /proc/PID/maps returns just the VMA covering an address, so the
check costs one ioctl per VMA the range spans (usually one).

The answer is turned into the same ``procfs.Mapping`` that read_maps
returns and judged by the same ``procfs.check_range``, so what counts as KV
memory is decided in one place. Kernels without the ioctl (ENOTTY) and
fixture trees (regular files) fall back to ``procfs.read_maps``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct

import numpy as np

from kvtier.kernel import procfs
from kvtier.errors import PermissionDenied, ProcessGone, os_error

# include/uapi/linux/fs.h
_QUERY = struct.Struct("=QQQQQQQQQIIIIQQ")  # struct procmap_query, 104 bytes
PROCMAP_QUERY = (3 << 30) | (_QUERY.size << 16) | (ord("f") << 8) | 17  # _IOWR('f', 17, ...)
VMA_READABLE, VMA_WRITABLE, VMA_EXECUTABLE, VMA_SHARED = 0x01, 0x02, 0x04, 0x08
# query_flags: answer the VMA covering the address or, in a gap, the next one
# (so one ioctl per VMA walks a range with holes in it).
COVERING_OR_NEXT_VMA = 0x10
NAME_MAX = 4096


class _Unsupported(Exception):
    pass


def _vma(fd: int, addr: int, name: ctypes.Array, flags: int = 0) -> procfs.Mapping | None:
    """The VMA covering ``addr`` (or the next one, with COVERING_OR_NEXT_VMA),
    None if no VMA does."""
    buf = bytearray(_QUERY.pack(_QUERY.size, flags, addr, 0, 0, 0, 0, 0, 0, 0, 0, NAME_MAX, 0,
                                ctypes.addressof(name), 0))
    try:
        fcntl.ioctl(fd, PROCMAP_QUERY, buf, True)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return None
        if e.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
            raise _Unsupported() from None
        if e.errno == errno.ESRCH:
            raise ProcessGone(e.errno, "PROCMAP_QUERY", "process exited") from None
        raise os_error(e.errno, f"PROCMAP_QUERY at 0x{addr:x}") from None
    # (A fixture tree's regular file answers ENOTTY above: the caller falls back.)
    f = _QUERY.unpack(buf)
    start, end, flags, offset, inode, name_size = f[3], f[4], f[5], f[7], f[8], f[11]
    perms = ("r" if flags & VMA_READABLE else "-") + ("w" if flags & VMA_WRITABLE else "-") + \
            ("x" if flags & VMA_EXECUTABLE else "-") + ("s" if flags & VMA_SHARED else "p")
    # name_size counts the terminating NUL; 0 means an anonymous VMA.
    path = name.raw[: max(0, name_size - 1)].decode(errors="replace") if name_size else ""
    return procfs.Mapping(start, end, perms, offset, inode, path)


def _open_maps(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ProcessGone(errno.ESRCH, f"open {path}", "process does not exist") from None
    except PermissionError as e:
        raise PermissionDenied(e.errno, f"open {path}") from None


def _query_range(path: str, start: int, length: int) -> list[procfs.Mapping]:
    fd = _open_maps(path)
    try:
        name = ctypes.create_string_buffer(NAME_MAX)
        out: list[procfs.Mapping] = []
        pos, end = start, start + length
        while pos < end:
            m = _vma(fd, pos, name)
            if m is None:
                break  # a gap: check_range reports it
            out.append(m)
            pos = m.end
        return out
    finally:
        os.close(fd)


def mappings(pid: int, start: int, length: int, proc_root: str = "/proc") -> list[procfs.Mapping]:
    """The mappings of ``pid`` that [start, start+length) overlaps, in address
    order, up to the first gap (with the maps text fallback: every mapping)."""
    path = os.path.join(proc_root, str(pid), procfs.PROC_MAPS)
    try:
        return _query_range(path, start, length)
    except _Unsupported:
        end = start + length
        return [m for m in procfs.read_maps(pid, proc_root) if m.end > start and m.start < end]


def check_range(pid: int, start: int, length: int, proc_root: str = "/proc", *, kv_only: bool = True) -> None:
    """Raise RangeNotMapped unless [start, start+length) lies in mappings of
    ``pid`` that are private anonymous or shared memory (readable too with
    ``kv_only``; procfs.check_range rules)."""
    procfs.check_range(mappings(pid, start, length, proc_root), start, length, kv_only=kv_only)


def _spans(pid: int, runs: list[tuple[int, int]], proc_root: str, shared_only: bool = False) -> np.ndarray:
    """(start, end) of every mapping overlapping the address runs (only the
    shared ones with ``shared_only``), sorted, adjacent ones merged: (n, 2)
    uint64."""
    path = os.path.join(proc_root, str(pid), procfs.PROC_MAPS)
    out: list[tuple[int, int]] = []
    try:
        fd = _open_maps(path)
        try:
            name = ctypes.create_string_buffer(NAME_MAX)
            for lo, hi in runs:
                pos = lo
                while pos < hi:
                    m = _vma(fd, pos, name, COVERING_OR_NEXT_VMA)
                    if m is None or m.start >= hi:
                        break
                    if m.shared or not shared_only:
                        out.append((m.start, m.end))
                    pos = m.end
        finally:
            os.close(fd)
    except _Unsupported:
        out = [(m.start, m.end) for m in procfs.read_maps(pid, proc_root)
               if (m.shared or not shared_only) and any(m.start < hi and m.end > lo for lo, hi in runs)]
    if not out:
        return np.zeros((0, 2), dtype=np.uint64)
    spans = np.array(sorted(out), dtype=np.uint64)
    # merge touching mappings (a VMA split by mbind or madvise is still mapped)
    new = np.concatenate(([True], spans[1:, 0] > spans[:-1, 1]))
    starts = spans[new, 0]
    ends = np.maximum.reduceat(spans[:, 1], np.flatnonzero(new))
    return np.stack([starts, ends], axis=1)


def mapped_blocks(pid: int, starts: np.ndarray, lengths: np.ndarray, proc_root: str = "/proc") -> np.ndarray:
    """Per block, whether all of [start, start+length) is mapped (by any
    mapping: what move_pages and MADV_PAGEOUT need to act on it).

    One PROCMAP_QUERY per VMA the blocks span (gaps are skipped by asking
    for the covering-or-next VMA), /proc/PID/maps before Linux 6.11; the
    per-block answer is one searchsorted over the merged mappings. This is
    how a block freed under the daemon (munmap) is told apart from one the
    kernel answers EFAULT for while it is mapped (the shared zero page)."""
    starts = np.asarray(starts, dtype=np.uint64)
    ends = starts + np.broadcast_to(np.asarray(lengths, dtype=np.uint64), starts.shape)
    if starts.size == 0:
        return np.zeros(0, dtype=bool)
    # blocks of a region come sorted: no sort (a pass, not O(n log n) and copies)
    order = None if starts.size < 2 or bool((starts[1:] >= starts[:-1]).all()) else np.argsort(starts, kind="stable")
    s, e = (starts, ends) if order is None else (starts[order], ends[order])
    # contiguous runs of blocks: one walk each (blocks of one region are adjacent)
    brk = np.flatnonzero(s[1:] != e[:-1]) + 1
    firsts = np.concatenate(([0], brk))
    runs = list(zip(s[firsts].tolist(), np.maximum.reduceat(e, firsts).tolist()))
    spans = _spans(pid, runs, proc_root)
    if not spans.shape[0]:
        return np.zeros(starts.size, dtype=bool)
    if spans.shape[0] == 1:  # the usual case: one mapping holds the region
        ok = (s >= spans[0, 0]) & (e <= spans[0, 1])
    else:
        k = np.searchsorted(spans[:, 0], s, side="right") - 1
        kk = np.maximum(k, 0)
        ok = (k >= 0) & (e <= spans[kk, 1]) & (s >= spans[kk, 0])
    if order is None:
        return ok
    out = np.empty(starts.size, dtype=bool)
    out[order] = ok
    return out


def shared_blocks(pid: int, starts: np.ndarray, lengths: np.ndarray, proc_root: str = "/proc") -> np.ndarray:
    """Per block, whether it starts in a shared mapping (MAP_SHARED
    anonymous, memfd, /dev/shm): memory another process may have paged in
    or out, which this process's page tables need not show. One walk over
    the mappings the blocks span, gaps between them skipped."""
    starts = np.asarray(starts, dtype=np.uint64)
    if starts.size == 0:
        return np.zeros(0, dtype=bool)
    ends = starts + np.broadcast_to(np.asarray(lengths, dtype=np.uint64), starts.shape)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    brk = np.flatnonzero(s[1:] != e[:-1]) + 1
    firsts = np.concatenate(([0], brk))
    runs = list(zip(s[firsts].tolist(), np.maximum.reduceat(e, firsts).tolist()))
    spans = _spans(pid, runs, proc_root, shared_only=True)
    out = np.zeros(starts.size, dtype=bool)
    if spans.shape[0]:
        k = np.searchsorted(spans[:, 0], s, side="right") - 1
        kk = np.maximum(k, 0)
        out[order] = (k >= 0) & (s >= spans[kk, 0]) & (s < spans[kk, 1])
    return out


class ProcProcesses:
    """The registry's ``ProcessChecker`` over a /proc tree: start time from
    /proc/PID/stat, ranges checked with PROCMAP_QUERY (maps as fallback)."""

    def __init__(self, proc_root: str = "/proc"):
        self.proc_root = proc_root

    def start_time(self, pid: int) -> int:
        return procfs.read_start_time(pid, self.proc_root)

    def check_range(self, pid: int, start: int, length: int) -> None:
        check_range(pid, start, length, self.proc_root)

    def alive(self, pid: int, start_time: int | None) -> bool:
        return procfs.process_alive(pid, start_time, self.proc_root)

    def mapped_blocks(self, pid: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return mapped_blocks(pid, starts, lengths, self.proc_root)

    def shared_blocks(self, pid: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return shared_blocks(pid, starts, lengths, self.proc_root)

    def swapped_bytes(self, pid: int) -> int:
        return procfs.read_swapped_bytes(pid, self.proc_root)

    def uids(self, pid: int) -> tuple[int, int]:
        return procfs.read_uids(pid, self.proc_root)
