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
