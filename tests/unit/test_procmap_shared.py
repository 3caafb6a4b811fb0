"""Which blocks lie in shared memory, from this process's own mappings
(real kernel: PROCMAP_QUERY, or /proc/self/maps before Linux 6.11). The
engine measures in full, once, only such blocks (and those of a process
with pages in swap) when a first look finds no page of them: a private
block found empty is just not written yet, and measuring a sparse 1 TiB
region that way took an hour of the residency budget (scripts/bench/
scale.py: idle CPU 0.7 -> 1.7 % of a core)."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from kvtier.kernel.procmap import ProcProcesses

BLOCK = 64 << 10
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
MAP_FIXED = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _map(addr, length, flags, fd=-1):
    p = _libc.mmap(addr, length, PROT_RW, flags | (MAP_FIXED if addr else 0), fd, 0)
    assert p not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    return p


def test_shared_blocks_are_those_of_shared_mappings_only_across_holes():
    # [private 4][hole 1][shared anonymous 4][hole 1][memfd 4], at fixed places
    base = _map(None, 14 * BLOCK, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fd = os.memfd_create("kvtier-test")
    try:
        os.ftruncate(fd, 4 * BLOCK)
        _libc.munmap(base + 4 * BLOCK, BLOCK)
        _map(base + 5 * BLOCK, 4 * BLOCK, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        _libc.munmap(base + 9 * BLOCK, BLOCK)
        _map(base + 10 * BLOCK, 4 * BLOCK, mmap.MAP_SHARED, fd)
        blocks = [0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13]
        starts = (base + BLOCK * np.array(blocks)).astype(np.uint64)
        p = ProcProcesses()
        got = p.shared_blocks(os.getpid(), starts, np.uint64(BLOCK))
        assert got.tolist() == [False] * 4 + [True] * 8
        perm = np.random.default_rng(1).permutation(starts.size)  # any order
        assert p.shared_blocks(os.getpid(), starts[perm], np.uint64(BLOCK)).tolist() == got[perm].tolist()
        assert p.shared_blocks(os.getpid(), starts[:0], starts[:0]).size == 0
        assert p.swapped_bytes(os.getpid()) >= 0
    finally:
        os.close(fd)
        _libc.munmap(base, 14 * BLOCK)
