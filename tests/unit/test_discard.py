"""Phase ``discard`` and the client's page drop: a block whose contents are
dead is never moved for what it held, frees its tier's room at once, and its
slot's next write is a new block."""

from __future__ import annotations

import ctypes
import errno
import mmap

import numpy as np
import pytest

from kvtier.blocks import F_NOT_PRESENT, F_PREFILL_DONE, F_STALE, F_UNMOVABLE, STUCK_PINNED, TIER_UNKNOWN, BlockTable
from kvtier.client import block_runs, drop_blocks
from kvtier.hotness import Temperature, apply_phase
from kvtier.policy import MIB, PolicyConfig, PolicyState, TierState, plan

BS = 2 * MIB
PAGE = mmap.PAGESIZE


def table(n: int, tier: int) -> BlockTable:
    t = BlockTable()
    t.add_region(1, 1000, 1 << 40, n * BS, BS)
    t.flags[:] &= ~np.uint8(F_NOT_PRESENT)
    t.tier[:] = tier
    return t


def three_tiers(dram: int, far: int) -> list[TierState]:
    return [TierState(0, "dram", "dram", dram * BS), TierState(1, "far0", "far", far * BS),
            TierState(2, "swap", "swap", 1000 * BS)]


def cfg() -> PolicyConfig:
    return PolicyConfig(high_wm=1.0, low_wm=0.8, promote_temp=2.0, demote_temp=0.5, min_residence_s=0.0,
                        margin_sigma=0.0)


def test_discarded_blocks_are_never_moved_and_free_their_room():
    # far0 holds 6 blocks against a target of 4; two of them are a finished
    # request's blocks kept for a prefix cache ("free"), two are dead
    # ("discard"). Only the kept ones are data worth paging out; the dead
    # ones leave far0 at once, so the tier is within target without a move
    # of dead data, and a hot block in swap gets the room.
    t = table(7, tier=1)
    t.tier[6] = 2
    t.temp[:] = 5.0
    t.temp[6] = 50.0
    apply_phase(t, np.array([0, 1]), "free")
    apply_phase(t, np.array([2, 3]), "discard")
    assert (t.tier[[2, 3]] == TIER_UNKNOWN).all()
    assert (t.flags[[2, 3]] & (F_NOT_PRESENT | F_STALE) == (F_NOT_PRESENT | F_STALE)).all()
    p, _ = plan(t.snapshot(), three_tiers(0, 4), cfg(), PolicyState(), 100.0)
    assert not set(p.rows.tolist()) & {2, 3}
    # 4 live blocks + the promoted one in a target of 4: one kept block goes
    assert 6 in p.rows[p.dst == 1].tolist()
    assert set(p.rows[p.dst == 2].tolist()) <= {0, 1}

    # The same table with the dead blocks only "free": they are moved (paged
    # out first, being coldest), which is what discard exists to avoid.
    t2 = table(7, tier=1)
    t2.tier[6] = 2
    t2.temp[:] = 5.0
    t2.temp[6] = 50.0
    apply_phase(t2, np.array([0, 1, 2, 3]), "free")
    p2, _ = plan(t2.snapshot(), three_tiers(0, 4), cfg(), PolicyState(), 100.0)
    assert set(p2.rows[p2.dst == 2].tolist()) & {2, 3}


def test_the_next_write_is_a_new_block_and_the_memory_keeps_its_flags():
    h = Temperature(5.0)
    t = table(2, tier=1)
    for k in range(4):  # three runs of reads
        h.decay(t, 10.0 * k)
        h.add(t, np.array([0, 1]), 10.0, 10.0 * k)
        apply_phase(t, np.array([0, 1]), "free")
    t.fail_count[:] = 3
    t.retry_at[:] = 200.0
    t.returns[:] = 2
    t.flags[1] |= np.uint8(F_UNMOVABLE)
    t.stuck[1] = STUCK_PINNED
    apply_phase(t, np.array([0, 1]), "discard")
    assert (t.runs == 0).all() and (t.temp == 0).all() and (t.returns == 0).all()
    assert (t.flags & F_PREFILL_DONE == 0).all()
    assert t.retry_at[0] == -np.inf and t.fail_count[0] == 0
    # a pinned slot stays pinned, with its re-probe time: that is the memory
    assert t.flags[1] & F_UNMOVABLE and t.stuck[1] == STUCK_PINNED and t.retry_at[1] == 200.0
    # the new block's first read starts its first run
    h.decay(t, 40.0)
    h.add(t, np.array([0]), 10.0, 40.0)
    assert t.runs[0] == 1 and t.temp[0] == pytest.approx(10.0)


def test_block_runs():
    assert block_runs([5, 1, 2, 3, 9, 8, 3]).tolist() == [[1, 4], [5, 6], [8, 10]]
    assert block_runs([]).shape == (0, 2)


_libc = ctypes.CDLL(None, use_errno=True)


def resident(addr: int, length: int) -> np.ndarray:
    vec = (ctypes.c_ubyte * (length // PAGE))()
    assert _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return np.frombuffer(vec, dtype=np.uint8) & 1


@pytest.mark.parametrize("flags", [mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS],
                         ids=["private", "shared"])
def test_drop_blocks_frees_the_pages_and_the_next_write_gets_zeroed_ones(flags):
    bs, n = 16 * PAGE, 6
    buf = mmap.mmap(-1, bs * n, flags=flags)
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:] = 7
    addr = arr.ctypes.data
    assert resident(addr, bs * n).all()
    assert drop_blocks(addr, bs, [1, 2, 4]) == 3 * bs
    res = resident(addr, bs * n).reshape(n, -1)
    # shared memory needs MADV_REMOVE: DONTNEED would leave its pages in
    # memory (mincore still resident) and the old bytes readable
    assert not res[[1, 2, 4]].any() and res[[0, 3, 5]].all()
    rows = arr.reshape(n, bs)
    assert (rows[[1, 2, 4]] == 0).all() and (rows[[0, 3, 5]] == 7).all()
    del arr, rows
    buf.close()


def test_drop_blocks_of_unmapped_memory_is_a_clear_error():
    buf = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(buf, dtype=np.uint8)
    addr = arr.ctypes.data
    del arr
    buf.close()
    with pytest.raises(OSError) as e:
        drop_blocks(addr, PAGE, [0, 1])
    assert e.value.errno == errno.ENOMEM and "dropping blocks 0..1" in str(e.value)
