"""Forgetting many regions at once (a process with hundreds of regions
exits): one pass over the block table and one state write, every other
region's blocks intact. Real pieces: this process's own sparse mappings,
the real Registry, BlockTable and /proc."""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvtier.blocks import BlockTable
from kvtier.hotness import Temperature
from kvtier.kernel.procmap import ProcProcesses
from kvtier.registry import Limits, Registry
from kvtier.stats import DaemonStats

BLOCK = 64 << 10
MAP_NORESERVE = 0x4000


def test_many_regions_leave_in_one_state_write_and_the_rest_keep_their_blocks():
    writes = []
    table = BlockTable()
    stats = DaemonStats()
    reg = Registry(table, Limits(), stats, Temperature(30.0), ProcProcesses("/proc"),
                   on_change=lambda: writes.append(1))
    maps = [mmap.mmap(-1, BLOCK * (i % 5 + 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
            for i in range(200)]
    addrs = [np.frombuffer(m, dtype=np.uint8).ctypes.data for m in maps]
    ids = [reg.add(os.getpid(), a, len(m), BLOCK, name=f"r{i}").id for i, (a, m) in enumerate(zip(addrs, maps))]
    for rid in ids:
        table.region_view(rid, "temp")[:] = rid  # per-block state that must follow its rows
    writes.clear()
    gone = ids[1::2] + ids[:1]
    removed = reg.remove_many(gone)
    assert [r.id for r in removed] == gone
    assert len(writes) == 1  # the state write follows once, not 101 times
    left = [rid for rid in ids if rid not in set(gone)]
    assert sorted(reg.regions) == sorted(left)
    assert stats.regions == 99 and stats.blocks == len(table)
    assert len(table) == sum(len(maps[ids.index(rid)]) // BLOCK for rid in left)
    for rid in left:
        m = maps[ids.index(rid)]
        np.testing.assert_array_equal(table.region_view(rid, "addr"),
                                      addrs[ids.index(rid)] + BLOCK * np.arange(len(m) // BLOCK, dtype=np.uint64))
        assert (table.region_view(rid, "temp") == rid).all()
    assert reg.drop_pid(os.getpid()) == 99
    assert not reg.regions and len(table) == 0 and stats.regions_dropped_exit_total == 99
    assert all("exited" in reg.drop_reasons[rid] for rid in left)
