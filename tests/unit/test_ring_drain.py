"""The daemon's drains of the shared-memory hint rings: what an open ring
costs while its client has nothing to hint, and that hints are still seen
at the configured interval once it writes again.

Real pieces: the ControlAPI, the Registry and a ring made by the daemon
side (a memfd) mapped by the client side. What is counted is drain passes
and the waits the daemon arms between them, never time.
"""

from __future__ import annotations

import asyncio
import mmap
import os

import numpy as np
import pytest

from kvtier import hintring, protocol
from kvtier.blocks import BlockTable
from kvtier.hotness import Temperature
from kvtier.kernel.procmap import ProcProcesses
from kvtier.registry import Limits, Registry
from kvtier.server import ControlAPI, Peer
from kvtier.stats import DaemonStats

BLOCK = 2 << 20
INTERVAL = 0.02


@pytest.fixture
def rig():
    loop = asyncio.new_event_loop()
    stats = DaemonStats()
    registry = Registry(BlockTable(), Limits(), stats, Temperature(30.0), ProcProcesses("/proc"))
    m = mmap.mmap(-1, 8 * BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    rid = registry.add(os.getpid(), np.frombuffer(m, dtype=np.uint8).ctypes.data, 8 * BLOCK, BLOCK).id
    api = ControlAPI(registry, None, stats, 1 << 20)
    api.ring_interval = INTERVAL
    peer = Peer(os.getpid(), os.getuid(), os.getgid(), True)

    async def open_ring() -> hintring.ClientRing:
        answer = api.handle(peer, protocol.HintRing())
        ring = hintring.ClientRing(os.dup(answer.fd))
        answer.done(True)
        return ring

    client = loop.run_until_complete(open_ring())
    yield loop, api, peer, client, rid, stats
    client.close()
    api.close_rings()
    loop.close()
    del m


def wait_armed(loop: asyncio.AbstractEventLoop, api: ControlAPI) -> float:
    """The wait the daemon armed before its next drain pass."""
    return api._ring_timer.when() - loop.time()


def idle_passes(loop, api, seconds: float) -> int:
    """Drain passes over ``seconds`` of an idle ring: each pass runs the
    timer's callback and adds the wait it armed."""
    async def go():
        passes, elapsed = 0, wait_armed(loop, api)
        while elapsed < seconds:
            api._drain_rings()
            passes += 1
            elapsed += wait_armed(loop, api)
        return passes

    return loop.run_until_complete(go())


def test_an_idle_ring_is_drained_a_few_times_a_second_not_every_interval(rig):
    loop, api, _, _, _, _ = rig
    passes = idle_passes(loop, api, 10.0)
    # at the interval alone: 500 passes in 10 s; backing off to
    # IDLE_INTERVAL_MAX: the doublings (4) then one pass per 0.32 s
    assert passes <= 10.0 / hintring.IDLE_INTERVAL_MAX + 6
    assert wait_armed(loop, api) == pytest.approx(hintring.IDLE_INTERVAL_MAX, abs=1e-3)


def test_a_hint_after_a_quiet_spell_brings_the_interval_back(rig):
    loop, api, _, client, rid, stats = rig
    idle_passes(loop, api, 5.0)
    assert client.put(hintring.region_word(rid), np.array([1, 2, 2], dtype="<u4").tobytes())

    async def one_pass():
        api._drain_rings()
        return wait_armed(loop, api)

    assert loop.run_until_complete(one_pass()) == pytest.approx(INTERVAL, abs=1e-3)
    assert stats.block_hints_total == 3  # taken by that pass
    # and the next empty pass waits twice the interval, not the idle maximum
    assert loop.run_until_complete(one_pass()) == pytest.approx(2 * INTERVAL, abs=1e-3)


def test_a_request_that_drains_hints_rearms_the_timer_at_the_interval(rig):
    loop, api, peer, client, rid, stats = rig
    idle_passes(loop, api, 5.0)
    assert wait_armed(loop, api) == pytest.approx(hintring.IDLE_INTERVAL_MAX, abs=1e-3)
    assert client.put(hintring.region_word(rid), np.array([5], dtype="<u4").tobytes())

    async def request():
        api.handle(peer, protocol.Stats())
        return wait_armed(loop, api)

    assert loop.run_until_complete(request()) <= INTERVAL + 1e-3
    assert stats.block_hints_total == 1


def test_a_request_with_nothing_in_the_ring_leaves_the_idle_wait(rig):
    loop, api, peer, _, _, _ = rig
    idle_passes(loop, api, 5.0)
    when = api._ring_timer.when()

    async def request():
        api.handle(peer, protocol.Stats())

    loop.run_until_complete(request())
    assert api._ring_timer.when() == when


def test_a_slow_configured_interval_is_never_shortened(rig):
    loop, api, _, _, _, _ = rig
    api.ring_interval = 10.0
    idle_passes(loop, api, 60.0)
    assert wait_armed(loop, api) == pytest.approx(10.0, abs=1e-3)


# -- what a drain applies: the same as the socket's hint op, region by region


class Side:
    """A registry of the same regions, fed either through a ring's drains
    or through Registry.hint per region (what the socket's hint op does)."""

    def __init__(self, maps: list[tuple[mmap.mmap, int]], uid: int):
        self.stats = DaemonStats()
        self.registry = Registry(BlockTable(), Limits(), self.stats, Temperature(30.0), ProcProcesses("/proc"),
                                 clock=lambda: 1000.0)
        self.ids = [self.registry.add(os.getpid(), np.frombuffer(m, dtype=np.uint8).ctypes.data, len(m), BLOCK,
                                      owner_uid=owner).id for m, owner in maps]
        rng = np.random.default_rng(2)
        self.registry.table.tier[:] = rng.integers(-1, 3, len(self.registry.table))
        self.uid = uid

    def columns(self) -> dict:
        t = self.registry.table
        return {k: getattr(t, k).copy() for k in ("temp", "fresh", "runs", "last_access", "flags")}


def socket_hints(side: Side, regions: np.ndarray, blocks: np.ndarray) -> dict:
    """The reference: each region's hints in one Registry.hint, regions in
    id order, bad ones counted as the drain counts them."""
    counts = {hintring.ACCEPTED: 0, hintring.BAD_REGION: 0, hintring.BAD_BLOCK: 0}
    reg = side.registry
    for rid in np.unique(regions).tolist():
        b = blocks[regions == rid]
        r = reg.regions.get(rid)
        if r is None or r.owner_uid != side.uid:
            counts[hintring.BAD_REGION] += b.size
            continue
        inside = b < r.nblocks
        counts[hintring.BAD_BLOCK] += int(b.size - inside.sum())
        if inside.any():
            counts[hintring.ACCEPTED] += reg.hint(rid, b[inside], None)
    return counts


class Recorded:
    """A recorder that keeps the hint messages (kvtier-sim replays them)."""

    def __init__(self):
        self.hints = []

    def hint(self, region_id, blocks, counts):
        self.hints.append((region_id, blocks.tolist(), counts))


@pytest.mark.parametrize("nregions, per_drain, hints_per_run, recording", [
    (3, 5, 2000, False),  # few regions, many hints each: summed per block
    (3, 5, 7, False),  # few hints: not summed
    (80, 200, 40, False),  # more distinct regions than RING_REGIONS_DIRECT in one drain
    (12, 30, 100, True),  # recorded: the messages region by region, as the socket's
])
def test_a_drain_applies_what_the_socket_would(nregions, per_drain, hints_per_run, recording):
    maps = []
    for i in range(nregions):
        m = mmap.mmap(-1, (4 + i % 5) * BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        maps.append((m, 0 if i % 7 else 12345))  # every 7th region is another user's
    uid = 0
    ring_side, ref = Side(maps, uid), Side(maps, uid)
    assert ring_side.ids == ref.ids
    if recording:
        ring_side.registry.recorder, ref.registry.recorder = Recorded(), Recorded()
    loop = asyncio.new_event_loop()
    api = ControlAPI(ring_side.registry, None, ring_side.stats, 1 << 20)
    peer = Peer(os.getpid(), uid, 0, False)

    async def open_ring():
        answer = api.handle(peer, protocol.HintRing(entries=1 << 16))
        client = hintring.ClientRing(os.dup(answer.fd))
        answer.done(True)
        return client

    client = loop.run_until_complete(open_ring())
    rng = np.random.default_rng(nregions)
    named = ring_side.ids + [9999]  # and a region nobody registered
    want = {hintring.ACCEPTED: 0, hintring.BAD_REGION: 0, hintring.BAD_BLOCK: 0}
    for _ in range(4):
        regions, blocks = [], []
        for _ in range(per_drain):
            rid = named[int(rng.integers(len(named)))]
            b = rng.integers(0, 9, int(rng.integers(1, hints_per_run + 1))).astype(np.uint32)  # some beyond
            assert client.put(hintring.region_word(rid), b.tobytes())
            regions.append(np.full(b.size, rid, np.uint32))
            blocks.append(b)
        for k, v in socket_hints(ref, np.concatenate(regions), np.concatenate(blocks)).items():
            want[k] += v

        async def drain():
            api._drain_rings()

        loop.run_until_complete(drain())
    got, exp = ring_side.columns(), ref.columns()
    for k in ("fresh", "runs", "last_access", "flags"):
        assert np.array_equal(got[k], exp[k]), k
    assert np.allclose(got["temp"], exp["temp"], rtol=1e-6)
    ring = api.rings[peer]
    assert {k: ring.counts[k] for k in want} == want
    for s in (ring_side, ref):
        s.counters = (s.stats.block_hints_total, dict(s.stats.hint_tier_blocks), s.registry.hints_off_top,
                      [r.block_hints for r in s.registry.regions.values()])
    assert ring_side.counters == ref.counters
    if recording:
        assert ring_side.registry.recorder.hints == ref.registry.recorder.hints
    assert want[hintring.ACCEPTED] and want[hintring.BAD_REGION] and want[hintring.BAD_BLOCK]
    client.close()
    api.close_rings()
    loop.close()


def test_a_drain_of_many_regions_folds_them_in_one_temperature_add():
    """16 regions' batches in one drain: one pass over the table's columns
    for all of them (it was one Registry.hint, with its ~25 array calls, per
    region: 64 GiB x 1000 regions x 1 M hints/s spent most of its loop there)."""
    maps = [(mmap.mmap(-1, 32 * BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), 0) for _ in range(16)]
    side = Side(maps, 0)
    adds = []
    temperature = side.registry.temperature
    real_add = temperature.add
    temperature.add = lambda table, rows, *a, **k: (adds.append(np.asarray(rows).size), real_add(table, rows, *a, **k))
    loop = asyncio.new_event_loop()
    api = ControlAPI(side.registry, None, side.stats, 1 << 20)
    peer = Peer(os.getpid(), 0, 0, False)

    async def go():
        answer = api.handle(peer, protocol.HintRing())
        client = hintring.ClientRing(os.dup(answer.fd))
        answer.done(True)
        rng = np.random.default_rng(1)
        for rid in side.ids:
            assert client.put(hintring.region_word(rid), rng.integers(0, 32, 3125).astype("<u4").tobytes())
        api._drain_rings()
        client.close()

    loop.run_until_complete(go())
    assert len(adds) == 1 and adds[0] == 16 * 32  # each block once, summed
    assert side.stats.block_hints_total == 16 * 3125
    assert [r.block_hints for r in side.registry.regions.values()] == [3125] * 16
    api.close_rings()
    loop.close()
