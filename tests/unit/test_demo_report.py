"""The demo report's ideal tierers (scripts/demo/report.py), on hand-made
timelines whose best placement is worked out by hand in each test.

The report sets kvtier's bytes moved beside them (issue 11 item 6), so a
reference that moves too little or serves too much would make kvtier look
worse or better than it is. One block is one byte here; DRAM holds ``cap``
blocks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "demo_report", Path(__file__).resolve().parents[2] / "scripts/demo/report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def second(t, reads=(), alloc=(), fresh=None, discarded=()):
    """One second of the workload's timeline: blocks read (once each unless
    given as (block, count)), blocks allocated (fresh: in a dropped slot,
    placed by first touch) and blocks discarded."""
    reads = [r if isinstance(r, tuple) else (r, 1) for r in reads]
    return {"t": float(t), "read_blocks": [b for b, _ in reads], "read_counts": [c for _, c in reads],
            "alloc_blocks": list(alloc), "alloc_fresh": list(alloc if fresh is None else fresh),
            "discarded": list(discarded)}


def test_foresight_leaves_out_the_block_read_farthest_ahead():
    # Three new blocks, room for two: the one read last (2) goes, and when it
    # is read, only once more never, it is served where it is, not promoted.
    tl = [second(0, alloc=[0, 1, 2]), second(1, [0]), second(2, [1]), second(3, [2]), second(4, [0])]
    f = report.foresight(tl, 2, 1)
    assert f["share"] == pytest.approx(3 / 4)
    assert (f["promoted"], f["demoted"]) == (0, 1)


def test_foresight_promotes_a_block_read_again_soon():
    # Room for one. Block 1's arrival pushes out block 0 (read again at 3,
    # after 1 at 2); at 3 block 0 is read from outside DRAM and read again at
    # 4 while block 1 never is: 0 comes back, 1 leaves.
    tl = [second(0, alloc=[0]), second(1, [0], alloc=[1]), second(2, [1]), second(3, [0]), second(4, [0])]
    f = report.foresight(tl, 1, 1)
    assert f["share"] == pytest.approx(3 / 4)
    assert (f["promoted"], f["demoted"], f["bytes"]) == (1, 2, 3)


def test_foresight_weighs_reads_and_frees_discarded_room():
    # A discarded block's room is free (no demotion for the block that takes
    # it); reads count with their multiplicity.
    tl = [second(0, alloc=[0]), second(1, [(0, 5)], alloc=[1], discarded=[0]), second(2, [(1, 3)])]
    f = report.foresight(tl, 1, 1)
    assert f["share"] == pytest.approx(1.0)
    assert f["bytes"] == 0


def test_foresight_beats_the_floor_and_lru_on_share():
    # A hot pair read every second and a stream of new blocks read once:
    # foresight keeps the pair; the floor demotes the pair for the new
    # blocks and never takes it back.
    tl = [second(0, alloc=[0, 1, 2])]
    for t in range(1, 9):
        tl.append(second(t, [0, 1, 1 + t], alloc=[2 + t]))
    cap = 3
    f = report.foresight(tl, cap, 1)
    floor = report.turnover(tl, cap, 1)
    lru = report.turnover(tl, cap, 1, reenter=True)
    assert f["share"] == pytest.approx(1.0)
    assert floor["share"] < 0.9
    assert lru["share"] <= f["share"]
    # each new block pushes out the one read last second, never read again
    assert (f["promoted"], f["demoted"]) == (0, 8)


def test_foresight_needs_the_ground_truth():
    assert report.foresight([{"t": 0.0, "reads": 3}], 4, 1) is None
