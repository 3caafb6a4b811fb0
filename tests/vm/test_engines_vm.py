"""Placement at allocation and prefetch in the guest, where there are nodes
to choose between: DRAM (node 0), far memory (node 1), CXL memory onlined
movable by dax kmem (node 2), NVMe swap.

Long-term pinned pools too: io_uring fixed buffers (FOLL_LONGTERM, the pin
CUDA host memory and RDMA memory regions take) over memory kvtier allocated.
On the far node move_pages cannot migrate them: the kernel answers with the
count of pages it did not move and writes no per-page status; the block
must be marked unmovable, reason pinned, at once. On the CXL node
(ZONE_MOVABLE) the pin itself migrates the pages out (measured: to node 1),
so the placement is silently lost; the daemon must notice and say so.

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
from kvtier.ctl import decode_blocks
from kvtier.kernel import native
from vmhelpers import CXL_NODE, DRAM_NODE, FAR_NODE, GuestKvtierd, MiB, scaled, wait_for

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
    # The engine pins it for real (io_uring fixed buffers: FOLL_LONGTERM):
    # node 1's memory is not ZONE_MOVABLE, so the pin leaves it there.
    ring = native.pin_longterm(native.iovecs(np.array([on_far.start], dtype=np.uint64), on_far.length))
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
    assert (nodes_of(on_far) == FAR_NODE).all()
    kv.request("measure", region=on_far.id)
    wait_for(lambda: (on_far.query() == far["index"]).all(), "the pinned pool measured on the far tier",
             timeout=30, interval=0.1)
    listed = {r["name"]: r for r in kv.request("regions")["regions"]}
    assert listed["far-pinned"]["placement_lost"] == 0
    native.unpin_longterm(ring)


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


def test_hinted_far_pool_reaches_dram_through_the_policy(kvtierd):
    """The comparison for the prefetch above: the same 32 MiB on the far
    tier, read (hinted) every 50 ms as a decoding engine would, reaches DRAM
    through the policy: the hints' temperature must pass promote_temp, then
    a plan (tick 0.5 s here, 1 s by default) or the between-ticks promotion
    into free DRAM moves it. Prints the time from the first hint to
    residency (docs/benchmarks.md, "prefetch against the policy")."""
    kv = kvtierd
    far = tier_named(kv, "far")
    pool = kv.allocate(32 * MiB, 2 * MiB, tier=far["name"], name="hinted")
    data = pool.numpy(np.uint64)
    data[:] = np.arange(data.size, dtype=np.uint64)
    wait_for(lambda: (pool.query() == far["index"]).all(), "pool measured on the far tier", timeout=30, interval=0.05)
    ids = np.arange(pool.nblocks, dtype=np.uint32)
    t0 = time.monotonic()
    end = t0 + scaled(60)
    while not (pool.query() == 0).all():
        assert time.monotonic() < end, f"hinted pool not promoted: {pool.query()}"
        pool.hint(ids)
        time.sleep(0.05)
    took = time.monotonic() - t0
    wait_for(lambda: (nodes_of(pool) == DRAM_NODE).all(), "the kernel to agree", timeout=30, interval=0.05)
    assert (data == np.arange(data.size, dtype=np.uint64)).all()
    print(f"hinted 32 MiB far -> DRAM through the policy: {took:.3f} s first hint to residency (daemon's view)")


POOL = 2 * MiB  # CXL writes run at about 1 MiB/s under TCG


def pinned_pool(kv, tier: dict, name: str):
    """A pool allocated (unpinned: the daemon may move it) on ``tier``,
    written, then pinned long-term by this process, as an engine that
    registers its pool with CUDA after allocating it would."""
    pool = kv.allocate(POOL, POOL, tier=tier["name"], name=name)
    data = pool.numpy(np.uint64)
    data[:] = np.arange(data.size, dtype=np.uint64)
    ring = native.pin_longterm(native.iovecs(np.array([pool.start], dtype=np.uint64), POOL))
    return pool, data, ring


def test_a_pinned_pool_is_unmovable_at_once_with_the_reason(kvtierd):
    """Fails on main: move_pages' statuses are never written for a batch it
    gave up on, and main read its scratch buffer as if they had been (no
    pinned reason either way)."""
    kv = kvtierd
    pool, data, ring = pinned_pool(kv, tier_named(kv, "far"), "far-then-pinned")
    try:
        assert (nodes_of(pool) == FAR_NODE).all()
        wait_for(lambda: (pool.query() >= 0).all(), "the pool measured", timeout=30, interval=0.1)
        assert kv.request("migrate", region=pool.id, tier=0)["queued"] == 1

        def stuck():
            b = decode_blocks(kv.request("blocks", region=pool.id))
            return b["stuck_names"][b["stuck"][0]] == "pinned" and b["flags"][0] & 1

        wait_for(stuck, "block 0 unmovable: pinned", timeout=60, interval=0.1)
        assert (nodes_of(pool) == FAR_NODE).all()  # the kernel did not move it either
        fails = kv.stats()["migration_failed_pages"]
        assert sum(n for k, n in fails.items() if k.endswith(":EBUSY")) == POOL // PAGE, fails
        text = kv.request("explain", region=pool.id, block=0)["text"]
        assert "unmovable: pinned" in text, text
        assert (data == np.arange(data.size, dtype=np.uint64)).all()
    finally:
        native.unpin_longterm(ring)


def test_a_pool_the_pin_moves_out_of_zone_movable_is_reported(kvtierd):
    """Fails on main: nothing compares where an allocated pool is with
    where it was placed (no placement_lost)."""
    kv = kvtierd
    pool, data, ring = pinned_pool(kv, tier_named(kv, "cxl"), "cxl-then-pinned")
    try:
        nodes = nodes_of(pool)
        assert not (nodes == CXL_NODE).any() and (np.isin(nodes, (DRAM_NODE, FAR_NODE))).all(), nodes
        kv.request("measure", region=pool.id)

        def lost():
            r = next(r for r in kv.request("regions")["regions"] if r["id"] == pool.id)
            return r.get("placement_lost") == 1

        wait_for(lost, "the lost placement reported", timeout=60, interval=0.1)
        text = kv.request("explain", region=pool.id, block=0)["text"]
        assert "placement lost" in text and "ZONE_MOVABLE" in text, text
        assert (data == np.arange(data.size, dtype=np.uint64)).all()
    finally:
        native.unpin_longterm(ring)
