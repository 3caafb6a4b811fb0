"""Region.hint_set against a real kvtierd: a set touched once per step tells
the daemon what a hint of its blocks per step would (same temperatures,
same hint counters), counts a changed set from the change, and loses no
count at close."""

from __future__ import annotations

import asyncio
import mmap

import numpy as np
import pytest

from kvtier import protocol
from kvtier.aio import AsyncClient
from test_daemon import DaemonProc, workdir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.root

MIB = 1 << 20
BLOCKS = 32


@pytest.fixture
def still(workdir):
    """A daemon whose temperatures barely decay within a test (tau of 116
    days: a tick decays them by 6e-6; runs never end; ticks 60 s apart), so
    what two regions were told compares to 1e-4 however their hints were
    timed (one read in 300 is 3e-3). A tau whose one-tick factor rounds to
    1 in float32 would end a block's run at every message."""
    d = DaemonProc(workdir, args=("--set", "hotness.tau_s=1e7", "--set", "hotness.end_of_run=0",
                                  "--set", "daemon.tick_interval=60")).start()
    yield d
    assert d.stop() == 0, d.read_log()
    assert "Traceback" not in d.read_log(), d.read_log()


def pool() -> mmap.mmap:
    buf = mmap.mmap(-1, BLOCKS * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"\1" * (BLOCKS * MIB))
    return buf


def temps(c, region: int) -> np.ndarray:
    return protocol.unpack(c.request("blocks", region=region)["temps"], protocol.TEMPS_DTYPE, "temps")


def block_hints(c, region: int) -> int:
    return next(r for r in c.request("regions")["regions"] if r["id"] == region)["block_hints"]


@pytest.mark.parametrize("client_args", [
    {},  # through the hint ring
    {"hint_ring": False},  # on the socket
    {"hint_batch": 64},  # flushes past hint_batch entries: one entry per block with its count
], ids=["ring", "socket", "counts"])
def test_touches_tell_the_daemon_what_a_hint_per_step_does(still, client_args):
    per_call, by_set = pool(), pool()
    with still.client(**client_args) as c:
        a = c.register(per_call, block_size=MIB, name="per-call")
        b = c.register(by_set, block_size=MIB, name="hint-set")
        seq = [3, 4, 5, 30]
        hs = b.hint_set(seq)
        for step in range(300):
            if step in (40, 170):  # the sequence grows by a block
                seq.append(7 + step // 40)
                hs.extend(seq[-1:])
            a.hint(np.array(seq, dtype=np.uint32))
            hs.touch()
        assert c.flush() == []
        assert hs.pending == 0
        ta, tb = temps(c, a.id), temps(c, b.id)
        assert (ta[seq] > 0).all()
        np.testing.assert_allclose(tb, ta, rtol=1e-4)
        hinted = 300 * 4 + 260 + 130
        assert block_hints(c, a.id) == hinted
        if "hint_batch" in client_args:
            # One entry per block and flush: the daemon's counter counts entries.
            assert block_hints(c, b.id) < hinted
        else:
            assert block_hints(c, b.id) == hinted
        if client_args.get("hint_ring", True):
            assert c.ring is not None, c.ring_error


def test_a_changed_set_counts_from_the_change(still):
    with still.client(hint_interval=3600) as c:
        region = c.register(pool(), block_size=MIB)
        hs = region.hint_set([1, 2])
        for _ in range(3):
            hs.touch()
        hs.extend(np.array([5], dtype=np.uint32))  # read from now on: not by the 3 touches before
        for _ in range(2):
            hs.touch()
        hs.replace([8, 1])  # a different set: the old one keeps its 5 and 2
        for _ in range(4):
            hs.touch()
        assert len(hs) == 2 and hs.blocks.tolist() == [8, 1] and hs.touches == 9
        hs.close()
        assert c.flush() == []
        t = temps(c, region.id)
        reads = np.zeros(BLOCKS)
        reads[[1, 2, 5, 8]] = [5 + 4, 5, 2, 4]
        np.testing.assert_allclose(t / t[8], reads / 4, rtol=1e-4)
        assert block_hints(c, region.id) == reads.sum()


def test_nothing_counted_is_lost_at_close(still):
    buf = pool()
    # hint_interval of an hour: the first touch goes at once (nothing sent
    # for an interval before it), every later one waits for a flush.
    with still.client(hint_interval=3600) as c:
        region = c.register(buf, block_size=MIB)
        rid = region.id
        closed = region.hint_set([0, 1, 2])
        for _ in range(10):
            closed.touch()
        assert closed.pending == 27
        closed.close()  # sends its counts
        with pytest.raises(ValueError, match="closed"):
            closed.touch()
        left_open = region.hint_set([9])
        for _ in range(7):
            left_open.touch()
        assert left_open.pending == 6
    # Client.close flushed the open set; the region outlives the
    # connection (registered by this live process).
    with still.client() as c:
        assert block_hints(c, rid) == 30 + 7
        t = temps(c, rid)
        assert t[0] == t[1] == t[2] > 0 and t[9] > 0 and t[3:9].max() == 0


def test_unregister_retires_the_sets_and_bad_blocks_are_refused(still):
    with still.client() as c:
        region = c.register(pool(), block_size=MIB)
        with pytest.raises(ValueError, match="out of range 0..31"):
            region.hint_set([3, BLOCKS])
        hs = region.hint_set([3])
        with pytest.raises(ValueError, match="out of range"):
            hs.extend([-1])
        assert hs.blocks.tolist() == [3]  # a refused change changes nothing
        hs.touch()
        assert c.flush() == []
        region.unregister()
        with pytest.raises(ValueError, match="closed"):
            hs.touch()
        assert c.flush() == []


def test_async_client_hint_set(still):
    per_call, by_set = pool(), pool()

    async def main():
        async with AsyncClient(still.sock) as kv:
            a = await kv.register(per_call, block_size=MIB)
            b = await kv.register(by_set, block_size=MIB)
            ids = np.array([2, 6, 11], dtype=np.uint32)
            hs = b.hint_set(ids)
            for _ in range(50):
                a.hint(ids)
                hs.touch()
            assert await kv.flush() == []
            return [protocol.unpack((await kv.request("blocks", region=r.id))["temps"], protocol.TEMPS_DTYPE, "t")
                    for r in (a, b)]

    ta, tb = asyncio.run(main())
    assert ta[[2, 6, 11]].min() > 0
    np.testing.assert_allclose(tb, ta, rtol=1e-4)
