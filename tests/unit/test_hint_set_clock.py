"""HintSet.touch's look at the clock, against a clock the test moves: how
often a set reads the clock, when its counts leave, and that they are the
entries a hint per step would have made (tests/host/test_hint_set.py checks
the same against a real kvtierd). Counts and clock readings, no wall time."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtier import client as client_mod
from kvtier.client import LOOK_SHARE, MAX_TOUCHES_PER_LOOK, Region

INTERVAL = 0.2
BLOCKS = np.arange(8, 24, dtype=np.uint32)  # the guest workload's hot set: 16 blocks


class Clock:
    """time.monotonic as the hint set sees it: moved by the test, reads counted."""

    def __init__(self):
        self.now, self.reads = 1000.0, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class Edge:
    """The client at its edge to the daemon: what went into the hint ring, when."""

    hint_batch = 1 << 20
    hint_interval = INTERVAL

    def __init__(self, clock: Clock):
        self.clock, self.puts = clock, []

    def _ring_put(self, word: int, packed: bytes, checked: bool = False) -> bool:
        self.puts.append((self.clock.now, np.frombuffer(packed, dtype=np.uint32).copy()))
        return True


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(client_mod, "_clock", c)
    return c


def hint_set(clock: Clock) -> tuple[Edge, client_mod.HintSet]:
    edge = Edge(clock)
    region = Region(edge, {"region": 3, "blocks": 64, "block_size": 1 << 21}, 0, 64 << 21)
    return edge, region.hint_set(BLOCKS)


def run(hs, clock: Clock, steps: int, pace: float) -> None:
    for _ in range(steps):
        clock.now += pace
        hs.touch()
        assert 0 <= hs._left <= 256  # counted in ints CPython caches: no allocation per touch


@pytest.mark.parametrize("pace", [1.6e-3, 20e-6, 0.03], ids=["guest-pass", "fast", "slow"])  # s a touch
def test_a_steady_pace_reads_the_clock_a_few_times_an_interval_and_flushes_on_time(clock, pace):
    edge, hs = hint_set(clock)
    steps = min(math.ceil(20 / pace), 200_000)  # 20 s, or 4 s of the fast pace
    reads0 = clock.reads
    run(hs, clock, steps, pace)
    intervals = steps * pace / INTERVAL
    reads = clock.reads - reads0
    if pace * MAX_TOUCHES_PER_LOOK >= INTERVAL / LOOK_SHARE:
        # one look per quarter interval, and the one past the flush's time
        assert reads <= (LOOK_SHARE + 2) * (intervals + 1)
    else:  # a look every MAX_TOUCHES_PER_LOOK touches, not every touch
        assert reads <= steps / MAX_TOUCHES_PER_LOOK + 2 * (intervals + 1)
    times = np.array([t for t, _ in edge.puts])
    gaps = np.diff(times)
    assert gaps.min() >= INTERVAL - 1e-9
    assert gaps.max() <= INTERVAL + 2 * pace + 1e-9
    assert times[0] == pytest.approx(1000.0 + pace)  # the first touch goes at once
    hs.flush()
    sent = np.concatenate([b for _, b in edge.puts])
    # every touch told the daemon each block of the set once, in the set's order
    assert sent.size == steps * BLOCKS.size
    np.testing.assert_array_equal(sent.reshape(-1, BLOCKS.size), np.broadcast_to(BLOCKS, (steps, BLOCKS.size)))
    assert hs.touches == steps and hs.pending == 0


@pytest.mark.parametrize("pace", [1.6e-3, 10e-3])  # s a touch
@pytest.mark.parametrize("before_pause", range(1000, 1130, 13))  # anywhere between two flushes
def test_after_a_pause_the_counts_leave_within_a_quarter_interval_of_the_pace(clock, before_pause, pace):
    edge, hs = hint_set(clock)
    run(hs, clock, before_pause, pace)
    before = len(edge.puts)
    clock.now += 30.0  # the engine stops for 30 s, then steps at the same pace
    for step in range(1, 1000):
        clock.now += pace
        hs.touch()
        if len(edge.puts) > before:
            break
    assert step <= min(INTERVAL / LOOK_SHARE / pace + 2, MAX_TOUCHES_PER_LOOK)
    # the pause's flush carries the touches from the last flush before it on
    assert sum(b.size for _, b in edge.puts) == (before_pause + step) * BLOCKS.size
    # and the pace found again: the next flush one interval later
    run(hs, clock, 500, pace)
    times = [t for t, _ in edge.puts[before:]]
    assert INTERVAL - 1e-9 <= times[1] - times[0] <= INTERVAL + 2 * pace + 1e-9


def test_touches_count_through_changes_and_a_closed_set_raises(clock):
    edge, hs = hint_set(clock)
    run(hs, clock, 700, 1e-3)
    hs.extend([40])
    run(hs, clock, 300, 1e-3)
    assert hs.touches == 1000
    hs.close()
    sent = np.concatenate([b for _, b in edge.puts])
    assert np.bincount(sent, minlength=64)[40] == 300 and np.bincount(sent, minlength=64)[8] == 1000
    with pytest.raises(ValueError, match="closed"):
        hs.touch()


def test_when_the_steps_slow_down_the_counts_leave_within_max_touches_per_look(clock):
    """A fast run (2,000 touches 10 us apart: a look would be 5,000 touches
    away at that pace), then steps 50 ms apart: the next flush comes at most
    MAX_TOUCHES_PER_LOOK slow touches past its time, not thousands."""
    edge, hs = hint_set(clock)
    run(hs, clock, 2000, 10e-6)
    due = edge.puts[-1][0] + INTERVAL
    before = len(edge.puts)
    run(hs, clock, 200, 0.05)
    assert len(edge.puts) > before
    assert edge.puts[before][0] <= due + MAX_TOUCHES_PER_LOOK * 0.05
