"""Page address generation for batches of blocks (pure numpy, no kernel)."""

import numpy as np
import pytest

from kvtier.errors import InvalidArgument
from kvtier.kernel.migrator import page_layout

P = 4096


def test_contiguous_blocks_form_one_run():
    starts = np.array([0x10000, 0x12000, 0x14000], dtype=np.uint64)
    lay = page_layout(starts, 0x2000, P)
    assert lay.pages.tolist() == [2, 2, 2]
    assert lay.addrs.tolist() == [0x10000 + i * P for i in range(6)]
    assert lay.first.tolist() == [0, 2, 4]
    assert lay.per_block(np.array([1, 0, 1, 1, 0, 0], dtype=bool)).tolist() == [1, 2, 0]
    assert lay.runs == [(0x10000, 0, 6)]


def test_gaps_split_runs_and_unaligned_ends_round_out():
    starts = np.array([0x10000, 0x20800], dtype=np.uint64)
    lengths = np.array([0x1001, 0x100], dtype=np.uint64)
    lay = page_layout(starts, lengths, P)
    # 0x10000+0x1001 spans two pages; 0x20800+0x100 lies in page 0x20000.
    assert lay.pages.tolist() == [2, 1]
    assert lay.addrs.tolist() == [0x10000, 0x11000, 0x20000]
    assert lay.runs == [(0x10000, 0, 2), (0x20000, 2, 1)]


def test_zero_length_block_is_refused():
    with pytest.raises(InvalidArgument):
        page_layout(np.array([0x1000], dtype=np.uint64), 0, P)


def test_large_batch_has_no_per_page_python_work():
    n = 4096  # 4096 blocks of 2 MiB = 2M pages
    starts = 0x7F0000000000 + np.arange(n, dtype=np.uint64) * np.uint64(2 << 20)
    lay = page_layout(starts, 2 << 20, P)
    assert len(lay.addrs) == n * 512
    assert np.all(np.diff(lay.addrs.astype(np.int64)) == P)
    assert len(lay.runs) == 1


def test_dry_run_record_is_bounded():
    # A dry run may last weeks: it keeps its last DRY_RUN_RECORD calls, newest last.
    from kvtier.kernel.migrator import DRY_RUN_RECORD, Migrator

    mig = Migrator(dry_run=True, max_node=0)
    for i in range(DRY_RUN_RECORD + 10):
        res = mig.move(1, np.array([0x10000 * (i + 1)], dtype=np.uint64), 4096, 0)
        assert res.dry_run and res.done == 0
    assert len(mig.record) == DRY_RUN_RECORD
    assert mig.record[-1]["pages"] == 1 and mig.record[0] is not mig.record[-1]
