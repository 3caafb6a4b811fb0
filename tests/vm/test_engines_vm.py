"""Placement at allocation and prefetch in the guest, where there are nodes
to choose between: DRAM (node 0), far memory (node 1), CXL memory onlined
movable by dax kmem (node 2), NVMe swap.

Small on purpose: writes to the emulated CXL device run at about 1 MiB/s
under TCG, so only 2 MiB go there; bulk work uses node 1.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import Client, KvtierClientError
from kvtier.kernel import native
from vmhelpers import CXL_NODE, DRAM_NODE, FAR_NODE, GuestKvtierd, MiB, scaled

pytestmark = pytest.mark.vm

PAGE = native.PAGE_SIZE


def nodes_of(region) -> np.ndarray:
    addrs = np.arange(region.start, region.start + region.length, PAGE, dtype=np.uint64)
    return native.move_pages(os.getpid(), addrs, None)


@pytest.fixture
def kvtierd(tmp_path: Path):
    with GuestKvtierd(tmp_path, "[metrics]\nenabled = false\n", daemon={"tick_interval": 0.5},
                      name="test_engines_vm", client_timeout=30) as d:
        yield d.client


def tier_named(client: Client, kind: str) -> dict:
    return next(t for t in client.request("tiers")["tiers"] if t["kind"] == kind)


def test_allocate_lands_on_the_chosen_nodes_and_refuses_movable_for_pinned(kvtierd):
    kv = kvtierd
    far, cxl = tier_named(kv, "far"), tier_named(kv, "cxl")
    assert far["nodes"] == [FAR_NODE] and cxl["nodes"] == [CXL_NODE]
    auto = kv.allocate(8 * MiB, 2 * MiB, name="auto")
    assert auto.placement["node"] == DRAM_NODE
    assert (nodes_of(auto) == DRAM_NODE).all()
    on_far = kv.allocate(16 * MiB, 2 * MiB, tier=far["name"], pinned=True, name="far-pinned")
    # the caller's CPUs are node 0's: the reason names the distance it used
    assert on_far.placement["node"] == FAR_NODE and "distance" in on_far.placement["reason"]
    assert (nodes_of(on_far) == FAR_NODE).all()  # bound before the first touch, not moved after
    # The CXL node's memory is ZONE_MOVABLE: a pinned pool there would be
    # migrated out by the pin itself. Refused, with the reason.
    with pytest.raises(KvtierClientError) as e:
        kv.allocate(2 * MiB, 2 * MiB, tier=cxl["name"], pinned=True)
    assert e.value.code == "invalid_argument" and "ZONE_MOVABLE" in str(e.value)
    unpinned = kv.allocate(2 * MiB, 2 * MiB, tier=cxl["name"], name="cxl")
    assert (nodes_of(unpinned) == CXL_NODE).all()
    listed = {r["name"]: r for r in kv.request("regions")["regions"]}
    assert listed["far-pinned"]["pinned"] and listed["far-pinned"]["placement"]["node"] == FAR_NODE

    # The pinned pool counts in its tier, and the policy never plans it.
    def counted():
        t = tier_named(kv, "far")
        return t["kvtier_bytes"] >= 16 * MiB

    end = time.monotonic() + scaled(30)
    while not counted():
        assert time.monotonic() < end, "pinned pool not counted in the far tier"
        time.sleep(0.1)
    with pytest.raises(KvtierClientError, match="pinned"):
        kv.request("migrate", region=on_far.id, tier=0)


def test_prefetch_brings_a_far_pool_to_dram_without_waiting_for_the_policy(kvtierd):
    kv = kvtierd
    far = tier_named(kv, "far")
    pool = kv.allocate(32 * MiB, 2 * MiB, tier=far["name"], name="session")
    data = pool.numpy(np.uint64)
    data[:] = np.arange(data.size, dtype=np.uint64)
    end = time.monotonic() + scaled(30)
    while not (pool.query() == far["index"]).all():
        assert time.monotonic() < end, f"pool not measured on the far tier: {pool.query()}"
        time.sleep(0.05)
    # Cold (never hinted): the policy alone would leave it where it is.
    r = pool.prefetch(wait=True, timeout=scaled(60))
    assert r["queued"] == pool.nblocks
    assert (nodes_of(pool) == DRAM_NODE).all()  # the kernel agrees
    assert (data == np.arange(data.size, dtype=np.uint64)).all()
    st = kv.stats()
    assert st["prefetch_seconds_hist"]["count"] == pool.nblocks
    print(f"prefetch 32 MiB far -> DRAM: {r['seconds']:.3f} s request to residency (client), "
          f"daemon mean {st['prefetch_seconds_hist']['sum'] / pool.nblocks:.3f} s per block")
    # And release sends blocks one tier down again (DRAM's next tier; two
    # blocks only, in case that tier is the slow CXL device).
    assert pool.release([0, 1])["queued"] == 2
    end = time.monotonic() + scaled(60)
    while not (pool.query()[:2] == 1).all():
        assert time.monotonic() < end, f"released blocks not one tier down: {pool.query()}"
        time.sleep(0.05)
    assert (pool.query()[2:] == 0).all()
