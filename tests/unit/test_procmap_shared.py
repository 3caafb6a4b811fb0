"""Which blocks lie in shared memory, from this process's own mappings
(real kernel: PROCMAP_QUERY, or /proc/self/maps before Linux 6.11). The
engine measures in full, once, only such blocks when a first look finds no
page of them: a private block found empty is just not written yet, and
measuring a sparse 1 TiB region that way took an hour of the residency
budget (scripts/bench/scale.py: idle CPU 0.7 -> 1.7 % of a core)."""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvtier.kernel.procmap import ProcProcesses

BLOCK = 64 << 10


def _addr(m: mmap.mmap) -> int:
    return np.frombuffer(m, dtype=np.uint8).ctypes.data


def test_shared_blocks_are_those_of_shared_mappings_only():
    private = mmap.mmap(-1, 4 * BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    shared = mmap.mmap(-1, 4 * BLOCK, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    fd = os.memfd_create("kvtier-test")
    os.ftruncate(fd, 4 * BLOCK)
    memfd = mmap.mmap(fd, 4 * BLOCK, flags=mmap.MAP_SHARED)
    os.close(fd)
    starts = np.concatenate([_addr(m) + BLOCK * np.arange(4, dtype=np.uint64)
                             for m in (private, shared, memfd)]).astype(np.uint64)
    got = ProcProcesses().shared_blocks(os.getpid(), starts, np.full(starts.size, BLOCK, dtype=np.uint64))
    assert got.tolist() == [False] * 4 + [True] * 8
    # nothing at all asked: nothing shared; one private block: not shared
    assert ProcProcesses().shared_blocks(os.getpid(), starts[:0], starts[:0]).size == 0
    assert not ProcProcesses().shared_blocks(os.getpid(), starts[:1], np.uint64(BLOCK)).any()
