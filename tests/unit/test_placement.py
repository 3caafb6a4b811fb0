"""Placement at allocation: the pure choice, and the kernel facts it reads
(from the QEMU guest's captured sysfs: node 2 is CXL memory onlined movable)."""

from __future__ import annotations

import os

import pytest

from kvtier import placement as pl
from kvtier.errors import InvalidArgument
from kvtier.kernel import affinity
from kvtier.policy import TierState

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
GIB = 1 << 30


def guest_like(far_free=(8 * GIB, 8 * GIB), dram_room=4 * GIB, cxl_movable=True):
    """DRAM node 0; a far tier of nodes 1 and 3 (distance 30 and 20 from the
    caller); a CXL node 2; swap."""
    return [
        pl.TierRoom(0, "dram", "dram", dram_room, (pl.NodeRoom(0, 16 * GIB, False, 10),)),
        pl.TierRoom(1, "far0", "far", 64 * GIB, (pl.NodeRoom(1, far_free[0], False, 30),
                                                  pl.NodeRoom(3, far_free[1], False, 20))),
        pl.TierRoom(2, "cxl0", "cxl", 64 * GIB, (pl.NodeRoom(2, 32 * GIB, cxl_movable, 40),)),
        pl.TierRoom(3, "swap", "swap", 64 * GIB, ()),
    ]


def test_auto_takes_the_fastest_tier_with_room():
    p = pl.choose(GIB, guest_like(), None, False)
    assert (p.tier, p.node) == (0, 0)
    p = pl.choose(8 * GIB, guest_like(), None, False)
    assert (p.tier_name, p.node) == ("far0", 3)
    assert "dram" in p.reason and "high watermark" in p.reason


def test_nearest_node_of_a_tier_wins_then_the_one_with_room():
    assert pl.choose(GIB, guest_like(), 1, False).node == 3  # distance 20 beats 30
    assert pl.choose(4 * GIB, guest_like(far_free=(8 * GIB, 2 * GIB)), 1, False).node == 1


def test_pinned_refuses_zone_movable_and_swap():
    with pytest.raises(InvalidArgument, match="ZONE_MOVABLE"):
        pl.choose(GIB, guest_like(), 2, True)
    assert pl.choose(GIB, guest_like(), 2, False).node == 2  # unpinned may go there
    assert pl.choose(GIB, guest_like(cxl_movable=False), 2, True).node == 2
    with pytest.raises(InvalidArgument, match="swap"):
        pl.choose(GIB, guest_like(), 3, True)
    # auto never lands a pinned pool on the movable node: it fails with the reason.
    full = guest_like(far_free=(0, 0), dram_room=0)
    with pytest.raises(pl.NoRoom, match="ZONE_MOVABLE"):
        pl.choose(GIB, full, None, True)
    assert pl.choose(GIB, full, None, False).tier_name == "cxl0"


def test_no_room_names_every_tier_it_tried():
    with pytest.raises(pl.NoRoom) as e:
        pl.choose(100 * GIB, guest_like(), None, False)
    assert all(name in str(e.value) for name in ("dram", "far0", "cxl0"))
    with pytest.raises(InvalidArgument, match="no tier 9"):
        pl.choose(GIB, guest_like(), 9, False)


def test_rooms_count_reservations_and_the_tenant_quota():
    states = [TierState(0, "dram", "dram", 10 * GIB, used_bytes=2 * GIB), TierState(1, "swap", "swap", 10 * GIB)]
    nodes = {0: (8 * GIB, False, 10, None)}
    r = pl.rooms(states, [10 * GIB, 10 * GIB], 0.9, [3 * GIB, 0], nodes, {0: (0,)})
    assert r[0].room == pytest.approx(9 * GIB - 5 * GIB)
    assert r[0].nodes == (pl.NodeRoom(0, 8 * GIB, False, 10, None),)
    r = pl.rooms(states, [10 * GIB, 10 * GIB], 0.9, [0, 0], nodes, {0: (0,)}, tenant_room0=GIB)
    assert r[0].room == GIB
    with pytest.raises(pl.NoRoom, match="quota"):  # and swap is never chosen
        pl.choose(2 * GIB, r, None, False)


def test_affinity_reads_movable_nodes_and_caller_cpus():
    assert affinity.movable_only_nodes(os.path.join(FIX, "qemu-cxl", "sys")) == {2}
    assert affinity.movable_only_nodes(os.path.join(FIX, "host-1node", "sys")) == frozenset()
    assert set(affinity.caller_cpus(os.getpid())) == os.sched_getaffinity(0)
